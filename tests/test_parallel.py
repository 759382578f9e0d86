"""``ms_shm.parallel``: the share of a row's CPU work that runs outside the GIL, from two rows read at once."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from ms_shm import parallel, rows
from tests.fakes import fake_probe_clock

T = 0.010


@pytest.mark.parametrize("cpu, together, share, cpus, expected", [
    ((T, T), 2 * T, 1.0, 2, 0.0),  # one ran while the other waited: the GIL
    ((T, T), T, 1.0, 2, 1.0),  # both at once
    ((T, T), 1.5 * T, 1.0, 2, pytest.approx(2 - 2 / (2 / 1.5))),  # half and half: f = 2 - 2/S
    ((T, T), T, 1.0, 1, 0.0),  # one CPU: nothing runs in parallel
    ((T / 20, T / 20), T, 0.05, 2, None),  # mostly waiting: the CPU share decides, not this
    ((T, T), 0.0, 1.0, 2, None),
])
def test_parallel_fraction(cpu, together, share, cpus, expected):
    assert parallel.parallel_fraction(cpu, together, share, cpus) == expected


@pytest.mark.parametrize("busy, expected", [
    (2 * T, 0.0),  # the GIL held through both rows' CPU work, whatever their overlap said
    (0.0, 1.0),  # never held: a cold pair's kernel contention is not the GIL
    (0.5 * T, 0.75),
    (3 * T, 0.0),  # a watcher late beyond the rows' CPU (a loaded machine): clipped
])
def test_the_gils_busy_time_decides_over_the_overlap(busy, expected):
    # The overlap alone (1.6 T for 2 T of CPU) would say 0.4: the watched GIL decides where it saw enough
    assert parallel.parallel_fraction((T, T), 1.6 * T, 1.0, 2, gil_busy=busy) == pytest.approx(expected)
    assert parallel.parallel_fraction((T, T), 1.6 * T, 1.0, 2) == pytest.approx(0.4)
    assert parallel.parallel_fraction((T, T), 1.6 * T, 1.0, 1, gil_busy=busy) == 0.0  # one CPU


def test_rows_too_cheap_for_the_watch_fall_back_to_their_overlap():
    tiny = parallel.MIN_SECONDS / 4
    assert parallel.parallel_fraction((tiny, tiny), tiny, 1.0, 2, gil_busy=2 * tiny) == pytest.approx(1.0)


NAP = 3e-4


@pytest.mark.parametrize("naps, begin, end, expected", [
    ([(0, NAP), (NAP, 2 * NAP), (1.0, 1.0 + NAP), (1.0 + NAP, 1.0 + 2 * NAP + 0.005),
      (1.0 + 3 * NAP + 0.005, 1.0 + 4 * NAP + 0.005)], 1.0, 1.1, 0.005),  # one nap waited 5 ms for the GIL
    ([(0, NAP), (1.0, 1.0 + NAP), (1.0 + NAP, 1.0 + 2 * NAP)], 1.0, 1.1, None),  # two naps in the span: too few
    ([], 0.0, 1.0, None),
    ([(0, NAP), (0.99, 1.0 + NAP + 0.002), (1.01, 1.01 + NAP), (1.02, 1.02 + NAP)], 1.0, 1.1, 0.002),  # clipped
    # a GIL-bound pair of 50 ms: naps of 15 ms; the last one still waiting when the pair ended counts to the end
    ([(0, NAP), (0.99, 1.005), (1.005, 1.02), (1.02, 1.035), (1.035, 1.06)], 1.0, 1.05, 0.05 - 4 * NAP),
])
def test_gil_busy_is_what_naps_took_beyond_the_shortest(naps, begin, end, expected):
    busy = parallel.gil_busy(naps, begin, end)
    assert busy == (None if expected is None else pytest.approx(expected, abs=1e-9))


@pytest.mark.skipif(parallel.usable_cpus() < 2, reason="one usable CPU: nothing can run in parallel")
def test_the_watch_sees_the_gil_held_by_python_and_free_under_hashing():
    """Real threads: a pure-Python pair keeps the GIL busy for most of its CPU time, a hashing pair (hashlib
    releases the GIL) for little of it. The watcher needs a core of its own only for its naps' wake-ups; a
    GIL-bound pair gives it a nap per switch interval (5 ms), so its rows are made long enough for several."""
    class LongPythonLoop(PythonLoop):
        def __getitem__(self, i):
            return (sum(PythonLoop.__getitem__(self, i)[0] for _ in range(6)),)

    def fraction(work):
        _, _, cpus, together, busy = parallel.run_pair(work.__getitem__, [0, 1])
        assert busy is not None, "the watcher saw too few naps"
        return parallel.parallel_fraction(cpus, together, 1.0, 2, busy)

    assert min(fraction(LongPythonLoop()) for _ in range(3)) < 0.3
    if not _second_core_free():
        pytest.skip("no second core free (machine loaded): a free GIL cannot be told from a busy machine")
    assert max(fraction(CountedReads(False)) for _ in range(3)) > 0.6


def test_run_pair_returns_in_order_and_raises_the_callers_error():
    results, walls, cpus, together, _ = parallel.run_pair(lambda x: x * 2, [3, 4])
    assert results == [6, 8] and len(walls) == len(cpus) == 2 and together >= 0

    def boom(x):
        raise KeyError(x)

    with pytest.raises(KeyError):
        parallel.run_pair(boom, [1, 2])


class PythonLoop:
    def __len__(self):
        return 50

    def __getitem__(self, i):
        total = 0
        for k in range(120_000):
            total += k
        return (total,)


class Hashing:
    """hashlib releases the GIL for buffers over 2 KiB."""

    data = bytes(16 << 20)

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return (hashlib.sha256(self.data).digest(),)


class Sleeping:
    def __len__(self):
        return 50

    def __getitem__(self, i):
        time.sleep(0.01)
        return (i,)


def _fractions(source, tries: int = 3) -> list:
    return [rows.measure_random_access(source, ["x"], time_fraction=1.0).parallel_fraction for _ in range(tries)]


def _second_core_free() -> bool:
    """Whether two GIL-releasing calls can run at once right now (a loaded machine has no core to spare)."""
    work = Hashing()
    _, _, cpus, together, _ = parallel.run_pair(work.__getitem__, [0, 1])
    return parallel.parallel_fraction(cpus, together, 1.0, parallel.usable_cpus()) > 0.8


def _fractions_with_a_core_free(source, tries: int = 6) -> list:
    """Fractions read with a second core free just before and just after: load in between reads as the GIL.

    A check before the reads alone let a loaded machine (a full suite beside other work) through: three reads of
    rows that release the GIL all said 0.32 or less.
    """
    seen = []
    for _ in range(tries):
        if _second_core_free():
            fraction = _fractions(source, 1)[0]
            if _second_core_free():
                seen.append(fraction)
    return seen


@pytest.mark.skipif(parallel.usable_cpus() < 2, reason="one usable CPU: nothing can run in parallel")
def test_the_probe_tells_gil_bound_from_gil_releasing_rows():
    releasing = _fractions_with_a_core_free(Hashing())
    if not releasing:
        pytest.skip("no second core free around any read (machine loaded): parallelism cannot be observed")
    gil_bound = min(_fractions(PythonLoop()))  # load only lowers it
    releasing = max(releasing)
    assert gil_bound < 0.3 and releasing > gil_bound + 0.35, (gil_bound, releasing)
    assert set(_fractions(Sleeping(), 1)) == {None}  # waiting rows: priced by their CPU share instead


def test_the_pair_counts_as_probe_rows_at_their_time_alone():
    stats = rows.measure_random_access(PythonLoop(), ["x"], time_fraction=1.0)
    assert stats.probed >= 3 and len(set(stats.indices)) == stats.probed
    assert stats.cpu_fraction > 0.5  # the pair's rows are not accounted at their contended wall time


class OwnPool(Hashing):
    """Each row hashes on the reading thread and on a thread of its own at once, as a BLAS ``matmul`` runs on its
    library's pool beside the caller."""

    def __getitem__(self, i):
        helper = threading.Thread(target=hashlib.sha256, args=(self.data,))
        helper.start()
        digest = hashlib.sha256(self.data).digest()
        helper.join()
        return (digest,)


def test_rows_whose_library_runs_threads_of_its_own_read_as_pooled():
    """The process's CPU counts the helper's hashing whether or not a second core was free for it (on one core
    the row takes twice as long and its own thread's share halves), so the figure holds on a loaded machine."""
    own = rows.measure_random_access(OwnPool(), ["x"], time_fraction=1.0)
    assert own.pooled and own.cores_busy > own.cpu_fraction + parallel.POOLED_FROM, own
    assert not rows.measure_random_access(Hashing(), ["x"], time_fraction=1.0).pooled


class NotThreadSafe:
    """Raises when two threads read it at once; one at a time it is fine (as in MindSpore's workers)."""

    def __init__(self):
        import threading

        self.busy = threading.Lock()

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if not self.busy.acquire(blocking=False):
            raise RuntimeError("concurrent read")
        try:
            time.sleep(0.005)
            total = sum(range(50_000))
            return (total,)
        finally:
            self.busy.release()


def test_a_source_unsafe_on_two_threads_is_read_one_row_at_a_time():
    stats = rows.measure_random_access(NotThreadSafe(), ["x"], time_fraction=1.0)
    assert stats.probed >= 3 and stats.parallel_fraction is None


class CountedReads(Hashing):
    """Rows slow enough for the pair at once (a 32 MiB hash: 16 ms or more even with SHA instructions, over
    ``parallel.PAIR_AT_ONCE_FROM``); ``drifts``: a row's value depends on how often it was read."""

    data = bytes(32 << 20)

    def __init__(self, drifts: bool):
        self.drifts, self.reads = drifts, []

    def __getitem__(self, i):
        self.reads.append(int(i))
        super().__getitem__(i)
        return (self.reads.count(int(i)) if self.drifts else int(i),)


@pytest.mark.parametrize("drifts", [False, True])
def test_the_pair_reads_the_first_row_again_for_the_fidelity_check(drifts):
    """The pair is the first row again beside the next one: the re-read costs no row of its own."""
    source = CountedReads(drifts)
    stats = rows.measure_random_access(source, ["x"], max_rows=3, time_fraction=1.0)
    # Row 0 is read a third time only where the first pair overlapped but read low (a cold fork: a second pair)
    assert sorted(set(source.reads)) == [0, 24, 49] and source.reads.count(0) in (2, 3)
    assert len(source.reads) == source.reads.count(0) + 2 and stats.indices == (0, 49, 24)
    assert stats.reread_differs == ("source[0] read twice differs" if drifts else None)


@pytest.mark.parametrize("fraction, together, alone, again", [
    (0.30, 0.020, 0.019, True),   # a cold JPEG pair: overlapped (1.05x one row), read low
    (0.00, 0.025, 0.019, True),   # ... even as low as 0
    (0.85, 0.020, 0.019, False),  # read high: kept
    (0.00, 0.080, 0.036, False),  # pure Python: the pair took 2.2x one row, the GIL was held
    (0.21, 0.080, 0.025, False),  # ... at a CPU share of 0.82
    (None, 0.004, 0.004, False),  # nothing measured
])
def test_a_second_pair_only_where_the_first_overlapped_but_read_low(fraction, together, alone, again):
    assert parallel.may_have_run_cold(fraction, together, alone) is again


@pytest.mark.parametrize("fraction, together, alone, inflation, again", [
    (0.04, 0.028, 0.0113, 1.37, True),  # a cold JPEG pair (bench_core): 2.5x a warm row, 1.37x its CPU
    (0.00, 0.0406, 0.0228, 0.88, False),  # pure Python: 1.8x a row, no more CPU per row (waiting for the GIL)
    (0.01, 0.0218, 0.0090, 1.22, True),  # a cold JPEG pair that burned a little more
    (0.00, 0.0500, 0.0220, 0.98, False),  # ... again
    (0.85, 0.028, 0.0113, 1.37, False),  # read high: kept
    (0.04, 0.028, 0.0113, None, False),  # rows that mostly wait: their CPU says nothing
])
def test_a_pair_that_burned_more_cpu_than_a_row_alone_ran_cold(fraction, together, alone, inflation, again):
    assert parallel.may_have_run_cold(fraction, together, alone, inflation) is again


# ------------------------------------------------------------------------------- map operations


def _timed_operations(monkeypatch, costs):
    """``measure.time_operations`` on three rows of an operation whose calls take ``costs(call)``: ``(wall, of
    which in the kernel)``, on a fake clock; pairs are recorded, each of their rows taking 2 ** -8 s, as the pair."""
    from ms_shm import measure

    clock, calls, pairs = fake_probe_clock(monkeypatch), [], []

    def operation(x):
        seconds, kernel = costs(len(calls))
        calls.append(int(x[0]))
        clock.now += seconds
        clock.kernel += kernel
        return x

    def run_pair(work, items):
        pairs.append([int(i[0][0]) for i in items])
        return [work(i) for i in items], [2.0 ** -8] * 2, [2.0 ** -8] * 2, 2.0 ** -8, None

    monkeypatch.setattr(parallel, "run_pair", run_pair)
    import numpy as np

    kept: list = []
    stats = measure.time_operations(operation, [[np.full(4, i)] for i in range(3)], kept)
    # and the outputs kept for ``_reread``, by input (or as fingerprints: ``measure.kept_for_reread``)
    return calls, pairs, stats, [int(k[0][0]) if isinstance(k[0], np.ndarray) else k[0] for k in kept]


def test_a_map_whose_first_call_faulted_in_pages_is_timed_warm_and_not_paired(monkeypatch):
    """An operation that makes an 8 MiB row: its first call in a fresh fork pays for new pages (kernel time)."""
    calls, pairs, stats, kept = _timed_operations(monkeypatch, lambda k: (2.0 ** -5, 2.0 ** -5 - 2.0 ** -9) if k == 0
                                            else (2.0 ** -12, 0.0))
    assert calls == [0, 1, 2] and pairs == [] and stats.seconds_per_row == 2.0 ** -12
    assert stats.parallel_fraction is None


def test_a_map_still_dear_once_warm_runs_its_first_row_again_beside_the_third(monkeypatch):
    """Four calls for three rows: the pair's second output of row 0 is the re-run ``_reread`` compares."""
    calls, pairs, stats, kept = _timed_operations(monkeypatch, lambda k: (2.0 ** -7, 0.0) if k == 0 else (2.0 ** -8, 0.0))
    assert pairs == [[0, 2]] and calls == [0, 1, 0, 2] and stats.rows == 3 and kept == [0, 0]
    assert stats.seconds_per_row == 2.0 ** -8 and stats.parallel_fraction == 1.0


def test_a_map_dear_from_its_first_call_pairs_the_next_two_at_once(monkeypatch):
    calls, pairs, stats, kept = _timed_operations(monkeypatch, lambda k: (2.0 ** -5, 2.0 ** -10))
    assert pairs == [[1, 2]] and calls == [0, 1, 2] and stats.rows == 3


def test_a_map_making_rows_over_the_pair_cap_runs_each_alone(monkeypatch):
    """MindSpore's UT map making 0.95 GB rows: a pair beside the kept first output held three (2890 MiB in the
    probe child against raw's 1306) and took 10-14 s. Rows over ``PAIR_ROWS_UP_TO`` are run one at a time, their
    GIL share unmeasured."""
    monkeypatch.setattr(parallel, "PAIR_ROWS_UP_TO", 16)  # the test's rows: 32 bytes
    calls, pairs, stats, kept = _timed_operations(monkeypatch, lambda k: (2.0 ** -5, 2.0 ** -10))
    assert pairs == [] and calls == [0, 1, 2] and stats.rows == 3 and stats.parallel_fraction is None
    assert len(kept) == 1 and kept[0].shape == (4,)  # the first output, by its fingerprint


def test_no_pair_is_due_for_rows_over_the_cap():
    dear = [2.0 ** -5]
    assert parallel.pair_now(dear, 0.0, 1.0, parallel.PAIR_ROWS_UP_TO)
    assert not parallel.pair_now(dear, 0.0, 1.0, parallel.PAIR_ROWS_UP_TO + 1)
