"""How much /dev/shm, memory and how many fds one pipeline of this rank may use, and who holds what already.

/dev/shm is one filesystem per host (or per pod), shared by every rank on it; MindSpore sizes each rank as if
it were alone. We split the free space evenly between the local ranks, keep headroom (MindSpore's own static
check refuses at 80%), and subtract what pipelines alive in this process already reserved.

Memory is the second dimension: tmpfs pages are charged to the memory cgroup of the process that writes them,
so a pipeline that fits /dev/shm can still be OOM-killed under ``docker run --memory`` or a pod's
``resources.limits.memory``. The memory left (the cgroup's limit less its working set, or available RAM) is
split and held back the same way.
"""

from __future__ import annotations

import itertools
import threading

from ms_shm import sizes
from ms_shm._results import Result, mib, record

DEFAULT_FRACTION = sizes.HEADROOM


@record
class Budget(Result):
    """This pipeline's share. ``shm_bytes`` is ``None`` when /dev/shm could not be read."""

    shm_bytes: int | None
    fds: int | None  # None: no limit, or unknown
    ranks: int
    fraction: float
    reserved_shm: int
    reserved_fds: int
    reason: str
    memory_bytes: int | None = None  # None: no limit known (ms_shm then plans /dev/shm and fds only)
    reserved_memory: int = 0
    memory_reason: str = ""


def compute(shm_free: int | None, ranks: int, nofile_soft: int | None, open_fds: int | None,
            reserved_shm: int = 0, reserved_fds: int = 0, fraction: float = DEFAULT_FRACTION,
            ranks_source: str = "", memory_left: int | None = None, reserved_memory: int = 0,
            memory_source: str = "") -> Budget:
    """The per-pipeline budget from host numbers taken before any pipeline of this process started."""
    ranks = max(1, ranks)
    if shm_free is None:
        shm, why = None, "/dev/shm could not be read: no shared-memory transport will be planned"
    else:
        share = int(shm_free * fraction / ranks)
        shm = max(0, share - reserved_shm)
        why = (f"{mib(shm_free)} free in /dev/shm x {fraction:.0%} headroom / {ranks} local rank(s)"
               f"{' [' + ranks_source + ']' if ranks_source else ''} = {mib(share)}")
        if reserved_shm:
            why += f", minus {mib(reserved_shm)} reserved by live pipelines"
    fds = None
    if nofile_soft is not None:
        fds = max(0, nofile_soft - (open_fds or 0) - sizes.FD_MARGIN - reserved_fds)
    memory, memory_why = _memory_share(memory_left, ranks, fraction, reserved_memory, memory_source)
    return Budget(shm, fds, ranks, fraction, reserved_shm, reserved_fds, why, memory, reserved_memory, memory_why)


def _memory_share(left: int | None, ranks: int, fraction: float, reserved: int, source: str) -> tuple:
    """Every local rank of a container is charged to one cgroup, as they all write one /dev/shm."""
    if left is None:
        return None, "memory left unknown: planned on /dev/shm and fds only"
    share = int(max(0, left) * fraction / ranks)
    why = f"{mib(left)} of memory left{' (' + source + ')' if source else ''} x {fraction:.0%} / {ranks} rank(s)"
    if reserved:
        why += f", minus {mib(reserved)} reserved by live pipelines"
    return max(0, share - reserved), why


MEASURE_WORKERS_BELOW = 8 << 30  # memory left under which a forked worker's own pages are worth measuring


def memory_may_bind(b: Budget) -> bool:
    """Whether memory is short enough that each worker's own pages should be measured (the probe child reads
    its ``smaps_rollup``, ~20 ms with MindSpore loaded) rather than taken as a generous default."""
    return b.memory_bytes is not None and b.memory_bytes < MEASURE_WORKERS_BELOW


@record
class Reservation(Result):
    key: int
    label: str
    shm_bytes: int
    fds: int
    memory: int = 0


class Ledger:
    """Pipelines alive together (train and eval) share one budget: each holds its predicted peak.

    A reservation is released when the dataset it belongs to is garbage-collected (``weakref.finalize``), or
    explicitly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict = {}
        self._ids = itertools.count(1)

    def reserve(self, label: str, shm_bytes: int, fds: int, memory: int = 0) -> Reservation:
        with self._lock:
            item = Reservation(next(self._ids), label, int(shm_bytes), int(fds), int(memory))
            self._items[item.key] = item
            return item

    def release(self, key: int) -> None:
        with self._lock:
            self._items.pop(key, None)

    def totals(self) -> tuple[int, int, int]:
        """Reserved /dev/shm, fds and memory."""
        with self._lock:
            return (sum(r.shm_bytes for r in self._items.values()),
                    sum(r.fds for r in self._items.values()),
                    sum(r.memory for r in self._items.values()))

    def live(self) -> tuple:
        with self._lock:
            return tuple(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
