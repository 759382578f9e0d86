"""What the runtime guard costs per row: ``GuardedSource.__getitem__`` against the bare source.

The guard runs in every worker for every row, so its cost must stay negligible next to MindSpore's own
per-row overhead (about 300 us per row through shared memory on the reference machine, ``ms_shm.engines.mindspore.planning.Costs``).
Rows have two columns (a 64x64x3 uint8 image and a 0-d int64 label), prebuilt, so the bare source costs
almost nothing and the difference is the guard alone. Indices are numpy int64, as MindSpore passes them.

Run: ``python benchmarks/bench_guard.py`` (prints one line per variant; ``--json`` for machine output).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from ms_shm import model
from ms_shm.guard import GuardedSource, GuardSpec

CALLS = 100_000
REPEATS = 5


class _Bare:
    """A source whose ``__getitem__`` only indexes a list of prebuilt rows."""

    def __init__(self, rows: list):
        self.rows = rows

    def __getitem__(self, index: int) -> Any:
        return self.rows[index % len(self.rows)]

    def __len__(self) -> int:
        return CALLS


def _rows(count: int = 64) -> list:
    return [(np.full((64, 64, 3), i % 251, np.uint8), np.array(i, np.int64)) for i in range(count)]


def _best_seconds(getitem, calls: int, repeats: int) -> float:
    indices = list(np.arange(calls, dtype=np.int64))  # MindSpore passes numpy int64 indices
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in indices:
            getitem(i)
        best = min(best, time.perf_counter() - start)
    return best


def _spec() -> GuardSpec:
    row = model.pages(64 * 64 * 3 + 8)
    slots = model.slots(model.DEFAULT_PREFETCH, 2)
    return GuardSpec(slots, 10 * slots * row, row, "lower num_parallel_workers", workers=2)


def measure(calls: int = CALLS, repeats: int = REPEATS) -> dict:
    """Seconds per row of the bare source and of the guard, with and without the budget check.

    Returns:
        dict: ``bare_us``, ``guard_us`` (the budget check, as in processes mode; elsewhere the source is not
        wrapped), the overhead ``guard_overhead_us``, and ``growth_us``: one slot growth, which adds a
        ``statvfs`` of /dev/shm.
    """
    rows = _rows()
    bare = _Bare(rows)
    guarded = GuardedSource(bare, _spec())
    for i in range(1000):  # fill every slot first: steady state, as after the first rows of an epoch
        guarded[i]
    t_bare = _best_seconds(bare.__getitem__, calls, repeats) / calls
    t_guard = _best_seconds(guarded.__getitem__, calls, repeats) / calls
    growth = []
    for _ in range(200):
        fresh = GuardedSource(bare, _spec())
        start = time.perf_counter()
        fresh[0]  # an empty slot list: this row creates a slot and reads /dev/shm's free space
        growth.append(time.perf_counter() - start)
    return {
        "calls": calls,
        "bare_us": t_bare * 1e6,
        "guard_us": t_guard * 1e6,
        "guard_overhead_us": (t_guard - t_bare) * 1e6,
        "growth_us": sorted(growth)[len(growth) // 2] * 1e6,
    }


def guard_overhead_us(calls: int = CALLS, repeats: int = REPEATS) -> float:
    """Microseconds the guard adds to each row in processes mode (the budget check), best of repeats."""
    return measure(calls, repeats)["guard_overhead_us"]


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = measure()
    if "--json" in argv:
        print(json.dumps(result, indent=2))
        return 0
    print(f"guard: {result['guard_overhead_us']:.2f} us/row over the bare source "
          f"({result['bare_us']:.2f} -> {result['guard_us']:.2f} us, {result['calls']} calls, 2-column rows)")
    print(f"a row that grows a slot (adds statvfs of /dev/shm): {result['growth_us']:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
