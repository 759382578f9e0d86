"""Copy-on-read: workers' memory with a plain list of small dicts against ``ms_shm.SharedList``.

Each variant runs in its own process, so one variant's heap never leaks into another's numbers. Inside,
a real ``GeneratorDataset`` (2 workers, python_multiprocessing=True) reads one epoch in order; the
source's ``__getitem__`` reads item ``i`` of its list and returns a small row. The worker measures its own
USS and PSS (``psutil``'s ``memory_full_info``) on its last rows and sends them back in the row, so the
numbers are exactly those of MindSpore's worker processes, at the end of the epoch.

"Added memory" is the workers' USS (or PSS) minus that of the same pipeline whose source holds no list.
Under fork the copy grows during the epoch, as reference counts are touched; under spawn it is there from
the start (the source is pickled into each worker), so the spawn runs read only ``--spawn-rows`` rows.

Run: ``.venv/bin/python benchmarks/bench_cow.py`` (``--items 100000`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from ms_shm import cow  # noqa: E402
from ms_shm._results import mib  # noqa: E402
from ms_shm.shared_list import SharedList  # noqa: E402

_TAIL = 8  # rows at the end of the epoch on which workers measure themselves (both workers get some)
_FIELDS = ("index", "touched", "pid", "first_uss", "first_pss", "uss", "pss")


def make_items(n: int) -> list:
    """Small annotation dicts, as a detection or captioning dataset keeps them."""
    return [{"id": i, "file": f"images/train/{i:08d}.jpg", "label": i % 1000} for i in range(n)]


def memory() -> tuple[int, int]:
    info = psutil.Process().memory_full_info()
    return info.uss, info.pss


class Source:
    """Random-access source; ``holder`` is what keeps the annotations: none, list, shared or shm."""

    def __init__(self, items: int, rows: int, holder: str) -> None:
        self.rows = rows
        self.items = None
        if holder == "list":
            self.items = make_items(items)
        elif holder in ("shared", "shm"):
            self.items = SharedList(make_items(items), shared_memory=holder == "shm")
        self.first = None  # set in each worker, on the first row it serves

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        touched = 0
        if self.items is not None:
            record = self.items[i]
            touched = record["label"] + len(record["file"])
        if self.first is None:
            self.first = memory()
        uss = pss = 0
        if i >= self.rows - _TAIL:
            uss, pss = memory()
        return (np.array([i, touched, os.getpid(), *self.first, uss, pss], np.int64),)


def run_variant(items: int, rows: int, holder: str, start: str, workers: int) -> dict:
    """One pipeline, one epoch; returns per-worker memory, time and a correctness check."""
    import mindspore.dataset as ds

    if start != "fork":
        ds.config.set_multiprocessing_start_method(start)
    source = Source(items, rows, holder)
    main_uss = memory()[0]
    dataset = ds.GeneratorDataset(source, ["x"], num_parallel_workers=workers, python_multiprocessing=True,
                                  shuffle=False)
    last: dict = {}
    firsts: dict = {}
    seen = 0
    touched = 0
    t0 = time.perf_counter()
    iterator = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
    for (row,) in iterator:
        values = dict(zip(_FIELDS, (int(v) for v in row)))
        if values["index"] != seen:
            raise AssertionError(f"row {seen} came back as {values['index']}")
        seen += 1
        touched += values["touched"]
        firsts[values["pid"]] = (values["first_uss"], values["first_pss"])
        if values["uss"]:
            last[values["pid"]] = (values["uss"], values["pss"])
    elapsed = time.perf_counter() - t0
    del iterator
    expected = sum(i % 1000 + len(f"images/train/{i:08d}.jpg") for i in range(rows)) if holder != "none" else 0
    return {"holder": holder, "start": start, "rows": seen, "seconds": elapsed, "main_uss": main_uss,
            "workers": {str(pid): {"first": firsts[pid], "end": mem} for pid, mem in last.items()},
            "pids_seen": len(firsts), "correct": touched == expected}


def spawn_variant(args: argparse.Namespace, holder: str, start: str, rows: int) -> dict:
    code = (f"import json, bench_cow; print('RESULT', json.dumps(bench_cow.run_variant("
            f"{args.items}, {rows}, {holder!r}, {start!r}, {args.workers})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("GLOG_v", "3")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(REPO))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"variant {holder}/{start} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")


def access_times(items: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds per ``lst[i]`` over every item, best of ``repeats``, for a plain list and a SharedList."""
    plain = make_items(items)
    shared = SharedList(plain)
    best = []
    for lst in (plain, shared):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(items):
                lst[i]
            runs.append(time.perf_counter() - t0)
        best.append(min(runs) / items)
    return best[0], best[1]


def totals(result: dict) -> tuple[int, int]:
    ends = [w["end"] for w in result["workers"].values()]
    return sum(e[0] for e in ends), sum(e[1] for e in ends)


LABELS = {"none": "no list (baseline)", "list": "plain list", "shared": "SharedList",
          "shm": "SharedList(shared_memory=True)"}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def print_runs(results: list, workers: int) -> dict:
    """The table of runs; returns each run's added (USS, PSS) over its start method's baseline."""
    print("\n| start | source holds | rows | workers' USS | added USS | workers' PSS | added PSS | "
          "main USS | µs/row | rows ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    added: dict = {}
    for result in results:
        base = next(r for r in results if r["start"] == result["start"] and r["holder"] == "none")
        uss, pss = totals(result)
        base_uss, base_pss = totals(base)
        added[(result["start"], result["holder"])] = (uss - base_uss, pss - base_pss)
        ok = result["correct"] and result["pids_seen"] == workers == len(result["workers"])
        print(f"| {result['start']} | {LABELS[result['holder']]} | {result['rows']:,} | {mib(uss)} | "
              f"{mib(uss - base_uss)} | {mib(pss)} | {mib(pss - base_pss)} | {mib(result['main_uss'])} | "
              f"{result['seconds'] / result['rows'] * 1e6:.0f} | {'yes' if ok else 'NO'} |")
    return added


def print_targets(results: list, added: dict, items: int, spawn: bool) -> None:
    plain_s, shared_s = access_times(items)
    print(f"\nper-item access in the main process, lst[i] over {items:,} items (best of 3): "
          f"plain list {plain_s * 1e9:.0f} ns, SharedList {shared_s * 1e9:.0f} ns")
    fork_ratio = _ratio(added[("fork", "shared")][0], added[("fork", "list")][0])
    by_row = {r["holder"]: r["seconds"] / r["rows"] for r in results if r["start"] == "fork"}
    row_ratio = _ratio(by_row["shared"], by_row["list"])
    access_ratio = _ratio(shared_s, plain_s)
    print("\n| target | measured | met |")
    print("|---|---:|---|")
    print(f"| fork: workers' added USS, SharedList / plain list <= 5% | {fork_ratio:.1%} | "
          f"{'yes' if fork_ratio <= 0.05 else 'no'} |")
    print(f"| per-row time through the pipeline, SharedList / plain list <= 2x | {row_ratio:.2f}x | "
          f"{'yes' if row_ratio <= 2 else 'no'} |")
    print(f"| bare lst[i], SharedList / plain list <= 2x | {access_ratio:.1f}x | "
          f"{'yes' if access_ratio <= 2 else 'no'} (one pickle.loads per read) |")
    if spawn:
        spawn_ratio = _ratio(added[("spawn", "shm")][0], added[("spawn", "list")][0])
        pickled_ratio = _ratio(added[("spawn", "shared")][0], added[("spawn", "list")][0])
        print(f"| spawn: workers' added USS, SharedList / plain list | pickled {pickled_ratio:.1%}, "
              f"shared memory {spawn_ratio:.1%} | info |")


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="items in the source's list")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--spawn-rows", type=int, default=20_000,
                        help="rows read in the spawn runs (their copy happens at start); 0 skips spawn")
    args = parser.parse_args(argv)
    here = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print("$ " + " ".join([here, os.path.relpath(__file__), *sys.argv[1:]]))
    print(f"{args.items:,} small dicts, {args.workers} workers, GeneratorDataset(python_multiprocessing=True), "
          f"{os.cpu_count()} CPUs\n")

    class Holder:
        def __init__(self) -> None:
            self.annotations = make_items(args.items)

    for start in ("fork", "spawn"):
        finding = cow.inspect_source(Holder(), args.workers, 1, start, min_objects=1)[0]
        print(f"inspector ({start}): {finding.attribute}: ~{mib(finding.bytes_per_worker)} per worker, "
              f"~{mib(finding.total_bytes)} in total")
    plan = [("fork", h, args.items) for h in ("none", "list", "shared")]
    if args.spawn_rows:
        plan += [("spawn", h, min(args.spawn_rows, args.items)) for h in ("none", "list", "shared", "shm")]
    results = []
    for start, holder, rows in plan:
        print(f"running {start}/{holder} ({rows:,} rows)...", file=sys.stderr, flush=True)
        results.append(spawn_variant(args, holder, start, rows))
    print_targets(results, print_runs(results, args.workers), args.items, bool(args.spawn_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
