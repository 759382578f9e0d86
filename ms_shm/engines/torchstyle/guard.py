"""The ``collate_fn`` wrapper that runs in every DataLoader worker: a batch that cannot fit stops with a clear error
naming the batch, what was checked and the fix, instead of a bus error, or ``No space left on device`` mid-epoch.

It returns exactly what the collate function returns and lets its exceptions through; in the main process
(``num_workers=0``, or a pin-memory thread) it only calls through. Two checks, in the worker, before the batch is
returned (and so before the framework writes it to ``/dev/shm``):

* **Budget.** A batch counts as too large when it, with the other batches in flight at their planned size
  (``need``), would fit neither the plan's ``/dev/shm`` budget nor what ``/dev/shm`` has free now, kept for every
  local rank alike: ``RowTooLargeError``. A rare big batch is one among planned ones: pricing every batch in
  flight at its size refused one 16 MiB sample among 1 MiB ones (a 19 MiB batch "needing" 5 x 19 = 95 MiB)
  under 64 MB, where raw torch ran both epochs bit-exact (the audit's ``ragged.py``). What of ``need`` is in
  ``/dev/shm`` already is not wanted free again: this batch where torch's collate wrote it, and the other batches
  in flight up to what ``/dev/shm`` gained since the plan (``_ours``; a batch sampler's 24 MiB batch beside a
  16 MiB one was refused under 64 MB, where raw torch ran it). A batch with the others at their planned size
  that all of that cannot hold still stops, and a write that finds no room is the guard's error (``_writing``).
  Torch's batches weigh their new storages only (``storages``): a dataset's tensor sent by an earlier batch
  costs no other, and samples that are views weigh the views' bytes before the collate, not the tensor viewed.
* **Free space.** Every batch the worker has yet to write to shared memory (a collate that keeps the samples'
  tensors, as ``list`` does; torch's default collate writes its batch there itself) must fit what ``/dev/shm``
  has free now: other processes or ranks, each sizing itself as if alone, may have filled it since the plan.
  torch's worker then fails in its queue's feeder thread ("unable to allocate shared memory ... No space left on
  device"), the batch never arrives and the loader waits forever (4 ranks without launcher variables under
  64 MB, measured); here it is a ``ShmFullError`` the loop receives. The check costs one ``statvfs`` (1.5 µs)
  and a walk of the batch's tensors (~3 µs) per batch. Torch's batches are then written to shared memory here
  (``share``: the copy its queue would make when sending them), so room taken between the check and the send
  fails in the worker's loop as well, and reaches the program.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from ms_shm import host, procfs, sizes
from ms_shm._results import free_text, mib
from ms_shm.engines.torchstyle import storages
from ms_shm.errors import RowTooLargeError, ShmFullError

log = logging.getLogger("ms_shm.guard")
SHM_DIR = "/dev/shm"  # where both frameworks' workers put a batch's shared-memory files
HARM = ("writing it would fail in the worker (torch: 'No space left on device', and the DataLoader would wait for "
        "it forever; MindSpore's DataLoader: a bus error)")


class GuardedCollate:
    """``collate(samples)``, checked in workers against ``limit_bytes`` for ``in_flight`` batches and against
    ``/dev/shm``'s free space.

    Args:
        collate: the caller's ``collate_fn`` (or the framework's default).
        weigh: a batch's ``(bytes, storages)`` (the engine's ``compat.weigh``).
        in_worker: the framework's ``get_worker_info``: ``None`` in the main process.
        planned_bytes: the batch size the plan was made for.
        in_flight: batches that may be in ``/dev/shm`` at once.
        limit_bytes: this loader's share of ``/dev/shm``.
        fix: what the loader's arguments allow instead of more ``/dev/shm`` (``guard_fix``), or ``""``.
        unshared: bytes of a batch still to be written to shared memory (``None``: all of its bytes).
        ranks: local ranks planned for (they may all grow alike; a full ``/dev/shm`` may be one planned as alone).
        to_give: the host ``/dev/shm`` size at which this loader's bytes fit (``budget.shm_to_give``: local
            ranks, the headroom and what other live pipelines reserved), to print a size that would fit.
        share: moves a batch's storages into shared memory (``None``: the framework does it when it sends).
        baseline_used: bytes of ``/dev/shm`` in use when the loader was planned (``used_now``; ``None``:
            unknown). What it gained since is at most partly this loader's own batches in flight (``_ours``).
        pipe: ``pipe(collate, samples)``, the batch made to travel through the worker's pipe (``plan.PIPES``:
            the engine's ``compat.piped``), or ``None``: through ``/dev/shm``, checked as above.

    ``others`` (set by ``loaders.register``) says which other DataLoaders of this process were alive when the
    worker started: a text for ``ShmFullError``, or ``""``.
    """

    def __init__(self, collate: Callable, weigh: Callable[[Any], tuple], in_worker: Callable[[], Any],
                 planned_bytes: int, in_flight: int, limit_bytes: int, fix: str,
                 unshared: Callable[[Any], int] | None = None, ranks: int = 1,
                 to_give: Callable[[int], int] = int,
                 share: Callable[[Any], None] | None = None, baseline_used: int | None = None,
                 pipe: Callable[[Callable, Any], Any] | None = None) -> None:
        self.collate, self.weigh, self.in_worker = collate, weigh, in_worker
        self.planned_bytes, self.in_flight, self.limit_bytes, self.fix = planned_bytes, in_flight, limit_bytes, fix
        self.unshared, self.ranks, self.to_give, self.share = unshared, max(1, ranks), to_give, share
        self.baseline_used, self.pipe = baseline_used, pipe
        self.batches, self.over_said = 0, False
        self.others: Callable[[], str] | None = None
        functools.update_wrapper(self, collate, updated=())

    def __call__(self, samples: Any) -> Any:
        info = self.in_worker()
        if info is None:
            return self.collate(samples)
        self.batches += 1
        if self.pipe is not None:  # no /dev/shm to check
            return self.pipe(self.collate, samples)
        seen = storages.samples_view(samples)
        weight = self._before(samples, info, seen)
        batch = self._writing(lambda: self.collate(samples), weight, weight, info)
        nbytes, written = self._weigh(batch, seen)
        over = self.need(nbytes) > self.limit_bytes
        pending = nbytes if self.unshared is None else self.unshared(batch)
        if not over and not pending:
            return batch
        space = _space()
        if over:
            self._check_budget(nbytes, written, space, info)
        if space is not None and pending > space.free:  # as in ``_writing``: over its plan, the batch is the cause
            if nbytes > self.planned_bytes:  # (an audit's three 24 MiB samples among 2 MiB ones, 2 workers, 64 MB:
                raise RowTooLargeError(self._over(nbytes, space.free, info))  # "something else filled it")
            raise ShmFullError(self._full(nbytes, pending, space, info))
        if pending and self.share is not None:
            self._share(batch, nbytes, pending, info)
        return batch

    def _before(self, samples: Any, info: Any, seen: tuple | None) -> int:
        """The samples' bytes; those heavier than the planned batch are checked before the collate: torch's
        default collate writes its batch to ``/dev/shm`` itself, so a growth that fills it failed there with
        torch's own "unable to allocate shared memory" (1 MiB samples growing to 24 MiB, 2 workers, 256 MB,
        measured), before any check after it. Where ``/dev/shm`` has not even this batch free now:
        ``RowTooLargeError``. Torch's samples weigh what a collate writes at least (``storages.samples_view``):
        a ``TensorDataset``'s are views of one tensor, whose whole storage read 96 MiB for a 1 MiB batch."""
        nbytes = seen[0] if seen is not None else self.weigh(samples)[0]
        if nbytes <= self.planned_bytes:
            return nbytes
        space = _space()
        if space is not None and space.free < nbytes:
            raise RowTooLargeError(self._over(nbytes, space.free, info))
        return nbytes

    def _weigh(self, batch: Any, seen: tuple | None) -> tuple:
        """``(bytes, of them written already)``: the batch's new bytes in ``/dev/shm`` (storages its samples had
        shared before, a dataset's tensor sent by an earlier batch, cost it nothing), and those the collate has
        written there (torch's default collate, in a worker). Without torch's storages: ``weigh``'s, none."""
        view = storages.batch_view(batch, seen[1] if seen is not None else set())
        return view if view is not None else (self.weigh(batch)[0], 0)

    def _ours(self, written: int, space: Any) -> int:
        """Of ``/dev/shm``'s use now, what may be this loader's own batches, which ``need`` counts too: this batch,
        where the collate wrote it, and at most the others in flight at their planned size, within what
        ``/dev/shm`` gained since the plan (``baseline_used``). Counted twice, a batch sampler's 24 MiB batch
        among 16 MiB ones, written by torch's collate beside the first batch (40.1 MiB in use, 23.9 MiB free of
        64 MB), "needed" 56 MiB free where raw torch ran it; within plain free space a batch that cannot fit
        beside the others still stops, and any write that finds no room is the guard's error (``_writing``)."""
        used = getattr(space, "used", None)
        if self.baseline_used is None or used is None:
            return written
        others = self.planned_bytes * max(0, self.in_flight - 1)
        return max(written, min(max(0, used - self.baseline_used), self.ranks * (written + others)))

    def _share(self, batch: Any, nbytes: int, pending: int, info: Any) -> None:
        """Writes the batch to shared memory here, as the framework would when sending it (4 ranks without
        launcher variables under 64 MB: a batch lost in torch's feeder thread in 1 of 3 runs, where nothing
        reached the loop)."""
        self._writing(lambda: self.share(batch), nbytes, pending, info)

    def _writing(self, write: Callable[[], Any], nbytes: int, pending: int, info: Any) -> Any:
        """``write()``, which puts ``pending`` bytes of a batch of ``nbytes`` in ``/dev/shm`` (torch's collate, or
        ``share``). Another process may take the room between a check and the write (the other worker's grown
        batch, 256 MB, 1 run of a suite's): what fails for want of it reaches the program as the guard's error,
        with the framework's as its cause: ``RowTooLargeError`` for a batch over its plan, ``ShmFullError`` for
        one within it. A write that failed for want of room (``_for_want_of_room``) is the guard's error though
        ``/dev/shm`` has room when read after it: the batches beside it may have been taken since (a 40 MiB
        batch planned at 16 MiB under 64 MB: torch's ENOSPC reached the program once in a full suite)."""
        try:
            return write()
        except RuntimeError as exc:
            space = _space()
            if space is None or not _for_want_of_room(exc, space, pending):
                raise
            room_now = space.free >= pending
            if nbytes > self.planned_bytes:
                raise RowTooLargeError(self._over(nbytes, space.free, info, failed=room_now)) from exc
            raise ShmFullError(self._full(nbytes, pending, space, info, failed=room_now)) from exc

    def need(self, nbytes: int) -> int:
        """``/dev/shm`` this loader needs while a batch of ``nbytes`` is in flight: it, and the other batches in
        flight at the planned size (one rule for the budget, the free-space fix and the size to give); a batch
        under the plan still needs the plan's room. Batches as large as this one everywhere are a growth the
        free space read now meets as ``/dev/shm`` fills (those already there are out of it)."""
        return max(nbytes, self.planned_bytes) + self.planned_bytes * max(0, self.in_flight - 1)

    def _in_flight(self) -> str:
        others = self.in_flight - 1
        return "it" if others <= 0 else \
            f"it and the {others} other batch(es) in flight at the planned {mib(self.planned_bytes)}"

    def _check_budget(self, nbytes: int, written: int, space: Any, info: Any) -> None:
        """Over the budget, yet ``/dev/shm`` has room now for it and the other batches in flight, for every
        local rank, beside what of them it may hold already (``_ours``): go on, and say so once per worker;
        else ``RowTooLargeError``."""
        need = self.need(nbytes)
        free = None if space is None else space.free
        ours = self._ours(written, space)
        if free is None or free + ours < need * self.ranks:
            raise RowTooLargeError(self._over(nbytes, free, info, ours))
        if not self.over_said:
            self.over_said = True
            log.warning("ms_shm guard: batch %s is %s (planned %s): %s need %s, over this loader's %s of %s, "
                        "which still has %s free%s; going on", self.batches, mib(nbytes), mib(self.planned_bytes),
                        self._in_flight(), mib(need), mib(self.limit_bytes), SHM_DIR, mib(free),
                        f" beside the {mib(ours)} of them it may hold already" if ours else "")

    def _over(self, nbytes: int, free: int | None, info: Any, ours: int = 0, failed: bool = False) -> str:
        """``failed``: writing the batch has failed for want of room, whatever ``/dev/shm`` has free now."""
        need = self.need(nbytes)
        if failed:
            room = f"no room for it when it was written ({_read_after(free)})"
        elif free is None:
            room = "its free space unreadable"
        else:
            room = f"only {free_text(free, need * self.ranks - ours)} free" + (
                f" beside the {mib(ours)} of them it may hold already" if ours else "")
        ranks = f" (for each of {self.ranks} local ranks)" if self.ranks > 1 else ""
        budget = "over" if need > self.limit_bytes else "within"
        return (f"{self._batch(nbytes, info)}: {self._in_flight()} need {mib(need)} of "
                f"{SHM_DIR}, {budget} the {mib(self.limit_bytes)} this loader may use, and {SHM_DIR} has {room}"
                f"{ranks}: {HARM}. Fix: {self._fix(nbytes)}")

    def _full(self, nbytes: int, pending: int, space: Any, info: Any, failed: bool = False) -> str:
        """What is free, what this loader needs free, who else of this process may hold it, and the /dev/shm
        size that would hold both what others hold now and this loader's batches in flight. ``failed``: sending
        it has failed for want of room, whatever ``/dev/shm`` has free now."""
        new = "" if pending == nbytes else f" ({mib(pending)} of it not yet in shared memory)"
        need = self.need(nbytes)
        used = max(0, space.total - space.free)
        size = used + need + 1
        room = (f"had too little free to send it when it was written ({_read_after(space.free)})" if failed else
                f"has {free_text(space.free, pending)} free, too little to send it")
        hint, ranks_fix = host.sharing_hint(self.ranks, SHM_DIR)
        return (f"{self._batch(nbytes, info)}{new}: {SHM_DIR} {room}, though the plan's {self.in_flight} batches "
                f"in flight fit this loader's {mib(self.limit_bytes)}: something else filled it after ms_shm planned "
                f"this loader ({self._others_text()}{hint}; or batches the program keeps besides the one its loop holds, "
                f"such as a list of past batches), and {HARM}. Fix: {ranks_fix}make room, this loader "
                f"needs {mib(need)} free for {self._in_flight()} and {mib(used)} of the {mib(space.total)} "
                f"of {SHM_DIR} are in use (find what uses it: `df -h {SHM_DIR}`; `ms-shm clean` removes what "
                f"crashed runs left), or give {SHM_DIR} at least {mib(size)} (docker run --shm-size="
                f"{sizes.shm_size_flag(size)}){', or ' + self.fix if self.fix else ''}")

    def _others_text(self) -> str:
        """The other DataLoaders of this process this worker knows of (its fork's copy of the ledger; none under
        spawn, which starts from a fresh interpreter): each was planned as iterating one after the other."""
        try:
            text = self.others() if self.others is not None else ""
        except Exception as exc:  # only the message's detail: the ShmFullError must still reach the loop
            log.debug("ms_shm guard: other loaders not read (%s: %s)", type(exc).__name__, exc)
            return ""
        return f"{text}; or " if text else ""

    def _batch(self, nbytes: int, info: Any) -> str:
        return (f"batch {self.batches} of DataLoader worker {getattr(info, 'id', '?')} is {mib(nbytes)} (planned "
                f"{mib(self.planned_bytes)})")

    def _fix(self, nbytes: int) -> str:
        """The host /dev/shm that holds this batch and the others in flight at the planned size (``need``), for
        every local rank, then what the loader's arguments allow."""
        host_need = self.to_give(self.need(nbytes))
        give = f"give {SHM_DIR} at least {mib(host_need)} ({sizes.where_to_set(host_need)})"
        return f"{give}, or {self.fix}" if self.fix else give

    def __repr__(self) -> str:
        return repr(self.collate)


def _for_want_of_room(exc: BaseException, space: Any, pending: int) -> bool:
    """Whether a framework's failed write to shared memory failed for want of room: ``/dev/shm`` lacks it now,
    or the framework said ENOSPC (torch's "unable to allocate shared memory ... No space left on device (28)" is
    a ``RuntimeError`` carrying only the text) while inodes are free; a tmpfs out of inodes says ENOSPC too,
    and room is not what it needs."""
    if space.free < pending:
        return True
    return "No space left on device" in str(exc) and not getattr(space, "out_of_files", False)


def _read_after(free: int) -> str:
    return f"{mib(free)} free when read after that: the batches in flight beside it may have been taken since"


def guard_fix(batch_size: int | None, batch_sampler: bool, workers: int, prefetch: int | None) -> str:
    """The loader's own settings that would shrink what it holds in ``/dev/shm``, only those that can go lower:
    smaller batches, fewer workers, a lower ``prefetch_factor`` (never "lower prefetch_factor" at 1)."""
    out = []
    if batch_sampler:
        out.append("smaller batches from the batch_sampler")
    elif batch_size is not None and batch_size > 1:
        out.append(f"batch_size={batch_size // 2}")
    if prefetch and prefetch > 1:
        out.append(f"prefetch_factor={prefetch - 1}")
    if workers > 1:
        out.append(f"num_workers={workers - 1}")
    return ", or ".join(out)


def used_now() -> int | None:
    """Bytes of ``/dev/shm`` in use now (``None``: unreadable): a guard's ``baseline_used``, read when its loader
    is planned."""
    space = _space()
    return None if space is None else space.used


def _space() -> Any:
    """``/dev/shm`` now: total, free and used bytes (``None``: unreadable; then the budget is all there is to go
    by)."""
    try:
        return procfs.statvfs(SHM_DIR)
    except OSError:
        return None


__all__ = ["GuardedCollate", "guard_fix", "used_now", "HARM"]
