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

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from ms_shm import sizes
from ms_shm._results import Result, mib, record

log = logging.getLogger(__name__)

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
    reserved_pipelines: int = 0  # live pipelines of this process whose reservations ``reserved_shm`` sums
    shm_readonly: bool = False  # /dev/shm is mounted read-only: 0 bytes, and no size helps
    returned: tuple = ()  # (shm, fds, memory) the reservations give back at prefetch 1, 2, ... (``at_prefetch``),
    # as each budget gains it (one short by more than that gains nothing)
    shm_others: int = 0  # /dev/shm in use when it was read, before this process's pipelines: other processes'
    nofile_soft: int | None = None  # the soft open-files limit ``fds`` was taken from

    def at_prefetch(self, prefetch: int) -> "Budget":
        """This budget for a candidate that lowers MindSpore's global prefetch to ``prefetch``: the stages
        planned before it whose next iterator is not made yet then run at that prefetch too, and hold less (an
        audit's generator, map and ``per_batch_map`` batch in a 700 MB container: the batch was refused while
        the two stages below it were counted at the prefetch they were planned with)."""
        if not 0 < prefetch <= len(self.returned):
            return self
        shm, fds, memory = self.returned[prefetch - 1]
        if not (shm or fds or memory):
            return self
        back = f" ({{}} of it given back at prefetch {prefetch})"
        return replace(self, shm_bytes=_plus(self.shm_bytes, shm), fds=_plus(self.fds, fds),
                       memory_bytes=_plus(self.memory_bytes, memory), reserved_shm=self.reserved_shm - shm,
                       reserved_fds=self.reserved_fds - fds, reserved_memory=self.reserved_memory - memory,
                       reason=self.reason + (back.format(mib(shm)) if shm else ""),
                       memory_reason=self.memory_reason + (back.format(mib(memory)) if memory else ""), returned=())


def _plus(left: int | None, more: int) -> int | None:
    return None if left is None else left + more


READ_ONLY = ("/dev/shm is mounted read-only: no worker process can start (multiprocessing's semaphores and heap "
             "live there)")


def compute(shm_free: int | None, ranks: int, nofile_soft: int | None, open_fds: int | None,
            reserved_shm: int = 0, reserved_fds: int = 0, fraction: float = DEFAULT_FRACTION,
            ranks_source: str = "", memory_left: int | None = None, reserved_memory: int = 0,
            memory_source: str = "", reserved_pipelines: int = 0, shm_readonly: bool | None = None,
            returned: tuple = (), shm_others: int = 0) -> Budget:
    """The per-pipeline budget from host numbers taken before any pipeline of this process started."""
    ranks = max(1, ranks)
    shm_left = None  # before it is clamped at 0: what the reservations given back at a lower prefetch add to
    if shm_free is None:
        shm, why = None, "/dev/shm could not be read: no shared-memory transport will be planned"
    elif shm_readonly:
        shm, why = 0, READ_ONLY
    else:
        share = int(shm_free * fraction / ranks)
        shm_left = share - reserved_shm
        shm = max(0, shm_left)
        why = (f"{mib(shm_free)} free in /dev/shm x {fraction:.0%} headroom / {ranks} local rank(s)"
               f"{' [' + ranks_source + ']' if ranks_source else ''} = {mib(share)}")
        if reserved_shm:
            why += f", minus {mib(reserved_shm)} reserved by live pipelines"
    fds = fds_left = None
    if nofile_soft is not None:
        fds_left = nofile_soft - (open_fds or 0) - sizes.FD_MARGIN - reserved_fds
        fds = max(0, fds_left)
    memory_left_, memory_why = _memory_share(memory_left, ranks, fraction, reserved_memory, memory_source)
    memory = None if memory_left_ is None else max(0, memory_left_)
    gains = tuple(_gains((shm_left, fds_left, memory_left_), back) for back in returned)
    return Budget(shm, fds, ranks, fraction, reserved_shm, reserved_fds, why, memory, reserved_memory, memory_why,
                  reserved_pipelines, bool(shm_readonly) and shm_free is not None, gains, max(0, shm_others),
                  nofile_soft)


def _gains(lefts: tuple, back: tuple) -> tuple:
    """What ``back`` (given back by the reservations) adds to each clamped budget: a budget already short of
    nothing gains it all, one short by more gains nothing (an audit's eval source was admitted with 128 MiB
    "given back" on top of a budget 273 MiB short, clamped at 0)."""
    return tuple(0 if left is None else max(0, left + more) - max(0, left) for left, more in zip(lefts, back))


def shm_fix(b: Budget, need: int) -> str:
    """The fix for ``need`` bytes of this pipeline's that /dev/shm lacks: a size to give it, or, for a read-only
    mount, where no size helps, a writable one. One rule for every ``ShmBudgetError``."""
    if b.shm_readonly:
        return ("mount /dev/shm read-write (mount -o remount,rw /dev/shm; docker run --shm-size with no read-only "
                "mount over it; Kubernetes: an emptyDir with medium: Memory at /dev/shm)")
    host_need = shm_to_give(b, need)
    return f"give /dev/shm at least {mib(host_need)} (docker run --shm-size={sizes.shm_size_flag(host_need)})" + \
        reserved_text(b)


def limits_fix(b: Budget, shm: int, fds: int) -> str:
    """The fix for the ``/dev/shm`` and open-files limits that ``shm`` bytes and ``fds`` fds exceed (``""``:
    neither): both changes in one fix where both bind (an audit was told "give /dev/shm at least 66.4 MiB; or
    raise `ulimit -n`", and was refused again after either alone). One rule for every ``ShmBudgetError``."""
    parts = [shm_fix(b, shm)] if b.shm_bytes is not None and shm > b.shm_bytes else []
    if b.fds is not None and fds > b.fds:
        to = f" to at least {b.nofile_soft + fds - b.fds}" if b.nofile_soft is not None else ""
        parts.append(f"raise `ulimit -n`{to}")
    return " and ".join(parts)


def shm_to_give(b: Budget, need: int) -> int:
    """The host's ``/dev/shm`` size at which ``need`` bytes fit this pipeline's share: what the live pipelines of
    this process reserved stays theirs (a 64 MB container with a 40 MiB loader alive was told to give /dev/shm
    "at least 30.0 MiB"), every local rank alike, and the headroom; and what other processes held when it was
    read stays theirs (another job's 40 MiB in a 64 MB /dev/shm: the fix named 64m, the size it had, 3 runs of
    3). One rule for every ``ShmBudgetError``."""
    return int((need + b.reserved_shm) * b.ranks / b.fraction) + b.shm_others + 1


def reserved_text(b: Budget) -> str:
    """What ``shm_to_give`` added for the live pipelines and other processes, said where the size is given
    (``""``: none)."""
    counted = []
    if b.reserved_shm:
        n = b.reserved_pipelines
        who = f"{n} other live pipeline{'' if n == 1 else 's'}" if n else "other live pipelines"
        counted.append(f"{mib(b.reserved_shm)} reserved by {who} of this process")
    if b.shm_others:
        counted.append(f"{mib(b.shm_others)} other processes held in /dev/shm when it was read")
    return f", counting {' and '.join(counted)}" if counted else ""


def _memory_share(left: int | None, ranks: int, fraction: float, reserved: int, source: str) -> tuple:
    """Every local rank of a container is charged to one cgroup, as they all write one /dev/shm."""
    if left is None:
        return None, "memory left unknown: planned on /dev/shm and fds only"
    share = int(max(0, left) * fraction / ranks)
    why = f"{mib(left)} of memory left{' (' + source + ')' if source else ''} x {fraction:.0%} / {ranks} rank(s)"
    if reserved:
        why += f", minus {mib(reserved)} reserved by live pipelines"
    return share - reserved, why


MEASURE_WORKERS_BELOW = 8 << 30  # memory left under which a forked worker's own pages are worth measuring


def memory_may_bind(b: Budget) -> bool:
    """Whether memory is short enough that each worker's own pages should be measured (the probe child reads
    its ``smaps_rollup``, ~20 ms with MindSpore loaded) rather than taken as a generous default."""
    return b.memory_bytes is not None and b.memory_bytes < MEASURE_WORKERS_BELOW


@record
class Reservation(Result):
    """A live pipeline's predicted peak. ``kind``: pipelines of one kind may be planned apart from each other
    (``Ledger.totals(apart=kind)``); ``""`` counts against every pipeline."""

    key: int
    label: str
    shm_bytes: int
    fds: int
    memory: int = 0
    kind: str = ""
    held_apart: int = 0  # memory that still counts against pipelines planned apart: persistent workers' own
    by_prefetch: tuple = ()  # (shm, fds, memory) at MindSpore's global prefetch 1, 2, ..., up to the planned one
    lean: tuple = ()  # the same for the stage's leanest settings (``Plan.lean``), where it may switch to them
    group: tuple = ()  # what tells its pipeline from others (the engine's ``pipeline_of``); () for none known

    def leaned(self) -> "Reservation":
        """What it holds once switched to its leanest settings, at the prefetch it holds now."""
        if not self.lean:
            return self
        now = len(self.by_prefetch)
        shm, fds, memory = self.lean[now - 1]
        return replace(self, shm_bytes=shm, fds=fds, memory=memory, by_prefetch=self.lean[:now], lean=())

    @property
    def lean_gain(self) -> int:
        """The memory switching to its leanest settings gives back (0: none, or it holds no less there)."""
        return self.memory - self.leaned().memory


def returned_at(items: Iterable[Reservation]) -> tuple:
    """``Budget.returned`` of ``items`` (those whose next iterator is not made yet): at each prefetch, what they
    would hold less than their reservations."""
    items = [r for r in items if r.by_prefetch]
    longest = max((len(r.by_prefetch) for r in items), default=0)
    return tuple(_returned_one(items, p) for p in range(1, longest))


def _returned_one(items: list, prefetch: int) -> tuple:
    back = [0, 0, 0]
    for r in items:
        if prefetch < len(r.by_prefetch):
            for i, (now, then) in enumerate(zip((r.shm_bytes, r.fds, r.memory), r.by_prefetch[prefetch - 1])):
                back[i] += max(0, now - then)
    return tuple(back)


def sums(items: Sequence[Reservation]) -> tuple[int, int, int]:
    """Reserved /dev/shm, fds and memory of ``items``."""
    return sum(r.shm_bytes for r in items), sum(r.fds for r in items), sum(r.memory for r in items)


def _asked(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception as exc:  # noqa: BLE001  (the safe answer: it keeps what it reserved)
        log.debug("ms_shm: a pipeline's iterators not read (%s: %s)", type(exc).__name__, exc)
        return False


def but_kind(items: tuple, apart: str | None) -> tuple:
    """``items`` but those of kind ``apart`` (``None``: all of them)."""
    return items if apart is None else tuple(r for r in items if r.kind != apart)


class Ledger:
    """Pipelines alive together (train and eval) share one budget: each holds its predicted peak.

    A reservation is released when the dataset it belongs to is garbage-collected (``weakref.finalize``), or
    explicitly. A MindSpore pipeline's iterator lives across epochs, so its reservation counts while it may
    iterate: until an iterator has run to its end on it, and while one lives (``in_use``, the engine's; an eval
    built after a finished train, the train's dataset still bound, was refused where raw ran); one it stops
    counting is said once (``_say_ended``). A DataLoader holds batches only while an iterator with workers
    runs, and train / val loaders built up front iterate one after the other far more often than at once (two 40 MiB loaders in a 64 MB container:
    the second refused while the first, idle, held its reservation): DataLoaders reserve with ``kind``
    ``"dataloader"`` and are planned ``apart`` from each other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict = {}
        self._in_use: dict = {}  # key -> whether its pipeline may hold /dev/shm now (absent: always)
        self._ended: set = set()  # keys of reservations said to count no more
        self._follows: dict = {}  # key -> whether its pipeline's next iterator reads the global prefetch anew
        self._go_lean: dict = {}  # key -> what switches its stage to its leanest settings
        self._ids = itertools.count(1)

    def reserve(self, label: str, shm_bytes: int, fds: int, memory: int = 0, kind: str = "",
                in_use: Callable[[], bool] | None = None, held_apart: int = 0, by_prefetch: tuple = (),
                follows_prefetch: Callable[[], bool] | None = None, lean: tuple = (),
                go_lean: Callable[[Reservation, Reservation], bool] | None = None, group: tuple = ()) -> Reservation:
        """``by_prefetch`` with ``follows_prefetch`` (the engine's: no iterator holding the pipeline is alive):
        what it holds where MindSpore's global prefetch is lowered before its next iterator is made. ``lean`` with
        ``go_lean(before, after)`` (which switches the stage to its leanest settings, ``True`` where it did): what
        it holds there, asked of it only while no iterator holds it either."""
        following = follows_prefetch is not None
        with self._lock:
            item = Reservation(next(self._ids), label, int(shm_bytes), int(fds), int(memory), kind,
                               int(held_apart), tuple(by_prefetch) if following else (),
                               tuple(lean) if following and go_lean is not None and by_prefetch else (),
                               tuple(group))
            self._items[item.key] = item
            if in_use is not None:
                self._in_use[item.key] = in_use
            if following:
                self._follows[item.key] = follows_prefetch
            if item.lean:
                self._go_lean[item.key] = go_lean
            return item

    def release(self, key: int) -> None:
        with self._lock:
            self._items.pop(key, None)
            self._in_use.pop(key, None)
            self._follows.pop(key, None)
            self._go_lean.pop(key, None)

    def totals(self, apart: str | None = None) -> tuple[int, int, int]:
        """Reserved /dev/shm, fds and memory (of ``live(apart)``)."""
        return sums(self.live(apart))

    def live(self, apart: str | None = None) -> tuple:
        """The live reservations whose pipelines may hold /dev/shm now, but those of kind ``apart`` (a pipeline
        of that kind is planned without them)."""
        with self._lock:
            items, checks = tuple(self._items.values()), dict(self._in_use)
        held = tuple(r for r in items if r.key not in checks or checks[r.key]())  # outside the lock: the engine's
        kept = {r.key for r in held}
        self._say_ended(r for r in items if r.key not in kept)
        return but_kind(held, apart)

    def following(self, items: Iterable[Reservation]) -> list:
        """Those of ``items`` whose pipelines would run at a lowered global prefetch: no iterator made on them
        is alive (a live one keeps the prefetch it was made with)."""
        with self._lock:
            checks = dict(self._follows)
        return [r for r in items if r.key in checks and _asked(checks[r.key])]

    def running(self, items: Iterable[Reservation]) -> list:
        """Those of ``items`` an iterator runs now (``following`` are not): what they hold shows in the memory
        left now."""
        items = list(items)
        waiting = {r.key for r in self.following(items)}
        return [r for r in items if r.key not in waiting]

    def lower_prefetch(self, prefetch: int) -> list:
        """MindSpore's global prefetch went down to ``prefetch``: the reservations that follow it hold what they
        hold there. Returns the ``(before, after)`` pairs changed."""
        changed = []
        for r in self.following(self.live()):
            if prefetch < len(r.by_prefetch):
                shm, fds, memory = r.by_prefetch[prefetch - 1]
                now = replace(r, shm_bytes=shm, fds=fds, memory=memory, by_prefetch=r.by_prefetch[:prefetch],
                              lean=r.lean[:prefetch])
                with self._lock:
                    if self._items.get(r.key) == r:
                        self._items[r.key] = now
                        changed.append((r, now))
        return changed

    def leanable(self) -> list:
        """The live reservations that may switch to their leanest settings now and hold less there, those giving
        back the most memory first."""
        with self._lock:
            asked = set(self._go_lean)
        items = [r for r in self.following(self.live()) if r.key in asked and r.lean_gain > 0]
        return sorted(items, key=lambda r: -r.lean_gain)

    def go_lean(self, items: Iterable[Reservation]) -> list:
        """Switch the stages of ``items`` to their leanest settings; returns the ``(before, after)`` pairs of those
        that did. A stage gone, switched meanwhile, or whose switch failed keeps its reservation, and is not asked
        again."""
        changed = []
        for r in items:
            with self._lock:
                switch = self._go_lean.get(r.key) if self._items.get(r.key) == r else None
            now = r.leaned()
            if switch is None:
                continue
            switched = _asked(functools.partial(switch, r, now))
            with self._lock:
                self._go_lean.pop(r.key, None)  # switched, or failed: not asked again
                if switched:
                    self._items[r.key] = now
            if switched:
                changed.append((r, now))
        return changed

    def _say_ended(self, ended: Iterable[Reservation]) -> None:
        """Each reservation that stopped counting, once: what the next plans get beside it, and why."""
        for r in ended:
            with self._lock:
                if r.key in self._ended:
                    continue
                self._ended.add(r.key)
            log.info("ms_shm: %s's reservation (%s of /dev/shm) no longer counts against pipelines planned from "
                     "now on: an iterator ran to its end on it and none is alive, so its workers and slots are "
                     "gone. Where it runs again beside a pipeline planned meanwhile, keep one iterator alive "
                     "across its runs (dataset.create_tuple_iterator(num_epochs=-1)): it then keeps counting",
                     r.label, mib(r.shm_bytes))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._in_use.clear()
            self._ended.clear()
            self._follows.clear()
            self._go_lean.clear()
