"""Pipelines that die on raw MindSpore in a small /dev/shm, run in a child process by the acceptance tests.

Importable (``python -m tests.scenarios KIND --seed S ARGS``) so spawn workers can unpickle the sources. Every row's
bytes are seeded by ``(seed, index)`` (``content``), so the test, which picks the seed, can compute each row's
expected digest itself. The child reports what arrived, in arrival order (label and sha256 of the row's bytes),
and the peak of /dev/shm it measured by polling ``statvfs`` every millisecond from a thread in its own mount
namespace (MindSpore unlinks its segments at once, so listing files would show nothing). It prints one
``RESULT {...}`` JSON line; a bus error kills it before that line, which is how the tests see a crash.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
import sys
import threading
import time

import numpy as np

MiB = 1 << 20
BLOCK = 65521  # a prime: each row repeats its seeded block, so no page or MiB boundary lines up with it


def content(seed: int, i: int, nbytes: int) -> np.ndarray:
    """Row ``i``'s bytes: a block drawn from ``default_rng([seed, i])``, repeated to ``nbytes``."""
    block = np.random.default_rng([seed, i]).integers(0, 256, BLOCK, dtype=np.uint8)
    return np.resize(block, nbytes)


def digest(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def ragged_bytes(i: int) -> int:
    """Row sizes of ``RaggedRows``: 0.5 to 6 MiB in half-MiB steps, in an order the probe cannot predict."""
    return ((i * 7919) % 12 + 1) * (MiB // 2)


def caption(i: int) -> str:
    return f"caption {i} — ünïcode"


def grown(seed: int, i: int, in_bytes: int, out_bytes: int) -> np.ndarray:
    """What ``Grow`` makes of row ``i``: its input bytes repeated to ``out_bytes``."""
    return np.resize(content(seed, i, in_bytes), out_bytes)


class FixedRows:
    """Random-access rows of ``mb`` MiB of seeded bytes plus an int64 label."""

    def __init__(self, n: int, mb: float, seed: int):
        self.n, self.nbytes, self.seed = n, int(mb * MiB), seed

    def size(self, i: int) -> int:
        return self.nbytes

    def __getitem__(self, i):
        i = int(i)
        return content(self.seed, i, self.size(i)), np.array(i, np.int64)

    def __len__(self):
        return self.n


class RaggedRows(FixedRows):
    """Row sizes cycle between 0.5 and 6 MiB: the probe cannot see every size."""

    def size(self, i: int) -> int:
        return ragged_bytes(i)


class StringRows(FixedRows):
    """A numpy row with a string column, as captioned image datasets have."""

    def __getitem__(self, i):
        i = int(i)
        return content(self.seed, i, self.nbytes), np.array(i, np.int64), np.array(caption(i))


def generator_rows(n: int, mb: float, seed: int):
    """A generator function source: MindSpore reads it in the main process."""
    def gen():
        for i in range(n):
            yield content(seed, i, int(mb * MiB)), np.array(i, np.int64)
    return gen


SOURCES = {"fixed": FixedRows, "ragged": RaggedRows, "strings": StringRows}


class Grow:
    """A map operation whose output is much larger than its input, like a JPEG decode."""

    def __init__(self, mb: float):
        self.nbytes = int(mb * MiB)

    def __call__(self, data):
        return np.resize(data, self.nbytes)


class ShmPeak:
    """Polls ``statvfs('/dev/shm')`` every ``interval`` seconds in a thread and keeps the largest use seen."""

    def __init__(self, path: str = "/dev/shm", interval: float = 0.001):
        self.path, self.interval = path, interval
        st = os.statvfs(path)
        self.size = st.f_blocks * st.f_frsize
        self.baseline = self.peak = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        return {"shm_size": self.size, "shm_baseline": self.baseline, "shm_peak": self.peak}


def received(rows) -> list:
    """``[label, sha256 of the data column, caption or None]`` for each row, in arrival order."""
    out = []
    for cols in rows:
        out.append([int(cols[1]), digest(cols[0]), str(cols[2]) if len(cols) > 2 else None])
    return out


def plan_fields(ms_shm, dataset) -> dict:
    plan = ms_shm.plan_of(dataset) if dataset is not None else None
    if plan is None:
        return {"mode": None, "workers": None, "prefetch": None, "budget": None}
    return {"mode": plan.mode, "workers": plan.workers, "prefetch": plan.prefetch, "budget": plan.budget.shm_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=[*SOURCES, "generator", "map", "pair", "foreign-map", "sequence"])
    ap.add_argument("--mode", choices=["raw", "ms_shm"], required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--mb", type=float, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--spawn", action="store_true")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to keep the iterator alive after the epoch")
    ap.add_argument("--map-mb", type=float, default=8)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    peak = ShmPeak()

    import mindspore.dataset as ds

    import ms_shm

    if args.kind == "pair":
        return pair(args, ds, ms_shm, peak)
    if args.kind == "foreign-map":
        return foreign_map(args, ds, ms_shm, peak)
    if args.kind == "sequence":
        return sequence(args, ms_shm, peak)
    if args.spawn:
        ds.config.set_multiprocessing_start_method("spawn")
    if args.kind == "generator":
        source = generator_rows(args.rows, args.mb, args.seed)
        names = ["data", "label"]
    elif args.kind == "map":
        source = FixedRows(args.rows, 1 / 1024, args.seed)
        names = ["data", "label"]
    else:
        source = SOURCES[args.kind](args.rows, args.mb, args.seed)
        names = ["data", "label", "caption"] if args.kind == "strings" else ["data", "label"]
    kwargs = {"num_parallel_workers": args.workers, "shuffle": False}
    if args.spawn:
        kwargs["python_multiprocessing"] = True
    # map: 2 processes asked for explicitly, so raw and ms_shm run the same transport (SysV)
    map_kwargs = {"input_columns": ["data"], "num_parallel_workers": 2, "python_multiprocessing": True}
    if args.mode == "raw":
        dataset = ds.GeneratorDataset(source, names, **kwargs)
        built = None
        if args.kind == "map":
            dataset = dataset.map(Grow(args.map_mb), **map_kwargs)
    else:
        ms_shm.tune()
        dataset = built = ms_shm.build_dataset(source, names, **kwargs)
        if args.kind == "map":
            dataset = ms_shm.map(dataset, Grow(args.map_mb), **map_kwargs)
    it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
    rows = received(it)
    if args.hold:
        time.sleep(args.hold)
    del it
    final = ms_shm.plan_of(dataset) if args.mode == "ms_shm" and args.kind == "map" else None
    print("RESULT " + json.dumps({
        "received": rows, **plan_fields(ms_shm, built), "map_mode": final.mode if final else None,
        **peak.stop(), "pid": os.getpid(),
    }), flush=True)
    return 0


def pair(args, ds, ms_shm, peak) -> int:
    """Train (seed) and eval (seed + 1) pipelines iterated together: their slots are alive at the same time."""
    train_src = FixedRows(args.rows, args.mb, args.seed)
    eval_src = FixedRows(args.rows, args.mb, args.seed + 1)
    kwargs = {"num_parallel_workers": args.workers, "shuffle": False}
    if args.mode == "raw":
        train = ds.GeneratorDataset(train_src, ["data", "label"], **kwargs)
        evalu = ds.GeneratorDataset(eval_src, ["data", "label"], **kwargs)
    else:
        ms_shm.tune()
        train = ms_shm.build_dataset(train_src, ["data", "label"], **kwargs)
        evalu = ms_shm.build_dataset(eval_src, ["data", "label"], **kwargs)
    it_train = train.create_tuple_iterator(output_numpy=True, num_epochs=1)
    it_eval = evalu.create_tuple_iterator(output_numpy=True, num_epochs=1)
    got = {"train": [], "eval": []}
    for a, b in itertools.zip_longest(it_train, it_eval):  # one row of each at a time, to the longer one's end
        got["train"] += received([a] if a is not None else [])
        got["eval"] += received([b] if b is not None else [])
    del it_train, it_eval
    plans = {name: plan_fields(ms_shm, d if args.mode == "ms_shm" else None)
             for name, d in (("train", train), ("eval", evalu))}
    print("RESULT " + json.dumps({"received": got, "plans": plans, **peak.stop()}), flush=True)
    return 0


def sequence(args, ms_shm, peak) -> int:
    """Train, then eval, each with explicit worker processes, the train's dataset still bound: an eval built
    after train's iterator ended, and (planned only) one built while that eval's iterator runs."""
    kwargs = {"num_parallel_workers": args.workers, "python_multiprocessing": True, "shuffle": False}
    ms_shm.tune()

    def build(seed):
        return ms_shm.build_dataset(FixedRows(args.rows, args.mb, seed), ["data", "label"], **kwargs)

    train = build(args.seed)
    it = train.create_tuple_iterator(output_numpy=True, num_epochs=1)
    got = {"train": received(it)}
    del it
    after = build(args.seed + 1)
    it = after.create_tuple_iterator(output_numpy=True, num_epochs=1)
    got["eval"] = received([next(it)])
    during = ms_shm.plan_of(build(args.seed + 2)).budget.shm_bytes
    got["eval"] += received(it)
    del it
    print("RESULT " + json.dumps({"received": got, "during": during, "train": plan_fields(ms_shm, train),
                                  "eval": plan_fields(ms_shm, after), **peak.stop()}), flush=True)
    return 0


def foreign_map(args, ds, ms_shm, peak) -> int:
    """``map`` on a dataset ms_shm did not build: ms_shm reads a few rows to measure the operation."""
    source = FixedRows(args.rows, 1 / 1024, args.seed)
    dataset = ds.GeneratorDataset(source, ["data", "label"], shuffle=False)
    if args.mode == "raw":
        mapped = dataset.map(Grow(args.map_mb), input_columns="data")
    else:
        mapped = ms_shm.map(dataset, Grow(args.map_mb), input_columns="data")
    it = mapped.create_tuple_iterator(output_numpy=True, num_epochs=1)
    rows = received(it)
    del it
    plan = ms_shm.plan_of(mapped) if args.mode == "ms_shm" else None
    print("RESULT " + json.dumps({"received": rows, "map_mode": plan.mode if plan else None,
                                  "row_bytes": plan.row_bytes if plan else None, **peak.stop()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
