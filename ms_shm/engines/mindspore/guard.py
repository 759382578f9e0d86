"""The source wrapper that runs inside every worker: checks each row against the plan before it reaches
shared memory, and otherwise changes nothing.

Used only where rows go through MindSpore's dynamic shared-memory slots (worker processes, shared memory on,
no static ``max_rowsize``): elsewhere the user's source is handed to MindSpore as it is. The wrapper returns
exactly what the source returns, receives exactly the index MindSpore passes, lets the source's exceptions
through unchanged, and forwards attribute reads to the source, so ``dataset[i]`` and ``dataset.source.x``
behave as without ms_shm. Per row it costs a few attribute reads and one ``nbytes`` sum (a ``statvfs`` only
when a slot grows):

* **Budget.** A worker's dynamic slots are created round-robin and only grow, so the worker can track its own
  slots exactly. A row that would push them past this worker's share of the budget becomes a clear
  ``RowTooLargeError`` naming the row, its size, the planned size and the fix, instead of a SIGBUS.
* **Free space.** When a row would create or enlarge a slot, the real free space of /dev/shm is read: another
  process may have filled it since the plan was made. Too little becomes a ``ShmFullError``, not a SIGBUS.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import Any

import numpy as np

from ms_shm import budget as budget_mod
from ms_shm import host, objects, procfs, sizes
from ms_shm._results import Result, free_text, mib, record
from ms_shm.budget import Budget
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import liveness, settings
from ms_shm.errors import RowTooLargeError, ShmFullError, SourceError

log = logging.getLogger(__name__)
_IMPORTED_BY = os.getpid()  # a worker forked from this process holds its MindSpore settings as they were then


@record
class GuardSpec(Result):
    """What one worker may use: ``slots`` dynamic slots within ``worker_bytes`` of /dev/shm.

    Attributes:
        slots: Slots per worker (MindSpore's queue size + 2) at the planned prefetch; the worker fills them
            round-robin, as many as the prefetch it was started with gives.
        worker_bytes: This worker's share of the pipeline's /dev/shm budget.
        planned_row_bytes: The row size the plan was made for.
        fix: The alternatives to more /dev/shm (fewer workers, threads), as text.
        workers: Workers of the pipeline: they may all create slots at the same moment, so a free-space check
            keeps room for the other workers' next slot.
        shm_path: The mount whose free space is checked.
        budget: the plan's budget, to print the host ``/dev/shm`` size that would fit (``budget.shm_to_give``:
            local ranks, the headroom and what other live pipelines reserved); ``None``: the bytes themselves.
        ranks: Local ranks planned for: each may grow alike, and a full /dev/shm may be one planned as alone.
        home_pid: The program's own process: rows read there (``dataset[i]``, MindSpore's own thread) use no
            slot and are not counted; ``None``: every process counts its reads.
    """

    slots: int
    worker_bytes: int
    planned_row_bytes: int
    fix: str
    workers: int = 1
    shm_path: str = "/dev/shm"
    budget: Budget | None = None
    ranks: int = 1
    home_pid: int | None = None


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem at ``path``, as ``host.read_shm`` counts them (raises ``OSError``)."""
    return procfs.statvfs(path).free


class GuardedSource(objects.Transparent):
    """Random-access source wrapper handed to ``GeneratorDataset`` in place of the user's source, only when
    rows go through dynamic shared-memory slots. Its attributes are the source's (``objects.Transparent``); the
    accounting lives in a ``SlotGuard`` beside it.

    Args:
        source: The user's random-access source.
        spec: The budget each worker enforces.
    """

    def __init__(self, source: Any, spec: GuardSpec):
        self._ms_shm_wrapped = source
        self._ms_shm_guard = SlotGuard(spec)

    def __len__(self) -> int:
        return len(self._ms_shm_wrapped)

    def __getitem__(self, index: Any) -> Any:
        row = self._ms_shm_wrapped[index]
        self._ms_shm_guard.check(row_nbytes(row), index)
        return row


class CarriedErrors(objects.Transparent):
    """Random-access source wrapper for a source ms_shm moved into worker processes where raw MindSpore reads it in
    its own process: what the source raises reaches the program as it would there. A worker's exception comes back
    as its class and its text, and MindSpore makes the class again from the text alone
    (``ExceptionHandler.reraise``): ``CorruptImageError(path, code)`` came out as "TypeError: __init__() missing 1
    required positional argument" where raw said "corrupt image img_57.jpg (code 3)" (an audit). Such an exception
    goes as ``SourceError`` naming it; one MindSpore can make again goes unchanged. Rows pass untouched."""

    def __init__(self, source: Any):
        self._ms_shm_wrapped = source

    def __len__(self) -> int:
        return len(self._ms_shm_wrapped)

    def __getitem__(self, index: Any) -> Any:
        try:
            return self._ms_shm_wrapped[index]
        except Exception as exc:
            if made_from_text(type(exc)):
                raise
            raise SourceError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}") from exc


def made_from_text(kind: type) -> bool:
    """Whether MindSpore can make ``kind`` again from one message, as its ``reraise`` does (``kind(message)``, or
    ``kind(message=...)`` for a class with a ``message`` attribute)."""
    try:
        kind(message="") if hasattr(kind, "message") else kind("")
    except Exception:
        return False
    return True


class SlotGuard:
    """One worker's account of its dynamic shared-memory slots, checked row by row (``check``)."""

    def __init__(self, spec: GuardSpec):
        self.spec = spec
        self._slots: list = []
        self._total = 0
        self._next_slot = 0
        self._pid = os.getpid()
        self._free_unknown = False
        self._over_share_said = False
        self._on, self._slot_count = True, spec.slots
        self.rows_checked = 0

    def __getstate__(self) -> dict:
        """Pickled as MindSpore starts a spawned (or forkserver) worker, whose own MindSpore holds its defaults:
        the settings it starts the worker with go along."""
        return dict(self.__dict__, _launched=settings.slot_settings())

    def _start_worker(self) -> None:
        """A fresh worker (fork copies our state) starts with no slots, as many as its queue has at the prefetch
        MindSpore started it with, and none where it sends rows through pipes: MindSpore reads both settings as
        it starts its workers, and a program may change them after the dataset was built (an audit: shared
        memory turned off after ``build_dataset``, or the prefetch lowered to 2, stopped a rare 34 MiB row that
        raw ran, the error counting 18 slots where the worker had 4). Unreadable: the plan's."""
        self._pid, self._slots, self._total, self._next_slot = os.getpid(), [], 0, 0
        forked = _IMPORTED_BY == self.spec.home_pid
        launched = settings.slot_settings() if forked else getattr(self, "_launched", None)
        if launched is not None:
            shared, prefetch = launched
            self._on, self._slot_count = shared is not False, model.slots(prefetch, self.spec.workers)

    def check(self, size: int, index: Any) -> None:
        """Mirror MindSpore's ``_SharedQueue.put``: a row with bytes takes slot ``seg_pos`` then advances it.

        Slots keep MindSpore's raw byte sizes (a slot is re-created when a row is larger by even one byte);
        the budget counts the pages each slot commits.

        Raises:
            RowTooLargeError: the grown slots would exceed this worker's share of the budget, and /dev/shm
                has no room for every worker to grow alike.
            ShmFullError: /dev/shm has less free space than the grown slot needs.
        """
        if os.getpid() == self.spec.home_pid:  # read in the program's own process: no slot
            return
        if os.getpid() != self._pid:
            self._start_worker()
        self.rows_checked += 1
        if size == 0 or not self._on:
            return  # MindSpore does not advance seg_pos for a row without bytes; pipes use no slot
        spec = self.spec
        slot = self._next_slot % self._slot_count
        if slot < len(self._slots):
            old = self._slots[slot]
            if size <= old:
                self._next_slot += 1
                return  # fits the slot it lands in: no new shared memory, nothing to check
        else:
            old = 0
        committed = model.pages(size)
        total = self._total - model.pages(old) + committed
        if total > spec.worker_bytes and not self._room_beyond_share(committed, total, index):
            raise RowTooLargeError(
                f"row {index} is {mib(size)}, ms_shm planned rows of {mib(spec.planned_row_bytes)}: this "
                f"worker's {self._slot_count} shared-memory slots would grow to {mib(total)}, over its "
                f"{mib(spec.worker_bytes)} share of /dev/shm, which would end in a bus error. "
                f"Fix: {self._fix(size)}")
        self._check_free(committed, index)
        _LAST[0] = (self, index, committed)
        if slot < len(self._slots):
            self._slots[slot] = size
        else:
            self._slots.append(size)
        self._total = total
        self._next_slot += 1

    def _room_beyond_share(self, committed: int, total: int, index: Any) -> bool:
        """Slots over the plan that still fit /dev/shm as it is now, with room kept for every other worker of
        every local rank: as much again as this slot (they may grow alike at the same instant; one rank going
        on alone took the room the other three then lacked), or, where less, the slots they have yet to make at
        the planned row size, which is all they add unless they too meet a row larger than their whole plan
        (one 34 MiB row among 1 MiB ones, 2 workers of 4 slots, ran raw in 64 MB and was stopped here). Rows
        are dealt round-robin, so the others have made about as many slots as this worker: those are in use
        in /dev/shm already (a 20 MiB row 60 of 80, 18 slots each made, was stopped counting them twice, where
        the same row at index 3 went on). Rare large rows the probe did not read (8 full-size images among
        96x96 ones) ran under raw MindSpore at 128 MB and stopped here before the share could be passed. Said
        once per worker."""
        spec = self.spec
        try:
            free = _free_bytes(spec.shm_path)
        except OSError:  # unreadable: the share is all there is to go by
            return False
        to_make = max(0, self._slot_count - len(self._slots))
        each = min(committed, to_make * model.pages(spec.planned_row_bytes))
        if free < committed + (spec.ranks * spec.workers - 1) * each:
            return False
        if not self._over_share_said:
            self._over_share_said = True
            largest = max([*self._slots, committed])
            log.warning("ms_shm guard: at row %s this worker's slots grow to %s (rows up to %s; planned %s), over "
                        "its %s share of %s, which still has %s free; going on (the pipeline now needs more "
                        "/dev/shm than planned)", index, mib(total), mib(largest), mib(spec.planned_row_bytes),
                        mib(spec.worker_bytes), spec.shm_path, mib(free))
        return True

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
        raise self.no_room(size, index, free, margin=margin)

    def no_room(self, size: int, index: Any, free: int | None, margin: int = 0,
                when_written: bool = False) -> ShmFullError:
        """``ShmFullError`` for row ``index``'s new slot of ``size``: found too little free at the check, or
        (``when_written``) its pages not there when MindSpore created the slot."""
        spec = self.spec
        room = f" plus {mib(margin)} for the other {spec.workers - 1} worker(s)' next slot" if margin else ""
        # a worker's guard does not see the others' slots: one that went over its share (``_room_beyond_share``)
        # may be what took the room
        sibling = ("another worker of this pipeline grew its slots past its share for rows larger than the probe "
                   "saw, or " if spec.workers > 1 else "")
        sibling = _earlier_iterators(self) + sibling
        have = f"has only {free_text(free, size + margin)} free" if not when_written else (
            f"had no room for it when the worker created it ({'?' if free is None else mib(free)} free when read "
            f"after that)")
        hint, ranks_fix = host.sharing_hint(spec.ranks, spec.shm_path)
        return ShmFullError(
            f"row {index} needs a new {mib(size)} shared-memory slot{room}, but {spec.shm_path} {have}: {sibling}"
            f"something else filled it after ms_shm planned this pipeline, and writing the row would end in a bus "
            f"error ({hint}). Fix: {ranks_fix}make room, this pipeline needs "
            f"{mib(self._need(size))} of {spec.shm_path} for its slots (find what else uses it: `df -h "
            f"{spec.shm_path}`; `ms-shm clean` removes what crashed runs left), or {spec.fix}")

    def _need(self, size: int) -> int:
        """/dev/shm this pipeline needs when every slot of every worker holds rows of ``size``."""
        spec = self.spec
        row = max(model.pages(size), model.pages(spec.planned_row_bytes))
        return spec.workers * self._slot_count * row + model.semaphore_bytes(spec.workers)

    def _fix(self, size: int) -> str:
        """The fix for rows of ``size``: the /dev/shm that would hold them in every slot, or the alternatives."""
        spec = self.spec
        need = self._need(size)
        host_need = budget_mod.shm_to_give(spec.budget, need) if spec.budget is not None else need
        return (f"give /dev/shm at least {mib(host_need)} for rows of {mib(size)} ({sizes.where_to_set(host_need)}), "
                f"or {spec.fix}")


def _earlier_iterators(guard: "SlotGuard") -> str:
    """Where an earlier iterator of this pipeline is alive beside the one these workers serve, what it holds and
    the fix (an audit kept ``it`` after its last epoch and made a dict iterator: "something else filled it")."""
    earlier = liveness.iterators_reading(guard) - 1
    if earlier <= 0:
        return ""
    return (f"{earlier} earlier iterator(s) of this pipeline are still alive, and their workers keep their slots "
            f"until they are gone, stopped or not (`del it` before making another, or read every epoch through one "
            f"iterator: create_tuple_iterator(num_epochs=N)), or ")


_LAST: list = [None]  # this worker's guard and the row it last let create a slot: (SlotGuard, index, pages)


def slot_not_committed(size: int) -> ShmFullError:
    """The error for a slot of ``size`` whose pages ``/dev/shm`` no longer had when MindSpore created it
    (``compat._commit_new_slots``), named as the guard that let it through would have named it."""
    try:
        free = _free_bytes("/dev/shm")
    except OSError:
        free = None
    last = _LAST[0]
    if last is not None and last[2] == model.pages(size):
        return last[0].no_room(size, last[1], free, when_written=True)
    have = "its free space unreadable" if free is None else f"{mib(free)} free"
    hint, ranks_fix = host.sharing_hint(_planned_ranks())
    return ShmFullError(
        f"a row of {mib(size)} needs a new shared-memory slot, and /dev/shm had no room for it when the worker "
        f"created it ({have} when read after that): something else filled it ({hint}), and "
        f"writing the row would have ended in a bus error. Fix: {ranks_fix}make room (find what uses it: `df -h /dev/shm`; "
        f"`ms-shm clean` removes what crashed runs left), or give /dev/shm more")


def _planned_ranks() -> int:
    """The local ranks this process planned for (its fork of the session), 1 where it never read them."""
    from ms_shm.state import SESSION

    facts = SESSION.facts
    return facts.ranks.local_size if facts is not None else 1


def row_nbytes(row: Any) -> int:
    """Bytes a row takes in a dynamic slot, as MindSpore's ``_SharedQueue.put`` counts them after
    ``_convert_row``: every array column (a Python scalar becomes an 8-byte array, a dict is pickled)."""
    if type(row) is np.ndarray:
        return row.nbytes
    if type(row) not in (tuple, list) and not _iterated_whole(row):
        return _column_nbytes(row)
    total = 0
    for column in row:
        total += column.nbytes if type(column) is np.ndarray else _column_nbytes(column)
    return total


def _iterated_whole(row: Any) -> bool:
    """A container MindSpore iterates for its columns (a deque) that can be read again; a one-shot iterator is
    left to MindSpore, read once."""
    return isinstance(row, Collection) and not isinstance(row, (str, bytes, dict, np.generic)) and \
        not hasattr(row, "asnumpy")


def _column_nbytes(column: Any) -> int:
    if isinstance(column, dict):
        return 0
    nbytes = getattr(column, "nbytes", None)  # numpy scalars, MindSpore Tensors
    if isinstance(nbytes, int):
        return nbytes
    return 8 if isinstance(column, (int, float, bool)) else 0


__all__ = ["CarriedErrors", "GuardedSource", "made_from_text", "GuardSpec", "RowTooLargeError", "ShmFullError", "row_nbytes"]
