"""Pipelines run inside a memory cgroup (a container's memory limit) by ``tests/test_memory_cgroup.py``.

Each scenario prints one ``RESULT {json}`` line: the rows' digests, in order, and what ms_shm planned, or the
``ShmBudgetError`` it raised before any worker started.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys

import numpy as np

ROWS, MB, SEED = 48, 8, 7
BATCH, SLOW = 4, {"generator_batch": 0.1, "stages": 0.3}  # batch_size; scenario: seconds the loop takes per batch


def row(i: int) -> np.ndarray:
    """Row ``i``: 8 MiB that numpy's seeded generator fills (every row differs, and is cheap to make again)."""
    block = np.random.default_rng([SEED, int(i)]).integers(0, 256, 65521, dtype=np.uint8)
    return np.resize(block, MB << 20)


def expected_digests(name: str = "") -> list:
    if name == "stages":
        return [hashlib.sha256(np.stack([flip(small_row(i)) + np.uint8(1) for i in range(b, b + BATCH)]).tobytes()
                               ).hexdigest() for b in range(0, STAGE_ROWS, BATCH)]
    make = (lambda i: flip(row(i))) if name in ("generator_map", "spawn") else row
    if name == "generator_batch":
        return [hashlib.sha256(np.stack([row(i) for i in range(b, b + BATCH)]).tobytes()).hexdigest()
                for b in range(0, ROWS, BATCH)]
    return [hashlib.sha256(make(i).tobytes()).hexdigest() for i in range(ROWS)]


class Rows:
    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return (row(i),)


STAGE_ROWS, STAGE_MB = 40, 3  # the "stages" scenario: a source, a map and a per_batch_map batch of 3 MiB rows


def small_row(i: int) -> np.ndarray:
    return row(i)[:STAGE_MB << 20]


class SlowRows:
    """3 MiB rows each made after ~2 ms of pure Python: work that worker processes speed up."""

    def __len__(self):
        return STAGE_ROWS

    def __getitem__(self, i):
        _spin()
        return (small_row(i),)


def _spin() -> int:
    spin = 0
    for k in range(20000):
        spin += k & 3
    return spin


def add_one(rows, info):
    return ([r + np.uint8(1) for r in rows],)


def grow(index):
    return row(int(index))


def flip(data):
    """A map's work on a source's 8 MiB rows: a new 8 MiB row out, as a decode or an augmentation makes."""
    return data ^ np.uint8(1)


TRAIN_EVAL = ((0, 32, 4), (1000, 12, 2))  # the "train_eval" scenario: (first row, rows, batch size) of each


def normal_row(i: int) -> np.ndarray:
    """Row ``i``: 8 MiB of float32 that numpy's seeded generator draws outside the GIL (~25 ms): rows MindSpore's
    threads read in parallel."""
    return np.random.default_rng([SEED, int(i)]).standard_normal(MB << 18, dtype=np.float32)


class NormalRows:
    """``rows`` rows from ``normal_row(first)`` on."""

    def __init__(self, first: int, rows: int):
        self.first, self.rows = first, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        return (normal_row(self.first + i),)


def scale(data):
    return data * np.float32(2) + np.float32(1)


def train_eval_digests() -> list:
    """Two train epochs, the eval pipeline read after each."""
    def batches(first: int, rows: int, size: int) -> list:
        return [hashlib.sha256(np.stack([scale(normal_row(first + i)) for i in range(b, b + size)]).tobytes()
                               ).hexdigest() for b in range(0, rows, size)]

    train, evaluation = (batches(*spec) for spec in TRAIN_EVAL)
    return (train + evaluation) * 2


def _train_eval_pipeline(mode: str, first: int, rows: int, size: int):
    """A train or eval pipeline with no settings of its own: a source, a map, a batch."""
    import mindspore.dataset as ds

    import ms_shm

    if mode == "patch":
        with ms_shm.patched():
            return _train_eval_pipeline("raw", first, rows, size)
    if mode == "ms_shm":
        return ms_shm.batch(ms_shm.map(ms_shm.build_dataset(NormalRows(first, rows), ["data"], shuffle=False),
                                       scale, input_columns=["data"]), size)
    return ds.GeneratorDataset(NormalRows(first, rows), ["data"], shuffle=False).map(
        scale, input_columns=["data"]).batch(size)


def run_train_eval(mode: str, eval_late: bool = False) -> None:
    """Two train epochs through one iterator, the eval pipeline read after each; built up front, or
    (``eval_late``) the eval built after the train's first epoch, its iterator alive."""
    import ms_shm

    if mode != "raw":
        ms_shm.tune()
    built = []

    def pipeline(first: int, rows: int, size: int):
        try:
            return _train_eval_pipeline(mode, first, rows, size)
        except ms_shm.ShmBudgetError as exc:
            print("RESULT " + json.dumps({"error": str(exc)}), flush=True)
            raise SystemExit(0) from None

    (train_spec, eval_spec), digests = TRAIN_EVAL, []
    train = pipeline(*train_spec)
    if not eval_late:
        built.append(pipeline(*eval_spec))
    iterator = train.create_tuple_iterator(output_numpy=True, num_epochs=2)
    for _ in range(2):
        digests += [_digest(r[0], 0) for r in iterator]
        if not built:
            built.append(pipeline(*eval_spec))
        digests += [_digest(r[0], 0) for r in built[0].create_tuple_iterator(output_numpy=True, num_epochs=1)]
    print("RESULT " + json.dumps({"digests": digests}), flush=True)


def _pipeline(name: str, mode: str):
    import mindspore.dataset as ds

    import ms_shm

    small = [(np.array(i, dtype=np.int64),) for i in range(ROWS)]
    if mode == "patch":  # the raw pipeline, unchanged, as ``ms-shm run`` runs it
        ms_shm.tune()
        with ms_shm.patched():
            return _pipeline(name, "raw")
    if name == "stages":  # unchanged code asking for worker processes at every stage (run under ``patch``)
        source = ds.GeneratorDataset(SlowRows(), ["data"], shuffle=False, num_parallel_workers=2,
                                     python_multiprocessing=True)
        mapped = source.map(flip, input_columns=["data"], num_parallel_workers=2, python_multiprocessing=True)
        return mapped.batch(BATCH, per_batch_map=add_one, input_columns=["data"], num_parallel_workers=2,
                            python_multiprocessing=True)
    if name == "spawn":  # unchanged code whose worker processes are spawned: each imports MindSpore again
        ds.config.set_multiprocessing_start_method("spawn")
        source = ds.GeneratorDataset(Rows(), ["data"], shuffle=False, num_parallel_workers=2,
                                     python_multiprocessing=True)
        return source.map(flip, input_columns=["data"], num_parallel_workers=2, python_multiprocessing=True)
    if name == "generator_batch":  # batches of 4 x 8 MiB read by a loop slower than the pipeline
        if mode == "raw":
            return ds.GeneratorDataset(Rows(), ["data"], shuffle=False).batch(BATCH)
        ms_shm.tune()
        return ms_shm.batch(ms_shm.build_dataset(Rows(), ["data"], shuffle=False), BATCH)
    if mode == "raw":
        if name == "generator":
            return ds.GeneratorDataset(Rows(), ["data"], shuffle=False, num_parallel_workers=2)
        if name == "generator_map":
            return ds.GeneratorDataset(Rows(), ["data"], shuffle=False, num_parallel_workers=2).map(
                flip, input_columns=["data"], num_parallel_workers=2)
        base = ds.GeneratorDataset(small, ["data"], shuffle=False)
        return base.map(grow, input_columns=["data"], num_parallel_workers=2, python_multiprocessing=True)
    ms_shm.tune()
    if name == "generator":
        return ms_shm.build_dataset(Rows(), ["data"], shuffle=False, num_parallel_workers=2)
    if name == "generator_map":
        source = ms_shm.build_dataset(Rows(), ["data"], shuffle=False, num_parallel_workers=2)
        return ms_shm.map(source, flip, input_columns=["data"])  # ms_shm picks its workers
    base = ms_shm.build_dataset(small, ["data"], shuffle=False)
    explicit = {"python_multiprocessing": True} if name == "map_explicit" else {}
    return ms_shm.map(base, grow, input_columns=["data"], num_parallel_workers=2, **explicit)


def _digest(data: np.ndarray, seconds: float) -> str:
    import time

    time.sleep(seconds)
    return hashlib.sha256(data.tobytes()).hexdigest()


def run_scenario(name: str, mode: str) -> None:
    import ms_shm

    try:
        dataset = _pipeline(name, mode)
    except ms_shm.ShmBudgetError as exc:
        print("RESULT " + json.dumps({"error": str(exc)}), flush=True)
        return
    p = ms_shm.plan_of(dataset)
    digests = [_digest(r[0], SLOW.get(name, 0)) for r in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]
    plan = None if p is None else {"mode": p.mode, "workers": p.workers, "prefetch": p.prefetch,
                                   "memory": p.predicted_memory, "budget": p.budget.memory_bytes}
    print("RESULT " + json.dumps({"digests": digests, "plan": plan}), flush=True)


if __name__ == "__main__":
    (run_train_eval if sys.argv[1] == "train_eval" else functools.partial(run_scenario, sys.argv[1]))(sys.argv[2])
