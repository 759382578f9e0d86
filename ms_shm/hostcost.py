"""What moving a MiB costs on this host, measured once per process: a memory copy (what a shared-memory slot
costs: the worker copies the row in, the main process copies it out) and pickling through a pipe (what
MindSpore's pipes transport costs).

The planner's per-row costs (``engines.mindspore.planning.Costs``) were measured end to end on one reference
machine; their per-MiB parts scale with how fast this host copies and pipes compared with that machine. The
measurement takes ~10 ms of CPU, so ``tune()`` starts it on a background thread (``start()``) and a plan made
before it finished uses the reference figures (said in the plan's notes); a failure leaves the reference
figures in place, logged.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass

import numpy as np

from ms_shm._results import Result

log = logging.getLogger(__name__)

MiB = 1 << 20
COPY_BYTES, PIPE_BYTES = 4 * MiB, MiB
# The reference machine's figures, measured with ``measure()`` on it (2-core VM, the one Costs was fitted on).
REFERENCE_COPY_S_PER_MIB = 1.1e-4
REFERENCE_PIPE_S_PER_MIB = 1.0e-3
MATTERS_FROM_BYTES = MiB  # rows smaller than this: per-row costs are dominated by the constant part


@dataclass(frozen=True)
class TransferCosts(Result):
    """Seconds per MiB on this host, and how they compare with the reference machine (1.0: the same)."""

    copy_s_per_mib: float | None
    pipe_s_per_mib: float | None
    note: str = ""

    @property
    def copy_ratio(self) -> float:
        return self.copy_s_per_mib / REFERENCE_COPY_S_PER_MIB if self.copy_s_per_mib else 1.0

    @property
    def pipe_ratio(self) -> float:
        return self.pipe_s_per_mib / REFERENCE_PIPE_S_PER_MIB if self.pipe_s_per_mib else 1.0


def _best_of(runs: int, once) -> float:
    return min(once() for _ in range(runs))


def _copy_seconds(source: np.ndarray, target: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - start


def _pipe_seconds(array: np.ndarray) -> float:
    """Pickle the array, write it through a pipe, read and unpickle it on the other side (a thread)."""
    read_end, write_end = os.pipe()
    received: list = []

    def reader() -> None:
        chunks = []
        with os.fdopen(read_end, "rb") as r:
            while chunk := r.read(1 << 20):
                chunks.append(chunk)
        received.append(pickle.loads(b"".join(chunks)))

    thread = threading.Thread(target=reader, daemon=True)
    start = time.perf_counter()
    thread.start()
    with os.fdopen(write_end, "wb") as w:
        w.write(pickle.dumps(array, protocol=pickle.HIGHEST_PROTOCOL))
    thread.join()
    return time.perf_counter() - start


@functools.lru_cache(maxsize=1)
def measure() -> TransferCosts:
    """This host's copy and pipe costs per MiB (cached for the process). Never raises."""
    try:
        source = np.full(COPY_BYTES, 7, dtype=np.uint8)
        target = np.zeros_like(source)  # pages touched first: a fresh page's first fault is not a copy's cost
        copy = _best_of(3, lambda: _copy_seconds(source, target)) / (COPY_BYTES / MiB)
        pipe = _best_of(2, lambda: _pipe_seconds(source[:PIPE_BYTES])) / (PIPE_BYTES / MiB)
        return TransferCosts(copy, pipe)
    except Exception as exc:  # a probe must not stop a pipeline: the reference figures stand
        log.info("ms_shm: copy/pipe cost not measured (%s: %s); the reference machine's figures are used",
                 type(exc).__name__, exc)
        return TransferCosts(None, None, f"not measured: {type(exc).__name__}: {exc}")


_started = threading.Event()
_done = threading.Event()


def start() -> None:
    """Measure in a background thread, once per process (``tune()`` calls it)."""
    if _started.is_set():
        return
    _started.set()

    def run() -> None:
        measure()
        _done.set()

    threading.Thread(target=run, name="ms_shm-hostcost", daemon=True).start()


def for_rows(row_bytes: int) -> TransferCosts:
    """The host's figures where rows are large enough for them to matter and the measurement is in, else the
    reference machine's (with why, for the plan's notes). Never waits for the background measurement."""
    if row_bytes < MATTERS_FROM_BYTES:
        return TransferCosts(None, None, "rows too small for copy costs to matter")
    if not _done.is_set():
        return TransferCosts(None, None, "this host's copy cost is still being measured: reference figures")
    return measure()


__all__ = ["TransferCosts", "measure", "for_rows", "start"]
