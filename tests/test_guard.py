"""``GuardedSource`` without MindSpore: slot accounting, growth detection, normalisation and error texts.

The guard is only useful if its slot accounting is exactly MindSpore's: it predicts, row by row, what
``_SharedQueue.put`` (MindSpore 2.10, ``dataset/engine/queue.py``) is about to allocate. ``MindSporeSlots``
below transcribes that algorithm so the two can be compared on arbitrary row sequences.
"""

from __future__ import annotations

import logging
import os
import pickle
import random

import numpy as np
import pytest

from ms_shm import guard, model
from ms_shm.guard import (
    GuardedIterable,
    GuardedSource,
    GuardSpec,
    RowTooLargeError,
    ShmFullError,
    SizedGuardedIterable,
    SourceError,
    guard_iterable,
)
from ms_shm.rows import RowError

PAGE = model.PAGE
MiB = model.MiB


class MindSporeSlots:
    """MindSpore 2.10 ``_SharedQueue.put`` in dynamic mode, reduced to the slot sizes it allocates.

    ``check_and_create_shm(total)`` runs when the row's ndarray bytes are > 0: it appends a slot when
    ``seg_pos`` equals the number of slots, or re-creates slot ``seg_pos`` when it is smaller than the row.
    ``seg_pos`` advances only when some column went to shared memory (``start_bytes > 0``).
    """

    def __init__(self, num_seg: int):
        self.num_seg = num_seg
        self.sizes: list = []
        self.seg_pos = 0
        self.created = 0  # slots created or re-created: each is a new file in /dev/shm

    def put(self, row: tuple) -> None:
        total = sum(c.nbytes for c in row if isinstance(c, np.ndarray))
        if total > 0:
            if len(self.sizes) == self.seg_pos:
                self.sizes.append(total)
                self.created += 1
            elif self.sizes[self.seg_pos] < total:
                self.sizes[self.seg_pos] = total
                self.created += 1
        start_bytes = sum(c.nbytes for c in row if isinstance(c, np.ndarray) and c.nbytes > 0)
        if start_bytes > 0:
            self.seg_pos = (self.seg_pos + 1) % self.num_seg


class ListSource:
    def __init__(self, rows: list):
        self.rows = rows

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self):
        return len(self.rows)


def spec(slots: int = 4, worker_bytes: int = 1 << 40, planned: int = PAGE, workers: int = 1,
         scale: float = 1.0) -> GuardSpec:
    return GuardSpec(slots, worker_bytes, planned, "lower num_parallel_workers", workers, "/dev/shm", scale)


@pytest.fixture
def free_space(monkeypatch):
    """Replace the statvfs of /dev/shm with a settable number, and count the calls."""

    class Free:
        value = 1 << 40
        calls = 0

        def __call__(self, path):
            Free.calls += 1
            if isinstance(self.value, Exception):
                raise self.value
            return self.value

    free = Free()
    monkeypatch.setattr(guard, "_free_bytes", free)
    return free


def row_of(nbytes: int, label: int = 0) -> tuple:
    return (np.zeros(nbytes, np.uint8), np.array(label, np.int64))


# ------------------------------------------------------------------------------------- slot accounting


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slots", [1, 4, 18])
def test_slot_accounting_matches_mindspores_round_robin(seed, slots, free_space):
    """Random rows, some without bytes (which do not advance ``seg_pos``): same slots, same growth events."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 0, 1, 4095, 4096, 5000, 9000, 3 * MiB]) for _ in range(300)]
    rows = [(np.zeros(n, np.uint8),) if rng.random() < 0.5 else (np.zeros(n, np.uint8), np.zeros(0, np.int32))
            for n in sizes]
    ms = MindSporeSlots(slots)
    g = GuardedSource(ListSource(rows), None, spec(slots=slots))
    for i, row in enumerate(rows):
        g[i]
        ms.put(row)
        assert g._slots == ms.sizes, f"after row {i}"
        assert g._next_slot % slots == ms.seg_pos
    assert g._total == sum(model.pages(s) for s in ms.sizes)
    assert free_space.calls == ms.created  # statvfs exactly when MindSpore creates a file, never otherwise
    assert g.rows_checked == len(rows)


def test_rows_without_bytes_do_not_take_a_slot(free_space):
    empty = (np.zeros((0, 3), np.float32), np.zeros(0))
    g = GuardedSource(ListSource([empty, row_of(10), empty, row_of(10)]), None, spec(slots=4))
    for i in range(4):
        g[i]
    assert g._slots == [18, 18] and g._next_slot == 2 and g.rows_checked == 4


def test_a_dict_rows_values_are_normalised_too():
    g = GuardedSource(ListSource([{"a": np.arange(3, dtype=">i4"), "b": [1, 2]}]), ["d"])
    out = g[0][0]
    assert out["a"].dtype == np.int32 and out["a"].dtype.isnative and out["b"].dtype == np.int64
    np.testing.assert_array_equal(out["a"], [0, 1, 2])


def test_a_dict_row_is_pickled_not_shared(free_space):
    """MindSpore's dict column goes through the pipe: no slot, so the guard must not count one."""
    g = GuardedSource(ListSource([{"a": np.arange(1000)}]), ["d"], spec())
    out = g[0]
    assert isinstance(out, tuple) and list(out[0]) == ["a"]
    np.testing.assert_array_equal(out[0]["a"], np.arange(1000))
    assert g._slots == [] and free_space.calls == 0


def test_growth_is_checked_once_then_steady_rows_are_free(free_space):
    g = GuardedSource(ListSource([row_of(MiB)] * 40), ["x", "y"], spec(slots=4))
    for i in range(40):
        g[i]
    assert free_space.calls == 4  # one per slot created, none for the 36 rows that reuse them
    g.source.rows.append(row_of(2 * MiB))
    g[40]
    assert free_space.calls == 5  # a bigger row re-creates its slot


def test_a_fresh_worker_starts_with_no_slots(free_space):
    """Fork copies the main process's guard; the worker's own slots start empty (MindSpore's do too)."""
    g = GuardedSource(ListSource([row_of(MiB)] * 4), None, spec(slots=4, worker_bytes=5 * MiB))
    for i in range(4):
        g[i]
    assert g._total > 4 * MiB
    g._pid = -1  # as seen from a forked child
    g[0]
    assert g._slots == [MiB + 8] and g._pid == os.getpid()


def test_the_guard_survives_pickling_for_spawn(free_space):
    """With spawn, MindSpore pickles the source (dill): the copy must work and account from scratch."""
    g = GuardedSource(ListSource([row_of(100)] * 3), ["a", "b"], spec())
    g[0]
    copy = pickle.loads(pickle.dumps(g))
    copy._pid = -1
    copy[1]
    assert copy._slots == [108]


# ------------------------------------------------------------------------------------------ budget


def test_a_row_over_the_workers_share_is_refused_naming_row_size_plan_and_fix(free_space):
    rows = [row_of(12 * MiB - 8) for _ in range(3)]
    g = GuardedSource(ListSource(rows), ["data", "label"],
                      spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2, scale=1 / 0.8))
    g[0], g[1]
    with pytest.raises(RowTooLargeError) as err:
        g[2]
    need = int((2 * 18 * 12 * MiB + model.semaphore_bytes(2)) / 0.8)
    assert str(err.value) == (
        "row 2 is 12.0 MiB, ms_shm planned rows of 1.0 MiB: this worker's 18 shared-memory slots would grow "
        "to 36.0 MiB, over its 25.6 MiB share of /dev/shm, which would end in a bus error. Fix: give /dev/shm "
        f"at least {need / MiB:.1f} MiB for rows of 12.0 MiB (docker run --shm-size={-(-need // MiB)}m, or a "
        "Kubernetes emptyDir with medium: Memory and that sizeLimit), or lower num_parallel_workers")
    assert g._slots == [12 * MiB, 12 * MiB]  # the refused row took nothing: MindSpore never saw it
    assert g._next_slot == 2


def test_a_budget_exactly_full_is_allowed(free_space):
    g = GuardedSource(ListSource([row_of(PAGE - 8)] * 5), None, spec(slots=4, worker_bytes=4 * PAGE))
    for i in range(5):
        g[i]  # the 5th reuses slot 0
    assert g._total == 4 * PAGE


def test_without_a_spec_nothing_is_accounted(free_space):
    g = GuardedSource(ListSource([row_of(64 * MiB)]), ["a", "b"], None)
    g[0]
    assert g._slots == [] and free_space.calls == 0


# ------------------------------------------------------------------------------------ free space


def test_a_full_dev_shm_is_refused_naming_row_need_free_and_fix(free_space):
    free_space.value = 3 * MiB
    rows = [row_of(2 * MiB - 8)] * 2
    g = GuardedSource(ListSource(rows), ["a", "b"], spec(slots=4, planned=2 * MiB, workers=2))
    with pytest.raises(ShmFullError) as err:
        g[0]
    need = 2 * 4 * 2 * MiB + model.semaphore_bytes(2)
    assert str(err.value) == (
        "row 0 needs a new 2.0 MiB shared-memory slot plus 2.0 MiB for the other 1 worker(s)' next slot, but "
        "/dev/shm has only 3.0 MiB free: something else filled it after ms_shm planned this pipeline, and "
        f"writing the row would end in a bus error. Fix: make room, this pipeline needs {need / MiB:.1f} MiB of "
        "/dev/shm for its slots (find what else uses it: `df -h /dev/shm`; `ms-shm clean` removes what crashed "
        "runs left), or lower num_parallel_workers")
    assert g._slots == []


@pytest.mark.parametrize("workers, planned, free, ok", [
    (1, MiB, MiB, True),  # one worker: no margin, exactly enough
    (1, MiB, MiB - 1, False),
    (2, MiB, 2 * MiB, True),  # one planned row for the other worker
    (2, MiB, 2 * MiB - 1, False),
    (3, MiB // 2, 2 * MiB, True),  # margin uses the planned row when it is smaller than this one
    (3, MiB // 2, 2 * MiB - 1, False),
])
def test_free_space_margin(free_space, workers, planned, free, ok):
    free_space.value = free
    g = GuardedSource(ListSource([row_of(MiB - 8)]), None, spec(planned=planned, workers=workers))
    if ok:
        g[0]
    else:
        with pytest.raises(ShmFullError):
            g[0]


def test_unreadable_dev_shm_warns_once_and_falls_back_to_the_budget(free_space, caplog):
    free_space.value = PermissionError(13, "Permission denied")
    g = GuardedSource(ListSource([row_of(MiB * (i + 1)) for i in range(3)]), None, spec(slots=4))
    with caplog.at_level(logging.WARNING, logger="ms_shm.guard"):
        for i in range(3):
            g[i]
    warnings = [r for r in caplog.records if "statvfs(/dev/shm) failed" in r.getMessage()]
    assert len(warnings) == 1 and "PermissionError" in warnings[0].getMessage()
    assert free_space.calls == 1 and len(g._slots) == 3


def test_the_real_statvfs_is_read():
    assert guard._free_bytes("/") > 0
    with pytest.raises(OSError):
        guard._free_bytes("/nonexistent/ms_shm")


# ----------------------------------------------------------------------------------- normalisation


def test_good_rows_pass_through_untouched():
    row = (np.arange(6, dtype=np.float32), np.array(3))
    g = GuardedSource(ListSource([row]), ["a", "b"])
    assert g[0] is row


@pytest.mark.parametrize("value, expected_dtype", [
    (np.arange(6, dtype=">f4"), np.float32),
    (np.arange(6, dtype=">i8"), np.int64),
    (np.arange(24, dtype=">f4").reshape(4, 6).T, np.float32),  # both at once
    ([1, 2, 3], np.int64),
    ([[1.5, 2.5], [3.5, 4.5]], np.float64),
    (7, np.int64),
    (2.5, np.float64),
    (True, np.bool_),
    (np.float32(1.25), np.float32),
    ("text", np.dtype("<U4")),
    (np.array(5.0), np.float64),
    (np.zeros((0, 3), np.float32), np.float32),
])
def test_columns_mindspore_would_reject_become_native_arrays_with_the_same_values(value, expected_dtype):
    g = GuardedSource(ListSource([(value, np.array(0))]), ["x", "y"])
    out = g[0][0]
    assert type(out) is np.ndarray
    assert out.dtype == expected_dtype and out.dtype.isnative
    np.testing.assert_array_equal(out, np.asarray(value))
    assert out.shape == np.asarray(value).shape


def test_non_contiguous_arrays_are_not_copied():
    """MindSpore 2.10 carries them correctly in every transport (measured); a copy would only cost time."""
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    row = (strided, np.array(1))
    assert GuardedSource(ListSource([row]), ["x", "y"])[0] is row


def test_numpy_indices_reach_the_source_as_python_ints():
    """MindSpore passes numpy int64 indices; under NumPy 2 ``float32 + index`` would then become float64."""
    seen = []

    class Arith:
        def __getitem__(self, i):
            seen.append(type(i))
            return (np.zeros(3, np.float32) + i,)

        def __len__(self):
            return 5

    g = GuardedSource(Arith(), ["x"])
    assert g[np.int64(3)][0].dtype == np.float32 and g[2][0].dtype == np.float32
    assert seen == [int, int]
    assert (np.zeros(3, np.float32) + np.int64(3)).dtype == np.float64  # what the source would have made


def test_each_kind_is_logged_once_per_column(caplog):
    rows = [((np.arange(4, dtype=">f4")), [i], np.arange(8.0)[::2]) for i in range(5)]
    g = GuardedSource(ListSource(rows), ["be", "lst", "strided"])
    with caplog.at_level(logging.INFO, logger="ms_shm.guard"):
        for i in range(5):
            g[i]
    messages = sorted(r.getMessage() for r in caplog.records)
    assert len(messages) == 2
    assert messages[0].startswith("column 'be' is big-endian >f4; ms_shm passes it as native byte order")
    assert messages[1].startswith("column 'lst' is list; ms_shm passes it as np.asarray (dtype int64)")


def test_a_single_array_or_list_row_becomes_a_tuple():
    g = GuardedSource(ListSource([np.arange(3), [np.arange(2), np.array(1)]]), None)
    assert isinstance(g[0], tuple) and len(g[0]) == 1
    assert isinstance(g[1], tuple) and len(g[1]) == 2


@pytest.mark.parametrize("row, names, text", [
    (None, ["a"], "row 4 is None"),
    ((np.array([1, "x", None], dtype=object), np.array(1)), ["a", "b"], "column 'a' of row 4 is an object array"),
    ((np.arange(3).astype(np.complex64),), ["a"], "cannot carry complex numbers"),
    ((np.arange(3), np.arange(3)), ["a"], "row 4 has 2 column(s) but column_names has 1"),
    ({"a": 1, "b": 2}, ["a", "b"], "row 4 is a dict with keys ['a', 'b']"),
    (({"k": 1}, np.array(1)), ["a", "b"], "column 'a' of row 4 is a dict"),
])
def test_rows_mindspore_cannot_carry_are_refused_even_in_the_fast_path(row, names, text):
    """An object array in a tuple of ndarrays must not slip through: MindSpore would copy raw pointers."""
    g = GuardedSource(ListSource([row] * 5), names, spec())
    with pytest.raises(RowError) as err:
        g[4]
    assert text in str(err.value) and "Fix:" in str(err.value)


# ------------------------------------------------------------------------------------------- errors


class Broken:
    def __init__(self, at: int, exc: Exception, length: int = 10):
        self.at, self.exc, self.length = at, exc, length

    def __getitem__(self, index):
        if index >= self.at:
            raise self.exc
        return row_of(8, index)

    def __len__(self):
        return self.length


def test_a_source_error_names_the_row_the_original_and_where_it_was_raised():
    g = GuardedSource(Broken(7, ValueError("bad jpeg")), ["a", "b"], spec())
    g[6]
    with pytest.raises(SourceError) as err:
        g[7]
    text = str(err.value)
    assert text.startswith("source[7] raised ValueError: bad jpeg at ")
    assert f"{__file__}:" in text and "in __getitem__()" in text
    assert isinstance(err.value.__cause__, ValueError)


def test_an_index_error_points_at_a_lying_len():
    g = GuardedSource(Broken(40, IndexError("list index out of range"), length=64), ["a", "b"])
    with pytest.raises(SourceError) as err:
        g[40]
    assert "source[40] raised IndexError: list index out of range" in str(err.value)
    assert "MindSpore asks for indices 0..63 because __len__ returns 64: if the data has fewer rows, fix __len__" \
        in str(err.value)


@pytest.mark.parametrize("exc", [
    RowTooLargeError("row 3 is 12.0 MiB"), ShmFullError("row 0 needs"), SourceError("source[7] raised"),
    RowError("row 4 is None"),
])
def test_each_error_can_be_rebuilt_from_its_text_alone(exc):
    """MindSpore re-raises a worker's exception as ``except_type(traceback_text)``, after pickling the type."""
    cls = pickle.loads(pickle.dumps(type(exc)))
    rebuilt = cls("Traceback ...\n" + str(exc))
    assert isinstance(rebuilt, type(exc)) and str(exc) in str(rebuilt)


# ----------------------------------------------------------------------------------------- iterables


class Epochs:
    """An iterable whose every ``iter()`` is a new epoch, like ``rows.ReplaySource``."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


def test_guarded_iterable_normalises_and_names_the_position():
    def gen():
        yield (np.arange(3, dtype=">f4"),)
        yield ([1, 2],)
        raise OSError("disk gone")

    it = iter(GuardedIterable(Epochs(gen), ["a"]))
    first = next(it)
    assert first[0].dtype == np.float32 and first[0].dtype.isnative
    np.testing.assert_array_equal(first[0], [0, 1, 2])
    assert next(it)[0].dtype == np.int64
    with pytest.raises(SourceError) as err:
        next(it)
    assert str(err.value).startswith("the source raised OSError: disk gone at ")
    assert str(err.value).endswith("in gen() while producing row 2 of this epoch")


def test_guarded_iterable_starts_a_new_epoch_on_each_iter():
    g = GuardedIterable(Epochs(lambda: iter([(np.array(i),) for i in range(3)])), ["a"])
    assert [int(r[0]) for r in g] == [0, 1, 2]
    assert [int(r[0]) for r in g] == [0, 1, 2]


def test_guard_iterable_keeps_len_only_when_the_source_has_it():
    assert type(guard_iterable([], None)) is SizedGuardedIterable
    assert len(guard_iterable([(np.array(1),)] * 3, None)) == 3
    bare = guard_iterable(iter([]), None)
    assert type(bare) is GuardedIterable and not hasattr(bare, "__len__")


def test_the_guard_costs_microseconds_per_row():
    """The benchmark the lead reports; here only a generous ceiling, so a slow path slipping into every row
    (a copy, a syscall, a log call) fails loudly even on a busy CI machine."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_guard.py")
    spec_ = importlib.util.spec_from_file_location("bench_guard", path)
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    result = bench.measure(calls=20_000, repeats=3)
    assert 0 < result["guard_overhead_us"] < 25, result
    assert result["normalise_overhead_us"] < result["guard_overhead_us"] + 5
