"""How MindSpore's GeneratorDataset and map can move rows, priced: facts in, a ``Plan`` out. Pure.

Each candidate (transport x workers x prefetch) is priced twice: what it needs (``arithmetic``, exact for
MindSpore 2.10) against what this rank may use (``budget``), and how long an epoch would take (from the probe
rows' timing and per-row costs measured on MindSpore 2.10). ``plan.rank`` picks the fastest that fits;
arguments the user passed explicitly are never changed, except where MindSpore itself would refuse them.
MindSpore's own rules live here: one worker runs in MindSpore's thread whatever ``python_multiprocessing``
says, a static ``max_rowsize`` cannot be pickled for spawn, spawn pools cost seconds to start.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

from ms_shm import parallel, plan
from ms_shm._results import Result, free_text, mib, record
from ms_shm.budget import Budget
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import polling
from ms_shm.engines.mindspore.profiles import EngineProfile, profile_for
from ms_shm.errors import ShmBudgetError
from ms_shm.plan import INLINE, MODES, PIPES, PROCESSES, THREADS, Candidate, Decision, Plan, Request
from ms_shm.rows import RowStats

RAGGED_MARGIN = 1.5  # plan ragged rows at 1.5x the largest probe row; the runtime guard covers the rest
# An epoch whose rows cannot be counted before it runs (a map over a stream, or over a folder or record files
# MindSpore reads) is priced at this many rows, and the reason says so. The two ways of guessing wrong are not alike:
# a pool's fixed cost is paid once (1.1-1.2 s on 2.10, for every epoch the iterator runs), while the wrong transport
# loses on every row of every epoch. Priced at 100, a 20 ms GIL-bound map over a 200-row stream went to threads in
# 1 of 3 builds, 5.4 s against processes' 4.4-4.9 s; at 1000, a map goes to processes once its rows hold the GIL for
# ~3 ms or more, and a 100-row stream that did not need them pays at most the pool's fixed cost.
UNKNOWN_ROWS = 1000


@record
class Costs(Result):
    """Per-row cost in the main process (seconds = a + b * MiB) and pool start-up, per transport.

    Measured on this project's 2-core reference machine with MindSpore 2.10 (``benchmarks/bench_core.py``).
    """

    per_row: tuple = ((INLINE, 4e-5, 1.3e-4), (THREADS, 5e-5, 3.5e-4), (PROCESSES, 3e-4, 4.2e-4),
                      (PIPES, 3e-4, 2.3e-3))
    startup: tuple = ((INLINE, 0.0), (THREADS, 0.10), (PROCESSES, 0.20), (PIPES, 0.20))
    spawn_startup: float = 3.8  # spawn re-imports MindSpore in each worker: 2.1 s to start, 1.7 s to stop
    # how often a GeneratorDataset's main process looks for its workers' next row (``polling``); the start-up
    # figures above were fitted with MindSpore's own 0.1 s, whose first poll every iterator of workers waits
    poll_seconds: float = polling.POLL_SECONDS

    def row(self, mode: str, row_bytes: int) -> float:
        a, b = next((a, b) for m, a, b in self.per_row if m == mode)
        return a + b * row_bytes / model.MiB

    def start(self, mode: str) -> float:
        return next(s for m, s in self.startup if m == mode)

    def on_this_host(self, transfer: Any) -> "Costs":
        """The per-MiB parts scaled by how fast this host copies and pipes (``hostcost.TransferCosts``)
        compared with the reference machine; unchanged where it was not measured."""
        ratio = {PIPES: transfer.pipe_ratio}
        return replace(self, per_row=tuple((m, a, b * ratio.get(m, transfer.copy_ratio))
                                           for m, a, b in self.per_row))


def priced_rows(rows: int | None) -> int:
    """The rows (batches) one epoch is priced at: ``rows`` where known, zero too, else ``UNKNOWN_ROWS``. A shard
    or a validation set smaller than a ``drop_remainder`` batch has none; priced as unknown, its
    ``per_batch_map`` got a pool of worker processes started and closed for nothing (0.01 s raw, 1.2-1.3 s
    under ``patch()``)."""
    return UNKNOWN_ROWS if rows is None else rows


def _epoch_seconds(mode: str, workers: int, stats: RowStats, rows: int, costs: Costs,
                   start_method: str = "fork", cpus: int | None = None, prefetch: int | None = None
                   ) -> float | None:
    """Estimated seconds for one epoch; ``None`` when the rows were not timed. ``prefetch``: a GeneratorDataset's
    (its worker queues' depth, ``_polled_row``); ``None`` for a map or batch, whose pools are not polled.

    Threads: waiting (I/O, sleep) overlaps across threads; of the CPU part, what the probe measured running
    outside the GIL (``parallel_fraction``) spreads over the threads and cores, the rest and the per-row hand-off
    are serial (all of the CPU part when not measured). Processes: the workers' CPU work and the main process's
    per-row cost share the cores. Rows whose library runs its own thread pool (``RowStats.pooled``) burn the CPU
    it kept busy (``cores_busy``), and under threads they queue on that one pool: their parallel part already ran.
    """
    t = stats.seconds_per_row
    if t is None:
        return None
    pooled = stats.pooled
    # A pooled row's thread waits for its pool, not for I/O: that wait does not overlap under threads.
    cpu = 1.0 if stats.cpu_fraction is None or pooled else min(1.0, max(0.0, stats.cpu_fraction))
    work = t * max(cpu, stats.cores_busy) if pooled else t * cpu  # CPU seconds a row burns, on every thread
    cores = max(1, cpus or workers)
    overhead = costs.row(mode, stats.row_bytes_max)
    if mode == INLINE:
        made = per_row = t + overhead
    elif mode == THREADS:
        # One thread at a time holds the GIL for the row's serial part and MindSpore's per-row hand-off; the
        # rest runs beside it, as far as the cores go; waiting overlaps across threads.
        free = 0.0 if pooled else stats.parallel_fraction or 0.0
        serial = t * cpu * (1 - free) + overhead
        spread = cores if pooled else min(workers, cores)  # a pool spreads one thread's row over the cores
        made = max(serial, (work + overhead) / spread) + t * (1 - cpu) / workers
        per_row = made
    else:
        made = max(t / workers, (work + overhead) / cores)
        per_row = max(made, overhead) + 0.25 * overhead
    start = costs.start(mode)
    polled = _polled_row(mode, workers, prefetch, costs.poll_seconds)
    epoch = rows * per_row
    if polled:  # a GeneratorDataset's workers: the first row waits one poll, as in the start-up figures
        start = max(0.0, start - polling.POLL_SECONDS + costs.poll_seconds)
        if made > max(overhead, CAUGHT_UP_FROM) and polled > per_row:  # polls, the first one among them
            start = max(0.0, start - costs.poll_seconds)
            epoch = math.ceil(rows * polled / costs.poll_seconds - 1e-9) * costs.poll_seconds
    if mode in (PROCESSES, PIPES) and start_method == "spawn":
        start += costs.spawn_startup
    return start + epoch


# MindSpore's GeneratorDataset main process polls its workers (``polling``): where the workers make rows slower
# than it takes them, it catches up and waits a poll, so an epoch runs no faster than W x (depth + 1) rows per
# poll, whatever the rows cost; the depth is what a worker holds indices for. Measured on 2.10 with MindSpore's own
# 0.1 s poll (2 workers, 16 KiB rows of pure Python, 600 rows): rows of 0.5, 1, 2 and 5 ms took 2.2, 2.5, 3.1, 4.8
# ms each on threads and 2.7, 2.9, 3.2, 3.7 ms in processes, against 0.5, 0.9, 1.9, 4.6 ms read inline; bench_core's
# 8 ms JPEG rows in processes took 16-18 ms each at prefetch 2 (depth 2) and 10-11 ms at 4, against 5 ms at 16.
# ... but the main process has its own per-row work (the iterator, a batch): workers making a row in less time
# are never caught up with (16 KiB rows of no work: 0.4-0.6 ms each on 2 threads or 2 processes, not 2.9 ms;
# bench_core's 8 MiB rows, 0.4-0.5 s an epoch of 100 on either).
CAUGHT_UP_FROM = 3e-4
THREAD_QUEUE = 16  # a worker thread's queues (``_GeneratorWorker``: ``queue.Queue(16)``), whatever the prefetch


def _polled_row(mode: str, workers: int, prefetch: int | None, poll: float) -> float:
    """The fewest seconds per row a GeneratorDataset's polling of ``workers`` every ``poll`` seconds lets through;
    0 for a map or batch (``prefetch`` ``None``: their pools are not polled so), one worker (read in MindSpore's
    own thread) or inline."""
    if prefetch is None or workers <= 1 or mode == INLINE:
        return 0.0
    depth = THREAD_QUEUE if mode == THREADS else model.queue_size(prefetch, workers)
    return poll / (workers * (depth + 1))


def _prefetch_options(current: int) -> list:
    return list(range(max(1, current), 0, -1))


def _worker_options(req: Request) -> list:
    cap = max(1, min(req.cpu_count, req.usable_cpus))
    asked = _workers_cap(req)[0]
    return [max(1, asked)] if asked is not None else list(range(1, cap + 1))


def _modes(req: Request, notes: list, stats: RowStats | None = None) -> list:
    """The transports the request allows. One worker runs in MindSpore's own thread whatever
    ``python_multiprocessing`` says (it checks W > 1), so ``python_multiprocessing=True`` with the workers left
    out (MindSpore's default is one) allows it too: MindSpore's UT ``test_generator_19``, 10 rows of 0.02 ms,
    read 0.01 s raw and 0.28-1.5 s in the two worker processes ms_shm chose when it did not. Rows of MindSpore
    Tensors are not moved into worker processes unless asked: they travel through MindSpore's own tensor
    reductions there, which fail under NumPy 2 (``SystemError`` in ``_restore_tensor``, seen in MindSpore's own
    unit tests)."""
    if req.multiprocessing is True:
        modes = [PROCESSES, PIPES] + ([INLINE] if req.workers in (None, 1) else [])
    elif req.multiprocessing is False or (stats is not None and (stats.framework_tensors or stats.rows_one_column)):
        modes = [THREADS, INLINE]
        if stats is not None and stats.rows_one_column and req.multiprocessing is None:
            notes.append(f"rows are {stats.rows_one_column}s, which MindSpore's worker processes carry as one "
                         f"column (their queue wraps a row that is not a tuple): read in this process, in threads "
                         f"or in MindSpore's own thread. To allow worker processes, return a tuple")
    else:
        modes = list(MODES)
    if not req.can_switch_shared_mem and PIPES in modes:
        modes.remove(PIPES)
        notes.append("this MindSpore has no set_enable_shared_mem: pipes are not available")
    elif not req.shared_mem and PROCESSES in modes:  # ms_shm never switches it back on
        modes.remove(PROCESSES)
        notes.append("shared memory is switched off in this process (set_enable_shared_mem(False)): worker "
                     "processes send rows through pipes")
    return modes


def _limits(req: Request, stats: RowStats) -> str:
    """What kept transports out of the candidates (``_modes``'s notes), for the mode decision's reason."""
    notes: list = []
    _modes(req, notes, stats)
    return "".join(f"; {n}" for n in notes)


def _static_rowsize(req: Request, profile: EngineProfile, row_bytes: int, shared: bool) -> int | None:
    """The static slot size (MiB) a shared-memory candidate uses: the caller's, or the release's default."""
    if not shared:
        return None
    if req.max_rowsize:
        return req.max_rowsize
    if profile.generator_default_max_rowsize_mb:
        return max(model.static_rowsize_for(row_bytes), profile.generator_default_max_rowsize_mb)
    return None


def _why_not_memory(memory: int, budget: Budget) -> list:
    if budget.memory_bytes is not None and memory > budget.memory_bytes:
        return [f"needs {mib(memory)} of memory > {free_text(budget.memory_bytes, memory)} left for it"]
    return []


def _why_not(mode: str, shm: int, fds: int, static: int | None, req: Request, budget: Budget,
             stats: RowStats, memory: int = 0) -> list:
    """Why a candidate cannot run here: the budgets, the fd limit, and MindSpore's own refusals."""
    why = _why_not_memory(memory, budget)
    if budget.shm_bytes is None and mode in (PROCESSES, PIPES):
        why.append("/dev/shm unknown")
    elif budget.shm_bytes is not None and shm > budget.shm_bytes:
        why.append(f"needs {mib(shm)} > budget {free_text(budget.shm_bytes, shm)}")
    if budget.fds is not None and fds > budget.fds:
        why.append(f"needs {fds} fds > {budget.fds} left under the open-files limit")
    if static and req.start_method == "spawn":
        why.append("a static max_rowsize cannot be used with spawn: MindSpore fails to pickle its ctypes slots "
                   "('Failed to launch multiprocessing')")
    if static and static * model.MiB <= stats.row_bytes_max:
        why.append(f"max_rowsize={static} MiB is not larger than the {mib(stats.row_bytes_max)} row")
    return why


def _candidates(stats: RowStats, req: Request, budget: Budget, profile: EngineProfile,
                row_bytes: int, costs: Costs, notes: list) -> list:
    rows = _epoch_rows(req, stats)
    out = []
    for mode in _modes(req, notes, stats):
        for w in _worker_options(req):
            if (w == 1) != (mode == INLINE):
                continue
            static = _static_rowsize(req, profile, row_bytes, mode == PROCESSES)
            for p in _prefetch_options(req.prefetch):
                shm, fds, memory = _generator_needs(mode, w, p, row_bytes, static, stats.worker_bytes, rows,
                                                    _by_reference(stats, profile), _dict_bytes(stats))
                why = _why_not(mode, shm, fds, static, req, budget.at_prefetch(p), stats, memory)
                if mode == THREADS and budget.shm_bytes is None and profile.threads_need_dev_shm:
                    why.append(f"MindSpore {profile.version} needs /dev/shm for threads too (a multiprocessing.Value)")
                secs = _epoch_seconds(mode, w, stats, priced_rows(rows), costs, req.start_method, req.usable_cpus,
                                      prefetch=p)
                out.append(Candidate(mode, w, p, shm, fds, secs, not why, "; ".join(why), memory))
                if not why:
                    break  # a lower prefetch is never faster (``_polled_row``) once this one fits
    return out


def _epoch_rows(req: Request, stats: RowStats) -> int | None:
    return req.rows_per_epoch if req.rows_per_epoch is not None else stats.length


def _by_reference(stats: RowStats, profile: EngineProfile) -> float:
    """The share of a row MindSpore's own process carries without a copy (``arithmetic.generator_memory``):
    before, a list of two 300 MiB arrays was refused in a 1300 MB container where raw ran at a 770 MiB peak."""
    return (stats.held_fraction or 0.0) if profile.rows_by_reference else 0.0


def _dict_bytes(stats: RowStats) -> int:
    """The memory a row's dict columns hold beside its slot bytes (``RowStats.dict_bytes_max``), with the ragged
    rows' margin."""
    return int(stats.dict_bytes_max * (RAGGED_MARGIN if stats.ragged else 1.0))


def _generator_needs(mode: str, workers: int, prefetch: int, row_bytes: int, static: int | None,
                     worker_bytes: int | None, rows: int | None, by_reference: float = 0.0,
                     dict_bytes: int = 0) -> tuple:
    """``(shm, fds, memory)`` of one GeneratorDataset transport. Slots over the iterator's life, not one epoch's
    rows: a worker cycles through every slot it has across epochs (num_epochs > 1, repeat(), the next epoch
    prefetched), and the epochs an iterator runs are not known here (an audit: 16 rows, num_epochs=3,
    RowTooLargeError mid-epoch 2)."""
    in_process, shared = mode in (INLINE, THREADS), mode == PROCESSES
    shm = 0 if in_process else model.generator_peak(row_bytes, workers, prefetch, None, static, shared_mem=shared)
    fds = 0 if in_process else model.generator_fds(workers, prefetch, None, shared_mem=shared)
    return shm, fds, model.generator_memory(mode, row_bytes, workers, prefetch, shm, worker_bytes, rows,
                                            by_reference, dict_bytes)


def next_stage_memory(row_bytes: int) -> int:
    """The least memory a stage after the source holds: a map of rows this size in one thread at prefetch 1
    (its output connector, the next stage's, the row being made: ``map_memory``)."""
    return model.map_memory(False, row_bytes, 1, 1, model.MapCost(0, 0, 0), None)


def plain_batch_prefetch(row_bytes: int, batch_size: int, prefetch: int, batches: int | None,
                         budget: Budget) -> int | None:
    """The largest prefetch, up to ``prefetch`` (MindSpore's global setting now), at which a plain batch of
    ``batch_size`` rows of ``row_bytes`` holds no more than the memory left (``arithmetic.batch_memory``; the
    stages below it give some back at a lower prefetch), or ``None`` where none does. Lowering it leaves the
    batches as they are."""
    return next((p for p in range(prefetch, 0, -1)
                 if model.batch_memory(row_bytes, batch_size, p, batches) <= budget.at_prefetch(p).memory_bytes),
                None)


def _candidates_leaving_room(stats: RowStats, req: Request, budget: Budget, profile: EngineProfile,
                             row_bytes: int, costs: Costs) -> tuple:
    """The candidates priced against the memory left once the least a next stage holds is kept aside, and the
    decision that says so; against the whole budget where that changes nothing or leaves nothing that fits.

    Where memory binds, the source planned first took the fastest plan up to the whole budget, and the ``map``
    after it found nothing left: an audit's generator + map of 8 MiB rows under a 600 MB container was refused 6
    runs of 6, where a slower source plan (fewer rows in flight) leaves the map its room."""
    whole = _candidates(stats, req, budget, profile, row_bytes, costs, [])
    if budget.memory_bytes is None:
        return whole, None
    reserve = next_stage_memory(row_bytes)
    cands = _candidates(stats, req, replace(budget, memory_bytes=max(0, budget.memory_bytes - reserve)), profile,
                        row_bytes, costs, [])
    if not any(c.fits for c in cands):  # said, so that unchanged code whose settings may give way tries that
        return whole, Decision("memory_kept_for_next_stage", 0, reserve,
                               f"nothing honouring the call's settings fits once {mib(reserve)} of the "
                               f"{mib(budget.memory_bytes)} memory budget is kept for a stage after this one: a map "
                               f"after it may find no memory left")
    if _chosen(whole, req) == _chosen(cands, req):
        return whole, None
    return cands, Decision("memory_kept_for_next_stage", reserve, 0,
                           f"{mib(reserve)} of the {mib(budget.memory_bytes)} memory budget is left for a stage after "
                           f"this one (a map of these rows in one thread holds at least that): a source that takes "
                           f"it all leaves the map after it nothing")


def _chosen(cands: list, req: Request) -> tuple | None:
    fitting = [c for c in cands if c.fits]
    best = plan.choose(fitting, req, default_mode(req))[0] if fitting else None
    return (best.mode, best.workers, best.prefetch) if best else None


def plan_generator(stats: RowStats, request: Request, budget: Budget, profile: EngineProfile,
                   costs: Costs = Costs()) -> Plan:
    """Pick transport, workers and prefetch for a GeneratorDataset.

    Raises:
        ShmBudgetError: when nothing that honours the caller's explicit arguments fits the budget.
    """
    req = request
    if not stats.random_access:
        return plan_iterable(req, budget, profile)
    row, decisions = _planned_row(stats, req)
    cands, room = _candidates_leaving_room(stats, req, budget, profile, row, costs)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        relaxed = _candidates(stats, plan.unasked(req), budget, profile, row, costs, [])
        raise ShmBudgetError(plan.no_fit_message(cands, req, budget, stats, row, any(c.fits for c in relaxed)))
    best, kept = plan.choose(fitting, req, default_mode(req))
    decisions.append(Decision("mode", best.mode, default_mode(req),
                              _mode_reason(best, fitting, req, stats) + kept + plan.unknown_shm(budget)
                              + _limits(req, stats)))
    if room:
        decisions.append(room)
    decisions += _setting_decisions(best, cands, req, budget)
    shared = best.mode == PROCESSES
    static = req.max_rowsize if shared else None
    if shared and static is None and profile.generator_default_max_rowsize_mb:
        static = max(model.static_rowsize_for(row), profile.generator_default_max_rowsize_mb)
        decisions.append(Decision("max_rowsize", static, profile.generator_default_max_rowsize_mb,
                                  f"MindSpore {profile.version} uses static slots; must exceed the row"))
    if shared and profile.watchdog_leaks_slots:
        decisions.append(Decision("enable_watchdog", False, True,
                                  f"MindSpore {profile.version}'s watchdog reaps worker processes it does not own, and "
                                  f"then ~18% of iterators leave their static slots committed until the process "
                                  f"ends, so a later epoch fails the pre-check (measured; none with it off)"))
    slots = model.slots(best.prefetch, best.workers) if shared else 0
    worker_share, budget = 0, budget.at_prefetch(best.prefetch)
    if shared and budget.shm_bytes is not None and static is None:
        worker_share = (budget.shm_bytes - model.semaphore_bytes(best.workers)) // best.workers
    needs = functools.partial(_generator_needs, best.mode, best.workers, row_bytes=row, static=static,
                              worker_bytes=stats.worker_bytes, rows=_epoch_rows(req, stats),
                              by_reference=_by_reference(stats, profile), dict_bytes=_dict_bytes(stats))
    return Plan("generator", best.mode, best.workers, best.prefetch, best.mode in (PROCESSES, PIPES),
                shared, static, row, best.shm, best.fds, 0, budget, True, slots,
                worker_share, best.seconds, profile, tuple(decisions), (), tuple(plan.top(cands, best)), best.memory,
                by_prefetch=tuple(needs(p) for p in range(1, best.prefetch + 1)),
                lean=_lean_generator(best, stats, req, row, costs, _by_reference(stats, profile),
                                     _dict_bytes(stats)),
                in_process=_in_process(best, stats, req, costs))


def _in_process(best: Candidate, stats: RowStats, req: Request, costs: Costs) -> tuple:
    """``Plan.in_process``: MindSpore's own mode where it reads in this process, else the fastest such setting
    ``_modes`` allows (none where the call asked for worker processes, or rows depend on who reads them)."""
    if best.mode != PROCESSES:
        return ()
    own = default_mode(req)
    if own in (INLINE, THREADS):
        return own, best.workers if own == THREADS else 1
    rows = priced_rows(_epoch_rows(req, stats))
    options = _in_process_options(req, stats)
    if not options:
        return ()
    return min(options, key=lambda o: _epoch_seconds(*o, stats, rows, costs, req.start_method, req.usable_cpus,
                                                     prefetch=best.prefetch) or 0.0)


def _in_process_options(req: Request, stats: RowStats) -> list:
    """``(mode, workers)`` the call allows in this process: MindSpore's own thread, or threads."""
    return [(mode, w) for mode in _modes(req, [], stats) if mode in (INLINE, THREADS)
            for w in _worker_options(req) if (w == 1) == (mode == INLINE)]


def _lean_generator(best: Candidate, stats: RowStats, req: Request, row: int, costs: Costs,
                    by_reference: float, dict_bytes: int) -> plan.Lean | None:
    """The in-process settings the call allows that hold the least memory at the chosen prefetch, where that is
    less than the chosen ones hold and no more of /dev/shm or fds: worker processes are not started on a
    stage's behalf after it was built (their slots and the runtime guard are sized at the plan)."""
    rows = _epoch_rows(req, stats)
    options = _in_process_options(req, stats)
    if not options:
        return None

    def needs(mode: str, w: int, prefetch: int) -> tuple:
        return _generator_needs(mode, w, prefetch, row, None, stats.worker_bytes, rows, by_reference, dict_bytes)

    mode, w = min(options, key=lambda o: needs(*o, best.prefetch)[2])
    shm, fds, memory = needs(mode, w, best.prefetch)
    if memory >= best.memory or shm > best.shm or fds > best.fds:
        return None
    return plan.Lean(mode, w, _epoch_seconds(mode, w, stats, priced_rows(rows), costs, req.start_method,
                                             req.usable_cpus, prefetch=best.prefetch),
                     tuple(needs(mode, w, p) for p in range(1, best.prefetch + 1)))


def _planned_row(stats: RowStats, req: Request) -> tuple:
    """The row size to plan for (ragged rows with a margin), and the decisions that explain it."""
    row, decisions = stats.row_bytes_max, []
    if stats.ragged:
        row = int(row * RAGGED_MARGIN)
        decisions.append(Decision("row_bytes", row, stats.row_bytes_max,
                                  f"row sizes vary across probe rows ({mib(stats.row_bytes_min)} to "
                                  f"{mib(stats.row_bytes_max)}): planned at {RAGGED_MARGIN}x the largest"))
    return row, decisions + _workers_cap(req)[1]


def _setting_decisions(best: Candidate, cands: list, req: Request, budget: Budget) -> list:
    """Workers, prefetch and the shared-memory switch where the chosen candidate differs from the request."""
    out = []
    capped = _workers_cap(req)[0]  # the cap's decision is logged already
    asked = capped if capped is not None else 1
    if best.workers != asked:
        out.append(Decision("num_parallel_workers", best.workers, req.workers or 1,
                            "fastest that fits" if req.workers is None else "capped"))
    if best.prefetch != req.prefetch:
        out.append(Decision("prefetch_size", best.prefetch, req.prefetch,
                            f"prefetch {req.prefetch} does not fit ({_why_not_at(cands, best, req.prefetch)}); "
                            f"this lowers MindSpore's global prefetch size"))
    if best.mode == PIPES and req.shared_mem:
        slots_why = [c.why_not for c in cands if c.mode == PROCESSES and c.workers == best.workers]
        out.append(Decision("shared_mem", False, True,
                            "rows go through pipes: shared-memory slots "
                            + (f"do not fit ({slots_why[-1]})" if slots_why and slots_why[-1] else "are not faster")))
    return out


def _why_not_at(cands: list, best: Candidate, prefetch: int) -> str:
    return next((c.why_not for c in cands if c.mode == best.mode and c.workers == best.workers
                 and c.prefetch == prefetch), "")



def default_mode(req: Request) -> str:
    w = req.workers or 1
    if w <= 1:
        return INLINE
    return THREADS if req.multiprocessing is False else PROCESSES if req.shared_mem else PIPES


def _map_mode(req: Request) -> str:
    """The mode MindSpore's own map (or batch) arguments give: its threads (one or more) by default, processes
    where asked, whatever the shared-memory switch says (a map's rows go through SysV segments)."""
    return PROCESSES if req.multiprocessing is True else THREADS


def _mode_reason(best: Candidate, fitting: list, req: Request, stats: RowStats, native: bool = False) -> str:
    """``native``: a map of MindSpore's C++ transforms only (``plan_map``'s ``python_pool`` False)."""
    if best.seconds is None:
        return "rows were not timed: MindSpore's default transport that fits"
    rivals = sorted((c for c in fitting if c.mode != best.mode), key=lambda c: c.seconds or 0)
    free = stats.parallel_fraction
    unpaired = f", rows over {mib(parallel.PAIR_ROWS_UP_TO)} being read one at a time" \
        if (stats.row_bytes_max or 0) > parallel.PAIR_ROWS_UP_TO else ""
    gil = ("; MindSpore's C++ transforms, which its map threads run outside the GIL (the probe's own calls hold it)"
           if native else
           f"; its CPU work's share outside the GIL was not measured{unpaired} (taken as none)" if free is None else
           f", {free:.0%} of their CPU work ran outside the GIL (two rows read at once)")
    if stats.pooled:
        gil += (f"; their library kept {stats.cores_busy:.1f} CPUs busy on its own thread pool, which threads "
                f"share and worker processes split")
    timing = (f"probe rows took {stats.seconds_per_row * 1e3:.2f} ms each "
              f"({(stats.cpu_fraction or 0) * 100:.0f}% CPU){gil}, {mib(stats.row_bytes_max)}")
    if rivals:
        r = rivals[0]
        return (f"fastest that fits: ~{best.seconds:.2f} s/epoch vs {r.mode} x{r.workers} ~{r.seconds:.2f} s; "
                f"{timing}")
    if req.workers is not None and (req.workers <= 1 or req.multiprocessing is not None):
        return f"the transport the call's settings give; {timing}"  # asked for, or MindSpore's own (mode_locked)
    return f"the only transport that fits; {timing}"



def plan_iterable(req: Request, budget: Budget, profile: EngineProfile) -> Plan:
    """An iterable or generator source: MindSpore reads it in the main process, whatever the arguments."""
    workers, capped = _workers_cap(req)
    # INLINE is MindSpore's own doing here, not a change ms_shm makes: default and value agree (no "adapted")
    decision = Decision("mode", INLINE, INLINE,
                        "the source has no __getitem__/__len__: MindSpore reads it in the main process and ignores "
                        "num_parallel_workers, so it uses no shared memory; it is passed on untouched")
    return Plan("generator", INLINE, workers or 1, req.prefetch,
                req.multiprocessing if req.multiprocessing is not None else True, req.shared_mem,
                req.max_rowsize, 0, 0, 0, 0, budget, True, 0, 0, None, profile, (*capped, decision))


def plan_unmeasured(req: Request, budget: Budget, profile: EngineProfile, why: str | None,
                    kind: str = "generator") -> Plan:
    """No measurement: MindSpore's own settings, unchanged; the reason says why and what is unknown."""
    default_mp = kind == "generator"
    mp = req.multiprocessing if req.multiprocessing is not None else default_mp
    workers, capped = _workers_cap(req)
    workers = workers if workers is not None else 1
    mode = default_mode(replace(req, workers=workers, multiprocessing=mp))
    decision = Decision("mode", mode, mode, f"not measured ({why}): MindSpore's own settings are kept, and "
                                            f"ms_shm cannot predict their shared memory")
    return Plan(kind, mode, workers, req.prefetch, mp and workers > 1, req.shared_mem, req.max_rowsize, 0, 0, 0,
                0, budget, True, 0, 0, None, profile, (*capped, decision))


def _workers_cap(req: Request) -> tuple:
    return cap_workers(req.workers, req.cpu_count)


def cap_workers(workers: int | None, cpu_count: int) -> tuple:
    """``(workers, decisions)``: the workers asked, at most ``os.cpu_count()``, which MindSpore refuses to exceed
    (its ValueError, raised under ``patch(strict=True)`` only), and the decision saying so where it capped. Also
    for a stage ms_shm passes on unplanned (``api._cap_unplanned``)."""
    if workers is None or workers <= cpu_count:
        return workers, []
    return cpu_count, [Decision("num_parallel_workers", cpu_count, workers,
                                f"MindSpore refuses more workers than os.cpu_count()={cpu_count}", asked=True)]


# A map whose operations are all MindSpore's C++ transforms runs them in its own C++ threads, which never take the
# GIL; the probe calls them eagerly from Python, and an eager call holds it. Measured on 2.10 (an audit: 384 JPEG
# rows through Decode, Resize, Normalize, HWC2CHW, batch 32): eager calls on two threads gained nothing (0.94x),
# read as 0% outside the GIL, and the map got 1 thread, 0.77-0.80 s, where MindSpore's default 2 took 0.33-0.44 s.
NATIVE_FRACTION = 1.0


def plan_map(in_bytes: int, out_bytes: int, seconds_per_row: float | None, cpu_fraction: float | None,
             rows: int | None, request: Request, budget: Budget, profile: EngineProfile,
             sysv_limit: int | None = None, shmmax: int | None = None, worker_bytes: int | None = None,
             costs: Costs = Costs(), parallel_fraction: float | None = None, python_pool: bool = True,
             slot_rows: int = 1, cores_busy: float | None = None) -> Plan:
    """Pick processes or threads, and workers, for ``.map``. ``python_pool``: False where no operation would run
    in a Python worker (``compat.starts_python_pool``): processes then cost what threads cost. ``slot_rows``: a
    batch stage's batch size, by which MindSpore multiplies a static ``max_rowsize`` (``map_pool_cost``).

    In 2.7+ map workers exchange rows through one SysV segment each (not /dev/shm), so the limits are
    ``shmmax`` per segment and memory; before 2.7 they used six /dev/shm slots per worker; 2.7 also runs its
    /dev/shm pre-check on a static ``max_rowsize``.
    """
    req = request
    row = max(in_bytes, out_bytes)
    if not python_pool:
        parallel_fraction = NATIVE_FRACTION
    stats = RowStats(True, rows, 0, (), (), row, row, seconds_per_row, cpu_fraction, 0.0,
                     parallel_fraction=parallel_fraction, cores_busy=cores_busy)
    modes = [PROCESSES] if req.multiprocessing is True else [THREADS] if req.multiprocessing is False \
        else [THREADS, PROCESSES]
    limits = (budget, shmmax, worker_bytes, python_pool, slot_rows)

    def priced(r: Request, kinds: list) -> list:
        return [c for mode in kinds for w in _worker_options(r)
                for c in _map_prefetches(mode, w, in_bytes, out_bytes, stats, r, profile, limits, costs)]

    cands = priced(req, modes)
    lowered = _lowered_map_rowsize(req, profile, row, cands, modes, slot_rows)
    for size in _halvings(lowered):  # down to slots smaller than the rows, which then go through the pipe
        more = priced(replace(req, max_rowsize=size), [PROCESSES])
        cands += more
        lowered = size
        if any(c.fits for c in more):
            break
    fitting = [c for c in cands if c.fits]
    if not fitting:
        relaxed = priced(plan.unasked(req), [THREADS, PROCESSES])
        raise ShmBudgetError(plan.no_fit_message(cands, req, budget, stats, row, any(c.fits for c in relaxed)))
    own = _map_mode(req)
    best, kept = plan.choose(fitting, req, own)
    decisions = _workers_cap(req)[1]
    if lowered and best.mode == PROCESSES:  # none at the default size fitted
        req = replace(req, max_rowsize=lowered)
        decisions.append(Decision("max_rowsize", lowered, profile.map_default_max_rowsize_mb,
                                  f"MindSpore {profile.version}'s pool keeps 6 static slots per worker in /dev/shm: "
                                  f"at {profile.map_default_max_rowsize_mb} MiB they do not fit, slots of "
                                  f"{lowered} MiB " + (f"hold the probe rows ({mib(row)}) with a margin (a larger "
                                  f"row goes through the pool's pipe instead, the same row)"
                                  if lowered * model.MiB * slot_rows > row else
                                  f"fit where slots for the probe rows ({mib(row)}) do not: the rows go through "
                                  f"the pool's pipe instead, the same rows")))
    reason = _mode_reason(best, fitting, req, stats, native=not python_pool) if seconds_per_row is not None else \
        "operations were not timed: MindSpore's default transport that fits"
    if rows is None and seconds_per_row is not None:
        reason += f"; the rows per epoch are unknown before it runs: priced at {UNKNOWN_ROWS}"
    decisions.append(Decision("mode", best.mode, own, reason + kept + plan.unknown_shm(budget)))
    if best.prefetch != req.prefetch:
        decisions.append(Decision("prefetch_size", best.prefetch, req.prefetch,
                                  f"prefetch {req.prefetch} does not fit ({_why_not_at(cands, best, req.prefetch)}); "
                                  f"this lowers MindSpore's global prefetch size"))
    sysv = model.map_pool_cost(profile, best.workers, in_bytes, out_bytes, req.max_rowsize, slot_rows,
                               req.shared_mem).sysv \
        if best.mode == PROCESSES and python_pool else 0
    at = [_map_candidate(best.mode, best.workers, in_bytes, out_bytes, stats, replace(req, prefetch=p), profile,
                         limits, costs) for p in range(1, best.prefetch + 1)]
    return Plan("map", best.mode, best.workers, best.prefetch, best.mode == PROCESSES, req.shared_mem,
                req.max_rowsize, row, best.shm, best.fds, sysv, budget.at_prefetch(best.prefetch), True, 0, 0,
                best.seconds, profile, tuple(decisions), (), tuple(plan.top(cands, best)), best.memory,
                by_prefetch=tuple((c.shm, c.fds, c.memory) for c in at),
                lean=_lean_map(best, in_bytes, out_bytes, stats, req, profile, limits, costs))


def _halvings(size: int | None) -> list:
    """``size``, then halved down to 1 MiB (``[]`` for none)."""
    out = []
    while size:
        out.append(size)
        size = size // 2 if size > 1 else 0
    return out


def _lowered_map_rowsize(req: Request, profile: EngineProfile, row: int, cands: list, modes: list,
                         slot_rows: int) -> int | None:
    """A static ``max_rowsize`` (MiB) below the release's default for a ``/dev/shm`` pool (2.0-2.6), where the
    call left it and no worker-process candidate fits at the default: the probe rows with the ragged margin
    (a batch's slot is ``max_rowsize x batch_size``, ``slot_rows``, and holds the whole batch).
    Those releases send a row larger than a slot through the pool's pipe (``_SharedQueue.put``), so a smaller
    slot changes how rows travel, never which arrive. An audit's model-zoo map (SSD, explicit worker processes,
    rows of ~264 KiB) was refused under 64 MB, 192 MiB of 16 MiB slots against 51 MiB."""
    default = profile.map_default_max_rowsize_mb
    if (profile.map_transport == "sysv" or req.max_rowsize is not None or not req.shared_mem or not default
            or PROCESSES not in modes or any(c.fits for c in cands if c.mode == PROCESSES)):
        return None
    lowered = model.static_rowsize_for(int(row * RAGGED_MARGIN / max(1, slot_rows)))
    return lowered if lowered < default else None


def _lean_map(best: Candidate, in_bytes: int, out_bytes: int, stats: RowStats, req: Request,
              profile: EngineProfile, limits: tuple, costs: Costs) -> plan.Lean | None:
    """One thread where the chosen map runs in more, and the call leaves the workers to ms_shm: the fewest rows
    in flight. A map in worker processes keeps them (its pool is MindSpore's to size)."""
    if best.mode != THREADS or best.workers <= 1 or 1 not in _worker_options(req):
        return None
    at = [_map_candidate(THREADS, 1, in_bytes, out_bytes, stats, replace(req, prefetch=p), profile, limits, costs)
          for p in range(1, best.prefetch + 1)]
    return plan.Lean(THREADS, 1, at[-1].seconds, tuple((c.shm, c.fds, c.memory) for c in at))


def _map_prefetches(mode: str, w: int, in_bytes: int, out_bytes: int, stats: RowStats, req: Request,
                    profile: EngineProfile, limits: tuple, costs: Costs) -> list:
    """One transport at MindSpore's prefetch, then lower ones until it fits: rows in flight are memory."""
    out = []
    for p in _prefetch_options(req.prefetch):
        out.append(_map_candidate(mode, w, in_bytes, out_bytes, stats, replace(req, prefetch=p), profile, limits,
                                  costs))
        if out[-1].fits or not _why_not_memory(out[-1].memory, limits[0].at_prefetch(p)):
            break  # lower prefetch only helps memory
    return out


def _map_candidate(mode: str, w: int, in_bytes: int, out_bytes: int, stats: RowStats, req: Request,
                   profile: EngineProfile, limits: tuple, costs: Costs) -> Candidate:
    """One map transport priced: its /dev/shm, SysV and memory needs against the limits, and its epoch time."""
    budget, shmmax, worker_bytes, python_pool, slot_rows = limits
    budget = budget.at_prefetch(req.prefetch)
    processes = mode == PROCESSES and python_pool  # no pool: the C++ transforms run in MindSpore's threads
    cost = model.map_pool_cost(profile, w, in_bytes, out_bytes, req.max_rowsize, slot_rows, req.shared_mem) \
        if processes else model.MapCost(0, 0, 0)
    why = []
    if budget.shm_bytes is not None and cost.dev_shm > budget.shm_bytes:
        why.append(f"needs {mib(cost.dev_shm)} of /dev/shm > budget {free_text(budget.shm_bytes, cost.dev_shm)}")
    if budget.shm_bytes is None and processes:
        why.append("/dev/shm unknown (semaphores live there)")
    precheck = model.map_precheck_bytes(profile, w, req.max_rowsize and req.max_rowsize * slot_rows,
                                        req.shared_mem) if processes else 0
    again = _pool_held_meanwhile(profile, budget, cost) if precheck else 0
    if precheck and budget.shm_bytes is not None and precheck + again > budget.shm_bytes:
        why.append(f"MindSpore {profile.version}'s map pre-check asks for {mib(precheck)} of /dev/shm for a static "
                   f"max_rowsize ({profile.precheck_error}: 'Insufficient shared memory')" +
                   (f", and again for the next iterator (or `output_shapes()`) while this pool holds its "
                    f"{mib(cost.dev_shm)}" if again else ""))
    if shmmax is not None and cost.sysv_segment > shmmax:
        why.append(f"a {mib(cost.sysv_segment)} SysV segment exceeds kernel.shmmax={mib(shmmax)}")
    memory = model.map_memory(processes, out_bytes, w, req.prefetch, cost, worker_bytes)
    why += _why_not_memory(memory, budget)
    secs = None
    if stats.seconds_per_row is not None:
        secs = _epoch_seconds(PROCESSES if processes else THREADS, w, stats, priced_rows(stats.length), costs,
                              cpus=req.usable_cpus)
        if processes:
            secs += profile.map_teardown_seconds  # closing the pool (measured per release)
    return Candidate(mode, w, req.prefetch, cost.dev_shm, model.map_fds(w) if processes else 0, secs, not why,
                     "; ".join(why), memory)


def _pool_held_meanwhile(profile: EngineProfile, budget: Budget, cost: Any) -> int:
    """What a map pool whose slots are ``/dev/shm`` files (2.0-2.6) takes from the next pool's pre-check: an
    iterator per epoch, or ``output_shapes()`` before or after one, starts another pool while this one keeps its
    slots, and MindSpore checks against what is free then. An audit (2.0.0, 64 MB, 2 MiB rows, explicit
    processes): the first epoch ran, the next iterator failed the pre-check (3 runs of 3); planned as if alone."""
    return 0 if profile.map_transport == "sysv" else int(budget.fraction * cost.dev_shm)


def what_if(row_bytes: int, workers: int, prefetch: int = model.DEFAULT_PREFETCH, ranks: int = 1,
            version: str | None = None, shm_free: int | None = None, cpu_count: int | None = None,
            nofile_soft: int | None = None, open_fds: int | None = None,
            fraction: float = 0.8, ranks_source: str = "given", memory_left: int | None = None,
            memory_source: str = "") -> Plan:
    """The plan for a hypothetical pipeline (``ms-shm plan``): the user's workers and prefetch, row size given,
    against /dev/shm and the memory left (an audit: 64 MiB rows, 2 workers, said to fit in a 500 MB container
    that OOM-killed them, where ``build_dataset`` refused the same pipeline).

    Never raises for a misfit: the returned plan has ``fits=False`` and the reason, since the question is
    "what would happen".
    """
    from ms_shm import budget as budget_mod

    profile = profile_for(version)
    b = budget_mod.compute(shm_free, ranks, nofile_soft, open_fds, fraction=fraction,
                           ranks_source=ranks_source, memory_left=memory_left, memory_source=memory_source)
    cpus = max(workers, cpu_count or workers)
    stats = RowStats.synthetic(row_bytes)
    req = Request(workers=workers, prefetch=prefetch, cpu_count=cpus, usable_cpus=cpus)
    static = profile.generator_default_max_rowsize_mb
    as_asked, fds, memory = _generator_needs(PROCESSES if workers > 1 else INLINE, workers, prefetch, row_bytes,
                                             static, None, None)
    try:
        chosen = plan_generator(stats, req, b, profile)
    except ShmBudgetError as exc:
        return Plan("generator", "none", workers, prefetch, True, True, static, row_bytes, as_asked, fds, 0, b,
                    False, 0, 0, None, profile, (Decision("mode", "none", PROCESSES, str(exc)),),
                    predicted_memory=memory)
    shm_fits = b.shm_bytes is None or as_asked <= b.shm_bytes
    memory_fits = b.memory_bytes is None or memory <= b.memory_bytes
    asked = f"processes x{workers}, prefetch {prefetch}"
    memory_text = "" if b.memory_bytes is None else f", {mib(memory)} of memory vs {mib(b.memory_bytes)} left"
    decisions = (Decision("as_asked", asked, asked,
                          f"needs {mib(as_asked)} of /dev/shm vs budget {mib(b.shm_bytes)}{memory_text}: "
                          f"{'fits' if shm_fits and memory_fits else 'does NOT fit'}"),) + chosen.decisions
    return replace(chosen, fits=shm_fits and memory_fits, decisions=decisions,
                   alternatives=chosen.alternatives + (Candidate(PROCESSES, workers, prefetch, as_asked, fds, None,
                                                                 shm_fits and memory_fits, "as asked", memory),))


__all__ = ["Costs", "RAGGED_MARGIN", "plan_generator", "plan_map", "plan_iterable", "plan_unmeasured", "what_if",
           "default_mode", "plan_startup"]


def plan_startup(config, budget_bytes: int | None, workers: int, row_mb: float | None = None,
                 prefetch: int | None = None, version: str | None = None) -> tuple:
    """MindSpore's global settings ``tune()`` sets before any pipeline exists: a prefetch size that fits rows of
    ``row_mb`` (or the one asked for), and pipes when not even the smallest slots fit. Pure: decisions only.

    Args:
        config: ``compat.MindSporeConfig`` as it is now.
        budget_bytes: this rank's /dev/shm budget (``None``: unknown).
    """
    current = config.prefetch_size or model.DEFAULT_PREFETCH
    out = []
    if prefetch is not None:
        out.append(Decision("prefetch_size", prefetch, current, "asked for by the caller"))
    elif row_mb is not None and budget_bytes is not None:
        static = profile_for(version or config.version).generator_default_max_rowsize_mb
        out += _prefetch_for_rows(int(row_mb * model.MiB), workers, current, budget_bytes, row_mb, static)
    minimal = model.generator_peak(model.PAGE, 2, 1)
    if config.shared_mem and config.has_shared_mem_switch and (budget_bytes is None or budget_bytes < minimal):
        out.append(Decision("shared_mem", False, True,
                            f"/dev/shm budget {mib(budget_bytes)} cannot hold even 2 workers' smallest slots "
                            f"({mib(minimal)}): rows go through pipes"))
    return tuple(out)


def _prefetch_for_rows(row_bytes: int, workers: int, current: int, budget_bytes: int, row_mb: float,
                       static: int | None) -> list:
    p = model.fitting_prefetch(row_bytes, workers, budget_bytes, current, static)
    if p is None:
        return [Decision("prefetch_size", current, current,
                         f"{workers} workers x {row_mb} MiB rows do not fit {mib(budget_bytes)} even at prefetch 1: "
                         f"build_dataset will choose threads or pipes for them")]
    if p != current:
        return [Decision("prefetch_size", p, current,
                         f"{workers} workers x {row_mb} MiB rows fit {mib(budget_bytes)} only up to prefetch {p}")]
    return []
