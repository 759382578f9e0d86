"""The probe of a map's operations and of a ``per_batch_map``, run in a forked child on a source's first rows: no
framework. What MindSpore refuses at the first row (another number of columns than the output columns, ``None``)
is refused at ``map()`` / ``batch()``, before any worker starts; what it carries is measured."""

from __future__ import annotations

import numpy as np
import pytest

from ms_shm import measure
from ms_shm.rows import RowError


class Rows:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return (np.arange(3) + i, np.array(i))


LINEAGE = measure.SourceLineage(Rows(), ("a", "b"), (0, 1, 2, 3))


@pytest.mark.parametrize("operation, ins, outs, text", [
    (lambda x: (x, x), ["a"], ["a"], "the map returns 2 column(s) for the first probe row, but its output columns "
                                      "are 1 (['a'])"),
    (lambda a, b: a, ["a", "b"], ["a", "b"], "the map returns 1 column(s)"),
    (lambda x: None, ["a"], ["a"], "returns None for a probe row"),
])
def test_a_map_that_mindspore_stops_at_its_first_row_is_refused_at_map(operation, ins, outs, text):
    with pytest.raises(RowError) as err:
        measure.probe_operations(LINEAGE, operation, ins, outs)
    assert text in str(err.value) and "Fix:" in str(err.value)


def test_a_list_a_map_returns_is_one_column_as_mindspore_makes_it():
    """MindSpore 2.10 (measured): ``lambda x: [x, x]`` with one output column yields one 2x3 column; a tuple is
    columns. Between Python operations a list goes on as one argument (``py_transforms_util.compose`` wraps only
    what is not a tuple): ``y * 2`` repeats it."""
    probe = measure.probe_operations(LINEAGE, lambda x: [x, x], ["a"], ["a"])
    assert probe.stats is not None and probe.stats.out_bytes == 2 * np.arange(3).nbytes
    assert measure.run_operations([lambda x: [x, x], lambda y: y * 2], (np.arange(3),))[0].shape == (4, 3)


def test_where_mindspore_skips_or_replaces_a_failing_row_a_refused_output_is_a_warning(caplog):
    probe = measure.probe_operations(LINEAGE, lambda x: (x, x), ["a"], ["a"], fate="skips it")
    assert probe.stats is None and "the map returns 2 column(s)" in probe.unmeasured


def _raises_from(row: int):
    def operation(x):
        if int(x[0]) >= row:
            raise ValueError(f"bad row {int(x[0])}")
        return x * 2
    return operation


@pytest.mark.parametrize("row", [1, 2])
def test_a_map_whose_operations_raise_on_a_later_probe_row_is_measured_on_the_rows_before_it(row, caplog):
    """Before, the stage was left unmeasured (MindSpore's own settings, unprotected) as when the first row raises;
    now its rows before the failing one are measured and the warning names the row, as for a source's."""
    with caplog.at_level("WARNING", logger="ms_shm"):
        probe = measure.probe_operations(LINEAGE, _raises_from(row), ["a"], ["a"])
    assert probe.unmeasured is None and probe.stats.rows == row, probe
    assert probe.stats.out_bytes == np.arange(3).nbytes and probe.stats.seconds_per_row is not None
    assert f"source row {row} raised ValueError: bad row {row}" in probe.stats.raised
    assert "test_operation_probe.py" in probe.stats.raised  # the line that raised it
    assert f"planned from the {row} row(s) run before it" in caplog.text and "when the pipeline reaches" in caplog.text


def test_a_map_whose_first_probe_row_raises_is_left_unmeasured():
    probe = measure.probe_operations(LINEAGE, _raises_from(0), ["a"], ["a"])
    assert probe.stats is None and "raised ValueError: bad row 0 on a probe row" in probe.unmeasured


def test_the_map_after_one_that_raises_on_a_later_row_is_measured_on_the_rows_it_made():
    mapped = measure.MapLineage(LINEAGE, _raises_from(2), ("a",), ("a",))
    assert [list(v) for v in mapped.rows(3)["a"]] == [[0, 2, 4], [2, 4, 6]] and len(mapped.rows(3)["b"]) == 2
    probe = measure.probe_operations(mapped, lambda x: x + 1, ["a"], ["a"])
    assert probe.stats is not None and probe.stats.rows == 2 and probe.stats.raised is None
    with pytest.raises(ValueError):
        measure.MapLineage(LINEAGE, _raises_from(0), ("a",), ("a",)).rows(3)


@pytest.mark.parametrize("per_batch_map, ins, outs, text", [
    (lambda a, b, info: (a,), ["a", "b"], ["a", "b"], "the per_batch_map returns 1 column(s) for the first probe "
                                                       "batch, but its output columns are 2"),
    (lambda a, info: None, ["a"], ["a"], "the per_batch_map returns None"),
])
def test_a_per_batch_map_that_mindspore_stops_at_its_first_batch_is_refused_at_batch(per_batch_map, ins, outs,
                                                                                     text):
    with pytest.raises(RowError) as err:
        measure.probe_batch(LINEAGE, per_batch_map, 2, ins, outs)
    assert text in str(err.value)
    ok = measure.probe_batch(LINEAGE, lambda a, info: ([x * 2 for x in a],), 2, ["a"], ["a"])
    assert ok.stats is not None


class DictRows:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return ({"img": np.full(4, i, np.float32), "name": f"{i}.jpg"},)


DICT_LINEAGE = measure.SourceLineage(DictRows(), ("sample",), (0, 1, 2, 3))


def _pop_image(sample):
    return sample.pop("img") * 2, np.array(len(sample))


def _collate_popping(samples, info):
    return (np.stack([s.pop("img") for s in samples]),)


def test_operations_that_pop_from_their_dict_rows_are_measured_as_mindspore_runs_them_once():
    """mindyolo's ``test_collate_fn`` pops ``'img'`` from each dict row it gets: MindSpore passes every row once,
    the probe runs its first again (the fidelity check), and that second run raised ``KeyError`` on the popped
    dict, so the stage was built unmeasured, with a warning of an error MindSpore never raises (an audit)."""
    probe = measure.probe_operations(DICT_LINEAGE, _pop_image, ["sample"], ["img", "nkeys"])
    assert probe.unmeasured is None and probe.stats.rows == 3 and probe.stats.raised is None, probe
    batch = measure.probe_batch(DICT_LINEAGE, _collate_popping, 2, ["sample"], ["images"])
    assert batch.unmeasured is None and batch.stats is not None, batch


def test_the_probes_copies_of_an_operations_inputs_are_made_before_its_clock_starts(monkeypatch):
    """A deep copy of a 300 MiB dict value, timed as the ``per_batch_map``'s own work, made it look 200 times
    slower and worker processes faster: OOM-killed in 8000 MB where raw ran (an audit)."""
    from ms_shm import parallel

    timing, copied_while_timed = [], []
    real_timed, real_fresh = parallel.timed_call, measure._fresh

    def timed(fn, *args):
        timing.append(True)
        try:
            return real_timed(fn, *args)
        finally:
            timing.pop()

    def fresh(value):
        copied_while_timed.append(bool(timing))
        return real_fresh(value)

    monkeypatch.setattr(parallel, "timed_call", timed)
    monkeypatch.setattr(measure, "_fresh", fresh)
    samples = [DictRows()[i][0] for i in range(3)]
    assert measure.time_operations(_pop_image, [[s] for s in samples]).rows == 3  # in this process: no probe child
    assert measure.time_batch(_collate_popping, [samples], 3).rows == 1
    assert copied_while_timed and not any(copied_while_timed)
    assert all("img" in s for s in samples)  # and the inputs are left as they were


class _Counting:
    """An operation whose output counts its calls into every element: computed again, it differs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return np.full(1 << 16, self.calls, np.int64) + int(x[0])


@pytest.mark.parametrize("over_the_cap", [False, True])
@pytest.mark.parametrize("operation, differs", [(lambda x: np.full(1 << 16, int(x[0]), np.int64), False),
                                                (_Counting(), True)])
def test_an_output_too_large_to_hold_twice_is_compared_by_its_fingerprints(monkeypatch, over_the_cap, operation,
                                                                           differs):
    """A map making 0.95 GB rows (MindSpore's UT): the probe kept the first output whole beside the next, 1979 MiB
    in the child. Over ``PAIR_ROWS_UP_TO`` it keeps their fingerprints; the re-run is told apart as before."""
    from ms_shm import parallel

    if over_the_cap:
        monkeypatch.setattr(parallel, "PAIR_ROWS_UP_TO", 1 << 10)  # these outputs: 512 KiB
    kept = measure.kept_for_reread((operation(np.arange(3)),))
    assert isinstance(kept[0], measure.Printed) is over_the_cap
    probe = measure.probe_operations(LINEAGE, operation, ["a"], ["a"])
    assert probe.stats is not None and bool(probe.effects.rereads_differ) is differs


@pytest.mark.parametrize("returned, refused", [
    (lambda x: x.astype(np.complex64), "has dtype complex64"),
    (lambda x: x.astype(">i4"), "has byte order >i4"),
    (lambda x: x.astype(np.longdouble), "has dtype float128 (numpy's longdouble)"),
    (lambda x: {"k": x}, None),  # a dict MindSpore carries: made an object array by the probe, not judged
    (lambda x: x.astype(np.float16), None),
])
def test_an_output_mindspore_cannot_carry_is_refused_at_map_naming_its_column(returned, refused):
    """An audit: a map returning complex, big-endian or longdouble arrays passed ``map()`` and died mid-epoch
    ("data type is unknown"), where the same arrays from a source were refused at build."""
    if refused is None:
        assert measure.probe_operations(LINEAGE, returned, ["a"], ["a"]).stats is not None
        return
    with pytest.raises(RowError) as err:
        measure.probe_operations(LINEAGE, returned, ["a"], ["a"])
    assert f"the map's output column 'a' for the first probe row {refused}" in str(err.value)
    assert "Fix:" in str(err.value) and err.value.column == "a"
