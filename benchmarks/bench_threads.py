"""Threads per worker: BLAS-heavy rows read by 2 worker processes, every worker's BLAS pool left at one thread per
core (oversubscribed, ``MS_SHM_THREAD_CAP=0``) against ms_shm's cap (``C // 2`` threads per worker).

Each run is a fresh process: ``ms_shm.build_dataset`` (its probe included) and one epoch are timed inside it, the
process's whole life (interpreter start and imports too) outside. Runs are interleaved, each round in a shuffled
order; the figures are medians over rounds, the ratio is the median of the paired (oversubscribed / capped)
ratios.

    python benchmarks/bench_threads.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAYS = {"oversubscribed (MS_SHM_THREAD_CAP=0)": "0", "capped (ms_shm default)": "1"}


class MatmulRows:
    """Each row: a 512x512 float64 matmul and a solve (BLAS/LAPACK threads), returned as a small row."""

    def __init__(self, n: int, size: int = 512):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        import numpy as np

        rng = np.random.default_rng(int(index))
        a = rng.standard_normal((self.size, self.size))
        b = a @ a.T + self.size * np.eye(self.size)
        x = np.linalg.solve(b, a[:, 0])
        return (x.astype(np.float32), np.array(index, np.int64))


def child(rows: int) -> None:
    """One run: build through ms_shm with 2 worker processes, read one epoch, print the seconds and the cap."""
    import threadpoolctl

    import ms_shm

    start = time.perf_counter()
    dataset = ms_shm.build_dataset(MatmulRows(rows), ["x", "i"], num_parallel_workers=2,
                                   python_multiprocessing=True, shuffle=False)
    count = sum(1 for _ in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1))
    seconds = time.perf_counter() - start
    decision = next(d for d in ms_shm.plan_of(dataset).decisions if d.setting == "num_threads")
    blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    print("RESULT " + json.dumps({"seconds": seconds, "rows": count, "decision": str(decision), "main_blas": blas}))


def run(way: str, rows: int) -> tuple:
    env = dict(os.environ, MS_SHM_THREAD_CAP=WAYS[way], GLOG_v="3",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--rows", str(rows)],
                          capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{way} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if result["rows"] != rows:
        raise SystemExit(f"{way}: {result['rows']} rows, expected {rows}")
    return result["seconds"], wall, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rows)
        return 0
    seconds: dict = {way: [] for way in WAYS}
    walls: dict = {way: [] for way in WAYS}
    ratios, seen = [], {}
    over, capped = WAYS
    for _ in range(args.rounds):
        order = list(WAYS)
        random.shuffle(order)
        for way in order:
            s, wall, seen[way] = run(way, args.rows)
            seconds[way].append(s)
            walls[way].append(wall)
        ratios.append(seconds[over][-1] / seconds[capped][-1])
    import numpy  # noqa: F401  (loads the BLAS the workers use, so the line below shows it)
    import threadpoolctl

    print(f"host: {os.cpu_count()} CPUs, usable {len(os.sched_getaffinity(0))}; BLAS "
          f"{[(p['internal_api'], p['num_threads']) for p in threadpoolctl.threadpool_info()]}")
    for way in WAYS:
        print(f"{way}: {seen[way]['decision']}; main process BLAS threads {seen[way]['main_blas']}")
    print(f"\n| {args.rows} rows, 2 worker processes | construction + 1 epoch s | whole process s |")
    print("|---|---|---|")
    for way in WAYS:
        print(f"| {way} | {statistics.median(seconds[way]):.2f} | {statistics.median(walls[way]):.2f} |")
    print(f"| **oversubscribed / capped** (median of {args.rounds} paired rounds) | "
          f"**{statistics.median(ratios):.2f}** | {statistics.median(walls[over]) / statistics.median(walls[capped]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
