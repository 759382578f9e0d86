"""``ms_shm.patch()`` and ``ms-shm run``: unchanged raw-MindSpore scripts, protected.

The scripts in ``tests/patch_scenarios/`` import MindSpore only, never ms_shm. Each runs raw and through
``python -m ms_shm run`` in the same private /dev/shm. Where raw MindSpore dies (dynamic slots past the end of a
64 MB /dev/shm) the test asserts how it dies; where it copes (MindSpore 2.10 moves map rows through SysV) it
asserts raw delivers the same rows. Every row delivered is checked against a digest computed here from its index
(``tests.scenarios.content``), and labels must be 0..n-1 in order. No wall-clock asserts.
"""

from __future__ import annotations

import json
import pickle
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import isolated
from tests.isolated import assert_bus_error, result_of
from tests.scenarios import MiB, content, digest

pytestmark = pytest.mark.mindspore

SCENARIOS = Path(__file__).resolve().parent / "patch_scenarios"
PY = shlex.quote(sys.executable)


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def run(args: str, shm: str = "64m", cwd: Path | None = None, timeout: float = 300, limit: str = ""):
    prefix = f"cd {shlex.quote(str(cwd))} && " if cwd else ""
    return isolated.run_shell(prefix + f"exec {limit} {PY} {args}", shm=shm, timeout=timeout)


def assert_raw_bus_error(args: str, **kwargs) -> None:
    """The unchanged script, run by plain python, dies of the bus error (or hangs after it, and is killed)."""
    assert_bus_error(run(args, limit=isolated.RAW_LIMIT, **kwargs), hung_ok=True)




def assert_rows(res: dict, seed: int, rows: int, nbytes: int) -> None:
    assert res["labels"] == list(range(rows)), res["labels"]
    assert res["digests"] == [digest(content(seed, i, nbytes)) for i in range(rows)]


def adapted_warnings(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith("WARNING: ms_shm adapted")]


# ------------------------------------------------------------------------------------------ in process


def test_patch_unpatch_restore_the_originals_exactly(real_mindspore):
    import inspect

    import mindspore.dataset as ds
    from mindspore.dataset.engine.datasets import Dataset

    import ms_shm

    gd = ds.GeneratorDataset
    before = (dict(vars(gd)), dict(vars(Dataset)), inspect.signature(gd), inspect.signature(gd.__init__))
    ms_shm.patch()
    ms_shm.patch()  # idempotent
    try:
        assert vars(gd)["__init__"] is not before[0]["__init__"] and vars(Dataset)["map"] is not before[1]["map"]
        assert inspect.signature(gd) == before[2] and inspect.signature(gd.__init__) == before[3]
        src = [(np.full(3, i, np.int64),) for i in range(6)]
        built = ds.GeneratorDataset(src, ["x"], shuffle=False)
        assert type(built) is gd and isinstance(built, ds.GeneratorDataset)
        assert ms_shm.plan_of(built) is not None  # it went through ms_shm
        mapped = built.map(lambda x: x + 1, input_columns=["x"]).project(["x"]).repeat(2).skip(1).take(8)
        assert ms_shm.plan_of(mapped) is None  # the last stages are MindSpore's own, unpatched
        got = [int(r["x"][0]) for r in mapped.create_dict_iterator(output_numpy=True, num_epochs=1)]
        assert got == [2, 3, 4, 5, 6, 1, 2, 3]
        pickle.loads(pickle.dumps(src))
        slices = ds.NumpySlicesDataset(np.arange(4), ["a"], shuffle=False)  # MindSpore's own subclass: untouched
        assert type(slices) is ds.NumpySlicesDataset and ms_shm.plan_of(slices) is None
    finally:
        ms_shm.unpatch()
    ms_shm.unpatch()  # a no-op
    assert dict(vars(gd)) == before[0] and dict(vars(Dataset)) == before[1]
    assert all(vars(gd)[k] is v for k, v in before[0].items())
    plain = ds.GeneratorDataset([(np.zeros(2),)], ["x"])
    assert ms_shm.plan_of(plain) is None


def _raised(call) -> tuple:
    try:
        call()
    except Exception as exc:  # what raw MindSpore raises, patched code must raise
        return type(exc), str(exc)
    return None, None


def test_patched_calls_raise_mindspores_own_argument_errors(real_mindspore):
    """What MindSpore refuses at the call (found by its own unit tests, run through the patch), patched code
    refuses with the same exception and message, before ms_shm reads the arguments."""
    import mindspore.dataset as ds

    import ms_shm

    def source():
        return ds.GeneratorDataset([(np.full(4, i, np.int64),) for i in range(8)], ["x"], shuffle=False)

    calls = [lambda: source().batch(2, per_batch_map=lambda x, info: (x,), input_columns=["x"], output_columns=233),
             lambda: source().map(lambda x: x, input_columns=5),
             lambda: ds.GeneratorDataset([(np.zeros(2),)], ["x"], num_parallel_workers=0)]
    raw = [_raised(call) for call in calls]
    with ms_shm.patched():
        patched = [_raised(call) for call in calls]
    assert all(kind in (TypeError, ValueError) for kind, _ in raw), raw
    assert patched == raw


def test_workers_none_fails_at_the_epoch_as_raw_under_patch_and_at_the_call_through_the_api(real_mindspore,
                                                                                               caplog):
    """``GeneratorDataset(num_parallel_workers=None)``: MindSpore takes it and fails its first epoch (2.0 to
    2.10); planned, ms_shm chose the workers and every row arrived (an audit of MindSpore's unit tests)."""
    import mindspore.dataset as ds

    import ms_shm

    rows = [(np.full(4, i, np.int64),) for i in range(8)]

    def epoch():
        made = ds.GeneratorDataset(rows, ["x"], shuffle=False, num_parallel_workers=None)
        return _raised(lambda: list(made.create_tuple_iterator(num_epochs=1, output_numpy=True)))

    raw = epoch()
    with ms_shm.patched(), caplog.at_level("WARNING", logger="ms_shm"):
        patched = epoch()
    assert raw[0] is TypeError and patched == raw, (raw, patched)
    assert "num_parallel_workers=None" in caplog.text and "Fix: pass an int" in caplog.text
    with pytest.raises(ms_shm.UsageError, match="leave it out"):
        ms_shm.build_dataset(rows, ["x"], num_parallel_workers=None)


def test_too_many_workers_are_adapted_under_patch_and_refused_as_mindspore_does_when_strict(real_mindspore,
                                                                                           caplog):
    """``num_parallel_workers`` above the CPU count: MindSpore's ValueError raw and under ``strict``; a
    preference under ``patch()``, capped at the CPU count with a warning (code written for a bigger machine)."""
    import os

    import mindspore.dataset as ds

    import ms_shm

    rows = [(np.full(4, i, np.int64),) for i in range(8)]
    many = (os.cpu_count() or 1) + 2
    raw = _raised(lambda: ds.GeneratorDataset(rows, ["x"], shuffle=False, num_parallel_workers=many))
    with ms_shm.patched(strict=True):
        strict = _raised(lambda: ds.GeneratorDataset(rows, ["x"], shuffle=False, num_parallel_workers=many))
    assert raw[0] is ValueError and strict == raw
    with ms_shm.patched(), caplog.at_level("WARNING", logger="ms_shm"):
        built = ds.GeneratorDataset(rows, ["x"], shuffle=False, num_parallel_workers=many)
        got = [int(r["x"][0]) for r in built.create_dict_iterator(output_numpy=True, num_epochs=1)]
    assert got == list(range(8)) and "num_parallel_workers" in caplog.text


def test_the_same_adaptation_at_the_same_line_is_a_warning_once(real_mindspore, caplog):
    """A loop (a search, an eval rebuilt each epoch) building at one line: an audit's 100 iterations under
    ``ms-shm run`` said the same "adapted" warning 96 times. Once at WARNING, then at INFO."""
    import logging
    import os

    import mindspore.dataset as ds

    import ms_shm

    rows = [(np.full(4, i, np.int64),) for i in range(8)]
    many = (os.cpu_count() or 1) + 2
    with ms_shm.patched(), caplog.at_level("INFO", logger="ms_shm"):
        for _ in range(3):
            ds.GeneratorDataset(rows, ["x"], shuffle=False, num_parallel_workers=many)
    said = [r.levelno for r in caplog.records if r.getMessage().startswith("ms_shm adapted GeneratorDataset")]
    assert said == [logging.WARNING, logging.INFO, logging.INFO], said


def test_a_generator_function_under_patch_is_capped_as_a_random_access_source_and_not_otherwise_adapted(
        real_mindspore, caplog):
    """A generator function (no ``__getitem__``) with too many workers: MindSpore's ValueError raw, the same cap
    as any source under ``patch()``; with workers that fit, no "adapted" warning, since MindSpore itself reads such
    a source in the main process and ms_shm changes nothing (found with MindSpore's test_skip.py)."""
    import os

    import mindspore.dataset as ds

    import ms_shm

    def gen():
        for i in range(5):
            yield (np.full(2, i, np.int64),)

    def epoch(dataset):
        return [int(r["x"][0]) for r in dataset.create_dict_iterator(output_numpy=True, num_epochs=1)]

    many = (os.cpu_count() or 1) + 2
    assert _raised(lambda: ds.GeneratorDataset(gen, ["x"], num_parallel_workers=many))[0] is ValueError
    with ms_shm.patched(), caplog.at_level("WARNING", logger="ms_shm"):
        assert epoch(ds.GeneratorDataset(gen, ["x"], num_parallel_workers=many)) == list(range(5))
        assert "num_parallel_workers" in caplog.text and "os.cpu_count()" in caplog.text
        caplog.clear()
        assert epoch(ds.GeneratorDataset(gen, ["x"], num_parallel_workers=min(2, many - 2))) == list(range(5))
    assert "adapted" not in caplog.text, caplog.text


def test_an_operation_whose_getattr_raises_fails_where_mindspore_fails(real_mindspore):
    """An operation whose ``__getattr__`` raises ``KeyError`` (a dict subclass, from MindSpore's test_iterator.py):
    raw MindSpore builds the map and raises when the pipeline starts; so must patched code and ``ms_shm.map``,
    with MindSpore's own error (ms_shm looked up ``__self__`` with ``getattr``, which lets KeyError through)."""
    import mindspore.dataset as ds

    import ms_shm

    class AttrDict(dict):
        def __getattr__(self, key):
            return self[key]

        def __call__(self, x):
            return x

    def source():
        return ds.GeneratorDataset([(np.array(i),) for i in range(4)], ["a"], shuffle=False)

    def start(dataset):
        return list(dataset.create_tuple_iterator(num_epochs=1))

    mapped = source().map(operations=[AttrDict()])
    raw = _raised(lambda: start(mapped))
    assert raw[0] is KeyError
    with ms_shm.patched():
        mapped = source().map(operations=[AttrDict()])
    assert _raised(lambda: start(mapped)) == raw
    assert _raised(lambda: start(ms_shm.map(source(), [AttrDict()]))) == raw


def test_a_bad_row_under_patch_raises_where_mindspore_raises_it(real_mindspore, caplog):
    """Two column names, rows of one array: raw MindSpore builds the dataset and raises while iterating, so the
    patched constructor builds it too (ms_shm's clearer reason is logged) and iterating raises what raw does."""
    import mindspore.dataset as ds

    import ms_shm

    class OneColumn:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full(3, i, np.int64)

    def epoch(dataset):
        return [r for r in dataset.create_dict_iterator(output_numpy=True, num_epochs=1)]

    raw = _raised(lambda: epoch(ds.GeneratorDataset(OneColumn(), ["data", "label"], shuffle=False)))
    with ms_shm.patched(), caplog.at_level("WARNING", logger="ms_shm"):
        built = ds.GeneratorDataset(OneColumn(), ["data", "label"], shuffle=False)
        patched = _raised(lambda: epoch(built))
    assert raw[0] is RuntimeError and patched[0] is raw[0]
    assert "label" in caplog.text or "column" in caplog.text


def test_a_patched_map_keeps_threads_as_mindspore_does_without_a_warning(real_mindspore, caplog):
    """``map`` and ``batch`` default to threads (``python_multiprocessing=False``): a map asking for workers
    alone is not "adapted from processes"."""
    import mindspore.dataset as ds

    import ms_shm

    with ms_shm.patched(), caplog.at_level("WARNING", logger="ms_shm"):
        built = ds.GeneratorDataset([(np.full(4, i, np.int64),) for i in range(8)], ["x"], shuffle=False)
        mapped = built.map(lambda x: x * 2, input_columns=["x"], num_parallel_workers=2)
        got = [int(r["x"][0]) for r in mapped.create_dict_iterator(output_numpy=True, num_epochs=1)]
    assert got == [2 * i for i in range(8)]
    assert "adapted map" not in caplog.text, caplog.text


def test_patched_context_manager_and_strict(real_mindspore):
    import mindspore.dataset as ds

    import ms_shm
    from ms_shm import patch as _  # noqa: F401  (the function; the module is sys.modules["ms_shm.patch"])

    module = sys.modules["ms_shm.patch"]
    original = vars(ds.GeneratorDataset)["__init__"]
    with ms_shm.patched(strict=True):
        assert module.is_patched() and module._STATE["strict"] is True
        with ms_shm.patched():  # nested: the outer patch stays, with its own strict
            assert module._STATE["strict"] is False
        assert module.is_patched() and module._STATE["strict"] is True
    assert not module.is_patched() and vars(ds.GeneratorDataset)["__init__"] is original


def test_a_padded_batch_over_a_planned_pipeline_is_priced_as_a_batch_and_yields_raws(real_mindspore, monkeypatch):
    """``padded_batch`` (its own method since MindSpore 2.0) holds batches in memory as ``batch`` does: under the
    patch it is priced beside the pipeline below it (an audit's ``padded_batch(4)`` of 4 MiB rows added ~120 MiB,
    unpriced, in a 420 MB container). What it yields is MindSpore's own."""
    import mindspore.dataset as ds

    import ms_shm
    from ms_shm import api

    priced = []
    monkeypatch.setattr(api, "hold_room_for_batches", lambda result, below, size, quiet: priced.append(size))
    rows = [(np.arange(i % 4 + 1, dtype=np.int64),) for i in range(10)]

    def padded():
        made = ds.GeneratorDataset(rows, ["x"], shuffle=False).padded_batch(4, pad_info={"x": ([None], -1)})
        return [r["x"].tolist() for r in made.create_dict_iterator(output_numpy=True, num_epochs=1)]

    raw = padded()
    with ms_shm.patched():
        assert padded() == raw and priced == [4]
    assert padded() == raw and priced == [4]  # unpatched: MindSpore's own method again


# ------------------------------------------------------------------------------------------ scripts


def test_generator_with_explicit_processes_dies_raw_and_runs_through_ms_shm(real_mindspore, tmp_path):
    script = SCENARIOS / "gen_explicit.py"
    assert_raw_bus_error(f"{script} 31 12 8")
    report = tmp_path / "report.json"
    proc = run(f"-m ms_shm run --report {report} {script} 31 12 8")
    res = result_of(proc)
    assert_rows(res, 31, 12, 8 * MiB)
    assert res["type_is_generator"] is True
    warnings = adapted_warnings(proc)
    assert len(warnings) == 1, proc.stderr
    assert f"{script}:{line_of(script, 'ds.GeneratorDataset(')}" in warnings[0]
    data = json.loads(report.read_text())
    pipelines = data["pipelines"]
    assert [p["kind"] for p in pipelines] == ["GeneratorDataset"]
    assert len(data["tune_seconds"]) == 1 and 0 < data["tune_seconds"][0] < 60  # what ms_shm added, for bench_run
    assert 0 < pipelines[0]["seconds"] < 60
    assert pipelines[0]["call_site"].endswith(f"gen_explicit.py:{line_of(script, 'ds.GeneratorDataset(')}")
    assert pipelines[0]["plan"]["predicted_shm"] <= pipelines[0]["plan"]["budget"]["shm_bytes"]


def test_a_source_whose_last_rows_raise_is_planned_and_raises_where_mindspore_does(real_mindspore):
    """``__len__`` 24, rows 12 on raise ``IndexError``; the probe reads the last index. An audit: that row's error
    left the pipeline unplanned, and its slots filled 64 MB before row 12 (``ShmFullError`` blaming something
    else). Now planned from the rows read before it: every row up to 12, then MindSpore's ``IndexError``."""
    script = SCENARIOS / "gen_short.py"
    assert_raw_bus_error(f"{script} 31 24 8 12")
    proc = run(f"-m ms_shm run {script} 31 24 8 12")
    rows = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    # row 12's error may overtake row 11 from the other worker, raw or planned (MindSpore's race; seen once in a
    # full suite on a loaded machine): rows in order up to it, then its error
    assert proc.returncode != 0 and rows == list(range(len(rows))) and len(rows) >= 11, isolated.describe(proc)
    assert "IndexError: index 12 out of range" in proc.stderr and "ShmFullError" not in proc.stderr, proc.stderr
    assert "probe row 23 raised IndexError" in proc.stderr and "planned from the" in proc.stderr, proc.stderr


def test_a_generator_dataset_subclass_dies_raw_and_runs_through_ms_shm(real_mindspore):
    """A subclass calling ``super().__init__`` with explicit processes was passed on unplanned (audit)."""
    script = SCENARIOS / "gen_subclass.py"
    assert_raw_bus_error(f"{script} 31 12 8")
    proc = run(f"-m ms_shm run {script} 31 12 8")
    res = result_of(proc)
    assert_rows(res, 31, 12, 8 * MiB)
    assert res["type"] == "ZooDataset"
    warnings = adapted_warnings(proc)
    assert len(warnings) == 1 and f"{script}:{line_of(script, 'super().__init__(')}" in warnings[0], proc.stderr


def test_map_growing_rows_in_processes(real_mindspore, tmp_path):
    """MindSpore 2.10 moves map rows through SysV, so raw copes in 64 MB: it must deliver what ms_shm delivers."""
    script = SCENARIOS / "map_grow.py"
    raw = result_of(run(f"{script} 41 12 8"))
    report = tmp_path / "report.json"
    res = result_of(run(f"-m ms_shm run --report {report} {script} 41 12 8"))
    want = [digest(np.resize(content(41, i, 1024), 8 * MiB)) for i in range(12)]
    assert raw["digests"] == want and res["digests"] == want
    assert raw["labels"] == res["labels"] == list(range(12))
    kinds = [p["kind"] for p in json.loads(report.read_text())["pipelines"]]
    assert kinds == ["GeneratorDataset", "map"]


def test_batch_with_per_batch_map_in_processes(real_mindspore, tmp_path):
    script = SCENARIOS / "batch_pbm.py"
    assert_raw_bus_error(f"{script} 51 32 4")
    report = tmp_path / "report.json"
    res = result_of(run(f"-m ms_shm run --report {report} {script} 51 32 4"))
    assert res["labels"] == [i + 1000 for i in range(32)]
    assert res["digests"] == [digest(content(51, i, 4 * MiB) ^ np.uint8(0x5A)) for i in range(32)]
    pipelines = json.loads(report.read_text())["pipelines"]
    assert [p["kind"] for p in pipelines] == ["GeneratorDataset", "batch"]
    batch_plan = pipelines[1]["plan"]
    assert batch_plan["kind"] == "batch" and batch_plan["row_bytes"] >= 4 * 4 * MiB  # the batch is the row


def test_a_program_that_chose_spawn_keeps_it_where_raw_starts_no_worker_process(real_mindspore):
    """An audit: a ``GeneratorDataset`` of default arguments over GIL-bound rows, planned as 2 worker processes,
    turned the program's ``spawn`` into ``fork`` for every later ``Pool`` (MindSpore's pools switch it once they
    start). Raw starts none there, so neither does ms_shm, and it says why."""
    script = SCENARIOS / "spawn_program.py"
    raw = result_of(run(str(script), shm="1g"))
    proc = run(f"-m ms_shm run --log-level INFO {script}", shm="1g")
    ours = result_of(proc)
    assert raw["start_method"] == ours["start_method"] == "spawn", (raw, ours)
    said = [line for line in proc.stderr.splitlines() if "ms_shm decision python_multiprocessing=False" in line]
    assert said and "start method to 'spawn'" in said[0] and "pass python_multiprocessing=True" in said[0], \
        proc.stderr[-3000:]
    assert ours["rows"] == raw["rows"] and len(raw["rows"]) == 200


def test_spawned_workers(real_mindspore):
    script = SCENARIOS / "spawn_gen.py"
    assert_raw_bus_error(f"{script} 61 12 8")
    proc = run(f"-m ms_shm run {script} 61 12 8")
    assert_rows(result_of(proc), 61, 12, 8 * MiB)
    assert f"{script}:{line_of(script, 'ds.GeneratorDataset(')}" in adapted_warnings(proc)[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_under_msrun_die_raw_and_run_through_ms_shm(real_mindspore, tmp_path):
    """``msrun`` runs ``python TASK_SCRIPT`` per rank, and ``ms-shm`` is a Python script: ``msrun ...
    $(which ms-shm) run train.py`` (the README's line). Two ranks of 2 worker processes and 8 MiB rows in one
    64 MB ``/dev/shm``: raw's workers die of the bus error; through ``ms-shm run`` each rank plans for the 2
    local ranks msrun says there are and delivers every row."""
    bindir = Path(sys.executable).parent
    msrun, ms_shm_script = bindir / "msrun", bindir / "ms-shm"
    if not msrun.exists() or not ms_shm_script.exists():
        pytest.skip(f"no msrun (MindSpore 2.3+) or no ms-shm console script beside {sys.executable}")
    script = SCENARIOS / "gen_explicit.py"

    def launch(logs: Path, *task: str, limit: str = "") -> list:
        command = (f"cd {shlex.quote(str(tmp_path))} && PATH={shlex.quote(str(bindir))}:$PATH exec {limit} {msrun} "
                   f"--worker_num=2 --local_worker_num=2 --master_port={_free_port()} --log_dir={logs} "
                   f"--join=True {' '.join(shlex.quote(t) for t in task)} {script} 31 12 8")
        proc = isolated.run_shell(command, timeout=300)
        return [proc] + [(logs / f"worker_{rank}.log").read_text() for rank in (0, 1)]

    proc, *raw = launch(tmp_path / "raw", limit=isolated.RAW_LIMIT)  # msrun may wait on, after the bus error
    assert proc.returncode != 0 and all("RESULT " not in log for log in raw), isolated.describe(proc)
    assert any(isolated.BUS_WORKER in log for log in raw), raw
    proc, *ours = launch(tmp_path / "run", str(ms_shm_script), "run", "--log-level", "INFO")
    assert proc.returncode == 0, isolated.describe(proc) + "\n".join(ours)
    for log in ours:
        line = next(text for text in log.splitlines() if text.startswith("RESULT "))
        assert_rows(json.loads(line[len("RESULT "):]), 31, 12, 8 * MiB)
        assert "/ 2 local rank(s)" in log and "ms_shm adapted GeneratorDataset" in log, log[-3000:]


def test_pipeline_built_inside_an_imported_package(real_mindspore, tmp_path):
    package = tmp_path / "zoo"
    package.mkdir()
    (package / "__init__.py").write_text("from zoo.loader import create_loader  # noqa: F401\n")
    loader = package / "loader.py"
    loader.write_text(textwrap.dedent('''\
        import numpy as np
        import mindspore.dataset as ds


        class Rows:
            def __init__(self, seed, rows, mb):
                self.seed, self.rows, self.mb = seed, rows, mb

            def __len__(self):
                return self.rows

            def __getitem__(self, i):
                block = np.random.default_rng([self.seed, int(i)]).integers(0, 256, 65521, dtype=np.uint8)
                return np.resize(block, self.mb << 20), np.array(i, dtype=np.int64)


        def create_loader(seed, rows, mb):
            return ds.GeneratorDataset(Rows(seed, rows, mb), ["data", "label"], shuffle=False,
                                       python_multiprocessing=True, num_parallel_workers=2)
        '''))
    script = tmp_path / "use_zoo.py"
    script.write_text((SCENARIOS / "use_zoo.py").read_text())
    assert_raw_bus_error(f"{script} 71 12 8", cwd=tmp_path)
    proc = run(f"-m ms_shm run {script} 71 12 8", cwd=tmp_path)
    assert_rows(result_of(proc), 71, 12, 8 * MiB)
    warnings = adapted_warnings(proc)
    assert len(warnings) == 1 and f"{loader}:{line_of(loader, 'ds.GeneratorDataset(')} (from {script}:" in \
        warnings[0], proc.stderr


def test_explicit_arguments_that_cannot_fit_are_adapted_or_refused_with_strict(real_mindspore):
    """A 64 KiB /dev/shm cannot hold even the semaphores of 2 worker processes (raw MindSpore hangs there, so it
    is not run): by default the explicit python_multiprocessing=True gives way to threads, bit-exact, with one
    warning; ``--strict`` keeps it and stops with ShmBudgetError before any worker starts."""
    script = SCENARIOS / "gen_explicit.py"
    strict = run(f"-m ms_shm run --strict {script} 81 6 8", shm="64k")
    assert strict.returncode == 1 and "ms_shm.errors.ShmBudgetError" in strict.stderr, isolated.describe(strict)
    assert f'File "{script}", line {line_of(script, "ds.GeneratorDataset(")}' in strict.stderr
    assert "ms_shm/cli" not in strict.stderr.split("Traceback (most recent call last):")[1].splitlines()[1]
    proc = run(f"-m ms_shm run {script} 81 6 8", shm="64k")
    assert_rows(result_of(proc), 81, 6, 8 * MiB)
    warnings = adapted_warnings(proc)
    assert len(warnings) == 1 and "explicit_arguments" in warnings[0], proc.stderr


def test_run_behaves_like_python_for_argv_exit_codes_and_errors(real_mindspore, tmp_path):
    script = tmp_path / "argv_script.py"
    script.write_text(textwrap.dedent('''\
        import sys
        print("ARGV", sys.argv, __name__)
        if "raise" in sys.argv:
            raise KeyError("from the script")
        sys.exit(int(sys.argv[-1]))
        '''))
    proc = run(f"-m ms_shm run {script} --lr 3", shm=None)
    assert proc.returncode == 3 and f"ARGV {[str(script), '--lr', '3']!r} __main__" in proc.stdout, proc.stderr
    proc = run(f"-m ms_shm run {script} raise", shm=None)
    assert proc.returncode == 1 and "KeyError: 'from the script'" in proc.stderr
    assert proc.stderr.split("Traceback (most recent call last):\n")[1].startswith(f'  File "{script}"')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "main.py").write_text(script.read_text())
    proc = run("-m ms_shm run -m pkg.main --x 4", shm=None, cwd=tmp_path)
    assert proc.returncode == 4 and "'--x', '4'] __main__" in proc.stdout, proc.stderr


def test_run_ends_a_script_holding_a_cell_as_quietly_as_python(real_mindspore, tmp_path):
    """A network in the script's globals: its ``Cell.__del__`` at exit printed "Exception ignored" under run."""
    script = tmp_path / "net.py"
    script.write_text("from mindspore import nn\nnet = nn.SequentialCell([nn.Dense(4, 2), nn.ReLU()])\n"
                      "print('built')\n")
    plain, ours = (run(f"{prefix}{script}", shm=None) for prefix in ("", "-m ms_shm run "))
    assert plain.returncode == ours.returncode == 0 and plain.stdout == ours.stdout == "built\n", ours.stderr
    assert "Exception ignored" not in plain.stderr + ours.stderr, ours.stderr


# ------------------------------------------------------------------------------------------ the rule itself


def test_explicit_settings_are_adapted_only_as_preferences_and_never_when_locked():
    """``api._fit``: a request honouring explicit settings that cannot fit is retried without them only for
    ``"preference"`` and only where rows do not depend on the reader; otherwise the ShmBudgetError stands."""
    import dataclasses
    from dataclasses import replace

    from ms_shm import api
    from ms_shm.plan import Request, ShmBudgetError

    seen = []

    def plan_for(req):
        seen.append(req)
        if req.multiprocessing:
            raise ShmBudgetError("No configuration honouring python_multiprocessing=True fits. Fix: ...")
        return "threads-plan"

    asked = Request(workers=2, multiprocessing=True, cpu_count=2, usable_cpus=2)
    for explicit, locked in ((None, False), (api.ORDER, False), (api.PREFERENCE, True)):
        with pytest.raises(ShmBudgetError):
            api._fit(plan_for, replace(asked, explicit=explicit), locked)

    @dataclasses.dataclass(frozen=True)
    class FakePlan:  # the smallest plan-like object _fit can extend
        decisions: tuple = ()

    def plan_obj(req):
        plan_for(req)
        return FakePlan()

    seen.clear()
    p = api._fit(plan_obj, replace(asked, explicit=api.PREFERENCE), False)
    assert [r.multiprocessing for r in seen] == [True, None] and seen[1].workers is None
    adapted = p.decisions[0]
    assert adapted.setting == "explicit_arguments" and "num_parallel_workers=2" in adapted.default
    assert api._adapted(p)


@pytest.mark.torch
def test_an_unchanged_torch_script_is_protected_by_run(private_shm):
    pytest.importorskip("torch", reason="torch is not installed: pip install 'ms_shm[torch]'")
    script = SCENARIOS / "torch_loader.py"
    try:
        # batches of 6 x 8 MiB: each worker's first batch alone takes 48 MiB (of 4, two peaked at 64.1 MiB in 2 GB,
        # an edge the 64 MB raw had to overflow)
        raw = run(f"{shlex.quote(str(script))} 16 6", timeout=90)  # a few seconds when it fails at once
        assert raw.returncode != 0 and ("No space left on device" in raw.stderr or "Bus error" in raw.stderr), \
            isolated.describe(raw)
    except subprocess.TimeoutExpired as exc:  # torch's loop can wait for good on a worker that died of ENOSPC
        assert b"No space left on device" in (exc.stderr or b""), exc
    ours = run(f"-m ms_shm run {shlex.quote(str(script))} 16 6")
    res = result_of(ours)
    expected = [__import__("hashlib").sha256(((np.arange(1 << 21, dtype=np.float32) % 251) + np.float32(i)).tobytes())
                .hexdigest() for i in range(16)]
    assert res["labels"] == list(range(16)) and res["digests"] == expected
    warned = [line for line in ours.stderr.splitlines() if "ms_shm adapted DataLoader at" in line]
    assert len(warned) == 1 and f"torch_loader.py:{line_of(script, 'DataLoader(Samples()')}" in warned[0], \
        ours.stderr[-2000:]


def test_patch_imports_no_framework_and_patches_mindspore_once_imported(real_mindspore):
    """``patch()`` before MindSpore is imported (``ms-shm run``, or a program's first line): nothing is imported
    for it; ``GeneratorDataset`` goes through ms_shm once the program imports MindSpore."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import ms_shm
        ms_shm.patch()
        before = sorted(m for m in ("mindspore", "torch") if m in sys.modules)
        import mindspore.dataset as ds
        built = ds.GeneratorDataset([(np.zeros(2),)], ["x"], shuffle=False)
        patched = ms_shm.plan_of(built) is not None
        ms_shm.unpatch()
        plain = ms_shm.plan_of(ds.GeneratorDataset([(np.zeros(2),)], ["x"], shuffle=False)) is None
        print("RESULT " + __import__("json").dumps({"before": before, "patched": patched, "plain": plain}))
    """)
    res = result_of(run(f"-c {shlex.quote(code)}", shm="1g"))
    assert res == {"before": [], "patched": True, "plain": True}


def test_import_and_patch_load_no_planner_until_used():
    """``import ms_shm`` and ``patch()`` (what ``ms-shm run`` does before the script's first line) leave the
    planner, the probes and the DataLoader modules unloaded; the first use loads them."""
    code = textwrap.dedent("""
        import sys
        import ms_shm
        ms_shm.patch()
        heavy = ("ms_shm.api", "ms_shm.measure", "ms_shm.loaders", "ms_shm.plan", "numpy")
        before = sorted(m for m in heavy if m in sys.modules)
        ms_shm.unpatch()
        tune = ms_shm.tune
        print("RESULT " + __import__("json").dumps({"before": before, "tune": tune.__module__,
                                                    "after": "ms_shm.api" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result_of(proc) == {"before": [], "tune": "ms_shm.api", "after": True}


def test_run_tunes_once_the_script_imports_its_framework_and_imports_no_other(tmp_path):
    """A torch script under ``ms-shm run``: tuned after its ``import torch`` (the tune line follows the
    script's own first print), and MindSpore is never imported for it."""
    pytest.importorskip("torch", reason="torch is not installed: pip install 'ms_shm[torch]'")
    script = tmp_path / "torch_only.py"
    script.write_text(textwrap.dedent("""
        import sys
        print("before-import", file=sys.stderr, flush=True)
        import torch
        print("RESULT " + __import__("json").dumps({"mindspore": "mindspore" in sys.modules}), flush=True)
    """))
    proc = run(f"-m ms_shm run --log-level INFO {shlex.quote(str(script))}", shm="1g")
    assert result_of(proc) == {"mindspore": False}
    lines = proc.stderr.splitlines()
    tuned = [n for n, line in enumerate(lines) if line.startswith("INFO: ms_shm.tune:")]
    assert tuned and tuned[0] > lines.index("before-import"), proc.stderr[-2000:]


@pytest.mark.parametrize("old, new, keep", [("processes", "threads", "python_multiprocessing=True to keep processes"),
                                            ("pipes", "inline", "python_multiprocessing=True to keep processes"),
                                            ("threads", "processes", "python_multiprocessing=False to keep this "),
                                            ("processes", "pipes", None), ("inline", "threads", None)])
def test_an_adapted_mode_that_moves_rows_between_processes_and_this_one_says_what_edits_do(old, new, keep):
    """An audit's epoch-end callback set ``source.mosaic = False``: raw's worker processes never saw it in that
    iterator, ms_shm's threads saw it at once, mid-prefetch. Pure logic: the adapted warning's note."""
    from ms_shm import api
    from ms_shm.plan import Decision

    note = api._edits_note([Decision("mode", new, old, "fastest that fits")])
    assert (keep in note and "while an iterator runs" in note) if keep else note == "", note


def test_a_program_that_configures_no_logging_still_sees_the_adapted_warning(real_mindspore):
    """``patch()`` in a program without ``logging.basicConfig``: the warning naming the call and what changed
    reached nobody (ms_shm's logger had a NullHandler), an audit's adapted DataLoader and timed-out probe alike."""
    proc = isolated.run_python("""
        import numpy as np
        import mindspore.dataset as ds
        import ms_shm

        class Rows:
            def __getitem__(self, i):
                return (np.zeros(4, np.float32),)

            def __len__(self):
                return 4

        with ms_shm.patched():
            ds.GeneratorDataset(Rows(), ["x"], num_parallel_workers=64)
        print("built")
    """, shm="1g")
    assert proc.returncode == 0 and "built" in proc.stdout, isolated.describe(proc)
    assert "ms_shm adapted GeneratorDataset at <string>:14: num_parallel_workers 64 -> " in proc.stderr, proc.stderr


def test_run_says_what_a_typical_generatordataset_needs_only_once_the_script_builds_one(real_mindspore, tmp_path):
    """A MindSpore script that builds no GeneratorDataset (its DataLoader only) under ``ms-shm run`` in 64 MB was
    told, in a 27-line warning, that a typical GeneratorDataset pipeline would not fit, with ``ds.config`` fixes
    that do nothing for it. That finding waits for the script's first pipeline this host's room shapes: not one
    of 16 B rows read in MindSpore's own thread (audits' NLP scripts were told it in 28 lines), but one of 8 MiB
    rows in 2 worker processes, whose prefetch ms_shm lowers to fit; host findings do not wait."""
    script = tmp_path / "pipeline_or_not.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import mindspore.dataset as ds
        print("imported", file=sys.stderr, flush=True)
        if sys.argv[1] != "none":
            small = ds.GeneratorDataset([(np.zeros(4, np.float32),)] * 8, ["x"])
            print("small built", file=sys.stderr, flush=True)
            big = [(np.full(8 << 20, i, np.uint8),) for i in range(8)] if sys.argv[1] == "big" else []
            data = ds.GeneratorDataset(big, ["x"], num_parallel_workers=2, python_multiprocessing=True) if big \
                else small
            print("RESULT " + __import__("json").dumps(data.get_dataset_size()), flush=True)
        else:
            print("RESULT 0", flush=True)
    """))
    said = "a typical GeneratorDataset pipeline here"
    for argv, expected, rows in (("none", 0, 0), ("small", 0, 8), ("big", 1, 8)):
        proc = run(f"-m ms_shm run {shlex.quote(str(script))} {argv}", shm="64m")
        assert result_of(proc) == rows, proc.stderr[-2000:]
        assert proc.stderr.count(said) == expected, proc.stderr[-3000:]
        if expected:  # said as the pipeline that needs it is built, not before, and that ms_shm fits it
            assert proc.stderr.index(said) > proc.stderr.index("small built"), proc.stderr[-3000:]
            assert proc.stderr.count("ms_shm plans the") == 1, proc.stderr[-3000:]  # the held note, not tune()'s too
            assert "ms_shm plans the pipelines it builds to fit this instead" in proc.stderr, proc.stderr[-3000:]


def test_a_datasets_loader_adapted_again_is_said_once_at_warning(caplog):
    """A loop making a loader again, or Lightning building it again with its own sampler (accelerate for
    ``skip_first_batches``; the Lightning run of the audit's repro is checked by hand): the same adaptation of the
    same dataset is one warning, the repeats INFO naming the first site; another dataset, or the program's own
    loader of it at another line, gets its own warning; a dataset gone frees its entry."""
    import importlib
    import logging

    patch = importlib.import_module("ms_shm.patch")  # the module (ms_shm.patch is also the function)

    class Samples:
        pass

    from ms_shm.plan import EXPLICIT, Decision

    def adapted(free: str) -> list:
        return [Decision(EXPLICIT, "num_workers=0", "num_workers=2", f"no room: {free} free")]

    first, other = Samples(), Samples()
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        patch._say_adapted(first, "train.py:11", adapted("60 MiB"))
        patch._say_adapted(first, "train.py:11", adapted("28 MiB"))  # a loop; the first loader holds its room
        patch._say_adapted(other, "train.py:12", adapted("60 MiB"))
        patch._say_adapted(first, "train.py:13", adapted("60 MiB"))  # the program's eval loader of the same data
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", f"ms_shm adapted DataLoader at train.py:11: {EXPLICIT} num_workers=2 -> num_workers=0 (no room: "
                    "60 MiB free)"),
        ("INFO", f"ms_shm adapted DataLoader at train.py:11 as at train.py:11: {EXPLICIT} num_workers=2 -> "
                 "num_workers=0 (no room: 28 MiB free)"),
        ("WARNING", f"ms_shm adapted DataLoader at train.py:12: {EXPLICIT} num_workers=2 -> num_workers=0 (no room: "
                    "60 MiB free)"),
        ("WARNING", f"ms_shm adapted DataLoader at train.py:13: {EXPLICIT} num_workers=2 -> num_workers=0 (no room: "
                    "60 MiB free)")]
    held = len(patch._ADAPTED)
    del first
    assert len(patch._ADAPTED) == held - 1
    caplog.clear()  # Trainer's evaluate makes a new dataset per call (its unused columns removed), at one line
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        patch._say_adapted(Samples(), "train.py:12", adapted("60 MiB"))
    assert [r.levelname for r in caplog.records] == ["INFO"]
