"""The source wrapper that runs inside every worker: checks each row against the plan before it reaches
shared memory.

Four jobs, each cheap per row (a few attribute reads and one ``nbytes`` sum; a ``statvfs`` only when a slot
grows):

* **Budget.** A worker's dynamic slots are created round-robin and only grow, so the worker can track its own
  slots exactly. A row that would push them past this worker's share of the budget becomes a clear
  ``RowTooLargeError`` naming the row, its size, the planned size and the fix, instead of a SIGBUS.
* **Free space.** When a row would create or enlarge a slot, the real free space of /dev/shm is read: another
  process may have filled it since the plan was made. Too little becomes a ``ShmFullError``, not a SIGBUS.
* **Errors with the row index.** An exception in the user's ``__getitem__`` is re-raised naming the index
  and where the original was raised. MindSpore re-raises a worker's exception in the main process inside
  ``RuntimeError("Exception thrown from user defined Python function in dataset ...")`` keeping only the last
  traceback, so everything the user needs must be in our message.
* **Columns MindSpore would mangle.** Python scalars and lists (rejected by MindSpore 2.10 under NumPy 2:
  ``np.array(x, copy=False)``) and big-endian arrays (rejected: "data type is unknown") are turned into the
  native array with the same values; each kind is logged once. Non-contiguous arrays are carried correctly
  by MindSpore 2.10 (measured) and are left alone, so no row is copied twice.
* **Python int indices.** MindSpore passes each index as a numpy ``int64`` taken from its sampler array.
  Under NumPy 2 that silently widens the source's own arithmetic (``float32_array + index`` is float64), and
  the probe, which passes Python ints, would see other dtypes than the workers. The source gets ``int``.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ms_shm import model, rows
from ms_shm._results import Result, mib

log = logging.getLogger(__name__)

_KINDS = frozenset(rows.CARRIED_KINDS)


class RowTooLargeError(RuntimeError):
    """A row larger than the shared memory planned for it; raised in the worker, before the row is written."""


class ShmFullError(RuntimeError):
    """/dev/shm has less free space than a new slot needs (something else filled it after planning)."""


class SourceError(RuntimeError):
    """The user's source raised while producing a row; the message names the row index."""


@dataclass(frozen=True)
class GuardSpec(Result):
    """What one worker may use: ``slots`` dynamic slots within ``worker_bytes`` of /dev/shm.

    Attributes:
        slots: Slots per worker (MindSpore's queue size + 2); the worker fills them round-robin.
        worker_bytes: This worker's share of the pipeline's /dev/shm budget.
        planned_row_bytes: The row size the plan was made for.
        fix: The alternatives to more /dev/shm (fewer workers, threads), as text.
        workers: Workers of the pipeline: they may all create slots at the same moment, so a free-space check
            keeps room for the other workers' next slot.
        shm_path: The mount whose free space is checked.
        shm_scale: /dev/shm bytes the host needs per byte this pipeline uses (local ranks / budget fraction),
            to print a size that would fit.
    """

    slots: int
    worker_bytes: int
    planned_row_bytes: int
    fix: str
    workers: int = 1
    shm_path: str = "/dev/shm"
    shm_scale: float = 1.0


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem at ``path``, as ``host.read_shm`` counts them (raises ``OSError``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _origin(exc: BaseException) -> str:
    """Where the user's code raised: MindSpore drops that traceback when it re-raises in the main process."""
    frames = traceback.extract_tb(exc.__traceback__)
    if len(frames) < 2:  # only our own frame: the source object itself raised (e.g. not subscriptable)
        return ""
    last = frames[-1]
    return f" at {last.filename}:{last.lineno} in {last.name}()"


class GuardedSource:
    """Random-access source wrapper handed to ``GeneratorDataset`` in place of the user's source.

    Args:
        source: The user's random-access source.
        column_names: As passed to ``GeneratorDataset``; used to check the column count and name columns.
        spec: The budget to enforce, or ``None`` when rows do not go through dynamic shared-memory slots
            (threads, one worker, pipes, a static ``max_rowsize``): then only errors and columns are handled.
        cache: Rows the probe already read, served once instead of calling the source again
            (``reuse.ProbeRowCache``).
    """

    def __init__(self, source: Any, column_names: Sequence[str] | None, spec: GuardSpec | None = None,
                 cache: Any = None):
        self.source = source
        self.cache = cache
        self.column_names = list(column_names) if column_names is not None else None
        self.spec = spec
        self._width = len(self.column_names) if self.column_names is not None else None
        self._slots: list = []
        self._total = 0
        self._next_slot = 0
        self._pid = os.getpid()
        self._logged: set = set()
        self._free_unknown = False
        self.rows_checked = 0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: Any) -> tuple:
        if type(index) is not int and isinstance(index, np.integer):
            index = int(index)
        row = self.cache.take(index) if self.cache is not None else None
        if row is None:
            try:
                row = self.source[index]
            except Exception as exc:
                raise SourceError(f"source[{index}] raised {type(exc).__name__}: {exc}{_origin(exc)}"
                                  f"{self._length_hint(exc)}") from exc
        row = self._normalise(row, index)
        if self.spec is not None:
            self._check(row, index)
        return row

    def _length_hint(self, exc: Exception) -> str:
        if not isinstance(exc, IndexError):
            return ""
        try:
            length = len(self.source)
        except Exception as len_exc:  # a broken __len__ is worth naming too
            return f". len(source) raises {type(len_exc).__name__} as well"
        return (f". MindSpore asks for indices 0..{length - 1} because __len__ returns {length}: if the data "
                f"has fewer rows, fix __len__")

    def _normalise(self, row: Any, index: Any) -> tuple:
        if type(row) is tuple and (self._width is None or len(row) == self._width):
            for c in row:
                if not (type(c) is np.ndarray and c.dtype.kind in _KINDS and c.dtype.isnative):
                    break
            else:
                return row  # the common case: one pass of cheap checks, no copy
        out = []
        converted = rows.convert_row(row, index, self.column_names)
        for i, column in enumerate(converted):
            if isinstance(column, dict):  # a whole-row dict: MindSpore's dict column, pickled
                out.append({k: v if v.dtype.isnative else v.astype(v.dtype.newbyteorder("="))
                            for k, v in column.items()})
                continue
            original = row[i] if isinstance(row, (tuple, list)) else row
            if not column.dtype.isnative:
                self._once("byteorder", i, f"big-endian {column.dtype}", "native byte order")
                column = column.astype(column.dtype.newbyteorder("="))
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
                 "reject it)", name, what, into)

    def _check(self, row: tuple, index: Any) -> None:
        """Mirror MindSpore's ``_SharedQueue.put``: a row with bytes takes slot ``seg_pos`` then advances it.

        Slots keep MindSpore's raw byte sizes (a slot is re-created when a row is larger by even one byte);
        the budget counts the pages each slot commits.

        Raises:
            RowTooLargeError: the grown slots would exceed this worker's share of the budget.
            ShmFullError: /dev/shm has less free space than the grown slot needs.
        """
        if os.getpid() != self._pid:  # a fresh worker (fork copies our state): its slots start empty
            self._pid, self._slots, self._total, self._next_slot = os.getpid(), [], 0, 0
        self.rows_checked += 1
        size = 0
        for column in row:
            if type(column) is np.ndarray:
                size += column.nbytes
        if size == 0:
            return  # MindSpore does not advance seg_pos for a row without bytes
        spec = self.spec
        slot = self._next_slot % spec.slots
        if slot < len(self._slots):
            old = self._slots[slot]
            if size <= old:
                self._next_slot += 1
                return  # fits the slot it lands in: no new shared memory, nothing to check
        else:
            old = 0
        committed = model.pages(size)
        total = self._total - model.pages(old) + committed
        if total > spec.worker_bytes:
            raise RowTooLargeError(
                f"row {index} is {mib(size)}, ms_shm planned rows of {mib(spec.planned_row_bytes)}: this "
                f"worker's {spec.slots} shared-memory slots would grow to {mib(total)}, over its "
                f"{mib(spec.worker_bytes)} share of /dev/shm, which would end in a bus error. "
                f"Fix: {self._fix(size)}")
        self._check_free(committed, index)
        if slot < len(self._slots):
            self._slots[slot] = size
        else:
            self._slots.append(size)
        self._total = total
        self._next_slot += 1

    def _check_free(self, size: int, index: Any) -> None:
        """The new slot is a new file in /dev/shm: it needs ``size`` free bytes now, not at planning time.

        The other workers may be creating a slot at the same instant (every worker does at the start of an
        epoch), so room for one planned row per other worker is kept as well. With the default 80% budget
        that margin always fits when nobody else took space: ``(W-1)*row < W*S*row/S <= 0.8*free/4``.
        """
        if self._free_unknown:
            return
        spec = self.spec
        try:
            free = _free_bytes(spec.shm_path)
        except OSError as exc:
            self._free_unknown = True
            log.warning("ms_shm guard: statvfs(%s) failed (%s: %s); rows are checked against the planned "
                        "budget only", spec.shm_path, type(exc).__name__, exc)
            return
        margin = (spec.workers - 1) * min(size, model.pages(spec.planned_row_bytes))
        if free >= size + margin:
            return
        room = f" plus {mib(margin)} for the other {spec.workers - 1} worker(s)' next slot" if margin else ""
        raise ShmFullError(
            f"row {index} needs a new {mib(size)} shared-memory slot{room}, but {spec.shm_path} has only "
            f"{mib(free)} free: something else filled it after ms_shm planned this pipeline, and writing the "
            f"row would end in a bus error. Fix: make room, this pipeline needs {mib(self._need(size))} of "
            f"{spec.shm_path} for its slots (find what else uses it: `df -h {spec.shm_path}`; `ms-shm clean` "
            f"removes what crashed runs left), or {spec.fix}")

    def _need(self, size: int) -> int:
        """/dev/shm this pipeline needs when every slot of every worker holds rows of ``size``."""
        spec = self.spec
        row = max(model.pages(size), model.pages(spec.planned_row_bytes))
        return spec.workers * spec.slots * row + model.semaphore_bytes(spec.workers)

    def _fix(self, size: int) -> str:
        """The fix for rows of ``size``: the /dev/shm that would hold them in every slot, or the alternatives."""
        spec = self.spec
        host_need = int(self._need(size) * spec.shm_scale)
        return (f"give /dev/shm at least {mib(host_need)} for rows of {mib(size)} "
                f"(docker run --shm-size={-(-host_need // model.MiB)}m, or a Kubernetes emptyDir with "
                f"medium: Memory and that sizeLimit), or {spec.fix}")


class GuardedIterable:
    """An iterable or generator-function source, read by MindSpore in the main process.

    No shared memory is involved, so there is no budget; rows get the same normalisation as in
    ``GuardedSource``, and an exception names the row's position in the epoch. Each ``iter()`` starts a new
    epoch of the wrapped source, which keeps MindSpore's per-epoch semantics (see ``rows.ReplaySource``).
    """

    def __init__(self, source: Any, column_names: Sequence[str] | None):
        self.source = source
        self._rows = GuardedSource(None, column_names)

    def __iter__(self):
        return self._iterate()

    def _iterate(self):
        # Lazy like rows.ReplaySource: MindSpore calls iter() once at construction and never reads it.
        iterator = iter(self.source)
        index = 0
        while True:
            try:
                row = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                raise SourceError(f"the source raised {type(exc).__name__}: {exc}{_origin(exc)} while producing "
                                  f"row {index} of this epoch") from exc
            yield self._rows._normalise(row, index)
            index += 1


class SizedGuardedIterable(GuardedIterable):
    """A ``GuardedIterable`` whose source has ``__len__``, so MindSpore still knows the dataset size."""

    def __len__(self) -> int:
        return len(self.source)


def guard_iterable(source: Any, column_names: Sequence[str] | None) -> GuardedIterable:
    """Wrap an iterable source, keeping ``__len__`` only when the source has one (MindSpore checks ``hasattr``)."""
    cls = SizedGuardedIterable if hasattr(source, "__len__") else GuardedIterable
    return cls(source, column_names)


__all__ = ["GuardedSource", "GuardedIterable", "guard_iterable", "GuardSpec", "RowTooLargeError", "ShmFullError", "SourceError"]
