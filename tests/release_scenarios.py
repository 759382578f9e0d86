"""Pipelines for the release matrix, run in a subprocess under a private /dev/shm; each prints one ``RESULT``
line. Importable (``tests/test_releases.py`` runs them through ``python -c``).

Row contents are a function of the index alone, so the expected digest of every row is computed here
independently of MindSpore and ms_shm.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np

MiB = 1 << 20


def content(index: int, nbytes: int) -> np.ndarray:
    row = np.full(nbytes, index % 251, np.uint8)
    row[:8] = np.frombuffer(hashlib.sha256(str(index).encode()).digest()[:8], np.uint8)
    return row


def digest(*columns) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(c).tobytes() for c in columns)).hexdigest()


class Fixed:
    def __init__(self, n: int = 24, nbytes: int = 8 * MiB, python_work: int = 0):
        self.n, self.nbytes, self.python_work = n, nbytes, python_work

    def __len__(self):
        return self.n

    def size(self, index: int) -> int:
        return self.nbytes

    def __getitem__(self, index):
        index = int(index)
        spin = 0
        for k in range(self.python_work):  # pure-Python CPU work, GIL-bound
            spin += k * k
        return content(index, self.size(index)), np.array(index, np.int64)


class Ragged(Fixed):
    def size(self, index: int) -> int:
        return (1 + index % 4) * MiB


def grow(data):
    """A map that turns a small row into an 8 MiB one, deterministically."""
    index = int(data[8]) if data.size > 8 else 0
    return np.resize(data, 8 * MiB) ^ np.uint8(index % 7)


SOURCES = {
    "fixed8": lambda: Fixed(),
    "ragged": lambda: Ragged(n=24),
    "python_cpu": lambda: Fixed(n=16, nbytes=MiB, python_work=200_000),
    "map_grows": lambda: Fixed(n=16, nbytes=64 << 10),
}


# ~20 ms of GIL-bound work per row, 48 rows: worker processes pay off
BOUND_EPOCHS_SOURCE = functools.partial(Fixed, n=48, nbytes=MiB, python_work=400_000)


def expected(name: str, source: Fixed | None = None) -> list:
    source = SOURCES[name]() if source is None else source
    out = []
    for i in range(len(source)):
        data, label = content(i, source.size(i)), np.array(i, np.int64)
        out.append(digest(grow(data), label) if name == "map_grows" else digest(data, label))
    return out


def run_epochs(name: str, mode: str, epochs: int = 3) -> None:
    """``epochs`` epochs, each with a fresh iterator (what a training loop with an eval in between does)."""
    import mindspore.dataset as ds

    import ms_shm

    build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
    kwargs = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
    dataset = build(SOURCES[name](), ["data", "label"], **kwargs)
    if name == "map_grows":
        mapped = dict(input_columns=["data"], num_parallel_workers=2)  # ms_shm chooses the transport
        dataset = dataset.map(grow, **mapped) if mode == "raw" else ms_shm.map(dataset, grow, **mapped)
    seen = []
    for _ in range(epochs):
        it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
        seen.append([digest(*row) for row in it])
        it.stop()
        del it
    print("RESULT " + json.dumps({"epochs": seen}), flush=True)


def run_bound_epochs(epochs: int = 4) -> None:
    """``it = dataset.create_tuple_iterator()`` per epoch, the last one still bound as the next is made, workers
    given and the transport left to ms_shm: the plan and, per epoch, the worker processes alive after it."""
    import multiprocessing

    import ms_shm

    dataset = ms_shm.build_dataset(BOUND_EPOCHS_SOURCE(), ["data", "label"], shuffle=False, num_parallel_workers=2)
    seen, workers = [], []
    for _ in range(epochs):
        it = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
        seen.append([digest(*row) for row in it])
        workers.append(len(multiprocessing.active_children()))
    print("RESULT " + json.dumps({"epochs": seen, "mode": ms_shm.plan_of(dataset).mode, "workers": workers}),
          flush=True)


def run_precheck(workers: int, prefetch: int, row_mb: int) -> None:
    """Raw MindSpore's default GeneratorDataset at this prefetch: did the first epoch run, or what stopped it."""
    import mindspore.dataset as ds

    ds.config.set_prefetch_size(prefetch)
    dataset = ds.GeneratorDataset(Fixed(n=16, nbytes=row_mb * MiB), ["data", "label"], shuffle=False,
                                  num_parallel_workers=workers)
    try:
        rows = sum(1 for _ in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1))
        result = {"rows": rows, "error": None}
    except Exception as exc:
        result = {"rows": 0, "error": type(exc).__name__, "message": str(exc)[:2000]}
    print("RESULT " + json.dumps(result), flush=True)


def run_killed_worker(stuck: bool = False) -> None:
    """A worker process SIGKILLed mid-epoch (what the OOM killer does): the run must end, as raw MindSpore's
    watchdog ends it, not wait for that worker's rows forever. Prints ``RESULT`` only if the epoch finished.

    ``stuck``: as when MindSpore's SIGCHLD handler deadlocks in malloc (``ms_shm.sentinel``): the handler never
    runs (SIGCHLD back to its default) and the main thread waits in C holding the GIL. Prints ``NO_CXX_WATCHDOG``
    and returns on a release whose watchdog is not that handler (2.0's is a Python thread)."""
    import os
    import signal

    import ms_shm

    if stuck:
        import mindspore._c_dataengine as cde

        if not hasattr(cde, "register_worker_pids"):
            print("NO_CXX_WATCHDOG", flush=True)
            return
    dataset = ms_shm.build_dataset(Fixed(n=200, nbytes=MiB, python_work=100_000), ["data", "label"], shuffle=False,
                                   num_parallel_workers=2, python_multiprocessing=True)
    rows = 0
    for _ in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
        rows += 1
        if rows == 3:
            import multiprocessing
            import time

            time.sleep(1.0)  # killed while it runs, as the OOM killer finds it, not in its first instant
            workers = [p for p in multiprocessing.active_children() if type(p).__module__.startswith("mindspore")]
            if stuck:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            print(f"KILLING {workers[0].pid} of {len(workers)} workers", flush=True)
            os.kill(workers[0].pid, signal.SIGKILL)
            if stuck:
                import ctypes

                ctypes.PyDLL(None).sleep(120)  # libc's sleep, called holding the GIL
    print("RESULT " + json.dumps({"rows": rows}), flush=True)


def print_one_epoch(dataset) -> None:
    """One epoch's row digests, or the error that stopped it, as the ``RESULT`` line."""
    try:
        rows = [digest(*row) for row in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]
        result = {"rows": rows, "error": None}
    except Exception as exc:
        result = {"rows": [], "error": type(exc).__name__, "message": str(exc)[:2000]}
    print("RESULT " + json.dumps(result), flush=True)


def halve(data, label, info):
    """A per_batch_map whose output is a function of its input alone (the same in a worker as inline)."""
    return [d // 2 for d in data], label


def batch_pool_expected(n: int = 16, nbytes: int = 2 * MiB, size: int = 4) -> list:
    return [digest(np.stack([content(i, nbytes) // 2 for i in range(b, b + size)]),
                   np.arange(b, b + size, dtype=np.int64)) for b in range(0, n, size)]


def run_batch_pool(mode: str, n: int = 16, nbytes: int = 2 * MiB) -> None:
    """Unchanged code (``ms_shm.patch()`` for ``mode="patched"``) batching 4 rows of 2 MiB with a
    ``per_batch_map`` in 2 worker processes: the batch's slots hold ``batch_size`` rows each (2.0's pre-check asks
    for ``max_rowsize x batch_size`` per slot)."""
    import mindspore.dataset as ds

    if mode == "patched":
        import ms_shm

        ms_shm.patch()
    dataset = ds.GeneratorDataset(Fixed(n=n, nbytes=nbytes), ["data", "label"], shuffle=False)
    dataset = dataset.batch(4, per_batch_map=halve, input_columns=["data", "label"], num_parallel_workers=2,
                            python_multiprocessing=True)
    print_one_epoch(dataset)


def halve_one(data):
    return data // 2


def run_map_pool(mode: str, n: int = 16, nbytes: int = 256 << 10) -> None:
    """A map in 2 worker processes asked for explicitly, rows of 256 KiB, ``max_rowsize`` left to MindSpore (2.0:
    6 static slots of 16 MiB a worker in /dev/shm), through ``ms_shm.map`` for ``mode="ms_shm"``."""
    import mindspore.dataset as ds

    import ms_shm

    build = ds.GeneratorDataset if mode == "raw" else ms_shm.build_dataset
    dataset = build(Fixed(n=n, nbytes=nbytes), ["data", "label"], shuffle=False)
    kwargs = dict(input_columns=["data"], num_parallel_workers=2, python_multiprocessing=True)
    dataset = dataset.map(halve_one, **kwargs) if mode == "raw" else ms_shm.map(dataset, halve_one, **kwargs)
    print_one_epoch(dataset)


def map_pool_expected(n: int = 16, nbytes: int = 256 << 10) -> list:
    return [digest(content(i, nbytes) // 2, np.array(i, np.int64)) for i in range(n)]
