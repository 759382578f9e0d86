"""Pipelines run raw and through ms_shm in one subprocess each, under whatever /dev/shm the caller set up
(``tests.isolated.run_shell``); each prints one ``RESULT {json}`` line with a digest per row.

Importable: the tests call ``run_scenario`` through ``python -c`` inside a private mount namespace.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

MiB = 1 << 20


class SeededAugment:
    """8 MiB rows with noise from numpy's global RNG: what MindSpore reseeds per worker process."""

    def __init__(self, n: int = 24, nbytes: int = 8 * MiB):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        noise = np.random.randint(0, 255, 16, dtype=np.uint8)
        row = np.full(self.nbytes, int(index) % 251, np.uint8)
        row[:16] = noise
        return row, np.array(index, np.int64)


class Deterministic(SeededAugment):
    """The same rows whoever reads them: spawned workers get a default seed (5489) and are not reseeded."""

    def __getitem__(self, index):
        row = np.full(self.nbytes, int(index) % 251, np.uint8)
        row[:8] = np.frombuffer(hashlib.sha256(str(int(index)).encode()).digest()[:8], np.uint8)
        return row, np.array(index, np.int64)


def digests(dataset, epochs: int = 1) -> list:
    out = []
    for _ in range(epochs):
        for row in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
            out.append(hashlib.sha256(b"".join(np.ascontiguousarray(c).tobytes() for c in row)).hexdigest())
    return out


def one_iterator(dataset, epochs: int) -> list:
    """Every row of ``epochs`` epochs read through one iterator (``num_epochs``, as ``Model.train`` makes it)."""
    iterator = dataset.create_tuple_iterator(output_numpy=True, num_epochs=epochs)
    out = []
    for _ in range(epochs):
        out += [hashlib.sha256(b"".join(np.ascontiguousarray(c).tobytes() for c in row)).hexdigest()
                for row in iterator]
    return out


def run_scenario(name: str, mode: str) -> None:
    import mindspore.dataset as ds

    import ms_shm

    if name == "seeded_processes":
        ds.config.set_seed(1234)
        build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
        dataset = build(SeededAugment(), ["data", "label"], shuffle=False, num_parallel_workers=2)
    elif name == "spawn":
        if not hasattr(ds.config, "set_multiprocessing_start_method"):  # 2.0: fork only
            print("RESULT " + json.dumps({"unsupported": "no set_multiprocessing_start_method"}), flush=True)
            return
        ds.config.set_multiprocessing_start_method("spawn")
        build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
        dataset = build(Deterministic(n=8, nbytes=MiB), ["data", "label"], shuffle=False, num_parallel_workers=2,
                        python_multiprocessing=True)
    elif name == "small_many_epochs":  # fewer rows per worker than it has slots, over 3 epochs of one iterator
        build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
        dataset = build(Deterministic(n=16, nbytes=2 * MiB), ["data", "label"], shuffle=False,
                        num_parallel_workers=2, python_multiprocessing=True)
    else:
        raise SystemExit(f"unknown scenario {name}")
    rows = one_iterator(dataset, 3) if name == "small_many_epochs" else digests(dataset, epochs=2)
    plan = ms_shm.plan_of(dataset)
    print("RESULT " + json.dumps({"rows": rows, "mode": plan.mode if plan else None,
                                  "locked": bool(plan and any(d.setting == "mode_locked" for d in plan.decisions))}),
          flush=True)


if __name__ == "__main__":
    run_scenario(sys.argv[1], sys.argv[2])
