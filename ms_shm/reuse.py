"""Probe rows served once to the pipeline, so measuring a random-access source costs (almost) nothing.

``build_dataset`` must read a few rows before it can plan. Reading them again in the first epoch doubles
that work: for rows that take milliseconds to produce (a decoded image, a row of Python work) three probe
rows are 3% of a 100-row epoch read twice, more with fewer rows. Instead the first request for a probed
index gets the row the probe already holds, exactly as if ``source[i]`` had been called once, at build time.

Each probed index is served once in total, across threads and forked workers: a one-byte flag per row in an
anonymous shared mapping (created before the workers fork) marks it taken. A random augmentation therefore
still gives a fresh draw from the second epoch on. A spawned worker gets a pickled copy of the source: the
cache is dropped from the pickle, so nothing large is sent and nothing is served twice.

Rows are kept only when that saves time (``worth_keeping``: producing the row cost more than touching its
memory again would; held rows make the pipeline's own rows land on fresh pages) and cannot change what the
pipeline sees:

* every column is a numpy array (a dict column is re-normalised differently);
* no two probe rows share memory: a source that fills one reusable buffer per call would otherwise serve
  the last probe's contents under every probed index;
* the rows' total stays under ``limit`` bytes, so the parent does not hold large rows for the life of the
  dataset (in process mode only the workers ever take them).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 64 << 20
# Bytes per second at which a process fills memory it has not touched yet (page faults + first write), rounded
# down from the 8 MiB rows measured at ~5 GB/s. A row produced faster than this is mostly memory traffic.
TOUCH_BYTES_PER_SECOND = 2e9


def worth_keeping(seconds: float, nbytes: int) -> bool:
    """Keep a probe row only when producing it cost more than touching its memory again would.

    A kept row stays alive until served, so the pipeline's own rows need fresh pages meanwhile: for an 8 MiB
    ``np.full`` (0.2 ms in a warm epoch) keeping three probe rows cost ~5 ms, more than reading them again.
    A decoded image or a row of Python work (milliseconds for kilobytes) is worth keeping.
    """
    return seconds * TOUCH_BYTES_PER_SECOND >= nbytes


def _columns(row: Any) -> tuple | None:
    if type(row) is not tuple or not row:
        return None
    return row if all(type(c) is np.ndarray for c in row) else None


def reusable(rows: Sequence[Any], limit: int = DEFAULT_LIMIT) -> str | None:
    """Why these probe rows must not be served to the pipeline, or ``None`` when they may be."""
    arrays = []
    total = 0
    for row in rows:
        columns = _columns(row)
        if columns is None:
            return "a row is not a tuple of numpy arrays"
        total += sum(c.nbytes for c in columns)
        arrays.append(columns)
    if total > limit:
        return f"probe rows hold {total >> 20} MiB, over the {limit >> 20} MiB kept for reuse"
    for i, row in enumerate(arrays):
        for other in arrays[i + 1:]:
            if any(np.may_share_memory(a, b) for a in row for b in other if a.nbytes and b.nbytes):
                return "two probe rows share memory (the source reuses a buffer)"
    return None


class ProbeRowCache:
    """Rows already read by the probe, each handed out at most once (see the module docstring)."""

    def __init__(self, indices: Sequence[int], rows: Sequence[tuple]):
        self._slot = {int(i): n for n, i in enumerate(indices)}
        self._rows: list = list(rows)
        self._taken = mmap.mmap(-1, max(1, len(self._rows)))  # MAP_SHARED | MAP_ANONYMOUS: shared with forks
        self.served = 0

    def take(self, index: int) -> tuple | None:
        """The probe's row for ``index`` the first time anyone asks for it; ``None`` afterwards."""
        n = self._slot.get(index)
        if n is None or self._taken[n]:
            return None
        self._taken[n] = 1
        row, self._rows[n] = self._rows[n], None
        self.served += 1
        if self.served == len(self._rows):
            self._slot = {}
        return row

    def peek(self, index: int) -> tuple | None:
        """The row for ``index`` if nobody took it yet, without taking it (``ms_shm.map`` measures on it)."""
        n = self._slot.get(index)
        return None if n is None or self._taken[n] else self._rows[n]

    def __len__(self) -> int:
        return sum(1 for n in self._slot.values() if not self._taken[n])

    def __getstate__(self) -> dict:
        return {"_slot": {}, "_rows": [], "_taken": None, "served": 0}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._taken = mmap.mmap(-1, 1)

    def __deepcopy__(self, memo: dict) -> "ProbeRowCache":
        """MindSpore deep-copies sources in some paths: the copy serves nothing, so no row is served twice."""
        return ProbeRowCache((), ())


def cache_for(indices: Sequence[int], rows: Sequence[Any], limit: int = DEFAULT_LIMIT) -> ProbeRowCache | None:
    """A cache of the probe rows, or ``None`` (logged at DEBUG) when serving them could change the data."""
    if not rows:
        return None
    why = reusable(rows, limit)
    if why:
        log.debug("probe rows are read again by the pipeline: %s", why)
        return None
    return ProbeRowCache(indices, rows)


__all__ = ["ProbeRowCache", "cache_for", "reusable", "worth_keeping"]
