"""Whether a batch is the dataset's (or the ``collate_fn``'s) own objects or memory, as it arrives without workers.

Without workers the loop gets what the dataset and the collate return: a record dict the dataset keeps, a numpy
row or tensor over memory it keeps (``batch_size=None``, an identity collate), a buffer the collate fills again
for every batch. What the loop then changes in place changes the dataset, and the next epoch reads it; a batch
kept in a list is overwritten by the next. From a worker each batch is a copy. An audit: records whose
``seen`` count the loop raised, rows scaled in place, a collate filling one buffer (``torch.stack(..., out=)``):
raw's later epochs differed from the first, ms_shm's workers repeated it, and the dataset was left as it was.

Found by identity (a mutable container or object) and by address (a numpy array's or a tensor's bytes within
memory the holders keep), in the probe child, where the batch and the dataset are the child's alike. Tensors and
arrays are found by duck typing: torch is never imported here.
"""

from __future__ import annotations

import bisect
import collections
import datetime
import decimal
import enum
import fractions
import itertools
import pathlib
import types
import uuid
from typing import Any, Iterator

import numpy as np

from ms_shm.engines.torchstyle.storages import attributes

# Values no loop can change in place (an audit's collate handed on the dataset's own ``pathlib.Path``s: kept 0
# workers, where they arrive the same from one)
_VALUES = (pathlib.PurePath, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal, fractions.Fraction,
           uuid.UUID, enum.Enum, np.generic)
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range, type) + _VALUES
_SKIPPED = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType) + _VALUES
# The holders' objects looked at: a dataset of 300,000 record dicts took 30-50 ms at 10,000 (2 busy cores); the
# records a batch is read from are looked at by index besides (``_walk``'s ``at``).
HELD_WALK_LIMIT = 2_000
PER_CONTAINER = 256


class Held:
    """What the holders keep: the ids of their mutable objects, and the address ranges of their arrays' and
    tensors' memory."""

    def __init__(self) -> None:
        self.ids: set = set()
        self._ranges: list = []
        self._starts: list | None = None
        self._reach: list = []  # the furthest end among the ranges up to each, by start

    def add_range(self, span: tuple) -> None:
        self._ranges.append(span)
        self._starts = None

    def overlaps(self, span: tuple) -> bool:
        if self._starts is None:
            self._ranges.sort()
            self._starts = [start for start, _ in self._ranges]
            self._reach = list(itertools.accumulate((end for _, end in self._ranges), max))
        before = bisect.bisect_left(self._starts, span[1])  # the ranges that start before this one ends
        return before > 0 and self._reach[before - 1] > span[0]


def memory_span(value: Any) -> tuple | None:
    """``(first byte, past the last)`` of a tensor's storage or a numpy array's bytes, or ``None`` (a numpy
    scalar is a value: no loop changes it in place)."""
    if not _array_like(value) or isinstance(value, np.generic):
        return None
    storage = getattr(value, "untyped_storage", None)
    if callable(storage) and hasattr(value, "element_size"):
        s = storage()
        start, size = s.data_ptr(), s.nbytes()
        return (start, start + size) if start and size else None
    face = getattr(value, "__array_interface__", None)
    if not isinstance(face, dict) or not face.get("data"):
        return None
    start, shape = face["data"][0], face.get("shape", ())
    item = int(getattr(value, "itemsize", 1))
    if not start or any(n == 0 for n in shape):
        return None
    strides = face.get("strides") or _contiguous(shape, item)
    low = start + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = start + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + item
    return low, high


def _array_like(value: Any) -> bool:
    """A numpy or torch object (an array, a tensor, a dtype...): memory, not containers, to look at."""
    module = type(value).__module__
    return module == "numpy" or module.startswith("torch")


def _contiguous(shape: tuple, item: int) -> tuple:
    out, step = [], item
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _walk(root: Any, limit: int, at: tuple = ()) -> Iterator:
    """Every object reachable from ``root`` through containers and attributes (and a bound method's object), at
    most ``limit``, nearest first and ``PER_CONTAINER`` items of each container: one long list does not take the
    walk from the dataset's other attributes. Tensors and arrays are yielded, not looked into. Of a list, tuple
    or dict longer than that, the items at ``at`` too: the indices the batch was read at (``self.items[i]``; of
    a dict, the key ``i`` and the ``i``-th value)."""
    visited: set = set()
    queue, seen = collections.deque([root]), 0
    while queue and seen < limit:
        item = queue.popleft()
        if id(item) in visited or isinstance(item, _SKIPPED):
            continue
        visited.add(id(item))
        seen += 1
        yield item
        if _array_like(item):
            continue
        if isinstance(item, dict):
            queue.extend(itertools.islice(item.values(), PER_CONTAINER))
            if len(item) > PER_CONTAINER:  # records by index: an int key, or the i-th in the dict's order
                queue.extend(dict.get(item, i) for i in at if isinstance(i, int) and dict.__contains__(item, i))
                queue.extend(next(itertools.islice(item.values(), i, None)) for i in at
                             if isinstance(i, int) and 0 <= i < len(item))
        elif isinstance(item, (list, tuple, set, frozenset)):
            queue.extend(itertools.islice(item, PER_CONTAINER))
            if len(item) > PER_CONTAINER and isinstance(item, (list, tuple)):
                queue.extend(item[i] for i in at if isinstance(i, int) and -len(item) <= i < len(item))
        elif hasattr(item, "__self__") and hasattr(item, "__func__"):  # a bound method: its object
            queue.append(item.__self__)
        elif not callable(item) or hasattr(item, "__dict__") and not hasattr(item, "__code__"):
            queue.extend(attributes(item))


def held(*holders: Any, limit: int = HELD_WALK_LIMIT, at: tuple = ()) -> Held:
    """What ``holders`` (the dataset, the ``collate_fn``) keep, among ``limit`` objects each, and the items of
    their long lists at ``at`` (``_walk``)."""
    out = Held()
    for holder in holders:
        for item in _walk(holder, limit, at):
            span = memory_span(item)
            if span is not None and getattr(getattr(item, "flags", None), "writeable", True):
                out.add_range(span)  # a read-only array (an ``"r"`` memmap) is changed by no loop
            elif not isinstance(item, _IMMUTABLE) and not callable(item):
                out.ids.add(id(item))
    return out


def own_in(batch: Any, kept: Held, limit: int = HELD_WALK_LIMIT) -> str | None:
    """What of ``batch`` is the holders' own, named, or ``None``."""
    for item in _walk(batch, limit):
        span = memory_span(item)
        if span is not None and kept.overlaps(span):
            kind = "a tensor" if hasattr(item, "untyped_storage") else "a numpy array"
            return f"{kind} over memory the dataset or collate_fn keeps"
        if span is None and id(item) in kept.ids:
            return f"a {type(item).__name__} the dataset or collate_fn keeps"
    return None


__all__ = ["Held", "held", "own_in", "memory_span"]
