"""``ms_shm.rows`` without MindSpore: probe indices, row validation, and replaying an iterable's first rows.

Validation runs in the main process before any worker exists, so its messages are the user's first and best
chance to fix a bad source: each must name the column, the row and the fix. Replay must neither lose nor
duplicate a row, in the first epoch or any later one.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from ms_shm import rows
from ms_shm.rows import RowError
from tests.fakes import FakeClock, fake_probe_clock

# ---------------------------------------------------------------------------------------- _spread


@pytest.mark.parametrize("length, count, expected", [
    (0, 8, []),
    (1, 8, [0]),
    (5, 8, [0, 4, 2, 1, 3]),
    (8, 8, [0, 7, 4, 1, 2, 3, 5, 6]),
    (9, 8, [0, 8, 5, 1, 2, 3, 6, 7]),
    (64, 8, [0, 63, 36, 9, 18, 27, 45, 54]),
    (1000, 3, [0, 999, 500]),
    (10, 2, [0, 9]),
    (10, 1, [0]),
    (10, 0, []),
])
def test_spread_probes_first_last_and_middle_first(length, count, expected):
    """A probe stopped early (slow rows) has still seen both ends and the middle, where sizes differ most."""
    assert rows._spread(length, count) == expected


@pytest.mark.parametrize("length", [2, 9, 17, 100, 12345])
def test_spread_is_unique_in_range_and_covers_both_ends(length):
    got = rows._spread(length, 8)
    assert len(got) == len(set(got)) == min(length, 8)
    assert got[:2] == [0, length - 1] and all(0 <= i < length for i in got)


# ------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("row, names, texts, column", [
    (None, ["image", "label"], ["row 3 is None", "Fix: return a tuple of numpy arrays", "(image, label)"], None),
    ((np.zeros(2), None), ["image", "label"], ["column 'label' of row 3 is None", "Fix: return a value"], "label"),
    ({"image": 1, "label": 2}, ["image", "label"],
     ["row 3 is a dict with keys ['image', 'label']", "Fix: return a tuple of arrays in column order"], None),
    ({"image": 1}, None, ["row 3 is a dict", "Fix:"], None),
    ((np.array([1, "a", None], dtype=object),), ["x"],
     ["column 'x' of row 3 is an object array (dtype=object, ndarray)", "Fix: convert it"], "x"),
    (([[1, 2], [3]],), ["x"], ["column 'x' of row 3 is a ragged list", "Fix: pad it"], "x"),
    (([np.zeros(2), "a"],), ["x"], ["column 'x' of row 3 is a", "Fix:"], "x"),
    ((np.zeros(2), np.zeros(2), np.zeros(2)), ["a", "b"],
     ["row 3 has 3 column(s) but column_names has 2 (['a', 'b'])", "Fix: make __getitem__ return exactly 2"],
     None),
    ((np.array(["2020-01-01"], dtype="datetime64[D]"),), ["when"],
     ["column 'when' of row 3 has dtype datetime64[D] which MindSpore cannot carry", "x.astype(np.int64)"], "when"),
    ((np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),), ["rec"], ["has dtype", "split structured fields"], "rec"),
    ((np.arange(3).astype(np.complex64),), ["z"],
     ["column 'z' of row 3 has dtype complex64", "Fix: return np.stack([x.real, x.imag], axis=-1)"], "z"),
    ((np.ones(2, np.longdouble),), ["w"], ["column 'w' of row 3 has dtype float128", "x.astype(np.float64)"], "w"),
    (object(), ["x"], ["row 3 is a object", "Fix: return a tuple of numpy arrays (x)"], None),
    # words[i::4]: MindSpore 2.0 and 2.10 stop mid-epoch, "resize only works on single-segment arrays"
    ((np.array(["alpha", "beta"] * 4)[::4],), ["text"],
     ["column 'text' of row 3 is a strided view of a str array", "np.ascontiguousarray(x)"], "text"),
    ((np.array([b"ab"] * 12).reshape(3, 4)[:, ::2],), ["raw"], ["strided view of a bytes array"], "raw"),
])
def test_rows_mindspore_cannot_carry_are_refused_naming_column_row_and_fix(row, names, texts, column):
    with pytest.raises(RowError) as err:
        rows.convert_row(row, 3, names)
    for text in texts:
        assert text in str(err.value)
    assert err.value.row == 3 and err.value.column == column


@pytest.mark.parametrize("row, expected", [
    ((np.arange(3), 5, 2.5, "s", b"b", True, [1, 2]),
     [np.arange(3), np.array(5), np.array(2.5), np.array("s"), np.array(b"b"), np.array(True), np.array([1, 2])]),
    (np.arange(4), [np.arange(4)]),
    (7, [np.array(7)]),
    ([np.zeros((0, 2)), np.float16(1.5)], [np.zeros((0, 2)), np.array(1.5, np.float16)]),
    # text MindSpore carries: a transposed (Fortran-ordered) view, as measured on 2.0 and 2.10
    ((np.array(["ab", "c"] * 6).reshape(3, 4).T,), [np.array(["ab", "c"] * 6).reshape(3, 4).T]),
])
def test_carried_rows_become_tuples_of_arrays_with_the_same_values(row, expected):
    out = rows.convert_row(row, 0, None)
    assert isinstance(out, tuple) and len(out) == len(expected)
    for got, want in zip(out, expected):
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_dict_columns_are_carried_beside_others_and_nested_as_mindspore_carries_them():
    """MindSpore's ``_convert_row`` and pipeline carry these on 2.0, 2.7, 2.8 and 2.10 (measured): not refused."""
    out = rows.convert_row((np.zeros(2), {"id": 1, "box": np.arange(3.0)}), 0, ["image", "meta"])
    assert isinstance(out[1], dict) and out[1]["box"].dtype == np.float64 and out[1]["id"] == np.array(1)
    nested = rows.convert_row({"d": {"nested": 1}}, 0, ["d"])
    assert nested[0]["d"]["nested"] == np.array(1)
    assert rows.row_bytes(out) == 16  # a dict column goes through the pipe, not a slot


def test_objects_with_asnumpy_are_converted_like_mindspore_tensors():
    class Tensorish:
        def asnumpy(self):
            return np.arange(3, dtype=np.float32)

    out = rows.convert_row((Tensorish(),), 0, ["t"])
    np.testing.assert_array_equal(out[0], np.arange(3, dtype=np.float32))


def test_a_dict_row_is_mindspores_dict_column_when_there_is_one_column():
    """MindSpore 2.10 carries a whole-row dict as one column of dict type (measured): keep it, check values."""
    source_row = {"image": np.arange(4), "label": 3}
    out = rows.convert_row(source_row, 0, ["sample"])
    assert len(out) == 1 and isinstance(out[0], dict) and out[0] is not source_row
    np.testing.assert_array_equal(out[0]["image"], np.arange(4))
    assert out[0]["label"].dtype == np.int64 and source_row["label"] == 3


@pytest.mark.parametrize("columns, expected", [
    ((np.zeros(10, np.uint8), np.zeros(3, np.int64)), 34),
    ((np.zeros((0, 5)),), 0),
    (({"a": np.zeros(100)},), 0),  # pickled through the pipe, not shared memory
    ((np.zeros((4, 6), np.float32)[:, ::2],), 48),
])
def test_row_bytes_counts_ndarray_columns_only(columns, expected):
    assert rows.row_bytes(columns) == expected


# ---------------------------------------------------------------------------------------- probing


class Indexed:
    def __init__(self, length: int, data_rows: int | None = None, fail_at: int | None = None):
        self.length = length
        self.data_rows = length if data_rows is None else data_rows
        self.fail_at = fail_at
        self.calls: list = []

    def __getitem__(self, index):
        self.calls.append(index)
        if index == self.fail_at:
            raise KeyError(f"missing file {index}.jpg")
        if index >= self.data_rows:
            raise IndexError("list index out of range")
        return (np.full(100 + index, index, np.uint8), np.array(index))

    def __len__(self):
        return self.length


def test_probe_reads_rows_spread_over_the_source_with_mindspores_index_type():
    src = Indexed(64)
    stats = rows.measure_random_access(src, ["a", "b"], time_fraction=1e9)
    assert src.calls == rows._spread(64, 8) + [0] == [0, 63, 36, 9, 18, 27, 45, 54, 0]  # then row 0 re-read
    assert all(type(i) is np.int64 for i in src.calls)  # as MindSpore's sampler passes them
    assert stats.indices == tuple(src.calls[:-1]) and stats.probed == 8 and stats.reread_differs is None and stats.length == 64
    assert stats.row_bytes_max == 100 + 63 + 8 and stats.row_bytes_min == 108 and stats.ragged
    assert [c.name for c in stats.columns] == ["a", "b"] and stats.columns[0].varies


class Slow(Indexed):
    """Rows slow enough (20 ms) for the probe to read two of them at once, right after the first: 20, not 10, as
    the kernel's CPU time moves by whole ticks (4 ms here), so a 10 ms read could count 6 ms outside the kernel."""

    def __getitem__(self, index):
        import time

        time.sleep(0.020)
        return super().__getitem__(index)


@pytest.mark.parametrize("length, calls", [
    (100, [0, 0, 99]),  # the pair is the 2nd and 3rd read: 3 reads > 2% of 100 rows, no middle row
    (300, [0, 0, 299, 171, 43, 85, 128]),  # 2% of 300 is 6 reads: the pair counts two
])
def test_a_slow_source_stops_once_its_reads_pass_two_percent_of_an_epoch(length, calls):
    src = Slow(length)
    stats = rows.measure_random_access(src, ["a", "b"])
    assert sorted(src.calls) == sorted(calls)  # the pair's two reads run on two threads, in either order
    assert stats.reread_differs is None and stats.indices[:2] == (0, length - 1)


@pytest.mark.parametrize("together, calls, kept", [
    (0.004, [0, 0, 0, 57, 99], 0.85),  # the pair overlapped (1x a row) but read 0.3: read once more, larger kept
    (1.0, [0, 0, 99], 0.30),  # the pair took far longer than a row (the GIL was held): no second pair
])
def test_a_first_pair_read_low_that_overlapped_is_read_once_more(monkeypatch, together, calls, kept):
    from ms_shm import parallel

    fractions = iter([0.30, 0.85])
    monkeypatch.setattr(parallel, "parallel_fraction", lambda *args: next(fractions))
    monkeypatch.setattr(parallel, "run_pair", lambda work, items: ([work(i) for i in items], [0.004] * 2,
                                                                   [0.004] * 2, together, None))
    src = Slow(100)
    stats = rows.measure_random_access(src, ["a", "b"])
    assert sorted(src.calls) == calls and stats.parallel_fraction == kept
    assert any("a second pair read, 85% kept" in n for n in stats.notes) is (kept == 0.85)


def test_a_pair_whose_gil_was_watched_is_not_read_again(monkeypatch):
    """The watch's figure (70% outside the GIL) stands for the pair: a cold fork's contention in the kernel does
    not read as the GIL there, so the second pair the overlap rule would read (it overlapped, read low) is not."""
    from ms_shm import parallel

    monkeypatch.setattr(parallel, "run_pair", lambda work, items: ([work(i) for i in items], [0.004] * 2,
                                                                   [0.004] * 2, 0.004, 0.0024))
    src = Slow(100)
    stats = rows.measure_random_access(src, ["a", "b"])
    assert sorted(src.calls) == [0, 0, 99] and stats.parallel_fraction == pytest.approx(0.7)
    assert not any("second pair" in n for n in stats.notes)


def test_the_sources_own_exception_on_the_first_row_passes_unchanged():
    """MindSpore raises it when the pipeline reads the row: the caller decides, the probe does not wrap it."""
    with pytest.raises(KeyError, match="missing file 0.jpg"):
        rows.measure_random_access(Indexed(64, fail_at=0), ["a", "b"], time_fraction=1e9)


@pytest.mark.parametrize("source, failed, read", [
    (Indexed(64, fail_at=18), "row 18 raised KeyError: 'missing file 18.jpg'", [0, 63, 36, 9]),
    (Indexed(40, data_rows=30), "row 39 raised IndexError: list index out of range", [0]),
])
def test_a_later_rows_exception_is_said_and_the_rows_before_it_measured(source, failed, read):
    """An audit: a source whose last rows raise (``__len__`` larger than the data) went unplanned, and its
    unplanned slots filled a 64 MB /dev/shm before MindSpore reached the row that raises. The rows read before it
    plan the pipeline; MindSpore raises the error when it reaches that row, as raw."""
    stats = rows.measure_random_access(source, ["a", "b"], time_fraction=1e9)
    assert stats.raised.startswith(failed) and "test_rows.py:" in stats.raised, stats.raised
    assert list(stats.indices) == read and stats.row_bytes_max == 100 + max(read) + 8  # and the int64 label
    assert ("__len__ is wrong" in stats.raised) is (failed.startswith("row 39"))


def test_the_frameworks_own_conversion_refuses_first_keeping_its_message():
    def numpy2_convert(row):  # what MindSpore 2.10's _convert_row does under NumPy 2, reduced
        for column in row:
            if not isinstance(column, np.ndarray):
                raise ValueError("Unable to avoid copy while creating an array as requested.")

    class Scalars(Indexed):
        def __getitem__(self, index):
            return (np.zeros(3), 7)

    with pytest.raises(RowError) as err:
        rows.measure_random_access(Scalars(4), ["a", "b"], check=numpy2_convert)
    text = str(err.value)
    assert text.startswith("column 'b' of row 0: MindSpore's row conversion raises ValueError: Unable to avoid copy")
    assert "NumPy 2 refuses" in text and "Fix: return it as a numpy array" in text and err.value.column == "b"
    assert isinstance(err.value.__cause__, ValueError)


def _iterated(row):  # MindSpore's ``_convert_row`` for a row that is not one column: ``for x in row``
    return tuple(np.asarray(x) for x in row)


@pytest.mark.parametrize("make", [
    lambda: collections.deque([np.arange(3), np.float32(2)]),
    lambda: (x for x in (np.arange(3), np.float32(2))),
    lambda: map(np.asarray, [np.arange(3), np.float32(2)]),
], ids=["deque", "generator", "map object"])
def test_a_row_that_is_any_iterable_is_read_column_by_column_as_mindspore_does(make):
    """MindSpore iterates any row that is not one column; an audit's deque, generator and ``__iter__`` rows came
    out of raw MindSpore and were refused by ``build_dataset``."""
    row = rows.materialized(make())
    out = rows.checked_row(row, 0, ["a", "b"], _iterated)
    assert len(out) == 2 and out[0].tolist() == [0, 1, 2] and out[1] == np.float32(2)


def test_a_structured_scalar_row_is_iterated_for_its_fields_as_mindspore_does():
    record = np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")])[0]
    out = rows.convert_row(record, 0, ["a", "b"])
    assert [c.tolist() for c in out] == [1, 2.5]


def test_a_dict_column_carries_none_lists_and_complex_and_refuses_what_mindspores_iterator_refuses():
    """MindSpore hands a dict column's values out as they went in (``__convert_python``): ``None``, lists, complex
    arrays; an array of a dtype it has no tensor type for raises its ``TypeError`` as the row is yielded."""
    value = {"x": np.arange(3), "mask": None, "meta": {"z": np.ones(2, np.complex64), "tags": [None, 1]}}
    out = rows.convert_row(value, 0, ["d"])[0]
    assert out["mask"] is None and out["meta"]["tags"][0] is None and out["meta"]["z"].dtype == np.complex64
    for bad in (np.array([object()]), np.array(["2020-01-01"], "datetime64[D]"), np.arange(3, dtype=">i4")):
        with pytest.raises(rows.RowTypeError) as err:
            rows.convert_row((np.zeros(1), {"v": {"w": bad}}), 5, ["a", "d"])
        assert isinstance(err.value, TypeError) and isinstance(err.value, RowError)
        assert "column 'd['v']['w']' of row 5" in str(err.value) and "Fix:" in str(err.value)


def test_an_empty_source_is_noted_not_probed():
    stats = rows.measure_random_access(Indexed(0), ["a"])
    assert stats.probed == 0 and "source is empty" in stats.notes


def test_a_dict_column_is_probed_as_zero_shared_bytes():
    class Dicts:
        def __getitem__(self, i):
            return {"a": np.zeros(1000)}

        def __len__(self):
            return 4

    stats = rows.measure_random_access(Dicts(), ["d"], time_fraction=1e9)
    assert stats.row_bytes_max == 0 and stats.columns[0].dtype == "dict"


DATA = [(np.array(i),) for i in range(10)]


class Iterable:
    """Re-iterable, no ``__getitem__``: MindSpore calls ``iter()`` on it each epoch."""

    def __iter__(self):
        return iter(DATA)


def generator_function():
    yield from DATA


@pytest.mark.parametrize("source", [Iterable(), generator_function, DATA])
def test_read_head_starts_an_epoch_as_mindspore_does(source):
    assert [int(r[0]) for r in rows.read_head(source, 3)] == [0, 1, 2]


def test_is_random_access_needs_both_getitem_and_len():
    assert rows.is_random_access(Indexed(3)) and rows.is_random_access([1])
    assert not rows.is_random_access(Iterable()) and not rows.is_random_access(generator_function)


def test_a_slow_first_call_does_not_set_the_time_per_row(monkeypatch):
    """Lazy set-up in the first ``__getitem__`` (an index file, a lookup table) happens once, not once per row.

    The probe's clock is a fake the source advances (1 s for the first call, 1/1024 s for each other), so the
    figure is exact and no wall-clock time is asserted on.
    """
    clock = fake_probe_clock(monkeypatch)

    class LazyInit:
        ready = False

        def __len__(self):
            return 100

        def __getitem__(self, i):
            clock.now += 1.0 if not self.ready else 2.0 ** -10
            self.ready = True
            return np.zeros(8), np.array(i)

    stats = rows.measure_random_access(LazyInit(), ["a", "b"], time_fraction=1e9)
    assert stats.probed == 8 and stats.seconds_per_row == 2.0 ** -10  # the median, not the 1 s first call


@pytest.mark.parametrize("pool, busy, pooled", [(0.0, 1.0, False), (2.0 ** -12, 1 + 2.0 ** -6, False),
                                               (2.0 ** -9, 1.125, False), (2.0 ** -8, 1.25, True),
                                               (2.0 ** -7, 1.5, True)])
def test_cpu_a_row_s_library_burns_on_its_own_threads_counts_as_cores_busy(monkeypatch, pool, busy, pooled):
    """A BLAS ``matmul`` read in a probe child took 5 ms of wall and thread CPU and 7-13 ms of process CPU: its
    library's pool ran beside the reading thread. Reads timed on a fake clock: 2**-6 s each, all CPU."""
    clock = fake_probe_clock(monkeypatch)

    class Pooled:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            clock.now += 2.0 ** -6
            clock.pool += pool
            return np.zeros(8),

    stats = rows.measure_random_access(Pooled(), ["a"], time_fraction=1e9)
    assert stats.cores_busy == busy and stats.cpu_fraction == 1.0 and stats.pooled is pooled


class Timed:
    """100 rows whose reads take the times ``costs(call)`` gives, ``(seconds, of which in the kernel)``."""

    def __init__(self, clock: FakeClock, costs) -> None:
        self.clock, self.costs, self.calls = clock, costs, []

    def __len__(self):
        return 100

    def __getitem__(self, i):
        seconds, kernel = self.costs(len(self.calls))
        self.calls.append(int(i))
        self.clock.now += seconds
        self.clock.kernel += kernel
        return np.zeros(8), np.array(i)


def _timed_probe(monkeypatch, costs, pair_row=0.004, together=0.004):
    """The probe of ``Timed(costs)``; a pair's rows take ``pair_row`` each (wall and CPU), ``together`` in all."""
    from ms_shm import parallel

    clock, pairs = fake_probe_clock(monkeypatch), []

    def run_pair(work, items):
        pairs.append(list(items))
        return [work(i) for i in items], [pair_row] * 2, [pair_row] * 2, together, None

    monkeypatch.setattr(parallel, "run_pair", run_pair)
    src = Timed(clock, costs)
    return src, rows.measure_random_access(src, ["a", "b"]), pairs


def test_a_cheap_row_whose_first_read_faulted_in_pages_is_timed_warm_and_not_paired(monkeypatch):
    """8 MiB rows read 2.4-33 ms first in a fresh fork (new pages, in the kernel) and 0.3 ms warm: the warm reads
    set the time per row, and no pair is read (threads cannot help a row that cheap)."""
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -5, 2.0 ** -5 - 2.0 ** -9) if call == 0
                                            else (2.0 ** -12, 0.0))
    assert src.calls == [0, 99, 57, 0] and pairs == []  # three rows, then row 0 again (the fidelity re-read)
    assert stats.seconds_per_row == 2.0 ** -12 and stats.parallel_fraction is None and stats.indices == (0, 99, 57)


def test_rows_still_dear_once_warm_get_their_pair_after_the_reads_alone(monkeypatch):
    """A first read of 7.8 ms (under ``PAIR_AT_ONCE_FROM``) whose warm read stays at 3.9 ms: the GIL's share matters,
    so the third row is read beside row 0 (its re-read): four reads, not three alone and a pair of rows read."""
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -7, 0.0) if call == 0 else (2.0 ** -8, 0.0),
                                     pair_row=2.0 ** -8, together=2.0 ** -8)
    assert src.calls == [0, 99, 0, 57] and pairs == [[0, 57]]
    assert stats.indices == (0, 99, 57) and stats.seconds_per_row == 2.0 ** -8 and stats.parallel_fraction == 1.0


@pytest.mark.parametrize("together, pairs_read, kept", [
    (0.004, [[0, 57], [0, 14]], 0.85),  # overlapped (about one row's time) but read 0.3: read once more
    (0.5, [[0, 57]], 0.30),  # far longer than a row alone (the GIL was held): no second pair
])
def test_a_late_pair_read_low_that_overlapped_is_read_once_more(monkeypatch, together, pairs_read, kept):
    """JPEG rows of 6.5-9 ms fall on both sides of ``PAIR_AT_ONCE_FROM``: a late pair gets the same second chance."""
    from ms_shm import parallel

    fractions = iter([0.30, 0.85])
    monkeypatch.setattr(parallel, "parallel_fraction", lambda *args: next(fractions))
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -7, 0.0) if call == 0 else (2.0 ** -8, 0.0),
                                     pair_row=2.0 ** -8, together=together)
    assert pairs == pairs_read and stats.parallel_fraction == kept
    assert stats.indices == tuple(dict.fromkeys([0, 99] + [i for _, i in pairs_read]))  # each pair reads a new row
    assert stats.seconds_per_row == 2.0 ** -8
    assert any("a second pair read, 85% kept" in n for n in stats.notes) is (kept == 0.85)


def test_a_first_read_dear_outside_the_kernel_is_paired_at_once(monkeypatch):
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -5, 2.0 ** -10))
    assert src.calls == [0, 0, 99] and pairs == [[0, 99]]


def test_rows_over_the_pair_cap_are_read_alone_however_dear(monkeypatch):
    """A pair holds two new rows beside the first (kept for the re-read): rows over ``PAIR_ROWS_UP_TO`` are read
    one at a time, as a worker reads them, and row 0 is read again alone."""
    from ms_shm import parallel

    monkeypatch.setattr(parallel, "PAIR_ROWS_UP_TO", 0)
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -5, 2.0 ** -10))
    assert pairs == [] and src.calls == [0, 99, 57, 0] and stats.parallel_fraction is None


def test_a_cold_first_read_gives_way_to_row_0_read_faster_in_its_pair(monkeypatch):
    """Measured: JPEG rows decode in 15-24 ms on a fresh fork's first read and ~7 ms once warm. Row 0's faster time
    in the pair stands for it; whether the pair ran cold is still judged against the first read, as cold as it."""
    from ms_shm import parallel

    fractions = iter([0.30, 0.85])
    monkeypatch.setattr(parallel, "parallel_fraction", lambda *args: next(fractions))
    src, stats, pairs = _timed_probe(monkeypatch, lambda call: (2.0 ** -5, 2.0 ** -10), pair_row=2.0 ** -7,
                                     together=1.25 * 2.0 ** -5)
    assert pairs == [[0, 99], [0, 57]] and stats.parallel_fraction == 0.85  # 1.25x the first read: read again
    assert stats.seconds_per_row == 2.0 ** -7  # every row at its pair's time, row 0's first read replaced


@pytest.mark.parametrize("a, b, same", [
    (np.full(3, np.nan), np.full(3, np.nan), True),  # a NaN read twice is the same row, to the byte
    (np.zeros(1), -np.zeros(1), False),  # equal numbers, other bytes
    (np.arange(200_001, dtype=np.uint8), np.arange(200_001, dtype=np.uint8), True),  # past several steps
    (np.arange(200_001, dtype=np.uint8), np.r_[np.arange(200_000, dtype=np.uint8), np.uint8(0)], False),
    (np.arange(12.0).reshape(3, 4).T, np.arange(12.0).reshape(3, 4).T.copy(), True),  # not contiguous
    (np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64), False),
    (np.arange(4), np.arange(4).reshape(2, 2), False),
    (np.array(["ab", "c"]), np.array(["ab", "c"]), True),
    (({"k": np.ones(2)},), ({"k": np.ones(2)},), True),
    (({"k": np.ones(2)},), ({"k": np.zeros(2)},), False),
    (np.array([1, "x"], object), np.array([1, "x"], object), True),  # by the objects, not their addresses
    ((float("nan"), 2), (float("nan"), 2), True),
])
def test_a_row_read_twice_is_compared_to_the_byte(a, b, same):
    assert rows.same_row(a, b) is same


F4, I8, U = np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.str_)


@pytest.mark.parametrize("converted, dtypes, refused", [
    ((np.zeros(2, np.float32), np.array(1, np.int64)), ((F4, "Float32"), (I8, "Int64")), None),
    ((np.zeros(2, np.float32), np.array(1, np.int32)), ((F4, "Float32"), (I8, "Int64")), "b"),
    ((np.zeros(2, np.float64),), ((F4, "Float32"),), "a"),
    ((np.array(["x"]),), ((None, "String"),), None),  # a type checked by nothing: MindSpore's to judge
    ((np.array(["x"]), np.array("a longer one")), ((U, "String"), (U, "String")), None),  # str of any length
    (({"k": np.ones(1)},), ((F4, "Float32"),), None),  # a dict column: not an array
    ((np.zeros(2, np.float32),), None, None),  # no column_types given
])
def test_a_column_whose_dtype_is_not_its_column_type_is_refused_naming_it(converted, dtypes, refused):
    if refused is None:
        rows.refuse_column_types(converted, 3, ["a", "b"], dtypes)
        return
    with pytest.raises(RowError) as info:
        rows.refuse_column_types(converted, 3, ["a", "b"], dtypes)
    assert info.value.column == refused and info.value.row == 3
    assert f"column '{refused}' of row 3" in str(info.value) and "Fix: return x.astype(np." in str(info.value)
    assert "mindspore." in str(info.value).split("Fix:")[1]


def test_a_column_column_types_leaves_without_a_type_is_refused_naming_it():
    """An audit: ``column_types=[mindspore.int64]`` for 2 columns; MindSpore 2.0 and 2.10 refuse every row mid-epoch
    ("specified column type: unknown"). A schema's types are left to MindSpore."""
    two = (np.zeros(2, np.int64), np.array(1, np.int32))
    with pytest.raises(RowError) as info:
        rows.refuse_column_types(two, 0, ["a", "b"], ((I8, "Int64"),))
    assert info.value.column == "b" and "gives 1 for 2 columns" in str(info.value) and "Fix: give one type" in \
        str(info.value)
    rows.refuse_column_types(two, 0, ["a", "b"], ((I8, "Int64", "its schema"),))


@pytest.mark.parametrize("value, fix", [(np.array(b"sent 0"), "return a str (or x.decode() of bytes)"),
                                        (np.array([1, 2], np.int32), "return a str")])
def test_a_string_column_given_bytes_or_numbers_is_refused_naming_it(value, fix):
    """``column_types=[mindspore.string, ...]`` takes numpy's str arrays only: bytes and numbers stop raw
    MindSpore mid-epoch (2.0 to 2.10, measured) with a message naming no column (an audit's NLP source)."""
    with pytest.raises(RowError) as info:
        rows.refuse_column_types((value,), 0, ["text"], ((U, "String"),))
    assert "column 'text' of row 0" in str(info.value) and fix in str(info.value)
    assert "mindspore.bytes" not in str(info.value)  # no MindSpore type takes bytes


def test_the_probe_refuses_column_types_the_rows_do_not_have():
    source = [(np.zeros(2, np.float32), np.array(i, np.int32)) for i in range(4)]
    with pytest.raises(RowError, match="column 'b' of row 0 is int32, but column_types gives it Int64"):
        rows.measure_random_access(source, ["a", "b"], column_dtypes=((F4, "Float32"), (I8, "Int64")))


Point = collections.namedtuple("Point", "x y")


def test_two_reads_of_a_sample_compared_byte_for_byte():
    same = {"a": [np.arange(3), (1.5, float("nan"))], "p": Point(np.zeros(2), "s"), "o": np.array([1, "x"], object)}
    again = {"a": [np.arange(3), (1.5, float("nan"))], "p": Point(np.zeros(2), "s"), "o": np.array([1, "x"], object)}
    none = rows.difference(same, again, "sample")
    assert none is None, none
    assert rows.difference({"a": [np.arange(3)]}, {"a": [np.arange(3) + 1]}, "s") == "s['a'][0]"
    assert rows.difference(np.arange(3), np.arange(3).astype(np.int32), "s") == "s"
    assert rows.difference(Point(1, 2), (1, 2), "s") == "s"
    assert rows.difference([1, 2], [1, 3], "s") == "s[1]"


class NoTruth:
    """A value whose ``==`` gives no answer (a framework's tensor, a table)."""

    def __eq__(self, other):
        return self

    def __bool__(self):
        raise ValueError("ambiguous")


def test_a_value_eq_cannot_answer_for_is_not_known_to_be_the_same():
    assert rows.difference([1, NoTruth()], [1, NoTruth()], "s") == "s[1]"
    assert not rows.same_row((NoTruth(),), (NoTruth(),))
    unreadable = rows.difference(1, 1, "s", tensor_bytes=lambda v: 1 / 0)
    assert unreadable == "s"  # a tensor that cannot be read as bytes: not known to be the same


def test_two_reads_of_a_torch_sample_compared_by_dtype_shape_and_bytes():
    torch = pytest.importorskip("torch")
    from ms_shm.engines.torch import compat

    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert rows.difference((x, 1), (x.clone(), 1), "s", compat.tensor_bytes) is None
    assert rows.difference(x, x.reshape(3, 2), "s", compat.tensor_bytes) == "s"
    assert rows.difference(x, x.float(), "s", compat.tensor_bytes) == "s"
    assert rows.difference(x, x + 1, "s", compat.tensor_bytes) == "s"
    assert rows.difference(x, [1], "s", compat.tensor_bytes) == "s"


def test_a_strided_rows_bytes_are_compared_without_copying_it_whole():
    """Plain lists are probed in the program's own process: two whole copies of four 384 MB transposed rows
    raised its peak memory by 735 MB (an audit)."""
    import resource

    from ms_shm.rows import _same_bytes

    row = np.zeros((4000, 6000), np.float32).T  # 96 MB, a strided view
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert _same_bytes(row, row)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 16 << 10  # KiB: under 16 MiB more
    other = np.array(row)
    other[5, 3999] = 1
    assert not _same_bytes(row, other) and not _same_bytes(row, row[:, :10])
    nan = np.full((300, 300), np.nan).T
    assert _same_bytes(nan, np.array(nan))  # bytes, not values: NaN is the same NaN


class Holding:
    """Rows as sources keep them: the arrays themselves, views of one array, bytes read as arrays, strided views,
    or new arrays each read."""

    def __init__(self, kind):
        self.kind, self.big = kind, np.arange(4 * 1000, dtype=np.float64).reshape(4, 1000)
        self.blobs = [r.tobytes() for r in self.big]

    def __getitem__(self, index):
        i = int(index)
        return {"arrays": lambda: (self.big[i], np.array(i)),  # a view of a held array, and a new label
                "bytes": lambda: (np.frombuffer(self.blobs[i], np.float64),),
                "strided": lambda: (self.big[:, i],),
                "fresh": lambda: (self.big[i] + 0,)}[self.kind]()

    def __len__(self):
        return 4


@pytest.mark.parametrize("kind, held", [("arrays", 8000 / 8008), ("bytes", 1.0), ("strided", 0.0), ("fresh", 0.0)])
def test_a_row_the_source_holds_is_told_from_one_each_read_makes(kind, held):
    """MindSpore 2.7+ carries contiguous arrays the source holds without a copy in its own process (300 MiB rows,
    the same peak RSS iterated or not); a strided view or a new array per read is a copy, a row each."""
    stats = rows.measure_random_access(Holding(kind), None)
    assert stats.held_fraction == pytest.approx(held)


class Refilled(Holding):
    """One buffer filled for every row (``np.copyto(self.out, ...)``), as an audit's source did."""

    def __init__(self, kind):
        super().__init__(kind)
        self.out = np.empty(1000)

    def __getitem__(self, index):
        np.copyto(self.out, self.big[int(index)])
        return self.out, np.array(int(index))


class HandedOutAgain(Holding):
    """Arrays the source holds, handed out again unchanged: one mask for every row, or rows repeated by ``i % 2``."""

    def __getitem__(self, index):
        return (self.big[0] if self.kind == "constant" else self.big[int(index) % 2]), np.array(int(index))


@pytest.mark.parametrize("source, reused", [(Refilled("buffer"), True)] + [
    (Holding(kind), False) for kind in ("arrays", "bytes", "strided", "fresh")] + [
    (HandedOutAgain(kind), False) for kind in ("constant", "repeated")])
def test_a_source_filling_one_buffer_for_every_row_is_told_from_rows_it_holds(source, reused):
    """Rows carried without a copy in MindSpore's own process share that buffer: the next read overwrites those
    still queued (63 wrong rows of 64 in threads, none in worker processes: an audit)."""
    stats = rows.measure_random_access(source, None, time_fraction=1e9)
    assert (stats.reused_buffer is not None) == reused, stats.reused_buffer
    if reused:
        assert stats.reused_buffer.startswith("source[0]'s row changed in place as source[3] was read"), \
            stats.reused_buffer


@pytest.mark.parametrize("array", [np.zeros(3, "M8[s]"), np.zeros(2, [("a", "i4"), ("b", "f8")]), np.array(5),
                                   np.zeros((2, 3), np.float16), np.zeros(4, bool)])
def test_a_rows_bytes_are_fingerprinted_whatever_their_dtype(array):
    """``np.datetime64`` arrays export no buffer ("cannot include dtype 'M'"): the checksum, taken on every probe
    row, would have failed the probe (a review)."""
    printed = rows.fingerprint((array,))
    array.reshape(-1).view(np.uint8)[0] ^= 1  # one byte changed in place
    assert printed is not None and rows.fingerprint((array,)) != printed


def test_a_row_of_no_array_bytes_holds_nothing_known():
    assert rows.held_fraction((np.zeros(0),), (np.zeros(0),)) is None


def test_a_dict_columns_arrays_and_strings_are_counted_for_memory_not_for_slots():
    """mindyolo's eval rows carry their 8 MiB image in a dict: no slot holds it (``row_bytes`` 0), but every
    reader does; priced at 80 MiB of memory, the audit's pipeline grew 495."""
    row = ({"img": np.zeros(1000, np.uint8), "meta": {"name": "a.jpg", "shape": [np.zeros(10, np.int64)]}},
           np.zeros(5, np.int32))
    assert rows.row_bytes(row) == 20 and rows.dict_bytes(row) == 1000 + 5 + 80
    stats = rows.measure_random_access([row[0]] * 4, ["sample"])  # as MindSpore converts it: "a.jpg" is <U5
    assert stats.row_bytes_max == 0 and stats.dict_bytes_max == 1000 + 5 * 4 + 80


def test_a_schema_files_columns_give_the_names_and_types_a_row_is_checked_against(tmp_path):
    """``GeneratorDataset(schema=...)`` declares each column's type as ``column_types`` does, and MindSpore
    refuses another dtype mid-epoch naming no column (int64 ids in an int32 column, an audit): its columns, read
    from a ``Schema`` or its JSON file (columns listed, or keyed by name), are checked at build."""
    import json

    from ms_shm.engines.mindspore import compat

    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps({"columns": {"text": {"type": "string", "rank": 1},
                                             "ids": {"type": "int32", "rank": 1, "shape": [-1]}}}))
    assert compat.schema_columns(str(keyed)) == (("text", "string"), ("ids", "int32"))
    assert compat.schema_columns(tmp_path / "missing.json") is None
    dtypes = compat.column_dtypes(None, str(keyed))
    rows.refuse_column_types((np.array("a b"), np.arange(3, dtype=np.int32)), 0, ["text", "ids"], dtypes)
    with pytest.raises(RowError) as info:
        rows.refuse_column_types((np.array("a b"), np.arange(3)), 0, ["text", "ids"], dtypes)
    assert "column 'ids' of row 0 is int64, but its schema gives it int32" in str(info.value)
    assert "or give it mindspore.int64 in its schema" in str(info.value)


class Cached:
    """A small ``lru_cache`` over a loader that makes a new row each call (an audit's source): the first row read
    again is a cache hit at the same address, yet every other row is new memory."""

    def __init__(self, n=8, nbytes=16 << 20):
        import functools

        self.n, self.nbytes = n, nbytes
        self.load = functools.lru_cache(maxsize=4)(self._load)

    def _load(self, i):
        return np.full(self.nbytes, i, np.uint8)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return (self.load(int(index)),)


class SharedTable:
    """Each row a dict whose table is one array the source holds (a lookup table), beside a small new label."""

    def __init__(self):
        self.table = np.ones(16 << 20, np.uint8)

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return ({"table": self.table, "label": np.array([int(index)])},)


def test_a_row_a_cache_made_on_the_first_read_is_not_taken_for_one_the_source_held():
    """The cached row came back at the same address and was priced as no copy: ms_shm read it in threads at
    16 MiB of memory and was OOM-killed in 1000 MB where raw ran (an audit). A first read that grew the process
    by half the row or more made it; a table every row's dict shares is held, and priced so (refused before)."""
    assert rows.measure_random_access(Cached(), None).held_fraction == 0.0
    shared = rows.measure_random_access(SharedTable(), ["sample"])
    assert shared.held_fraction == pytest.approx(1.0, abs=1e-4) and shared.dict_bytes_max >= 16 << 20


def test_a_refused_torch_tensor_column_is_told_to_become_numpy():
    """An audit: a torch tensor column refused by MindSpore's conversion was told ``np.asarray`` "for scalars and
    lists"."""
    torch = pytest.importorskip("torch", reason="torch is not installed")

    def refuses_tensors(row):
        if any(isinstance(v, torch.Tensor) for v in row):
            raise ValueError("Unable to avoid copy while creating an array as requested.")

    with pytest.raises(RowError) as err:
        rows.checked_row((np.zeros(2), torch.arange(3)), 0, ["a", "t"], refuses_tensors)
    assert err.value.column == "t" and "x.numpy() for a torch tensor" in str(err.value)
