"""Pipelines that die on raw MindSpore in a small /dev/shm, run in a child process by the acceptance tests.

Importable (``python -m tests.scenarios KIND ARGS``) so spawn workers can unpickle the sources. The child prints
one ``RESULT {...}`` JSON line; a bus error kills it before that line, which is how the tests see a crash.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

MiB = 1 << 20


def content(i: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for row i, so the parent can check every row without storing it."""
    return np.full(nbytes, i % 251, np.uint8)


class FixedRows:
    """Random-access rows of ``mb`` MiB plus an int64 label."""

    def __init__(self, n: int, mb: float):
        self.n, self.nbytes = n, int(mb * MiB)

    def __getitem__(self, i):
        return content(i, self.nbytes), np.array(i, np.int64)

    def __len__(self):
        return self.n

    def expected(self, i):
        return self.nbytes


class RaggedRows(FixedRows):
    """Row sizes cycle between 0.5 and 6 MiB: the probe cannot see every size."""

    def __getitem__(self, i):
        return content(i, self.expected(i)), np.array(i, np.int64)

    def expected(self, i):
        return ((i * 7919) % 12 + 1) * (MiB // 2)


class StringRows(FixedRows):
    """A numpy row with a string column, as captioned image datasets have."""

    def __getitem__(self, i):
        return content(i, self.nbytes), np.array(i, np.int64), np.array(f"caption {i} — ünïcode")


def generator_rows(n: int, mb: float):
    """A generator function source: MindSpore reads it in the main process."""
    def gen():
        for i in range(n):
            yield content(i, int(mb * MiB)), np.array(i, np.int64)
    return gen


SOURCES = {"fixed": FixedRows, "ragged": RaggedRows, "strings": StringRows}


def check(rows_seen, source) -> None:
    seen = []
    for cols in rows_seen:
        data, label = cols[0], int(cols[1])
        expected = source.expected(label) if hasattr(source, "expected") else data.nbytes
        if data.nbytes != expected or data.dtype != np.uint8 or not (data == label % 251).all():
            raise AssertionError(f"row {label} is not bit-exact: {data.nbytes} bytes, dtype {data.dtype}")
        if len(cols) > 2 and str(cols[2]) != f"caption {label} — ünïcode":
            raise AssertionError(f"row {label}: string column is {cols[2]!r}")
        seen.append(label)
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=[*SOURCES, "generator", "map", "pair", "foreign-map"])
    ap.add_argument("--mode", choices=["raw", "ms_shm"], required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--mb", type=float, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--spawn", action="store_true")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to keep the iterator alive after the epoch")
    ap.add_argument("--map-mb", type=float, default=8)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")

    import mindspore.dataset as ds

    import ms_shm

    if args.kind == "pair":
        return pair(args, ds, ms_shm)
    if args.kind == "foreign-map":
        return foreign_map(args, ds, ms_shm)
    if args.spawn:
        ds.config.set_multiprocessing_start_method("spawn")
    t0 = time.perf_counter()
    if args.kind == "generator":
        source = generator_rows(args.rows, args.mb)
        names = ["data", "label"]
    elif args.kind == "map":
        source = FixedRows(args.rows, 1 / 1024)
        names = ["data", "label"]
    else:
        source = SOURCES[args.kind](args.rows, args.mb)
        names = ["data", "label", "caption"] if args.kind == "strings" else ["data", "label"]
    kwargs = {"num_parallel_workers": args.workers, "shuffle": False}
    if args.spawn:
        kwargs["python_multiprocessing"] = True
    plan = None
    if args.mode == "raw":
        dataset = ds.GeneratorDataset(source, names, **kwargs)
        if args.kind == "map":
            dataset = dataset.map(Grow(args.map_mb), input_columns=["data"], num_parallel_workers=args.workers,
                                  python_multiprocessing=True)
    else:
        report = ms_shm.tune()
        dataset = ms_shm.build_dataset(source, names, **kwargs)
        plan = ms_shm.plan_of(dataset)
        if args.kind == "map":
            dataset = ms_shm.map(dataset, Grow(args.map_mb), input_columns=["data"],
                                 num_parallel_workers=args.workers)
        del report
    it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
    checked = MapChecked(args.map_mb) if args.kind == "map" else None
    if checked:
        seen = [checked.check(cols) for cols in it]
    else:
        expected_source = FixedRows(args.rows, args.mb) if args.kind == "generator" else source
        seen = check(it, expected_source)
    elapsed = time.perf_counter() - t0
    if args.hold:
        time.sleep(args.hold)
    del it
    final = ms_shm.plan_of(dataset)
    print("RESULT " + json.dumps({
        "rows": len(seen), "unique": len(set(seen)), "in_order": seen == sorted(seen), "seconds": elapsed,
        "mode": plan.mode if plan else None, "workers": plan.workers if plan else None,
        "prefetch": plan.prefetch if plan else None, "predicted_shm": plan.predicted_shm if plan else None,
        "map_mode": final.mode if (final is not None and args.kind == "map") else None,
        "pid": os.getpid(),
    }), flush=True)
    return 0


def pair(args, ds, ms_shm) -> int:
    """Train and eval pipelines iterated together: their slots are alive at the same time."""
    train_src, eval_src = FixedRows(args.rows, args.mb), FixedRows(args.rows, args.mb)
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
    seen = []
    for a, b in zip(it_train, it_eval):
        seen += check([a], train_src) + check([b], eval_src)
    plans = [ms_shm.plan_of(d) for d in (train, evalu)]
    print("RESULT " + json.dumps({
        "rows": len(seen), "unique": len(set(seen)) * 2,
        "predicted_shm": sum(p.predicted_shm for p in plans if p) if plans[0] else None,
        "modes": [p.mode for p in plans if p], "prefetch": [p.prefetch for p in plans if p]}), flush=True)
    return 0


def foreign_map(args, ds, ms_shm) -> int:
    """ms_shm.map on a dataset ms_shm did not build: it reads a few rows to measure the operation."""
    source = FixedRows(args.rows, 1 / 1024)
    dataset = ds.GeneratorDataset(source, ["data", "label"], shuffle=False)
    mapped = ms_shm.map(dataset, Grow(args.map_mb), input_columns="data")
    checker = MapChecked(args.map_mb)
    seen = [checker.check(cols) for cols in mapped.create_tuple_iterator(output_numpy=True, num_epochs=1)]
    plan = ms_shm.plan_of(mapped)
    print("RESULT " + json.dumps({"rows": len(seen), "unique": len(set(seen)), "map_mode": plan.mode,
                                  "row_bytes": plan.row_bytes}), flush=True)
    return 0


class Grow:
    """A map operation whose output is much larger than its input, like a JPEG decode."""

    def __init__(self, mb: float):
        self.nbytes = int(mb * MiB)

    def __call__(self, data):
        return np.full(self.nbytes, int(data[0]), np.uint8)


class MapChecked:
    def __init__(self, mb: float):
        self.nbytes = int(mb * MiB)

    def check(self, cols):
        data, label = cols[0], int(cols[1])
        if data.nbytes != self.nbytes or not (data == label % 251).all():
            raise AssertionError(f"mapped row {label} is not bit-exact")
        return label


if __name__ == "__main__":
    sys.exit(main())
