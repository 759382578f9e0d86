"""``ms-shm run script.py`` against plain ``python script.py`` under an ample /dev/shm: the price of protecting an
unchanged script, end to end (interpreter start, imports, ``tune()``, probing, construction and one epoch).

Each round runs every script both ways, each in a fresh process in its own mount namespace with a 4 GB tmpfs on
/dev/shm: the scripts in a shuffled order, and each script's two runs back to back in a random order, so that the
machine's drift (a single run of the same script moves by 10-15% here) hits both sides of a pair alike. The figure
is the median over rounds of (run / plain) per script, with a 90% bootstrap interval of that median: the range
the figure would likely take in another run of the benchmark. Beside it, what
ms_shm's own work took inside the ``run`` (its ``--report``: ``tune()`` and each pipeline's build, probe, plan and
the framework's construction), as a share of the plain run: the part of the difference ms_shm can add, measured
in-process, free of the seconds-wide noise of interpreter start, imports and teardown.

    python benchmarks/bench_run.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _installed import compile_bytecode

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "patch_scenarios"
# script, its arguments (seed, rows, MiB per row): the patch tests' raw-MindSpore scripts
SCRIPTS = {"generator 2 workers x 8 MiB": ("gen_explicit.py", "7 48 8"),
           "map growing rows to 8 MiB": ("map_grow.py", "7 32 8"),
           "batch per_batch_map 4 x 4 MiB": ("batch_pbm.py", "7 32 4"),
           "torch DataLoader 2 workers x 4 x 8 MiB": ("torch_loader.py", "48")}


def own_seconds(report: Path) -> float:
    """What ms_shm's own work took in a run (``tune()`` and every pipeline's build), from its ``--report``."""
    data = json.loads(report.read_text())
    return sum(data.get("tune_seconds", [])) + sum(p.get("seconds", 0.0) for p in data["pipelines"])


def timed(command: str) -> float:
    shell = f"mount -t tmpfs -o size=4g tmpfs /dev/shm && {command} > /dev/null"
    start = time.perf_counter()
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], cwd=REPO,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    py = shlex.quote(sys.executable)
    compile_bytecode(REPO / "ms_shm")
    ratios: dict = {name: [] for name in SCRIPTS}
    own: dict = {name: [] for name in SCRIPTS}
    times: dict = {(name, way): [] for name in SCRIPTS for way in ("plain", "run")}
    report = Path(tempfile.mkdtemp(prefix="bench_run_")) / "report.json"
    for _ in range(args.rounds):
        for name in random.sample(list(SCRIPTS), len(SCRIPTS)):
            script, script_args = SCRIPTS[name]
            path = shlex.quote(str(SCENARIOS / script))
            for way in random.sample(["plain", "run"], 2):
                runner = f"{py} {path}" if way == "plain" else f"{py} -m ms_shm run --report {report} {path}"
                times[(name, way)].append(timed(f"{runner} {script_args}"))
                if way == "run":
                    own[name].append(own_seconds(report))
            ratios[name].append(times[(name, "run")][-1] / times[(name, "plain")][-1])
    print(f"| script | plain python s | ms-shm run s | run/plain, median of {args.rounds} paired rounds "
          f"(90% interval) | ms_shm's own work s (share of plain) |")
    print("|---|---|---|---|---|")
    for name in SCRIPTS:
        low, high = bootstrap_median(ratios[name])
        plain, mine = statistics.median(times[(name, 'plain')]), statistics.median(own[name])
        print(f"| {name} | {plain:.2f} | {statistics.median(times[(name, 'run')]):.2f} | "
              f"{statistics.median(ratios[name]):.3f} ({low:.3f}-{high:.3f}) | {mine:.3f} ({mine / plain:.1%}) |")
    return 0


def bootstrap_median(values: list, resamples: int = 4000, seed: int = 0) -> tuple:
    """The 5th and 95th percentiles of the median of ``values`` resampled with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


if __name__ == "__main__":
    sys.exit(main())
