"""The ``collate_fn`` wrapper that runs in every DataLoader worker: a batch much larger than planned stops with a
clear error naming the batch and the fix, instead of a bus error or ``No space left on device`` mid-epoch.

It returns exactly what the collate function returns and lets its exceptions through; in the main process
(``num_workers=0``, or a pin-memory thread) it only calls through. A batch counts as too large when the batches
in flight at its size would fit neither the plan's ``/dev/shm`` budget nor what ``/dev/shm`` has free now (one
padded 12 MiB batch among 1 MiB ones ran raw under 64 MB: the budget alone stopped it).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from ms_shm import procfs
from ms_shm._results import mib
from ms_shm.errors import RowTooLargeError

log = logging.getLogger("ms_shm.guard")
SHM_DIR = "/dev/shm"  # where both frameworks' workers put a batch's shared-memory files


class GuardedCollate:
    """``collate(samples)``, checked in workers against ``limit_bytes`` for ``in_flight`` batches."""

    def __init__(self, collate: Callable, weigh: Callable[[Any], tuple], in_worker: Callable[[], Any],
                 planned_bytes: int, in_flight: int, limit_bytes: int, fix: str) -> None:
        self.collate, self.weigh, self.in_worker = collate, weigh, in_worker
        self.planned_bytes, self.in_flight, self.limit_bytes, self.fix = planned_bytes, in_flight, limit_bytes, fix
        self.batches, self.over_said = 0, False
        functools.update_wrapper(self, collate, updated=())

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        info = self.in_worker()
        if info is None:
            return batch
        self.batches += 1
        nbytes = self.weigh(batch)[0]
        if nbytes * self.in_flight > self.limit_bytes and not self._room_now(nbytes):
            raise RowTooLargeError(
                f"batch {self.batches} of DataLoader worker {getattr(info, 'id', '?')} is {mib(nbytes)} (planned "
                f"{mib(self.planned_bytes)}): {self.in_flight} batches of it in flight need "
                f"{mib(nbytes * self.in_flight)} of /dev/shm, over the {mib(self.limit_bytes)} this loader may use, "
                f"so it would die of a bus error or 'No space left on device'. Fix: {self.fix}")
        return batch

    def _room_now(self, nbytes: int) -> bool:
        """Over the budget, yet ``/dev/shm`` has room now for every batch in flight at this size: go on, and say
        so once per worker."""
        try:
            free = procfs.statvfs(SHM_DIR).free
        except OSError:
            return False
        if free < nbytes * self.in_flight:
            return False
        if not self.over_said:
            self.over_said = True
            log.warning("ms_shm guard: batch %s is %s (planned %s): %s batches of it in flight are over this "
                        "loader's %s of %s, which still has %s free; going on", self.batches, mib(nbytes),
                        mib(self.planned_bytes), self.in_flight, mib(self.limit_bytes), SHM_DIR, mib(free))
        return True

    def __repr__(self) -> str:
        return repr(self.collate)


__all__ = ["GuardedCollate"]
