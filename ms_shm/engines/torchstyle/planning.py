"""Workers, prefetch and sharing strategy for a PyTorch-style DataLoader, priced: facts in, a ``Plan`` out. Pure.

Each candidate (``num_workers`` x ``prefetch_factor`` x sharing strategy) is priced against this rank's budget
(``/dev/shm``, the main process's fds, each worker's fds under the same soft limit, memory) and timed from the
probe batch. Arguments passed explicitly are kept: when nothing that keeps them fits, ``ShmBudgetError`` before
any worker starts. ``num_workers`` is chosen only where changing it cannot change what arrives: not for an
iterable dataset (each worker iterates its own copy), not where the samples draw random numbers (each worker
is seeded apart), nor where the call or the code ties samples to workers (``LoaderRequest.workers_locked``, set
by ``loaders``).
"""

from __future__ import annotations

from dataclasses import replace

from ms_shm import budget as budget_mod
from ms_shm import plan, sizes
from ms_shm._results import Result, free_text, mib, record
from ms_shm.budget import Budget
from ms_shm.changes import NOFILE
from ms_shm.engines.mindspore.planning import RAGGED_MARGIN  # one margin for rows and batches that vary
from ms_shm.engines.torchstyle import arithmetic as model
from ms_shm.errors import ShmBudgetError
from ms_shm.plan import INLINE, PIPES, PROCESSES, Candidate, Decision, Plan

FORK_START_SECONDS = 0.003  # a fork of a process with the framework loaded, where the probe did not time its own
SPAWN_START_SECONDS = 2.0  # per worker: it imports the framework again
# What a batch sent through a worker's pipe costs beyond shared memory, per MiB (pickled, written, read and
# rebuilt: 4 copies, and the receiving main process's CPU). Measured, torch 2.13 on the 2-core VM: 2 workers,
# 32 MiB batches of 8 MiB samples, 16 batches: 4.9 s against 2.5 s through /dev/shm, 4.7 ms per MiB.
PIPE_SECONDS_PER_MIB = 4.7e-3
PER_BATCH_SECONDS = 1e-3  # the main process's cost to receive one batch (unpickle, map its storages)
PER_STORAGE_SECONDS = 4e-5  # ... and each storage of it (a file descriptor passed and mapped)
# A worker's fork, then its exit and join at the epoch's end, in forks: each walks the parent's pages, the exits of
# several workers partly at once. Fitted with each engine's ``pool_seconds`` and ``worker_seconds`` to the epochs of
# 4 one-sample batches, 1 / 2 / 4 workers, over a parent whose fork takes 2 and 28-35 ms (``engines/torch``).
FORKS_PER_WORKER = 1.5


@record
class WorkerCosts(Result):
    """What workers cost a framework's DataLoader beyond the samples' own work: per-framework facts, measured
    (``engines/torch``, ``engines/mindspore_dataloader`` say how), priced here by one rule.

    Attributes:
        pool_seconds: once per epoch with any workers: the first batch's hand-off and the pool's shutdown.
        worker_seconds: per worker, beyond its fork and exit (its queues, its loop's set-up, its join).
        transfer_seconds_per_mib: per MiB of every batch, what moving it from a worker adds (writing its
            storages to ``/dev/shm`` there, faulting them in here), with the consumer reading every byte.
        saved_per_mib: seconds a sample's read saves in a loop (the main process's with ``num_workers=0``, a
            worker's), against the probe child's warm reads, per MiB the sample weighs: a fresh fork pays
            first-touch faults on the pages its allocator grows into, a loop's reads reuse the pages the
            batches before freed. Only where the probe did not time samples as a loop reads them
            (``BatchStats.inline_seconds_per_sample``), and never more than their CPU part.
    """

    pool_seconds: float = 0.04
    worker_seconds: float = 0.02
    transfer_seconds_per_mib: float = 1e-3
    saved_per_mib: float = 0.0


DEFAULT_COSTS = WorkerCosts()


@record
class BatchStats(Result):
    """What the probe batch showed, scaled to ``batch_size`` samples.

    Attributes:
        batch_bytes: bytes of one batch's tensors (the sum of their storages).
        storages: tensor storages per batch: one shared-memory file (and fd) each.
        seconds_per_sample: reading and collating, per sample (``None``: not timed).
        samples: samples per epoch (``None``: unknown, an iterable dataset).
        batch_size: samples per batch.
        worker_bytes: a forked worker's own pages after the probe (``None``: not measured).
        fork_seconds: the parent's ``os.fork()`` call for the probe child (``None``: not measured): a worker's
            fork costs as much, and grows with the parent's memory (its page tables).
        free_cpus: CPUs this loader may count on while the probe ran: its own and the host's idle ones
            (``None``: not measured; the usable CPUs are assumed free).
        cpu_seconds_per_sample: of ``seconds_per_sample``, the CPU time (``None``: all of it); waiting (I/O,
            sleep) costs the main process what it costs a fork.
        unsent: why a batch cannot travel from a worker process to the loop (it does not pickle: a lambda, a
            local class, a tensor that requires grad and is not a leaf), or ``None``.
        batch_bytes_min: where the probe's samples differ in size, the batch of the smallest (``batch_bytes``
            is the largest's); ``None``: they weighed alike.
        shared_bytes: storages the dataset holds that batches send views of (``storages.once_per_worker``):
            in ``/dev/shm`` once per worker, not per batch in flight; ``batch_bytes`` leaves them out.
    """

    batch_bytes: int
    storages: int
    seconds_per_sample: float | None
    samples: int | None
    batch_size: int
    worker_bytes: int | None = None
    fork_seconds: float | None = None
    free_cpus: float | None = None
    cpu_seconds_per_sample: float | None = None
    unsent: str | None = None
    batch_bytes_min: int | None = None
    shared_bytes: int = 0
    collate_shares: bool | None = None  # the caller's collate_fn, run as in a worker, built its batch in shared
    # memory (through torch's default collate); ``None``: not asked (no collate of the caller's) or unknown
    copied_bytes: int = 0  # what each worker process comes to copy of the dataset's big lists and dicts over an
    # epoch (``loaders._copies``: copy-on-read), beyond the pages the probe's few samples touched
    own: str | None = None  # what of the first batch is the dataset's or the collate_fn's own (``aliases.own_in``)
    thread_bound: str | None = None  # what the reads compute whose result depends on the thread count, which a
    # worker sets to 1 (``compat.thread_bound``)
    inline_seconds_per_sample: float | None = None  # a sample's time in a loop, the main process's or a worker's
    # (``probe.inline_seconds``); ``None``: not read, the engine's ``WorkerCosts.saved_per_mib`` prices it
    workers_ruled_out: str | None = None  # why no workers can be chosen, told from the first samples read
    # (``why_no_workers``): the probe then read neither the loop's timing samples nor the first sample again

    @property
    def ragged(self) -> bool:
        return self.batch_bytes_min is not None and self.batch_bytes_min != self.batch_bytes


@record
class LoaderRequest(Result):
    """What the call asked for (``None``: not passed, ms_shm may choose) and what cannot change."""

    framework: str
    workers: int | None = None
    prefetch_factor: int | None = None
    strategy: str = model.FILE_DESCRIPTOR  # the framework's sharing strategy now
    can_switch_strategy: bool = False  # torch: ``torch.multiprocessing.set_sharing_strategy``
    workers_locked: str | None = None  # why num_workers must stay as asked (iterable, random samples)
    pin_memory: bool = False
    start_method: str = "fork"
    usable_cpus: int = 1
    nofile_soft: int | None = None
    nofile_hard: int | None = None  # the soft limit may be raised up to this
    min_workers: int = 0  # where ms_shm chooses: the fewest workers that keep what arrives (``persistent_workers``)
    persistent_workers: bool = False  # forked once, not every epoch (``model.held_at_start``)
    pipes: bool = False  # batches may travel through the workers' pipes where no shared-memory plan fits
    read_ahead: int = 0  # batches the loop holds beyond the one it consumes (a library's: ``sites.made_by_a_library``)
    prefetch_locked: bool = False  # how far ahead the workers read decides what arrives (``loaders._prefetch_kept``)
    custom_collate: bool = False  # the caller's collate_fn: it may build its batch in /dev/shm in the worker
    # (through torch's default collate: ``LoaderProfile.collate_in_shm``), unless the probe saw it does not
    # (``BatchStats.collate_shares``)


def _worker_options(req: LoaderRequest) -> list:
    if req.workers is not None:
        return [req.workers]
    if req.workers_locked:
        return [0]  # the framework's default: samples read in the main process
    return list(range(req.min_workers, max(1, req.usable_cpus, req.min_workers) + 1))


def _prefetch_options(req: LoaderRequest, workers: int) -> list:
    if workers == 0:
        return [None]
    if req.prefetch_factor is not None:
        return [req.prefetch_factor]
    return list(range(model.DEFAULT_PREFETCH_FACTOR, 0, -1))


def _strategy_options(req: LoaderRequest) -> list:
    if not req.can_switch_strategy:
        return [req.strategy]
    other = model.FILE_SYSTEM if req.strategy == model.FILE_DESCRIPTOR else model.FILE_DESCRIPTOR
    return [req.strategy, other]


def start_seconds(workers: int, stats: BatchStats, req: LoaderRequest, costs: WorkerCosts) -> float:
    """What starting ``workers`` and shutting them down at the epoch's end cost: spawn imports the framework
    again; fork pays the program's measured fork ``FORKS_PER_WORKER`` times (the fork, its exit), plus the
    framework's own set-up."""
    if workers <= 0:
        return 0.0
    if req.start_method == "spawn":
        return costs.pool_seconds + workers * SPAWN_START_SECONDS
    fork = stats.fork_seconds if stats.fork_seconds is not None else FORK_START_SECONDS
    return costs.pool_seconds + workers * (costs.worker_seconds + FORKS_PER_WORKER * fork)


def cpus_free(stats: BatchStats, req: LoaderRequest) -> float:
    """CPUs the loader's processes can share: the usable ones, fewer where the probe saw the host busy."""
    usable = float(max(1, req.usable_cpus))
    return usable if stats.free_cpus is None else max(1.0, min(usable, stats.free_cpus))


def cpu_part(stats: BatchStats) -> float:
    """A sample's CPU seconds, as the probe measured them (all of its time when not measured)."""
    cpu = stats.cpu_seconds_per_sample
    return stats.seconds_per_sample if cpu is None else min(cpu, stats.seconds_per_sample)


def steady_sample(stats: BatchStats, costs: WorkerCosts = DEFAULT_COSTS) -> tuple:
    """A sample's ``(wall, CPU)`` seconds once a loop runs, the main process's (``num_workers=0``) or a worker's:
    the probe's fresh samples read after its batches were dropped (``inline_seconds_per_sample``, read in the
    probe's fork, as a worker is one), else its warm reads less what the engine's loops save per MiB of sample
    (``WorkerCosts.saved_per_mib``, up to their CPU part); the CPU part in the same proportion (what a loop saves
    may be first touches of pages, CPU work, or a wait the page cache ended: neither is told apart).

    One time for both, as measured: MindSpore 2.8's DataLoader, ~4 ms of numpy work on 2 MiB samples, read 6.2 ms
    each in the probe's warm reads, 5.1 after, 4.9-5.0 ms in a worker's loop and 5.0 in the main process's (torch
    2.13: 4.0 in both). Workers priced at the warm reads were estimated at 1.36-1.62 s an epoch, ran 1.18-1.26,
    and lost to ``num_workers=0`` (1.28-1.46 s); and where the main process alone was priced at a fraction of the
    warm reads (0.55 for torch, whatever the sample), 30 ms samples of CPU work making 1 KiB kept no workers for
    the 2 that read them in half the time."""
    wall, cpu = stats.seconds_per_sample, cpu_part(stats)
    steady = stats.inline_seconds_per_sample
    if steady is None:
        steady = wall - min(cpu, costs.saved_per_mib * stats.batch_bytes / max(1, stats.batch_size) / (1 << 20))
    if steady >= wall or wall <= 0:
        return wall, cpu
    return steady, cpu * steady / wall


def _seconds(stats: BatchStats, workers: int, req: LoaderRequest, costs: WorkerCosts,
             piped: bool = False) -> float | None:
    """One epoch: the samples' work in the main process, or spread over the workers (their CPU work over the
    free CPUs too), with each batch's transfer (a worker's) and receipt (the main process's), and the workers'
    start and stop; ``piped``: each batch through its worker's pipe besides (``PIPE_SECONDS_PER_MIB``)."""
    if stats.seconds_per_sample is None:
        return None
    samples = 100 * stats.batch_size if stats.samples is None else stats.samples  # zero is known: no epoch to speed up
    batches = -(-samples // max(1, stats.batch_size))
    wall, cpu = steady_sample(stats, costs)
    work = samples * wall
    if workers == 0:
        return work
    transfer = batches * costs.transfer_seconds_per_mib * stats.batch_bytes / (1 << 20)
    busy = samples * cpu + transfer  # what needs a CPU; the rest (waiting) overlaps over the workers
    receive = batches * (PER_BATCH_SECONDS + PER_STORAGE_SECONDS * stats.storages)
    cpus = cpus_free(stats, req)
    spread = max((work + transfer) / workers, busy / min(workers, cpus), (busy + receive) / cpus, receive)
    piping = batches * PIPE_SECONDS_PER_MIB * stats.batch_bytes / (1 << 20) if piped else 0.0
    return start_seconds(workers, stats, req, costs) + spread + piping


def _fd_room(budget: Budget, req: LoaderRequest) -> int | None:
    """Fds the loader may hold once the soft limit is raised to the hard one (``None``: no limit known)."""
    if budget.fds is None:
        return None
    if req.nofile_soft is None or req.nofile_hard is None or req.nofile_hard <= req.nofile_soft:
        return budget.fds
    return budget.fds + (req.nofile_hard - req.nofile_soft)


def _why_not(shm: int, fds: int, worker_fds: int, memory: int, budget: Budget, req: LoaderRequest) -> list:
    why = []
    if budget.shm_bytes is not None and shm > budget.shm_bytes:
        why.append(f"needs {mib(shm)} of /dev/shm > budget {free_text(budget.shm_bytes, shm)}")
    if budget.shm_bytes is None and shm:
        why.append("/dev/shm unknown")
    room = _fd_room(budget, req)
    if room is not None and fds > room:
        why.append(f"needs {fds} fds > {room} left under the open-files limit, even raised to its hard limit "
                   f"{req.nofile_hard}")
    if req.nofile_hard is not None and worker_fds > req.nofile_hard:
        why.append(f"each worker needs {worker_fds} fds > the hard open-files limit {req.nofile_hard}")
    if budget.memory_bytes is not None and memory > budget.memory_bytes:
        why.append(f"needs {mib(memory)} of memory > {free_text(budget.memory_bytes, memory)} left for it")
    return why


def _worker_bytes(stats: BatchStats) -> int:
    """A worker's own pages: the probe child's, else 32 MiB (measured 12-25), and its copies of the dataset's big
    containers."""
    return (stats.worker_bytes if stats.worker_bytes is not None else 32 << 20) + stats.copied_bytes


def _candidates(stats: BatchStats, req: LoaderRequest, budget: Budget, costs: WorkerCosts) -> list:
    out = []
    worker_bytes = _worker_bytes(stats)
    for w in _worker_options(req):
        held = model.held_at_start(w, req.start_method, req.persistent_workers) + (req.read_ahead if w else 0)
        for strategy in _strategy_options(req) if w else [req.strategy]:
            for pf in _prefetch_options(req, w):
                p = pf or 0
                shm = model.shm_peak(stats.batch_bytes, stats.storages, w, p, stats.shared_bytes, held)
                fds = model.main_fds(stats.storages, w, p, strategy)
                wfds = model.worker_fds(stats.storages, p, strategy) if w else 0
                mem = model.memory(stats.batch_bytes, stats.storages, w, p, worker_bytes, req.pin_memory,
                                   stats.shared_bytes, held)
                why = _why_not(shm, fds, wfds, mem, budget, req)
                seconds = _seconds(stats, w, req, costs)
                out.append((Candidate(PROCESSES if w else INLINE, w, p, shm, fds, seconds, not why, "; ".join(why),
                                      mem), strategy))
                if not why:
                    break  # a lower prefetch only adds waiting once this one fits
    return out


def _pipe_candidates(stats: BatchStats, req: LoaderRequest, budget: Budget, costs: WorkerCosts) -> list:
    """The workers asked, their batches through their pipes (``compat.piped``): no ``/dev/shm`` but what a
    ``collate_fn`` of the caller's may build there in each worker, one fd per worker's queue, and the batches in
    flight as memory, each pickled once more while it is sent."""
    out = []
    worker_bytes = _worker_bytes(stats)
    for w in (w for w in _worker_options(req) if w > 0):
        for p in _prefetch_options(req, w):
            shm = w * model.pages(stats.batch_bytes) if req.custom_collate else 0
            fds = model.main_fds(0, w, p, req.strategy)
            mem = model.memory(stats.batch_bytes, stats.storages, w, p, worker_bytes, req.pin_memory,
                               stats.shared_bytes) + w * stats.batch_bytes
            why = _why_not(shm, fds, model.worker_fds(0, p, req.strategy), mem, budget, req)
            seconds = _seconds(stats, w, req, costs, piped=True)
            out.append((Candidate(PIPES, w, p, shm, fds, seconds, not why, "; ".join(why), mem), req.strategy))
            if not why:
                break
    return out


def _pipes_decision(best: Candidate, items: list, req: LoaderRequest, budget: Budget) -> Decision:
    """Why the batches go through pipes, and the ``/dev/shm`` size that would give those workers shared memory."""
    own = [c for c, _ in items if c.mode != PIPES and c.workers == best.workers]
    refused = own[0].why_not if own else ""
    fix = budget_mod.shm_fix(budget, min(c.shm for c in own)) if own else "a larger /dev/shm"
    kept = req.workers_locked or (
        "persistent_workers=True draws the loader's seed once, without workers every epoch" if req.min_workers else
        f"num_workers={req.workers} as the call asked: no fewer workers fit either")
    return Decision("transport", PIPES, "shared memory",
                    f"no configuration with shared memory fits ({refused or 'see the candidates'}), and the workers "
                    f"asked stay ({kept}): each batch travels pickled through its worker's pipe, the same batches "
                    f"with no /dev/shm, ~{PIPE_SECONDS_PER_MIB * 1e3:.1f} ms more per MiB. Fix, for shared memory "
                    f"and its speed: {fix}")


def _rank(item: tuple, req: LoaderRequest, fastest: float | None, kept_short: bool = False) -> tuple:
    """Fastest first, where every estimate within ``plan.TIE_FRACTION`` of the fastest ties (a few probe samples
    cannot tell them apart); then one whose kept batches fit the open-files limit (``_kept_short``); then the
    request's own strategy, then the framework's defaults: the fewest workers (0: none to start), then prefetch 2."""
    c, strategy = item
    seconds = c.seconds if c.seconds is not None else 0.0
    tied = fastest is None or c.seconds is None or seconds <= fastest * (1 + plan.TIE_FRACTION)
    untimed = c.workers if c.seconds is None else 0  # nothing to gain measured: the framework's default, 0
    return (0.0 if tied else seconds, kept_short, strategy != req.strategy, untimed, c.workers, -c.prefetch)


def _kept_short(item: tuple, stats: BatchStats, req: LoaderRequest, room: int | None) -> bool:
    """Whether an epoch's batches kept by the program would pass the open-files limit even raised to the hard one
    (``kept_batch_fds``), where that hard limit is as low as ``startup_strategy`` judges too low for
    ``file_descriptor``: torch's ``file_system`` strategy, the same speed, holds no fd per kept batch (an audit:
    ``ulimit -n 256``, 300 batches kept by ``list(loader)``, died of "Too many open files" raw and through
    ``build_dataloader`` alike; ``tune()`` had switched the strategy, ``build_dataloader`` did not). A higher hard
    limit keeps the framework's strategy: the soft one is raised (``_nofile_decision``)."""
    c, strategy = item
    if room is None or not c.workers or c.mode != PROCESSES or req.nofile_hard is None or \
            req.nofile_hard >= FILE_SYSTEM_BELOW_HARD:
        return False
    return c.fds + kept_batch_fds(stats, strategy) > room


def why_no_workers(stats: BatchStats, req: LoaderRequest, budget: Budget, profile: object = None) -> str | None:
    """Why the plan will choose no workers whatever the probe reads next, or ``None``: asked once the first samples
    are weighed and timed, before the samples a loop's timing needs (``inline_seconds``) and the first one read
    again (for workers' copies of a hidden generator), which only workers need, are read.

    Everything read or measured after can only take workers further out: a worker's own pages, the dataset's
    copies, the fork, the CPUs the host leaves free, samples that draw or depend on the thread count (those keep
    none). So workers are judged at their best: pages and fork at nothing, every usable CPU free, and a loop's
    sample as slow as the probe's warm reads (a faster one shortens none's epoch by all it saves and the workers'
    by at most that over their count). Where then no candidate with two workers or more fits (16 MiB batches under
    Docker's 64 MB; one worker never beats none: its samples, plus each batch's trip and its start), or none is
    within ``plan.TIE_FRACTION`` of the fastest (MindSpore 2.8's DataLoader, 2 MiB samples of ~5 ms in 16 MiB
    batches: none ~1.3 s, 2 workers ~1.6 s, each batch's trip priced at 3.3 ms per MiB), none is chosen."""
    if req.workers is not None or req.min_workers or req.pipes:
        return None  # the workers asked, or some kept: whether samples depend on the reader still matters
    costs = getattr(profile, "costs", None) or DEFAULT_COSTS
    best_case = replace(planned_batch(stats)[0], worker_bytes=stats.worker_bytes or 0, fork_seconds=0.0,
                        free_cpus=None, inline_seconds_per_sample=stats.seconds_per_sample)
    fitting = [i for i in _candidates(best_case, req, budget, costs) if i[0].fits]
    if not any(c.workers >= 2 for c, _ in fitting):
        return "no plan with 2 workers or more fits these batches, and 1 never beats none"
    none, _ = _chosen(fitting, best_case, req, budget)  # the plan's own choice, at the workers' best
    if none.workers or none.seconds is None:
        return None
    priced = min(c.seconds for c, _ in fitting if c.workers)
    return (f"workers at their best (every CPU free, no fork, a loop's sample as slow as a warm one) ~{priced:.2f}"
            f" s/epoch do not beat none's ~{none.seconds:.2f} s by {plan.TIE_FRACTION:.0%}")


def _chosen(fitting: list, stats: BatchStats, req: LoaderRequest, budget: Budget) -> tuple:
    """``(candidate, strategy)`` the plan takes of the ``fitting`` ones: the first by ``_rank``."""
    fastest = min((c.seconds for c, _ in fitting if c.seconds is not None), default=None)
    room = _fd_room(budget, req)
    return min(fitting, key=lambda i: _rank(i, req, fastest, _kept_short(i, stats, req, room)))


def plan_loader(stats: BatchStats, req: LoaderRequest, budget: Budget, profile: object = None) -> Plan:
    """Pick ``num_workers``, ``prefetch_factor`` and the sharing strategy.

    ``profile`` (the engine's ``LoaderProfile``) carries the framework's measured ``WorkerCosts``; without
    one, ``DEFAULT_COSTS``.

    Raises:
        ShmBudgetError: when nothing that keeps the explicit arguments fits.
    """
    measured, (stats, sized) = stats, planned_batch(stats)
    costs = getattr(profile, "costs", None) or DEFAULT_COSTS
    items = _candidates(stats, req, budget, costs)
    fitting = [i for i in items if i[0].fits]
    if not fitting and req.pipes:  # the last resort: the workers asked, their batches through their pipes
        fitting = [i for i in _pipe_candidates(stats, req, budget, costs) if i[0].fits]
    if not fitting:
        raise ShmBudgetError(_no_fit(items, stats, req, budget))
    best, strategy = _chosen(fitting, stats, req, budget)
    room = _fd_room(budget, req)
    decisions = [_mode_decision(best, measured, req, fitting)] + sized
    if best.mode == PIPES:
        decisions.append(_pipes_decision(best, items, req, budget))
    if best.workers and req.prefetch_factor is None and best.prefetch != model.DEFAULT_PREFETCH_FACTOR:
        decisions.append(Decision("prefetch_factor", best.prefetch, model.DEFAULT_PREFETCH_FACTOR,
                                  f"prefetch_factor {model.DEFAULT_PREFETCH_FACTOR} does not fit "
                                  f"({_why_at(items, best, model.DEFAULT_PREFETCH_FACTOR, strategy)})"))
    if strategy != req.strategy:
        decisions.append(Decision("sharing_strategy", strategy, req.strategy,
                                  _strategy_reason(items, best, req, stats, room)))
    decisions += _nofile_decision(best, strategy, stats, req, budget)
    guard = max(0, (budget.shm_bytes or 0)) if best.workers else 0
    return Plan("dataloader", best.mode, best.workers, best.prefetch, best.workers > 0, best.mode != PIPES, None,
                stats.batch_bytes, best.shm, best.fds, 0, budget, True, 0, guard, best.seconds, profile,
                tuple(decisions), (), tuple(c for c, _ in items if c is not best)[:6], best.memory)


def kept_batch_fds(stats: BatchStats, strategy: str) -> int:
    """Fds the batches of one epoch hold where the program keeps them all (``list(loader)``, a buffer of outputs):
    under ``file_descriptor`` a received storage keeps its fd until it is freed, which no plan of the batches in
    flight counts (torch's note "DataLoader on Linux and open files limit"). An epoch of unknown length counts
    ``KEPT_BATCHES_UNKNOWN`` batches."""
    if strategy != model.FILE_DESCRIPTOR:
        return 0
    batches = KEPT_BATCHES_UNKNOWN if not stats.samples else -(-stats.samples // max(1, stats.batch_size))
    return stats.storages * batches


KEPT_BATCHES_UNKNOWN = 256


def _nofile_decision(best: Candidate, strategy: str, stats: BatchStats, req: LoaderRequest, budget: Budget) -> list:
    """The soft open-files limit raised toward the hard one where the batches in flight need it, or where an
    epoch's batches, kept by the program, would pass it (``kept_batch_fds``): process-local, undone by
    ``ms_shm.session().restore()``. An audit: torch's own ``test_chain_iterable_style_dataset`` (35 batches kept
    by ``list(loader)``, one worker) under ``ulimit -Sn 64`` failed with "Too many open files" raw and through
    ms_shm alike, whose plan counted the 14 fds in flight only, which fit."""
    soft, hard, room = req.nofile_soft, req.nofile_hard, budget.fds
    if soft is None or room is None or not best.workers:
        return []
    kept = kept_batch_fds(stats, strategy) if best.mode == PROCESSES else 0  # piped batches arrive as memory
    if best.fds + kept <= room:
        return []
    target = sizes.nofile_within(soft + best.fds + kept - room, hard)
    if target <= soft:
        return []  # nothing to raise it to: the hard limit is the soft one (``tune()`` then picks file_system)
    if best.fds > room:
        why = f"{best.fds} fds for the batches in flight ({_storages(stats.storages, req)} each) > {room} left"
    else:
        why = (f"{best.fds} fds for the batches in flight and {kept} more for an epoch's batches the program may "
               f"keep ({stats.storages} fd(s) each under {strategy} until freed: `list(loader)`, a buffer of "
               f"outputs) > {room} left")
    short = soft + best.fds + kept - room - target  # fds still missing at the target
    fix = (f"; {short} short of them even so, should the program keep them: raise the hard limit (`ulimit -Hn`, "
           f"`docker run --ulimit nofile={sizes.nofile_target(target + short)}`)" if short > 0 else "")
    return [Decision(NOFILE, target, soft, f"{why} under the soft open-files limit: raised toward the hard limit "
                                           f"{hard}{fix}",
                     precaution=best.fds <= room and soft >= KEPT_QUIET_FROM)]


KEPT_QUIET_FROM = 1024  # a soft limit this high (the usual default) raised for batches the program *may* keep: INFO


def planned_batch(stats: BatchStats) -> tuple:
    """``(stats, decisions)``: the batch to plan for. Where the probe's samples (read spread over the dataset)
    differ in size, the largest batch with ``build_dataset``'s margin for ragged rows (``RAGGED_MARGIN``): a few
    samples seldom hold the largest, and the runtime guard covers the rest."""
    if not stats.ragged:
        return stats, []
    planned = int(stats.batch_bytes * RAGGED_MARGIN)
    return replace(stats, batch_bytes=planned), [Decision(
        "batch_bytes", planned, stats.batch_bytes,
        f"batch sizes vary across the probe's samples, read spread over the dataset ({mib(stats.batch_bytes_min)} "
        f"to {mib(stats.batch_bytes)} per batch): planned at {RAGGED_MARGIN}x the largest")]


def kept_plan(req: LoaderRequest, budget: Budget, profile: object = None) -> Plan:
    """The plan of a loader whose ``num_workers`` was not passed and must stay the framework's default
    (``req.workers_locked`` says why): no workers, so no batch in shared memory and nothing to size; the probe
    is not run (it could only cost time, and read from what the dataset streams)."""
    why = f"{req.workers_locked}: the framework's default num_workers=0 is kept; not probed (nothing to size)"
    return Plan("dataloader", INLINE, 0, 0, False, True, None, 0, 0, 0, 0, budget, True, 0, 0, None, profile,
                (Decision("num_workers", 0, 0, why),))


def _mode_decision(best: Candidate, stats: BatchStats, req: LoaderRequest, fitting: list) -> Decision:
    default = req.workers if req.workers is not None else 0
    timing = f"probe batch: {mib(stats.batch_bytes)} in {_storages(stats.storages, req)}{_shared_text(stats)}, " + (
        "samples not timed" if stats.seconds_per_sample is None else
        f"{stats.seconds_per_sample * 1e3:.2f} ms per sample{_inline_text(stats)}") + (
        "; one batch more counted as held by the loop (made by a library whose loop reads one batch ahead)"
        if req.read_ahead and best.workers else "")
    if req.workers is not None:
        why = f"num_workers={req.workers} as passed; {timing}"
    elif req.workers_locked:
        why = f"{req.workers_locked}: the framework's default num_workers=0 is kept; {timing}"
    else:
        rivals = sorted((c for c, _ in fitting if c.workers != best.workers), key=lambda c: c.seconds or 0)
        vs = f" vs {rivals[0].workers} workers ~{rivals[0].seconds:.2f} s" if rivals and rivals[0].seconds else ""
        est = f"~{best.seconds:.2f} s/epoch{vs}; " if best.seconds is not None else ""
        tie = rivals and rivals[0].seconds is not None and best.seconds is not None and \
            rivals[0].seconds < best.seconds
        lead = (f"within {plan.TIE_FRACTION:.0%} of the fastest, the fewer workers kept"
                if tie else "fastest that fits")
        why = f"{lead}: {est}{timing}"
    return Decision("num_workers", best.workers, default, why)


def _storages(count: int, req: LoaderRequest) -> str:
    """A batch's shared-memory files in the framework's word: torch's tensor storages, MindSpore's tensors (an
    audit was told of "storage(s)" by MindSpore's DataLoader)."""
    return f"{count} {'storage(s)' if req.framework == 'torch' else 'tensor(s)'}"


def _inline_text(stats: BatchStats) -> str:
    if stats.workers_ruled_out:
        return (f" ({stats.workers_ruled_out}: the samples a loop's timing needs and the first read again were not "
                f"read)")
    inline = stats.inline_seconds_per_sample
    return "" if inline is None else f" ({inline * 1e3:.2f} once warm, as a loop reads them)"


def _shared_text(stats: BatchStats) -> str:
    """The dataset's storages the batches send views of, where there are any: each worker shares them once."""
    return f" + {mib(stats.shared_bytes)} the dataset holds, in /dev/shm once per worker" if stats.shared_bytes else ""


def _why_at(items: list, best: Candidate, prefetch: int, strategy: str) -> str:
    return next((c.why_not for c, s in items if c.workers == best.workers and c.prefetch == prefetch
                 and s == strategy), "")


def _strategy_reason(items: list, best: Candidate, req: LoaderRequest, stats: BatchStats, room: int | None) -> str:
    why = next((c.why_not for c, s in items if c.workers == best.workers and s == req.strategy), "") or (
        f"an epoch's batches kept by the program would hold {kept_batch_fds(stats, req.strategy)} fds, "
        f"{stats.storages} each, beyond the {room} the hard open-files limit {req.nofile_hard} leaves")
    return (f"{req.strategy} does not fit ({why}); file_system names each batch's storages in /dev/shm instead of "
            f"passing an fd per storage, so a killed run leaves /dev/shm/torch_* files behind (`ms-shm clean` "
            f"removes those of dead processes); this is process-wide")


def _no_fit(items: list, stats: BatchStats, req: LoaderRequest, budget: Budget) -> str:
    """The numbers, why each candidate failed, and the fixes that apply. Where ``num_workers`` is kept because
    workers change what arrives (``req.workers_locked``), dropping it comes last, saying so: it cannot give the
    same batches (the audit's ``bigrand.py`` was told only "drop the explicit num_workers=2")."""
    asked = [f"{k}={v}" for k, v in (("num_workers", req.workers), ("prefetch_factor", req.prefetch_factor))
             if v is not None]
    least = min((c for c, _ in items), key=lambda c: (c.shm, c.fds))
    least_memory = min((c.memory for c, _ in items), default=0)
    reasons = sorted({f"{c.workers} workers, prefetch {c.prefetch}: {c.why_not}" for c, _ in items})
    memory_text = "" if budget.memory_bytes is None else (
        f", {mib(least_memory)} of memory against {mib(budget.memory_bytes)} left for it ({budget.memory_reason})")
    drop = f"drop the explicit {' / '.join(asked)} so ms_shm can choose" if asked else ""
    locked = req.workers_locked and req.workers is not None
    fixes = [] if locked else [drop]
    shm_binds = budget.shm_bytes is not None and least.shm > budget.shm_bytes  # only the limits that bind
    fixes.append(budget_mod.limits_fix(budget, least.shm, least.fds))
    memory = plan.memory_fix(least_memory, budget, staged=False)
    # bytes shrink with the batch, not below one sample (fds: a default collate stacks each field into one storage)
    smaller = "a smaller batch_size" if stats.batch_size > 1 and (shm_binds or memory) else ""
    shared = (f"share the dataset's big lists and dicts (`ms_shm.SharedList` / `SharedDict`, named in the "
              f"copy-on-read warning): each worker copies ~{mib(stats.copied_bytes)} of them"
              if memory and stats.copied_bytes and _least_memory_workers(items) else "")
    fixes += [shared, memory, smaller]
    if req.prefetch_factor is not None and req.prefetch_factor > 1:
        fixes.append(f"prefetch_factor={req.prefetch_factor - 1}")
    if locked:
        fixes.append(f"{drop} (the batches would then differ: {req.workers_locked})")
    return (f"No DataLoader configuration honouring {', '.join(asked) or 'the request'} fits: batches of "
            f"{mib(stats.batch_bytes)} in {_storages(stats.storages, req)}{_shared_text(stats)}; the smallest needs {mib(least.shm)} of /dev/shm "
            f"against {mib(budget.shm_bytes)} ({budget.reason}) and {least.fds} fds against "
            f"{budget.fds if budget.fds is not None else 'unlimited'}{memory_text}. Why: {' | '.join(reasons)[:600]}. "
            f"Fix: {'; or '.join(f for f in fixes if f)}.")


def _least_memory_workers(items: list) -> int:
    """The workers of the candidate that needs the least memory: where it has none, the copies are not why."""
    return min(((c.memory, c.workers) for c, _ in items), default=(0, 0))[1]


FILE_SYSTEM_BELOW_HARD = 4096  # a hard open-files limit this low cannot carry a loader's batches as fds


def unplanned_fd_decisions(req: LoaderRequest) -> list:
    """What a loader with workers whose batches were not measured (its probe failed) needs of the open-files
    limits all the same: ``file_system`` under a hard limit too low for ``file_descriptor`` (``startup_strategy``,
    where the framework can switch), else, under ``file_descriptor``, a soft limit below the usual default raised
    toward the hard one (every storage in flight or kept holds an fd)."""
    if req.can_switch_strategy:
        switch = startup_strategy(req.nofile_hard, req.strategy)
        if switch is not None:
            return [switch]
    soft, hard = req.nofile_soft, req.nofile_hard
    if req.strategy != model.FILE_DESCRIPTOR or soft is None or soft >= KEPT_QUIET_FROM or \
            (hard is not None and hard <= soft):
        return []
    target = sizes.nofile_within(soft, hard)  # at least NOFILE_FLOOR
    return [Decision(NOFILE, target, soft, f"the batches were not measured, and under {req.strategy} each "
                                           f"storage a worker sends holds an fd while in flight or kept: the soft "
                                           f"open-files limit {soft} raised toward the hard limit {hard}")]


def startup_strategy(nofile_hard: int | None, current: str) -> Decision | None:
    """At ``tune()``, with torch loaded: ``file_system`` where the hard open-files limit is too low for
    ``file_descriptor`` (one fd per storage in flight, in every worker too), else nothing."""
    if nofile_hard is None or nofile_hard >= FILE_SYSTEM_BELOW_HARD or current != model.FILE_DESCRIPTOR:
        return None
    return Decision("sharing_strategy", model.FILE_SYSTEM, current,
                    f"the hard open-files limit is {nofile_hard} (< {FILE_SYSTEM_BELOW_HARD}): file_descriptor "
                    f"passes one fd per tensor storage in flight; file_system names them in /dev/shm instead "
                    f"(`ms-shm clean` removes the /dev/shm/torch_* files a killed run leaves)")


__all__ = ["BatchStats", "LoaderRequest", "WorkerCosts", "DEFAULT_COSTS", "plan_loader", "why_no_workers", "planned_batch", "kept_plan",
           "start_seconds", "cpus_free", "cpu_part", "steady_sample", "startup_strategy", "unplanned_fd_decisions"]
