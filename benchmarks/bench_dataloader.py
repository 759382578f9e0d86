"""PyTorch-style DataLoaders: raw (as a user writes it) vs ``ms_shm.build_dataloader`` vs the best of a grid,
per framework and ``/dev/shm`` size, end to end (construction, probe and ``tune()`` included, then one epoch).

The dataset: ``--samples`` (default 64) samples of 2 MiB float32 with ~8 ms of numpy work each (so workers pay
off), batches of 8 (16 MiB). At 64 the epoch is ~0.6 s, so the figure is mostly start-up (ms_shm's import,
``tune()`` and probe fork are ~0.15 s of it); 256 is an epoch of a few seconds. Raw is ``DataLoader(ds, batch_size=8, num_workers=2)``; ms_shm is ``build_dataloader(ds,
batch_size=8)``; the grid is num_workers 0/1/2 x prefetch_factor 1/2/4 (x sharing strategy for torch). Every
run is a fresh process in a private mount namespace with a tmpfs of the cell's size; every batch is checked
against the digest of a run with room to spare, so a wrong batch counts as a crash. Rounds interleave every
configuration of a cell (shuffled per round, seeded); the median of ``--repeat`` rounds is reported.

    python benchmarks/bench_dataloader.py --repeat 5 [--samples 64] [--epochs 1] [--frameworks torch,mindspore]
        [--shm 64m,512m,ample] [--ms-python PATH]

``--epochs 2`` iterates the one loader twice: workers start again for the second epoch while the loop may still
hold the first's last batch, so a configuration that fits one epoch can die in the next.

MindSpore's DataLoader needs NumPy 1.x: ``--ms-python`` names an interpreter with MindSpore 2.8+ and numpy<2
(default: the release matrix's ``.venv-ms2.8.0``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from _installed import compile_bytecode

REPO = Path(__file__).resolve().parent.parent
TAG = "BENCH_DL "
SHM = {"64m": "64m", "512m": "512m", "ample": "4g"}
FRAMEWORKS = "torch,mindspore"
HANG_SECONDS = 120  # an epoch here takes a few seconds


def child(framework: str, config: dict) -> None:
    """One run: build the loader as ``config`` says, iterate one epoch, print seconds and the batches' digest."""
    import gc
    import hashlib
    import logging

    import numpy as np

    if framework == "torch":
        import torch
        from torch.utils.data import DataLoader, Dataset

        tensor = torch.from_numpy
    else:
        from mindspore import Tensor
        from mindspore.dataset.dataloader import DataLoader, Dataset

        tensor = Tensor

    class Samples(Dataset):
        def __len__(self):
            return config["samples"]

        def __getitem__(self, i):
            base = np.random.default_rng(i).random(1 << 19, dtype=np.float32)
            for _ in range(6):
                base = np.sqrt(base * base + 1.0, dtype=np.float32)  # ~8 ms of numpy work per sample
            return tensor(base), i

    logging.disable(logging.WARNING)
    # The framework's import leaves a full garbage collection due, which the next code to allocate pays (ms_shm's
    # import, or the user's first model): part of that import, so paid before the clock in every configuration.
    gc.collect()
    started = time.perf_counter()  # after the framework's import, as bench_core; ms_shm's own import counts
    if config["kind"] == "ms_shm":
        import ms_shm

        ms_shm.tune()
        loader = ms_shm.build_dataloader(Samples(), batch_size=8)
    else:
        if framework == "torch" and config.get("strategy"):
            torch.multiprocessing.set_sharing_strategy(config["strategy"])
        kwargs = {"batch_size": 8, "num_workers": config["workers"]}
        if config["workers"] and config.get("prefetch"):
            kwargs["prefetch_factor"] = config["prefetch"]
        loader = DataLoader(Samples(), **kwargs)
    h = hashlib.sha256()
    for _ in range(config.get("epochs", 1)):
        for data, label in loader:
            h.update(np.asarray(data.asnumpy() if hasattr(data, "asnumpy") else data.numpy()).tobytes())
            h.update(np.asarray(label.asnumpy() if hasattr(label, "asnumpy") else label.numpy()).tobytes())
    seconds = time.perf_counter() - started
    chosen = f"W{loader.num_workers}" + (f" P{loader.prefetch_factor}" if loader.num_workers else "")
    if framework == "torch" and loader.num_workers:
        chosen += f" {torch.multiprocessing.get_sharing_strategy()[5:]}"
    print(TAG + json.dumps({"seconds": seconds, "digest": h.hexdigest()[:16], "chosen": chosen}), flush=True)


def configs(framework: str) -> list:
    out = [{"name": "raw", "kind": "raw", "workers": 2}, {"name": "ms_shm", "kind": "ms_shm"},
           {"name": "W0", "kind": "grid", "workers": 0}]
    strategies = ("file_descriptor", "file_system") if framework == "torch" else (None,)
    for w in (1, 2):
        for p in (1, 2, 4):
            for s in strategies:
                suffix = f" {s[5:]}" if s else ""
                out.append({"name": f"W{w} P{p}{suffix}", "kind": "grid", "workers": w, "prefetch": p, "strategy": s})
    return out


def run_one(python: str, framework: str, config: dict, shm: str) -> dict:
    command = " ".join(shlex.quote(a) for a in (python, str(Path(__file__).resolve()), "--child", framework,
                                                  json.dumps(config)))
    shell = f"mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec {command}"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "GLOG_v": "3"}
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(REPO), env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:  # a loader that stalls (torch under a full /dev/shm can): a crash too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"crash": f"HANG: no end of the epoch within {HANG_SECONDS} s"}
    lines = [line for line in stdout.splitlines() if line.startswith(TAG)]
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["?"]
        return {"crash": f"rc {proc.returncode}: {tail[0][:120]}"}
    return json.loads(lines[-1][len(TAG):])


def cell(python: str, framework: str, shm: str, repeat: int, rng: random.Random, samples: int,
         epochs: int = 1) -> dict:
    """Every configuration of one cell, ``repeat`` interleaved rounds; a configuration that crashed stops."""
    cfgs = [dict(c, samples=samples, epochs=epochs) for c in configs(framework)]
    reference = run_one(python, framework, {"kind": "grid", "workers": 0, "samples": samples, "epochs": epochs},
                        "4g").get("digest")
    times: dict = {c["name"]: [] for c in cfgs}
    crashes: dict = {}
    chosen: list = []  # what ms_shm picked, per round
    for _ in range(repeat):
        order = [c for c in cfgs if c["name"] not in crashes]
        rng.shuffle(order)
        for c in order:
            r = run_one(python, framework, c, SHM[shm])
            if "crash" in r or r.get("digest") != reference:
                crashes[c["name"]] = r.get("crash", "wrong batches")
            else:
                times[c["name"]].append(r["seconds"])
                if c["kind"] == "ms_shm":
                    chosen.append(r["chosen"])
    med = {n: statistics.median(t) for n, t in times.items() if t and n not in crashes}
    return {"framework": framework, "shm": shm, "median": med, "crashes": crashes, "chosen": chosen}


def _seconds_or_crash(name: str, med: dict, crashes: dict) -> str:
    return f"{med[name]:.2f}" if name in med else f"CRASH ({crashes.get(name, '?')[:40]})"


def _row(c: dict) -> str:
    med, crashes = c["median"], c["crashes"]
    grid = {n: s for n, s in med.items() if n not in ("raw", "ms_shm")}
    if not grid:
        return f"| {c['framework']} | {c['shm']} | - | - | - | - | - | - |"
    best_name, best = min(grid.items(), key=lambda kv: kv[1])
    raw, ours = med.get("raw"), med.get("ms_shm")
    ratio = f"{best / ours:.2f}" if ours else "-"
    vs_raw = f"{ours / raw:.2f}" if ours and raw else "-"
    grid_crashes = sum(1 for n in crashes if n not in ("raw", "ms_shm"))
    picked = ", ".join(f"{n}x {k}" if n > 1 else k for k, n in Counter(c.get("chosen", ())).most_common())
    return (f"| {c['framework']} | {c['shm']} | {_seconds_or_crash('raw', med, crashes)} | "
            f"{_seconds_or_crash('ms_shm', med, crashes)} ({picked or '-'}) | {best:.2f} ({best_name}) | {ratio} | "
            f"{vs_raw} | "
            f"{int('raw' in crashes)}, {int('ms_shm' in crashes)}, {grid_crashes} |")


def table(cells: list, repeat: int, samples: int, epochs: int = 1) -> list:
    lines = ["| framework | /dev/shm | raw s | ms_shm s (its choice per round) | best grid s (config) | best/ms_shm | ms_shm/raw | "
             "crashes (raw, ms_shm, grid) |", "|---|---|---|---|---|---|---|---|"]
    lines += [_row(c) for c in cells]
    lines.append(f"\nMedian of {repeat} interleaved rounds, end to end (the framework's import excluded; ms_shm's "
                 f"import, tune, probe, construction and {_epochs_text(epochs)} of {samples} samples included).")
    return lines


def _epochs_text(epochs: int) -> str:
    return "one epoch" if epochs == 1 else f"{epochs} epochs"


def _flags(args: argparse.Namespace) -> str:
    """The options a run was given beyond ``--repeat`` and ``--samples``, as its command line says them."""
    given = [("--epochs", args.epochs, 1), ("--frameworks", args.frameworks, FRAMEWORKS),
             ("--shm", args.shm, ",".join(SHM))]
    return "".join(f" {flag} {value}" for flag, value, default in given if value != default)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], json.loads(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--samples", type=int, default=64, help="samples per epoch (batches of 8)")
    parser.add_argument("--epochs", type=int, default=1,
                        help="epochs per run, one loader (a configuration that lives one epoch only crashes at 2)")
    parser.add_argument("--frameworks", default=FRAMEWORKS)
    parser.add_argument("--shm", default=",".join(SHM))
    parser.add_argument("--ms-python", default=str(REPO / ".venv-ms2.8.0" / "bin" / "python"))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    rng, cells, started = random.Random(7), [], time.perf_counter()
    for framework in args.frameworks.split(","):
        python = sys.executable if framework == "torch" else args.ms_python
        if not Path(python).exists():
            print(f"{framework}: skipped ({python} not found)")
            continue
        compile_bytecode(REPO / "ms_shm", python)
        for shm in args.shm.split(","):
            cells.append(cell(python, framework, shm, args.repeat, rng, args.samples, args.epochs))
            print(json.dumps(cells[-1]), flush=True)
    lines = [f"Command: `python benchmarks/bench_dataloader.py --repeat {args.repeat} --samples {args.samples}{_flags(args)}` ({time.perf_counter() - started:.0f} s)",
             ""] + table(cells, args.repeat, args.samples, args.epochs)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
