"""The generic half of planning: what a plan is, and how candidates are ranked. Pure: no I/O, no clock, no
framework. Each engine prices its own candidates (``ms_shm.engines.mindspore.planning``) and ranks them here.

The fastest candidate that fits wins (estimates within 0.05 s tie, then the framework's own defaults); a
request none of whose candidates fits becomes one ``ShmBudgetError`` with the numbers and the fix.
"""

from __future__ import annotations

import math
from dataclasses import field, replace
from typing import Any

from ms_shm import budget as budget_mod
from ms_shm._results import Result, mib, record
from ms_shm.budget import Budget
from ms_shm.errors import ShmBudgetError
from ms_shm.rows import RowStats

INLINE, THREADS, PROCESSES, PIPES = "inline", "threads", "processes", "pipes"
MODES = (INLINE, THREADS, PROCESSES, PIPES)


EXPLICIT = "explicit_arguments"  # a Decision on the arguments the caller passed: its ``default`` is what was asked


@record
class Decision(Result):
    setting: str
    value: Any
    default: Any  # the framework's default, or, for ``EXPLICIT`` and where ``asked``, what the caller asked
    reason: str
    asked: bool = False  # ``default`` is what the caller passed (a cap on it), said "asked", not "default"
    precaution: bool = False  # a process-wide change made for what the program may do, not what the plan needs:
    # said at INFO (a soft open-files limit of 1024 raised for batches the program may keep)

    def __str__(self) -> str:
        before = "asked" if self.setting == EXPLICIT or self.asked else "default"
        changed = "" if self.value == self.default else f" ({before} {self.default})"
        return f"{self.setting}={self.value}{changed}: {self.reason}"


@record
class Request(Result):
    """What the caller asked for. ``None`` means "not passed": ms_shm may choose."""

    workers: int | None = None
    multiprocessing: bool | None = None
    max_rowsize: int | None = None
    prefetch: int = 16  # the framework's queue depth as it is now (MindSpore's global prefetch_size)
    shared_mem: bool = True  # MindSpore's global switch, as it is now
    can_switch_shared_mem: bool = True  # the installed MindSpore has set_enable_shared_mem
    start_method: str = "fork"
    rows_per_epoch: int | None = None  # this rank's rows (after num_samples / shards)
    cpu_count: int = 1  # os.cpu_count(): MindSpore refuses more workers than this
    usable_cpus: int = 1  # affinity and cgroup quota
    explicit: str | None = None  # "preference": explicit settings may be adapted to fit (ms_shm.patch); else kept


@record
class Candidate(Result):
    mode: str
    workers: int
    prefetch: int
    shm: int
    fds: int
    seconds: float | None
    fits: bool
    why_not: str = ""
    memory: int = 0  # host memory it adds to the memory cgroup, its /dev/shm pages included


@record
class Lean(Result):
    """The leanest settings a planned stage may switch to before its iterator is made, rows unchanged (one the
    call's settings allow, ms_shm's own choice among them; always in this process: MindSpore's own thread or
    threads, as no worker process is started for a stage after it was built): what a pipeline planned later asks of it where it
    finds no room (``api._with_room``). ``by_prefetch`` as ``Plan.by_prefetch``."""

    mode: str
    workers: int
    seconds: float | None
    by_prefetch: tuple = ()


@record
class Plan(Result):
    """The chosen configuration, what it will use, and why."""

    kind: str  # "generator" or "map"
    mode: str
    workers: int
    prefetch: int
    python_multiprocessing: bool
    shared_mem: bool
    max_rowsize: int | None
    row_bytes: int  # the row size planned for (ragged rows include a margin)
    predicted_shm: int
    predicted_fds: int
    predicted_sysv: int
    budget: Budget
    fits: bool
    guard_slots: int  # shm slots per worker the runtime guard accounts for (0: guard off)
    guard_worker_bytes: int  # each worker's share of the budget
    estimated_seconds: float | None
    profile: Any  # the engine's profile of the installed release
    decisions: tuple = ()
    advice: tuple = ()
    alternatives: tuple = ()
    predicted_memory: int = 0  # host memory it adds to the memory cgroup, its /dev/shm pages included
    rows_per_epoch: int | None = None  # rows (batches, for a batch stage) it yields per epoch, where known
    # (shm, fds, memory) at MindSpore's global prefetch 1, 2, ..., ``prefetch``: what it holds where a stage
    # planned after it lowers that prefetch before its iterator is made
    by_prefetch: tuple = field(default=(), repr=False)
    lean: Lean | None = field(default=None, repr=False)  # where it holds less memory in MindSpore's threads
    # (mode, workers): the fastest setting in this process the call allows, rows unchanged, where the plan starts
    # worker processes with shared-memory slots; a new iterator made while an earlier one holds its slots reads
    # with it where /dev/shm has no room for a second set (``second_iterator``)
    in_process: tuple = field(default=(), repr=False)

    def summary(self) -> str:
        """The one INFO line: mode, workers, prefetch, predicted peak vs budget, why."""
        budget = mib(self.budget.shm_bytes) if self.budget.shm_bytes is not None else "unknown"
        why = next((d.reason for d in self.decisions if d.setting == "mode"), "")
        est = f", ~{self.estimated_seconds:.2f} s/epoch" if self.estimated_seconds is not None else ""
        return (f"{self.kind}: mode={self.mode} workers={self.workers} prefetch={self.prefetch} "
                f"row={mib(self.row_bytes)} predicted /dev/shm {mib(self.predicted_shm)} of {budget} budget"
                f"{self._memory()}{est}; {why}")

    def _memory(self) -> str:
        """The memory prediction, where memory binds tighter than /dev/shm (a container's limit below its
        /dev/shm: its tmpfs pages count against the limit)."""
        memory, shm = self.budget.memory_bytes, self.budget.shm_bytes
        if memory is None or not self.predicted_memory or (shm is not None and memory >= shm):
            return ""
        return f", memory {mib(self.predicted_memory)} of {mib(memory)} ({self.budget.memory_reason})"

    def __str__(self) -> str:
        return self.summary()


def rank(c: Candidate, req: Request) -> tuple:
    """Fastest first (within 0.05 s: estimates are rough), then MindSpore's own defaults, then less shm.

    Pipes lose every tie: they are never faster than shared-memory slots at the same workers, and switching
    to them changes a deprecated global that every later pipeline of the process inherits. Among equally
    fast candidates fewer workers win (GeneratorDataset's own default is 1): extra processes or threads that
    buy nothing still cost memory, fds and start-up.
    """
    seconds = c.seconds if c.seconds is not None else 0.0
    default_like = {PROCESSES: 0, THREADS: 1, PIPES: 2, INLINE: 3}[c.mode] if c.seconds is None else 0
    return (round(seconds / 0.05 + 0.5) if seconds > 0 else 0, c.mode == PIPES, default_like, -c.prefetch,
            c.workers if c.seconds is not None else -c.workers, c.shm)


TIE_FRACTION = 0.10  # how far apart two epoch estimates from a few probe rows may be and still mean the same


def choose(fitting: list, req: Request, default_mode: str) -> tuple:
    """The fastest fitting candidate, and a note; but where the framework's own choice (its default transport
    for this request, at the current prefetch) is within the estimate's error of the fastest, that one: it
    changes no global setting, and the estimate cannot tell the two apart."""
    best = min(fitting, key=lambda c: rank(c, req))
    if best.seconds is None:
        return best, ""
    band = max(0.05, TIE_FRACTION * best.seconds)
    own = [c for c in fitting if c.mode == default_mode and c.prefetch == req.prefetch and c.seconds is not None
           and c.seconds - best.seconds <= band]
    if not own or best.mode == default_mode:
        return best, ""
    kept = min(own, key=lambda c: rank(c, req))
    return kept, (f"; {best.mode} x{best.workers} (~{best.seconds:.2f} s) is within the estimate's error "
                  f"({TIE_FRACTION:.0%}): the framework's own {kept.mode} x{kept.workers} is kept (no global change)")


def unknown_shm(budget: Budget) -> str:
    if budget.shm_bytes is not None:
        return ""
    return "; /dev/shm size unknown: no shared-memory transport was considered"


def top(cands: list, best: Candidate, n: int = 6) -> list:
    seen, out = set(), []
    for c in sorted(cands, key=lambda c: (not c.fits, c.seconds or 0.0)):
        key = (c.mode, c.workers)
        if key in seen or c is best:
            continue
        seen.add(key)
        out.append(c)
    return out[:n]


def no_fit_message(cands: list, req: Request, budget: Budget, stats: RowStats, row: int,
                   relaxed_fits: bool = True) -> str:
    """One error for a request nothing fits: what the smallest candidate needs against each budget, why each
    transport failed (at its smallest prefetch), and the fixes for the limits that bind. ``relaxed_fits``:
    whether anything fits once the explicit settings are dropped; where nothing does, dropping them is no fix
    (an audit dropped ``num_parallel_workers=2`` as told, and the map was refused again)."""
    asked = [f"{name}={value}" for name, value in (("num_parallel_workers", req.workers),
                                                   ("python_multiprocessing", req.multiprocessing),
                                                   ("max_rowsize", req.max_rowsize)) if value is not None]
    smallest = min(cands, key=lambda c: (c.shm, c.memory)) if cands else Candidate("", 0, 0, 0, 0, None, False)
    least = min(cands, key=lambda c: c.memory) if cands else smallest
    least_memory = least.memory
    # each against the budget at its own prefetch, as the reasons below are (``Budget.at_prefetch``)
    budget, memory_budget = budget.at_prefetch(smallest.prefetch), budget.at_prefetch(least.prefetch)
    memory = "" if memory_budget.memory_bytes is None else (
        f", {mib(least_memory)} of memory against {mib(memory_budget.memory_bytes)} left for it "
        f"({memory_budget.memory_reason})")
    fixes = [f"drop the explicit {' / '.join(asked)} so ms_shm can choose {_untried(cands, req)}"
             if asked and relaxed_fits else ""]
    fixes.append(budget_mod.limits_fix(budget, smallest.shm, smallest.fds))
    fixes.append(memory_fix(least_memory, memory_budget))
    return (f"No configuration honouring {', '.join(asked) or 'the request'} fits: rows of {mib(row)}; the "
            f"smallest needs {mib(smallest.shm)} of /dev/shm against {mib(budget.shm_bytes)} ({budget.reason}), "
            f"{smallest.fds} fds against {budget.fds if budget.fds is not None else 'unlimited'}{memory}. "
            f"Why: {' | '.join(_reasons(cands))[:600]}. Fix: {'; or '.join(f for f in fixes if f) or 'see above'}.")


def unasked(req: Request) -> Request:
    """The request without the caller's explicit transport settings: what dropping them lets ms_shm try."""
    return replace(req, workers=None, multiprocessing=None, max_rowsize=None)


def _untried(cands: list, req: Request) -> str:
    """What dropping the explicit arguments lets ms_shm choose: only what no candidate here tried (every one
    failed), that is the transport kind the caller ruled out and fewer workers than asked."""
    tried = {c.mode for c in cands}
    left = [name for name, modes in (("threads", {THREADS}), ("worker processes", {PROCESSES, PIPES}))
            if req.multiprocessing is not None and not modes & tried]
    if req.workers is not None and req.workers > 1:
        left.append(f"fewer than {req.workers} workers (1 reads rows in the main process)")
    return " or ".join(left) or "what fits"


def _reasons(cands: list) -> list:
    """Each transport's reason at the last (smallest) prefetch tried: the higher ones failed for more."""
    last: dict = {}
    for c in cands:
        if c.why_not:
            last[(c.mode, c.workers)] = f"{c.mode} x{c.workers}: {c.why_not}"
    return list(last.values())


MEMORY_FIX_MARGIN, MEMORY_FIX_STEP = 1.1, 16 << 20


def memory_fix(least: int, budget: Budget, staged: bool = True) -> str:
    """The container fix when memory binds: tmpfs pages count against the container's memory limit. Asked
    with a margin (a tenth more, in 16 MiB steps): memory left is read at the build and moves with the page
    cache, and a container given exactly what was asked was refused again by 0.1-0.4 MiB (an audit: 2 runs of
    13). The size counts the stages built so far, and says so: a source's map refused at 600 MB was told
    "32 MiB more", and its ``batch(2)`` of 24 MiB rows then needed ~500 MiB more at 700 MB (an audit, where raw was
    OOM-killed at both); a DataLoader (not ``staged``) has no later stages."""
    if budget.memory_bytes is None or least <= budget.memory_bytes:
        return ""
    short = (least - budget.memory_bytes) * budget.ranks / budget.fraction
    more = math.ceil(short * MEMORY_FIX_MARGIN / MEMORY_FIX_STEP) * MEMORY_FIX_STEP
    return (f"give the container at least {mib(more)} more memory (docker run --memory; Kubernetes "
            f"resources.limits.memory, raised by the /dev/shm emptyDir's sizeLimit): /dev/shm pages count "
            f"against it" + ("; that is for the pipeline built so far, and stages added after it (a batch of its "
                             "rows) hold memory of their own" if staged else ""))


__all__ = ["Plan", "Lean", "Decision", "Request", "Candidate", "ShmBudgetError", "rank", "choose", "top", "no_fit_message",
           "memory_fix", "unasked",
           "unknown_shm", "MODES", "INLINE", "THREADS", "PROCESSES", "PIPES"]
