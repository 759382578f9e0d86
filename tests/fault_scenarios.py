"""Faults and bad inputs for real MindSpore pipelines, run by ``tests/test_faults.py``.

Two roles, both started as ``python -m tests.fault_scenarios``:

* ``drive NAME [--action A]`` runs inside the test's private mount + IPC namespace (own /dev/shm, /tmp and
  SysV tables). It starts the scenario in a new session, optionally hurts it when the scenario prints
  ``READY`` (SIGKILL a worker, SIGKILL the whole process group, fill /dev/shm), waits until every process of
  that session is gone, then measures what is left: /dev/shm bytes in use, SysV segments and queues, MindSpore's
  ``/tmp/dataset_ipc_*`` key files. One ``DRIVER {json}`` line carries all of it.
* ``run NAME`` is the scenario: a pipeline that prints ``RESULT {json}`` (rows seen, bit-exact or not, the
  error text) unless it is killed first.

Sources live at module level so they are importable; every row's content is a function of its index, so the
scenario checks each row without keeping a copy.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MiB = 1 << 20
PIDS = Path("/tmp/ms_shm_fault_pids")  # each process that reads the source leaves its pid here


def content(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, np.uint8)


def note_pid() -> None:
    PIDS.mkdir(exist_ok=True)
    (PIDS / str(os.getpid())).touch()


class Rows:
    """``n`` rows of ``mb`` MiB (``big_mb`` at every index the probe does not read) plus an int64 label."""

    def __init__(self, n: int = 64, mb: float = 1, big_mb: float | None = None, delay: float = 0.0):
        from ms_shm import rows

        self.n, self.mb, self.big_mb, self.delay = n, mb, big_mb, delay
        self.probed = set(rows._spread(n, 8))

    def nbytes(self, i: int) -> int:
        mb = self.mb if self.big_mb is None or i in self.probed else self.big_mb
        return int(mb * MiB) - 8

    def __getitem__(self, i):
        note_pid()
        if self.delay:
            time.sleep(self.delay)
        return content(i, self.nbytes(i)), np.array(i, np.int64)

    def __len__(self):
        return self.n


class Failing(Rows):
    """Raises at row ``at``; the message does not contain the index, so only ms_shm can name it."""

    def __init__(self, at: int, n: int = 64):
        super().__init__(n, 1 / 64)
        self.at = at

    def __getitem__(self, i):
        if i == self.at:
            raise ValueError("bad jpeg header")
        return super().__getitem__(i)


class Shorter(Rows):
    """``__len__`` says ``length`` but only ``real`` rows exist."""

    def __init__(self, length: int, real: int):
        super().__init__(length, 1 / 64)
        self.real = real

    def __getitem__(self, i):
        if i >= self.real:
            raise IndexError("list index out of range")
        return super().__getitem__(i)


def seeded_shape(i: int) -> tuple:
    rng = np.random.default_rng(i)
    return int(rng.integers(1, 512)), int(rng.integers(1, 512))


def seeded_row(i: int) -> np.ndarray:
    rows, cols = seeded_shape(i)
    return np.random.default_rng(10_000 + i).standard_normal((rows, cols)).astype(np.float32)


class SeededShapes:
    """Every row a different shape, seeded by its index: the test can recompute exactly what was returned."""

    def __getitem__(self, i):
        return seeded_row(i), np.array(i, np.int64)

    def __len__(self):
        return 64


class CallShapes:
    """A new random shape on every call (the probe and the worker see different shapes for one index).

    Rows describe themselves: ``arange(size).reshape(shape) + index``, so any shape can be checked.
    """

    def __getitem__(self, i):
        i = int(i)  # MindSpore passes numpy int64 indices: int32 + np.int64 would be int64 under NumPy 2
        a, b = random.randint(1, 400), random.randint(1, 400)
        return (np.arange(a * b, dtype=np.int32).reshape(a, b) + i), np.array(i, np.int64)

    def __len__(self):
        return 64


class Table:
    """Rows from a function of the index: the bad-input cases."""

    def __init__(self, fn, n: int = 16):
        self.fn, self.n = fn, n

    def __getitem__(self, i):
        return self.fn(int(i))  # MindSpore passes numpy int64 indices; the cases are written for ints

    def __len__(self):
        return self.n


# --------------------------------------------------------------------------------------------- helpers


def emit(tag: str, payload: dict) -> None:
    print(f"{tag} {json.dumps(payload, default=str)}", flush=True)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def read(dataset, check, on_row=None) -> dict:
    """Iterate one epoch; ``check(i, row)`` raises on a wrong row. Errors are caught and reported."""
    seen, bad, error, it = 0, [], None, None
    try:
        it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
        for row in it:
            try:
                check(seen, row)
            except AssertionError as exc:
                bad.append(f"row {seen}: {exc}")
            seen += 1
            if on_row:
                on_row(seen)
    except Exception as exc:  # the pipeline's error, as the user sees it
        error = error_text(exc)
    finally:
        stop = getattr(it, "stop", None)
        if stop:
            stop()
        it = None
    return {"rows": seen, "bad": bad, "error": error}


def check_rows(source):
    def check(i, row):
        data, label = row
        assert int(label) == i, f"label {int(label)}"
        assert data.dtype == np.uint8 and data.nbytes == source.nbytes(i), f"{data.dtype} {data.nbytes}"
        assert (data == i % 251).all(), "content differs"
    return check


def plan_info(dataset) -> dict:
    import ms_shm

    p = ms_shm.plan_of(dataset)
    if p is None:
        return {}
    return {"mode": p.mode, "workers": p.workers, "prefetch": p.prefetch, "row_bytes": p.row_bytes,
            "guard_slots": p.guard_slots, "guard_worker_bytes": p.guard_worker_bytes,
            "predicted_shm": p.predicted_shm, "budget": p.budget.shm_bytes}


def shm_state() -> dict:
    st = os.statvfs("/dev/shm")
    return {"used": (st.f_blocks - st.f_bfree) * st.f_frsize, "free": st.f_bavail * st.f_frsize}


# ------------------------------------------------------------------------------------------- scenarios


def sc_worker_kill(ds, ms_shm) -> None:
    """Reads slowly; after 5 rows prints the worker pids so the driver can SIGKILL one mid-epoch."""
    source = Rows(64, 1, delay=0.05)
    dataset = ms_shm.build_dataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                                   python_multiprocessing=True)

    checked = []

    def check(i, row):
        check_rows(source)(i, row)
        checked.append(i)

    def on_row(seen):
        if seen == 5:
            # readers still alive: ms_shm's probe child read the source too, and is gone by now
            workers = sorted(int(p.name) for p in PIDS.iterdir()
                             if int(p.name) != os.getpid() and os.path.exists(f"/proc/{p.name}"))
            emit("READY", {"workers": workers, "main": os.getpid(), "checked": checked,
                           "plan": plan_info(dataset)})

    emit("RESULT", dict(read(dataset, check, on_row=on_row), plan=plan_info(dataset)))


def sc_group_kill(ds, ms_shm) -> None:
    """A processes GeneratorDataset feeding a processes map (SysV): then the whole group is SIGKILLed."""
    source = Rows(64, 1 / 64, delay=0.05)
    dataset = ms_shm.build_dataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                                   python_multiprocessing=True)
    mapped = ms_shm.map(dataset, Grow(4), input_columns=["data"], num_parallel_workers=2,
                        python_multiprocessing=True)

    checked = []

    def check(i, row):
        assert row[0].nbytes == 4 * MiB and int(row[1]) == i and (row[0] == i % 251).all()
        checked.append(i)

    def on_row(seen):
        if seen == 5:
            emit("READY", {"main": os.getpid(), "map_mode": ms_shm.plan_of(mapped).mode, "checked": checked})
            time.sleep(60)  # the driver kills us here

    emit("RESULT", read(mapped, check, on_row=on_row))


class Grow:
    """A map operation with a 4 MiB output (a decode): map workers then hold row-sized SysV segments."""

    def __init__(self, mb: float):
        self.nbytes = int(mb * MiB)

    def __call__(self, data):
        return np.full(self.nbytes, int(data[0]), np.uint8)


def sc_shm_filled(ds, ms_shm, raw: bool) -> None:
    """Plan with /dev/shm empty, then wait while the driver fills it, then read."""
    source = Rows(64, 1)
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    if raw:
        dataset = ds.GeneratorDataset(source, ["data", "label"], **kwargs)
    else:
        dataset = ms_shm.build_dataset(source, ["data", "label"], **kwargs)
    emit("READY", {"planned_with": shm_state(), "plan": plan_info(dataset)})
    assert sys.stdin.readline().strip() == "GO"
    result = read(dataset, check_rows(source))
    emit("RESULT", dict(result, plan=plan_info(dataset), after=shm_state()))


def sc_rows_larger(ds, ms_shm, raw: bool, big_mb: float) -> None:
    """Probe rows are 1 MiB; every other row is ``big_mb``."""
    source = Rows(64, 1, big_mb=big_mb)
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    if raw:
        dataset = ds.GeneratorDataset(source, ["data", "label"], **kwargs)
    else:
        dataset = ms_shm.build_dataset(source, ["data", "label"], **kwargs)
    result = read(dataset, check_rows(source))
    emit("RESULT", dict(result, plan=plan_info(dataset), probed=sorted(source.probed)))


def sc_source_raises(ds, ms_shm) -> None:
    """Row 37 raises, in every transport ms_shm may pick, and once on raw MindSpore for comparison."""
    out = {}
    for label, kwargs in (("processes", dict(num_parallel_workers=2, python_multiprocessing=True)),
                          ("threads", dict(num_parallel_workers=2, python_multiprocessing=False)),
                          ("inline", dict(num_parallel_workers=1))):
        source = Failing(37)
        dataset = ms_shm.build_dataset(source, ["data", "label"], shuffle=False, **kwargs)
        out[label] = dict(read(dataset, check_rows(source)), plan=plan_info(dataset))
    source = Failing(37)
    raw = ds.GeneratorDataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                              python_multiprocessing=True)
    out["raw"] = read(raw, check_rows(source))
    emit("RESULT", out)


def sc_len_lying(ds, ms_shm) -> None:
    """``__len__`` larger than the data (64 said, 40 real) and smaller (30 said, 64 real)."""
    out = {}
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    try:
        ms_shm.build_dataset(Shorter(64, 40), ["data", "label"], **kwargs)
        out["larger"] = {"error": None}
    except Exception as exc:
        out["larger"] = {"error": error_text(exc)}
    source = Shorter(64, 40)
    out["larger_raw"] = read(ds.GeneratorDataset(source, ["data", "label"], **kwargs), check_rows(source))
    source = Rows(64, 1 / 64)
    source.n = 30  # __len__ says 30 of 64 readable rows
    dataset = ms_shm.build_dataset(source, ["data", "label"], **kwargs)
    out["smaller"] = read(dataset, check_rows(source))
    out["smaller_raw"] = read(ds.GeneratorDataset(source, ["data", "label"], **kwargs), check_rows(source))
    emit("RESULT", out)


def sc_random_shapes(ds, ms_shm) -> None:
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    dataset = ms_shm.build_dataset(SeededShapes(), ["data", "label"], **kwargs)

    def seeded(i, row):
        data, label = row
        assert int(label) == i and data.dtype == np.float32
        assert data.shape == seeded_shape(i), f"shape {data.shape}"
        assert np.array_equal(data, seeded_row(i)), "content differs"

    out = {"seeded": dict(read(dataset, seeded), plan=plan_info(dataset))}
    dataset = ms_shm.build_dataset(CallShapes(), ["data", "label"], **kwargs)
    shapes = set()

    def described(i, row):
        data, label = row
        assert int(label) == i and data.dtype == np.int32 and data.ndim == 2
        assert np.array_equal(data, np.arange(data.size, dtype=np.int32).reshape(data.shape) + i)
        shapes.add(data.shape)

    out["per_call"] = dict(read(dataset, described), plan=plan_info(dataset))
    out["per_call"]["shapes"] = len(shapes)
    emit("RESULT", out)


# Each case: a row function, the column names, and what every good row must come out as (same dtype, same
# shape, same values), and optionally more GeneratorDataset arguments. The cases that are bad at one row are
# listed in test_faults.BAD_AT.
def _schema(mindspore, *columns) -> object:
    schema = mindspore.dataset.Schema()
    for name, dtype in columns:
        schema.add_column(name, de_type=dtype, shape=[-1] if dtype != mindspore.string else None)
    return schema


def _cases() -> dict:
    import mindspore

    f4 = np.arange(24, dtype=np.float32).reshape(4, 6)
    return {
        "column_types_match": (lambda i: (np.arange(3, dtype=np.float16) + i, np.array(i, np.int32)), ["a", "b"],
                               lambda i: (np.arange(3, dtype=np.float16) + i, np.array(i, np.int32)),
                               {"column_types": [mindspore.float16, mindspore.int32]}),
        "column_types_differ": (lambda i: (np.arange(3, dtype=np.float32), np.array(i, np.int32)), ["a", "b"],
                                lambda i: (np.arange(3, dtype=np.float32), np.array(i, np.int32)),
                                {"column_types": [mindspore.float32, mindspore.int64]}),
        "column_types_string": (lambda i: (np.array(f"sent {i}" * (i % 3 + 1)), np.array(i, np.int32)), ["a", "b"],
                                lambda i: (np.array(f"sent {i}" * (i % 3 + 1)), np.array(i, np.int32)),
                                {"column_types": [mindspore.string, mindspore.int32]}),
        "column_types_string_bytes": (lambda i: (np.array(f"sent {i}".encode()), np.array(i, np.int32)), ["a", "b"],
                                      lambda i: (np.array(f"sent {i}".encode()), np.array(i, np.int32)),
                                      {"column_types": [mindspore.string, mindspore.int32]}),
        "schema_types_differ": (lambda i: (np.array(f"sent {i}"), np.arange(2, dtype=np.int64) + i), None,
                                lambda i: (np.array(f"sent {i}"), np.arange(2, dtype=np.int64) + i),
                                {"schema": _schema(mindspore, ("a", mindspore.string), ("b", mindspore.int32))}),
        "schema_types_match": (lambda i: (np.array(f"sent {i}"), np.arange(2, dtype=np.int64) + i), None,
                               lambda i: (np.array(f"sent {i}"), np.arange(2, dtype=np.int64) + i),
                               {"schema": _schema(mindspore, ("a", mindspore.string), ("b", mindspore.int64))}),
        "list_column": (lambda i: ([1, 2, i], np.array(i)), ["a", "b"],
                        lambda i: (np.array([1, 2, i]), np.array(i))),
        "list_row": (lambda i: [np.arange(3) + i, np.array(i)], ["a", "b"],
                     lambda i: (np.arange(3) + i, np.array(i))),
        "python_scalars": (lambda i: (i, i * 0.5, True), ["a", "b", "c"],
                           lambda i: (np.array(i), np.array(i * 0.5), np.array(True))),
        "numpy_scalar": (lambda i: (np.float32(i) / 4, np.array(i)), ["a", "b"],
                         lambda i: (np.array(np.float32(i) / 4), np.array(i))),
        "zero_d": (lambda i: (np.array(i * 1.5), np.array(i)), ["a", "b"],
                   lambda i: (np.array(i * 1.5), np.array(i))),
        "empty": (lambda i: (np.zeros((0, 3), np.float32), np.array(i)), ["a", "b"],
                  lambda i: (np.zeros((0, 3), np.float32), np.array(i))),
        "all_empty_some_rows": (lambda i: (np.zeros((0, 3) if i % 3 else (i, 3), np.float32),), ["a"],
                                lambda i: (np.zeros((0, 3) if i % 3 else (i, 3), np.float32),)),
        "non_contiguous": (lambda i: ((f4 + i)[:, ::2], np.array(i)), ["a", "b"],
                           lambda i: (np.ascontiguousarray((f4 + i)[:, ::2]), np.array(i))),
        "big_endian": (lambda i: ((np.arange(6) + i).astype(">f4"), np.array(i)), ["a", "b"],
                       lambda i: ((np.arange(6) + i).astype(np.float32), np.array(i))),
        "strings": (lambda i: (np.array(f"row {i}"), np.array([b"x", b"yz"])), ["a", "b"],
                    lambda i: (np.array(f"row {i}"), np.array([b"x", b"yz"]))),
        "dict_row": (lambda i: {"x": np.arange(3) + i, "y": np.array([i])}, ["sample"],
                     lambda i: ({"x": np.arange(3) + i, "y": np.array([i])},)),
        # A dict column's None: carried as it is (an audit found it refused)
        "dict_with_none": (lambda i: {"x": np.arange(3) + i, "mask": None}, ["sample"],
                           lambda i: ({"x": np.arange(3) + i, "mask": None},)),
        # Bad at one row: the rows before it must arrive intact, then the error must name that row.
        "none_at_probe": (lambda i: None if i == 0 else (np.array(i),), ["a"], lambda i: (np.array(i),)),
        "none_later": (lambda i: None if i == 5 else (np.array(i),), ["a"], lambda i: (np.array(i),)),
        "object_later": (lambda i: (np.array([1, "x"], dtype=object) if i == 5 else np.array([1, 2]),), ["a"],
                         lambda i: (np.array([1, 2]),)),
        "dict_two_columns": (lambda i: {"x": np.arange(3), "y": np.array(i)}, ["x", "y"],
                             lambda i: (np.arange(3), np.array(i))),
        "ragged_list": (lambda i: ([[1, 2], [3]] if i == 5 else [[1, 2], [3, 4]],), ["a"],
                        lambda i: (np.array([[1, 2], [3, 4]]),)),
    }


def same(got, want) -> bool:
    if want is None:
        return got is None
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def sc_bad_inputs(ds, ms_shm, raw: bool) -> None:
    """Every case through ms_shm (processes, 2 workers) or through raw MindSpore with the same settings."""
    out = {}
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    for name, (fn, names, expect, *more) in _cases().items():
        source = Table(fn)
        arguments = dict(kwargs, **(more[0] if more else {}))

        def check(i, row, expect=expect):
            want = expect(i)
            assert len(row) == len(want), f"{len(row)} columns"
            for got, w in zip(row, want):
                assert same(got, w), f"got {getattr(got, 'dtype', type(got))} {np.shape(got)}: {got!r:.80}"

        try:
            if raw:
                dataset = ds.GeneratorDataset(source, names, **arguments)
            else:
                dataset = ms_shm.build_dataset(source, names, **arguments)
        except Exception as exc:
            out[name] = {"rows": 0, "bad": [], "error": error_text(exc), "at": "build"}
            continue
        out[name] = dict(read(dataset, check), at="read")
    emit("RESULT", out)


ROW_KINDS = {"list": list, "deque": collections.deque, "generator": lambda columns: (c for c in columns)}


class GilBound:
    """Rows of ``kind`` (a list, a deque, a generator of columns), each made after ~30 ms of pure Python: a tuple
    of them is read fastest in worker processes."""

    def __init__(self, kind: str):
        self.make = ROW_KINDS[kind]

    def __len__(self):
        return 12

    def __getitem__(self, i):
        spin = 0
        for k in range(600_000):
            spin += k & 3
        return self.make([np.full(1 << 16, int(i) % 251, np.uint8), np.array(int(i))])


def sc_row_kinds(ds, ms_shm) -> None:
    """Rows that are not tuples, through ms_shm's defaults and raw MindSpore's: every row as MindSpore's own
    thread reads it (worker processes would carry each as one column), and the mode ms_shm chose."""
    def check(i, row):
        assert len(row) == 2 and row[0].shape == (1 << 16,) and int(row[0][0]) == i % 251 and int(row[1]) == i

    out = {}
    for kind in ROW_KINDS:
        dataset = ms_shm.build_dataset(GilBound(kind), ["a", "b"], shuffle=False)
        out[kind] = dict(read(dataset, check), mode=ms_shm.plan_of(dataset).mode)
        out[kind + "_raw"] = read(ds.GeneratorDataset(GilBound(kind), ["a", "b"], shuffle=False), check)
    emit("RESULT", out)


def sc_no_dev_shm(ds, ms_shm) -> None:
    """/dev/shm does not exist at all (the driver hides it): the probe says so, the plan avoids it."""
    facts = ms_shm.probe()
    out = {"exists": os.path.exists("/dev/shm"), "shm_free": facts.shm_free,
           "notes": [n for n in facts.notes if "shm" in n]}
    source = Rows(32, 1)
    dataset = ms_shm.build_dataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2)
    out["default"] = dict(read(dataset, check_rows(source)), plan=plan_info(dataset))
    try:
        ms_shm.build_dataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                             python_multiprocessing=True)
        out["forced"] = {"error": None}
    except Exception as exc:
        out["forced"] = {"error": error_text(exc)}
    raw = ds.GeneratorDataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                              python_multiprocessing=True)
    out["raw"] = read(raw, check_rows(source))
    emit("RESULT", out)


def sc_no_proc(ds, ms_shm) -> None:
    """/proc is an empty tmpfs (the driver masks it): the probe notes what it could not read; rows still flow."""
    facts = ms_shm.probe()
    out = {"proc_empty": not os.listdir("/proc"), "facts": {
        k: getattr(facts, k) for k in ("shm_free", "mem_total", "open_fds", "cgroup_version", "shmmax",
                                        "usable_cpus")},
        "notes": list(facts.notes)}
    source = Rows(32, 1)
    for label, kwargs in (("default", {}), ("forced", {"python_multiprocessing": True})):
        try:
            dataset = ms_shm.build_dataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                                           **kwargs)
        except Exception as exc:
            out[label] = {"rows": 0, "error": error_text(exc), "at": "build"}
            continue
        out[label] = dict(read(dataset, check_rows(source)), plan=plan_info(dataset), at="read")
    raw = ds.GeneratorDataset(source, ["data", "label"], shuffle=False, num_parallel_workers=2,
                              python_multiprocessing=True)
    out["raw"] = read(raw, check_rows(source))
    emit("RESULT", out)


class Reiterable:
    """An iterable without ``__getitem__``: MindSpore calls ``iter()`` on it once per epoch."""

    def __iter__(self):
        return iter([(np.full(3, i, np.uint8), np.array(i)) for i in range(10)])


def ten_rows():
    for i in range(10):
        yield np.full(3, i, np.uint8), np.array(i)


def odd_columns():
    """Columns MindSpore 2.10 rejects: a big-endian array and a Python list."""
    for i in range(10):
        yield (np.arange(3) + i).astype(">f4"), [i, i]


ITERABLES = {
    "iterable": Reiterable,
    "generator_function": lambda: ten_rows,
    "generator_object": ten_rows,
    "one_shot_iterator": lambda: iter(list(ten_rows())),
    "zip": lambda: zip([np.full(3, i, np.uint8) for i in range(10)], [np.array(i) for i in range(10)]),
    "odd_columns": lambda: odd_columns,
}


def sc_iterables(ds, ms_shm) -> None:
    """Two epochs of each kind of non-random-access source, raw and through ms_shm: the same rows each epoch."""
    out = {}
    for name, make in ITERABLES.items():
        for mode in ("raw", "ms_shm"):
            build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
            epochs, error = [], None
            try:
                dataset = build(make(), ["data", "label"], shuffle=False)
                it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=2)
                for _ in range(2):
                    epochs.append([[int(row[1].flat[0]), str(row[0].dtype), row[0].tolist()] for row in it])
            except Exception as exc:
                error = error_text(exc)
            out[f"{name}/{mode}"] = {"epochs": epochs, "error": error}
    emit("RESULT", out)


SCENARIOS = {
    "iterables": sc_iterables,
    "worker_kill": sc_worker_kill,
    "group_kill": sc_group_kill,
    "shm_filled": lambda ds, m: sc_shm_filled(ds, m, raw=False),
    "shm_filled_raw": lambda ds, m: sc_shm_filled(ds, m, raw=True),
    "rows_larger": lambda ds, m: sc_rows_larger(ds, m, raw=False, big_mb=12),
    "rows_larger_raw": lambda ds, m: sc_rows_larger(ds, m, raw=True, big_mb=12),
    "rows_bit_larger": lambda ds, m: sc_rows_larger(ds, m, raw=False, big_mb=1.3),
    "source_raises": sc_source_raises,
    "len_lying": sc_len_lying,
    "random_shapes": sc_random_shapes,
    "bad_inputs": lambda ds, m: sc_bad_inputs(ds, m, raw=False),
    "row_kinds": sc_row_kinds,
    "bad_inputs_raw": lambda ds, m: sc_bad_inputs(ds, m, raw=True),
    "no_dev_shm": sc_no_dev_shm,
    "no_proc": sc_no_proc,
}


def run(name: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    import mindspore.dataset as ds

    import ms_shm

    SCENARIOS[name](ds, ms_shm)
    return 0


# ---------------------------------------------------------------------------------------------- driver


def sysv_objects() -> dict:
    """Every SysV segment and queue in this IPC namespace (the test made it, so all of them are ours)."""
    out = {}
    for kind in ("shm", "msg"):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        header = lines[0].split()
        out[kind] = [dict(zip(header, line.split())) for line in lines[1:] if line.strip()]
    return out


def session_pids(sid: int) -> list:
    """Processes of the scenario's session, zombies included: ``clean()`` rightly counts an unreaped pid as
    alive, and a killed worker stays a zombie until init reaps it."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


# Commands that run the scenario with part of the system hidden, in a nested mount namespace of its own.
HIDE = {
    "dev_shm": ("d=$(mktemp -d) && mount --rbind /dev $d && mount -t tmpfs -o size=1m tmpfs /dev && "
                "for n in null zero full random urandom tty; do touch /dev/$n && mount --bind $d/$n /dev/$n; "
                "done && ln -s /proc/self/fd /dev/fd && "),
    "proc": "mount -t tmpfs -o size=1m tmpfs /proc && ",
}


def become_subreaper() -> None:
    """Orphans of the scenario come to this driver, not to the machine's pid 1: a worker whose main process
    died before reaping it stays a zombie for as long as its parent does not wait for it, and a container's
    pid 1 often never does (CI's kept pid 5932 past the 20 s wait)."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans() -> None:
    """Wait for every child that has exited, the orphans handed to this subreaper included."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def drive(name: str, action: str | None, hide: str | None, fill_leave: int, timeout: float) -> int:
    """Start the scenario, hurt it as asked, wait for its whole session to end, then measure leftovers."""
    PIDS.mkdir(exist_ok=True)
    become_subreaper()
    out = {"before": {"shm": shm_state(), "sysv": sysv_objects()}}
    cmd = [sys.executable, "-m", "tests.fault_scenarios", "run", name]
    if hide:
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               HIDE[hide] + "exec " + " ".join(cmd)]
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty stderr must not block the child
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                             text=True, start_new_session=True)
    sid = child.pid
    stdout_lines, ready = [], None

    def overtime() -> None:
        out["timed_out"] = True
        os.killpg(sid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, overtime)  # a hung scenario must not hang the test run
    watchdog.start()
    for line in child.stdout:
        stdout_lines.append(line)
        if line.startswith("READY "):
            ready = json.loads(line[len("READY "):])
            out["ready"] = ready
            out["session_at_ready"] = session_pids(sid)
            if action == "kill-worker":
                os.kill(ready["workers"][0], signal.SIGKILL)
            elif action == "kill-group":
                out["sysv_before_kill"] = sysv_objects()
                os.killpg(sid, signal.SIGKILL)
            elif action == "fill":
                fill = max(0, shm_state()["free"] - fill_leave)
                fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
                os.posix_fallocate(fd, 0, fill)
                os.close(fd)
                out["filled"] = fill
                out["free_after_fill"] = shm_state()["free"]
                child.stdin.write("GO\n")
                child.stdin.flush()
    rc = child.wait()
    watchdog.cancel()
    errors.seek(0)
    out["stderr"] = errors.read()[-20000:]
    errors.close()
    out["rc"] = rc
    gone_by = time.time() + 20
    while session_pids(sid) and time.time() < gone_by:
        reap_orphans()
        time.sleep(0.05)
    out["stragglers"] = session_pids(sid)
    if os.path.exists("/dev/shm/filler"):
        os.unlink("/dev/shm/filler")
    results = [json.loads(line[len("RESULT "):]) for line in stdout_lines if line.startswith("RESULT ")]
    out["result"] = results[-1] if results else None
    out["stdout"] = "".join(line for line in stdout_lines if not line.startswith("RESULT "))[-5000:]
    out["leftover_sysv"] = sysv_objects()
    out["leftover_ipc_files"] = sorted(p for p in os.listdir("/tmp") if p.startswith("dataset_ipc_"))
    if action == "kill-group":
        from ms_shm.cleanup import clean

        out["ipcs"] = subprocess.run(["ipcs", "-m", "-q"], capture_output=True, text=True).stdout
        out["clean"] = clean(dry_run=False).to_dict()
        out["after_clean_sysv"] = sysv_objects()
        out["after_clean_ipcs"] = subprocess.run(["ipcs", "-m", "-q"], capture_output=True, text=True).stdout
        out["after_clean_ipc_files"] = sorted(p for p in os.listdir("/tmp") if p.startswith("dataset_ipc_"))
    out["after"] = {"shm": shm_state()}
    emit("DRIVER", out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["drive", "run"])
    ap.add_argument("name", choices=sorted(SCENARIOS))
    ap.add_argument("--action", choices=["kill-worker", "kill-group", "fill"])
    ap.add_argument("--hide", choices=sorted(HIDE))
    ap.add_argument("--fill-leave", type=int, default=8 * MiB)
    ap.add_argument("--timeout", type=float, default=90)
    args = ap.parse_args(argv)
    if args.role == "run":
        return run(args.name)
    return drive(args.name, args.action, args.hide, args.fill_leave, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
