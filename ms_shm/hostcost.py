"""What moving a MiB costs on this host, measured once per process: a memory copy (what a shared-memory slot
costs: the worker copies the row in, the main process copies it out) and a pickle round trip (what MindSpore's
pipes transport adds to the copies).

The planner's per-row costs (``engines.mindspore.planning.Costs``) were measured end to end on one reference
machine; their per-MiB parts scale with how fast this host copies and pipes compared with that machine. The
measurement takes ~9 ms, so it is made (once per process) only where it can change a plan: rows of a MiB or
more in an epoch of half a second or more; a failure leaves the reference figures in place, logged.
"""

from __future__ import annotations

import functools
import logging
import pickle
import time

import numpy as np

from ms_shm._results import Result, record

log = logging.getLogger(__name__)

MiB = 1 << 20
COPY_BYTES = MiB  # enough for a per-MiB figure: copies and pickles scale linearly from here
# The reference machine's figures: the median of ``measure()`` over runs on it (the 2-core VM Costs was fitted on).
REFERENCE_COPY_S_PER_MIB = 7.0e-5
REFERENCE_PIPE_S_PER_MIB = 1.35e-3
MATTERS_FROM_BYTES = MiB  # rows smaller than this: per-row costs are dominated by the constant part


@record
class TransferCosts(Result):
    """Seconds per MiB on this host, and how they compare with the reference machine (1.0: the same)."""

    copy_s_per_mib: float | None
    pipe_s_per_mib: float | None
    note: str = ""

    @property
    def copy_ratio(self) -> float:
        return _ratio(self.copy_s_per_mib, REFERENCE_COPY_S_PER_MIB)

    @property
    def pipe_ratio(self) -> float:
        return _ratio(self.pipe_s_per_mib, REFERENCE_PIPE_S_PER_MIB)


NOISE = 1.5  # repeated measurements on one idle machine spread this much: closer than that is the same host


def _ratio(measured: float | None, reference: float) -> float:
    if not measured:
        return 1.0
    ratio = measured / reference
    return 1.0 if 1 / NOISE < ratio < NOISE else ratio


def _best_of(runs: int, once) -> float:
    return min(once() for _ in range(runs))


def _copy_seconds(source: np.ndarray, target: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - start


def _pickle_seconds(array: np.ndarray) -> float:
    """A pickle round trip of the array: what MindSpore's pipe transport pays per row beside the kernel's
    copies (timing a real pipe adds a thread hand-off whose scheduling noise is larger than the copy)."""
    start = time.perf_counter()
    pickle.loads(pickle.dumps(array, protocol=pickle.HIGHEST_PROTOCOL))
    return time.perf_counter() - start


@functools.lru_cache(maxsize=1)
def measure() -> TransferCosts:
    """This host's copy and pipe costs per MiB (cached for the process). Never raises."""
    try:
        source = np.full(COPY_BYTES, 7, dtype=np.uint8)
        target = np.zeros_like(source)  # pages touched first: a fresh page's first fault is not a copy's cost
        copy = _best_of(3, lambda: _copy_seconds(source, target)) / (COPY_BYTES / MiB)
        pipe = _best_of(3, lambda: _pickle_seconds(source)) / (COPY_BYTES / MiB)
        return TransferCosts(copy, pipe)
    except Exception as exc:  # a probe must not stop a pipeline: the reference figures stand
        log.info("ms_shm: copy/pipe cost not measured (%s: %s); the reference machine's figures are used",
                 type(exc).__name__, exc)
        return TransferCosts(None, None, f"not measured: {type(exc).__name__}: {exc}")


MATTERS_FROM_SECONDS = 0.5  # epochs shorter than this: ~9 ms of measuring would cost more than it could save


def for_rows(row_bytes: int, epoch_seconds: float | None) -> TransferCosts:
    """This host's figures where they can change a plan (rows of a MiB or more, an epoch of half a second or
    more, read serially), measured then (once per process); else the reference machine's, with why."""
    if row_bytes < MATTERS_FROM_BYTES:
        return TransferCosts(None, None, "rows too small for copy costs to matter")
    if epoch_seconds is None or epoch_seconds < MATTERS_FROM_SECONDS:
        return TransferCosts(None, None, "epoch too short for measuring copy costs to pay off")
    return measure()


__all__ = ["TransferCosts", "measure", "for_rows"]
