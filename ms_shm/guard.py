"""The source wrapper that runs inside every worker: checks each row against the plan before it reaches
shared memory.

Three jobs, each cheap per row (a few attribute reads and one ``nbytes`` sum):

* **Budget.** A worker's dynamic slots are created round-robin and only grow, so the worker can track its own
  slots exactly. A row that would push them past this worker's share of the budget becomes a clear
  ``RowTooLargeError`` naming the row, its size, the planned size and the fix, instead of a SIGBUS.
* **Errors with the row index.** An exception in the user's ``__getitem__`` is re-raised naming the index.
* **Columns MindSpore would mangle.** Python scalars and lists (rejected by MindSpore 2.10 under NumPy 2),
  big-endian and non-contiguous arrays (returned as float64) are turned into the native, contiguous array
  with the same values; each kind is logged once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ms_shm import model, rows
from ms_shm._results import Result, mib

log = logging.getLogger(__name__)


class RowTooLargeError(RuntimeError):
    """A row larger than the shared memory planned for it; raised in the worker, before the row is written."""


class SourceError(RuntimeError):
    """The user's source raised while producing a row; the message names the row index."""


@dataclass(frozen=True)
class GuardSpec(Result):
    """What one worker may use: ``slots`` dynamic slots within ``worker_bytes`` of /dev/shm."""

    slots: int
    worker_bytes: int
    planned_row_bytes: int
    fix: str


class GuardedSource:
    """Random-access source wrapper handed to ``GeneratorDataset`` in place of the user's source."""

    def __init__(self, source: Any, column_names: Sequence[str] | None, spec: GuardSpec | None = None):
        self.source = source
        self.column_names = list(column_names) if column_names is not None else None
        self.spec = spec
        self._slots: list = []
        self._next_slot = 0
        self._pid = os.getpid()
        self._logged: set = set()
        self.rows_checked = 0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: Any) -> tuple:
        try:
            row = self.source[index]
        except Exception as exc:
            raise SourceError(f"source[{index}] raised {type(exc).__name__}: {exc}") from exc
        row = self._normalise(row, index)
        if self.spec is not None:
            self._check(row, index)
        return row

    def _normalise(self, row: Any, index: Any) -> tuple:
        if isinstance(row, tuple) and all(type(c) is np.ndarray and c.dtype.isnative and c.flags.c_contiguous
                                          for c in row):
            if self.column_names is None or len(row) == len(self.column_names):
                return row  # the common case costs one pass of cheap checks
        out = []
        for i, column in enumerate(rows.convert_row(row, index, self.column_names)):
            original = row[i] if isinstance(row, (tuple, list)) else row
            if not column.dtype.isnative:
                self._once("byteorder", i, f"big-endian {column.dtype}", "native byte order")
                column = column.astype(column.dtype.newbyteorder("="))
            if not column.flags.c_contiguous:
                self._once("contiguous", i, "a non-contiguous array", "a contiguous copy")
                column = np.ascontiguousarray(column)
            if not isinstance(original, np.ndarray):
                self._once("scalar", i, type(original).__name__, f"np.asarray (dtype {column.dtype})")
            out.append(column)
        return tuple(out)

    def _once(self, kind: str, column: int, what: str, into: str) -> None:
        key = (kind, column)
        if key in self._logged:
            return
        self._logged.add(key)
        name = self.column_names[column] if self.column_names and column < len(self.column_names) else column
        log.info("column '%s' is %s; ms_shm passes it as %s with the same values (MindSpore 2.10 would "
                 "reject it or change its dtype)", name, what, into)

    def _check(self, row: tuple, index: Any) -> None:
        if os.getpid() != self._pid:  # a fresh worker: its slots start empty
            self._pid, self._slots, self._next_slot = os.getpid(), [], 0
        spec = self.spec
        size = model.pages(rows.row_bytes(row))
        self.rows_checked += 1
        if size == 0:
            return
        slot = self._next_slot % spec.slots
        grown = list(self._slots)
        if slot < len(grown):
            grown[slot] = max(grown[slot], size)
        else:
            grown.append(size)
        if sum(grown) > spec.worker_bytes:
            raise RowTooLargeError(
                f"row {index} is {mib(size)}, ms_shm planned rows of {mib(spec.planned_row_bytes)}: this worker's "
                f"{spec.slots} shared-memory slots would grow to {mib(sum(grown))}, over its "
                f"{mib(spec.worker_bytes)} share of /dev/shm, which would end in a bus error. "
                f"Fix: {spec.fix}")
        self._slots = grown
        self._next_slot += 1
