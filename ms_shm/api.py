"""The public calls: ``tune``, ``build_dataset``, ``map``, ``plan_of``. Each composes probe -> plan -> apply.

State that must outlive one call lives in ``_SESSION``: the host facts taken before the first pipeline
started (later readings would count our own pipelines' slots as "used by someone else"), the ledger of live
pipelines, and whether recommendations were already logged.
"""

from __future__ import annotations

import logging
import resource
import statistics
import textwrap
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ms_shm import budget as budget_mod
from ms_shm import engine, host, model, reuse, rows
from ms_shm import plan as planner
from ms_shm._results import Result, mib
from ms_shm.guard import GuardedSource, GuardSpec, guard_iterable
from ms_shm.plan import Decision, Plan, ShmBudgetError

log = logging.getLogger("ms_shm")

PLAN_ATTR = "ms_shm_plan"
ROWS_ATTR = "_ms_shm_rows"
NOFILE_TARGET = 65536  # what tune() raises a low soft limit to, within the hard limit


@dataclass
class _Session:
    facts: host.HostFacts | None = None
    fraction: float = budget_mod.DEFAULT_FRACTION
    ranks: int | None = None
    ledger: budget_mod.Ledger = field(default_factory=budget_mod.Ledger)
    advised: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def host_facts(self) -> host.HostFacts:
        with self.lock:
            if self.facts is None:
                self.facts = host.probe(ranks=self.ranks)
            return self.facts


_SESSION = _Session()


@dataclass(frozen=True)
class TuneReport(Result):
    """What ``tune()`` found and changed. ``restore()`` puts every changed setting back."""

    facts: host.HostFacts
    mindspore: Any
    budget: budget_mod.Budget
    decisions: tuple
    changes: tuple
    advice: tuple
    dry_run: bool
    notes: tuple = ()

    def restore(self) -> None:
        """Undo this report's changes (prefetch size, shared-memory switch, open-files limit)."""
        engine.undo(self.changes)

    def __str__(self) -> str:
        lines = [f"ms_shm.tune: budget {mib(self.budget.shm_bytes)} of /dev/shm per pipeline "
                 f"({self.budget.reason})"]
        lines += [f"  decided {d}" for d in self.decisions]
        lines += [f"  changed {c.setting}: {c.old} -> {c.new}" for c in self.changes]
        lines += [f"  advice: {a.problem} -> {a.fix}" for a in self.advice]
        return "\n".join(lines)


def _advise(facts: host.HostFacts, ms_config: Any) -> tuple:
    try:
        from ms_shm import advice
    except ImportError:
        return ()
    return tuple(advice.diagnose(facts, ms_config))


def _log_advice_once(facts: host.HostFacts, items: Sequence[Any]) -> None:
    """Recommendations go to the log once per process, and only from local rank 0 of a multi-rank job."""
    if facts.ranks.local_rank != 0:
        return
    for item in items:
        key = getattr(item, "problem", str(item))
        if key in _SESSION.advised:
            continue
        _SESSION.advised.add(key)
        level = logging.WARNING if getattr(item, "severity", "") in ("crash", "slow") else logging.INFO
        snippets = "".join(f"\n  {label}:\n" + textwrap.indent(text, "    ")
                           for label, text in getattr(item, "snippets", ()))
        log.log(level, "%s Fix: %s%s", item.problem, item.fix, snippets)


def tune(dry_run: bool = False, ranks: int | None = None, shm_fraction: float = budget_mod.DEFAULT_FRACTION,
         workers: int | None = None, row_mb: float | None = None, prefetch: int | None = None,
         raise_nofile: bool = True, clean: bool = False) -> TuneReport:
    """Read the host once at start-up and set MindSpore's global dataset config to what it allows.

    Idempotent. Every change is recorded with its old value (``report.restore()`` undoes it); with
    ``dry_run=True`` nothing changes and the report says what would.

    Args:
        dry_run: decide and log, change nothing.
        ranks: ranks sharing this host's /dev/shm, overriding the launcher's environment.
        shm_fraction: share of free /dev/shm ms_shm plans to use (MindSpore's own check stops at 0.8).
        workers: the workers a typical pipeline of this job will use (default: usable CPUs).
        row_mb: a typical row's size, when known before any pipeline exists: sets a prefetch that fits.
        prefetch: force MindSpore's prefetch size.
        raise_nofile: raise the soft open-files limit toward the hard limit when it is low.
        clean: on local rank 0, remove IPC objects left by crashed MindSpore runs (``ms_shm.clean``).

    Returns:
        TuneReport: facts, budget, decisions, changes and advice.
    """
    facts = host.probe(ranks=ranks)
    with _SESSION.lock:
        _SESSION.facts, _SESSION.fraction, _SESSION.ranks = facts, shm_fraction, ranks
    ms = engine.read_config()
    notes = list(facts.notes)
    if ms is None:
        notes.append("mindspore is not importable: only host facts and the open-files limit were handled")
    b = _budget(facts, reserved=(0, 0))
    decisions, changes = [], []
    w = workers or max(1, min(facts.usable_cpus, 8))
    current_p = ms.prefetch_size if ms and ms.prefetch_size else model.DEFAULT_PREFETCH

    # Open files: one fd per shm slot in the main process, per worker.
    need_fds = (facts.open_fds or 0) + model.FD_MARGIN + 2 * model.generator_fds(w, current_p)
    if facts.nofile_soft is not None and facts.nofile_soft < need_fds:
        hard = facts.nofile_hard
        target = NOFILE_TARGET if hard is None else min(hard, NOFILE_TARGET)
        reason = (f"soft open-files limit {facts.nofile_soft} < {need_fds} needed by two {w}-worker pipelines "
                  f"at prefetch {current_p} (one fd per shared-memory slot)")
        decisions.append(Decision("RLIMIT_NOFILE(soft)", target, facts.nofile_soft, reason))
        if raise_nofile and not dry_run and target > facts.nofile_soft:
            change = engine.set_nofile_soft(target, reason)
            if change:
                changes.append(change)

    if ms is not None:
        p = prefetch
        if p is None and row_mb is not None and b.shm_bytes is not None:
            p = _largest_prefetch(int(row_mb * model.MiB), w, current_p, b.shm_bytes)
            if p is None:
                decisions.append(Decision("prefetch_size", current_p, current_p,
                                          f"{w} workers x {row_mb} MiB rows do not fit {mib(b.shm_bytes)} even at "
                                          f"prefetch 1: build_dataset will choose threads or pipes for them"))
            elif p != current_p:
                decisions.append(Decision("prefetch_size", p, current_p,
                                          f"{w} workers x {row_mb} MiB rows fit {mib(b.shm_bytes)} only up to "
                                          f"prefetch {p}"))
        elif p is not None:
            decisions.append(Decision("prefetch_size", p, current_p, "asked for by the caller"))
        if p is not None and p != current_p and not dry_run:
            changes.append(engine.set_prefetch_size(p, "tune()"))
        minimal = model.generator_peak(model.PAGE, 2, 1)
        if ms.shared_mem and ms.has_shared_mem_switch and (b.shm_bytes is None or b.shm_bytes < minimal):
            reason = (f"/dev/shm budget {mib(b.shm_bytes)} cannot hold even 2 workers' smallest slots "
                      f"({mib(minimal)}): rows go through pipes")
            decisions.append(Decision("shared_mem", False, True, reason))
            if not dry_run:
                change = engine.set_shared_mem(False, reason)
                if change:
                    changes.append(change)

    advice = _advise(facts, ms)
    report = TuneReport(facts, ms, b, tuple(decisions), tuple(c for c in changes if c), advice, dry_run,
                        tuple(notes))
    log.info("ms_shm.tune: /dev/shm budget %s per pipeline: %s", mib(b.shm_bytes), b.reason)
    for d in decisions:
        log.info("ms_shm.tune%s: %s", " (dry run)" if dry_run else "", d)
    _log_advice_once(facts, advice)
    if clean and facts.ranks.local_rank == 0 and not dry_run:
        try:
            from ms_shm import cleanup
        except ImportError:
            log.warning("ms_shm.tune(clean=True): cleanup is not available in this build")
        else:
            result = cleanup.clean(dry_run=False)
            log.info("ms_shm.tune: cleaned leftovers of crashed runs: %s freed", mib(result.bytes_freed))
    return report


def _largest_prefetch(row_bytes: int, workers: int, current: int, budget: int) -> int | None:
    for p in range(current, 0, -1):
        if model.generator_peak(row_bytes, workers, p) <= budget:
            return p
    return None


def _budget(facts: host.HostFacts, reserved: tuple | None = None) -> budget_mod.Budget:
    shm_used, fds_used = reserved if reserved is not None else _SESSION.ledger.totals()
    return budget_mod.compute(facts.shm_free, facts.ranks.local_size, facts.nofile_soft, facts.open_fds,
                              shm_used, fds_used, _SESSION.fraction, facts.ranks.source)


def _current_nofile(facts: host.HostFacts) -> host.HostFacts:
    """The fd limit may have been raised by tune() since the facts were cached."""
    soft, hard = engine.get_nofile()
    inf = resource.RLIM_INFINITY
    return replace(facts, nofile_soft=None if soft == inf else soft, nofile_hard=None if hard == inf else hard)


def _request(kwargs: dict, ms: Any, facts: host.HostFacts, stats: rows.RowStats) -> planner.Request:
    rows_per_epoch = stats.length
    if kwargs.get("num_samples"):
        rows_per_epoch = min(rows_per_epoch or kwargs["num_samples"], kwargs["num_samples"])
    if kwargs.get("num_shards") and rows_per_epoch:
        rows_per_epoch = -(-rows_per_epoch // kwargs["num_shards"])
    return planner.Request(
        workers=kwargs.get("num_parallel_workers"),
        multiprocessing=kwargs.get("python_multiprocessing"),
        max_rowsize=kwargs.get("max_rowsize") if (kwargs.get("max_rowsize") or -1) > 0 else None,
        prefetch=ms.prefetch_size if ms and ms.prefetch_size else model.DEFAULT_PREFETCH,
        shared_mem=bool(ms.shared_mem) if ms and ms.shared_mem is not None else True,
        can_switch_shared_mem=bool(ms and ms.has_shared_mem_switch),
        start_method=(ms.start_method if ms else None) or "fork",
        rows_per_epoch=rows_per_epoch,
        cpu_count=facts.cpu_count or facts.usable_cpus,
        usable_cpus=facts.usable_cpus,
    )


def _inspect_copy_on_read(source: Any, workers: int, facts: host.HostFacts, start_method: str,
                          share_lists: bool) -> None:
    try:
        from ms_shm import cow
    except ImportError:
        return
    findings = cow.inspect_source(source, workers=workers, ranks=facts.ranks.local_size,
                                  start_method=start_method)
    if not findings:
        return
    if share_lists:
        cow.share_lists(source, findings)
    elif facts.ranks.local_rank == 0:
        cow.log_findings(findings)


def build_dataset(source: Any, column_names: Sequence[str] | str | None = None, share_lists: bool = False,
                  reuse_probe_rows: bool = True, **generator_kwargs: Any):
    """A ``mindspore.dataset.GeneratorDataset`` whose transport, workers and prefetch fit this host.

    Takes every ``GeneratorDataset`` argument. A few rows are measured first (spread over a random-access
    source; the first rows of an iterable, re-emitted so nothing is lost or duplicated) and validated, the
    pipeline's peak shared memory is predicted, and the fastest configuration that fits is built. Arguments
    passed explicitly are kept.

    Args:
        source: random-access source (``__getitem__`` and ``__len__``), iterable, or generator function.
        column_names: as for ``GeneratorDataset``.
        share_lists: replace large Python lists held by the source with ``ms_shm.SharedList``
            (copy-on-read fix), logging each swap.
        reuse_probe_rows: serve each row the probe read (random-access source) to the first request for its
            index instead of calling ``source[i]`` again, so probing costs nothing when rows are expensive.
            Pass ``False`` when the source must see every call (e.g. it counts calls, or you change its
            transform after ``build_dataset``).
        **generator_kwargs: passed to ``GeneratorDataset``.

    Returns:
        mindspore.dataset.GeneratorDataset: with the plan attached (``ms_shm.plan_of(dataset)``).

    Raises:
        ms_shm.RowError: a probe row MindSpore cannot carry (names the column, the row and the fix).
        ms_shm.ShmBudgetError: explicit arguments that cannot fit, before any worker starts.
        RuntimeError: ``python_multiprocessing=True`` where MindSpore cannot start worker processes (no /proc).
    """
    facts = _current_nofile(_SESSION.host_facts())
    ms = engine.read_config()
    names = [column_names] if isinstance(column_names, str) else column_names
    source = rows.as_mindspore_source(source)
    random_access = rows.is_random_access(source)
    if random_access:
        stats, kept = rows.measure_random_access(
            source, names, keep_row=reuse.worth_keeping if reuse_probe_rows else (lambda seconds, nbytes: False))
        feed = source
    else:
        stats, probe_rows, feed = rows.measure_iterable(source, names)
        feed = guard_iterable(feed, names)
        later = _by_column(probe_rows, names)
    req = _request(generator_kwargs, ms, facts, stats)
    blocked = engine.processes_blocker() if random_access and ms is not None else None
    if blocked:
        req = _without_processes(req, blocked)
    profile = model.profile_for(ms.version if ms else facts.mindspore_version)
    b = _budget(facts)
    p = planner.plan_generator(stats, req, b, profile)
    if blocked:
        p = replace(p, decisions=p.decisions + (Decision("python_multiprocessing", False, True, blocked),))
    if random_access and p.python_multiprocessing and p.workers > 1:
        _inspect_copy_on_read(source, p.workers, facts, req.start_method, share_lists)
    if random_access:
        spec = None
        if p.guard_slots and p.guard_worker_bytes:
            spec = GuardSpec(p.guard_slots, p.guard_worker_bytes, p.row_bytes, _ROW_FIX, p.workers,
                             facts.shm_path, max(1, facts.ranks.local_size) / max(p.budget.fraction, 0.01))
        cache = reuse.cache_for(list(kept), list(kept.values()))
        feed = GuardedSource(source, names, spec, cache)
        later = _LateProbeRows(source, names, stats.indices[:4], cache)
        if cache is not None and stats.seconds_per_row is not None:
            p = _with_reuse(p, len(cache), stats.seconds_per_row * len(cache))  # median x count: an estimate
    kwargs = dict(generator_kwargs)
    changes = _apply_globals(p, ms)
    if random_access:
        kwargs["num_parallel_workers"] = p.workers
        kwargs["python_multiprocessing"] = p.python_multiprocessing
        if p.max_rowsize is not None and "max_rowsize" not in generator_kwargs:
            kwargs["max_rowsize"] = p.max_rowsize
    dataset = engine.generator_dataset(feed, column_names, kwargs)
    reservation = _SESSION.ledger.reserve(f"GeneratorDataset({type(source).__name__})", p.predicted_shm,
                                          p.predicted_fds)
    weakref.finalize(dataset, _SESSION.ledger.release, reservation.key)
    if changes:
        p = replace(p, decisions=p.decisions + tuple(Decision(c.setting, c.new, c.old, c.reason)
                                                     for c in changes))
    _attach(dataset, p, later)
    _log_plan(p, generator_kwargs)
    return dataset


def _with_reuse(p: Plan, count: int, seconds: float) -> Plan:
    why = (f"the {count} probe rows (about {seconds * 1e3:.1f} ms to read) are served to the first request for their "
           f"index instead of being read again; build_dataset(..., reuse_probe_rows=False) reads them again")
    return replace(p, reused_rows=count, reused_seconds=seconds,
                   decisions=p.decisions + (Decision("reuse_probe_rows", count, 0, why),))


_ROW_FIX = "lower num_parallel_workers, or pass python_multiprocessing=False to build_dataset"


def _without_processes(req: planner.Request, why: str) -> planner.Request:
    """MindSpore's worker processes cannot start here: plan threads, or stop now if the caller insisted."""
    if req.multiprocessing is True and (req.workers or 1) > 1:
        raise RuntimeError(f"python_multiprocessing=True cannot work here: {why}, and MindSpore's GeneratorDataset "
                           f"reads its own process through psutil before starting workers. Fix: mount /proc (or "
                           f"make it readable), or pass python_multiprocessing=False.")
    log.warning("ms_shm: %s; worker processes are not planned, threads are", why)
    return replace(req, multiprocessing=False)


def _apply_globals(p: Plan, ms: Any) -> list:
    """Global MindSpore settings the plan needs. Both only ever go down, so other pipelines stay safe."""
    if ms is None:
        return []
    out = []
    if ms.prefetch_size and p.prefetch < ms.prefetch_size:
        out.append(engine.set_prefetch_size(p.prefetch, next((d.reason for d in p.decisions
                                                          if d.setting == "prefetch_size"), "plan")))
    if p.mode == planner.PIPES and ms.shared_mem:
        out.append(engine.set_shared_mem(False, "rows go through pipes: shared-memory slots would not fit; this "
                                             "also applies to pipelines launched later in this process"))
    for change in out:
        if change:
            log.warning("ms_shm changed MindSpore's global %s from %s to %s: %s", change.setting, change.old,
                        change.new, change.reason)
    return [c for c in out if c]


def _by_column(probe_rows: list, names: Sequence[str] | None, count: int = 4) -> dict:
    """The probe rows by column name, for a later ``ms_shm.map`` to run its operations on."""
    if not names:
        return {}
    out: dict = {n: [] for n in names}
    for row in probe_rows[:count]:
        for n, value in zip(names, row):
            out[n].append(value)
    return out


class _LateProbeRows:
    """The probe rows of a random-access source, for a later ``ms_shm.map``, without holding them.

    Rows the pipeline has not been served yet come from the probe cache; the others are read again from the
    source (one extra call per row, at ``map`` time). Holding them all for the dataset's life would cost
    memory, and fresh pages for every row the pipeline produces meanwhile.
    """

    def __init__(self, source: Any, names: Sequence[str] | None, indices: Sequence[int], cache: Any):
        self.source, self.names, self.indices, self.cache = source, names, tuple(indices), cache

    def __call__(self) -> dict:
        out = []
        for index in self.indices:
            row = self.cache.peek(index) if self.cache is not None else None
            if row is None:
                try:
                    row = rows.convert_row(self.source[index], index, self.names)
                except Exception as exc:  # it worked at probe time; map falls back to a short pipeline run
                    log.debug("ms_shm.map: re-reading probe row %s failed: %s: %s", index, type(exc).__name__, exc)
                    continue
            out.append(row)
        return _by_column(out, self.names)


def _attach(dataset: Any, p: Plan, columns: Any) -> None:
    try:
        setattr(dataset, PLAN_ATTR, p)
        setattr(dataset, ROWS_ATTR, columns)
    except AttributeError as exc:
        log.debug("could not attach the plan to %r: %s", type(dataset).__name__, exc)


def _log_plan(p: Plan, asked: dict) -> None:
    log.info("ms_shm %s", p.summary())
    for d in p.decisions:
        explicit = d.setting in asked and asked[d.setting] != d.value
        log.log(logging.WARNING if explicit else logging.DEBUG, "ms_shm decision %s", d)


def plan_of(dataset: Any) -> Plan | None:
    """The plan ms_shm built ``dataset`` with, or ``None`` for a dataset it did not build."""
    return getattr(dataset, PLAN_ATTR, None)


def _input_rows(dataset: Any, count: int = 3) -> dict:
    cached = getattr(dataset, ROWS_ATTR, None)
    if callable(cached):
        cached = cached()
    if cached:
        return cached
    log.info("ms_shm.map: the input dataset was not built by ms_shm; reading %d rows of it to measure the "
             "operations (one short pipeline run)", count)
    taken = engine.take_rows(dataset, count)
    out: dict = {}
    for row in taken:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return out


def map(dataset: Any, operations: Any, input_columns: Sequence[str] | str | None = None,
        output_columns: Sequence[str] | str | None = None, num_parallel_workers: int | None = None,
        **map_kwargs: Any):
    """``dataset.map(...)`` with workers and transport that fit this host, measured on real rows.

    The operations run once on a few input rows first: that measures the output rows (which may be much
    larger than the input, e.g. a decode), their cost, and catches an error before any worker starts.

    Returns:
        mindspore.dataset.Dataset: the mapped dataset, with its plan attached.

    Raises:
        ms_shm.ShmBudgetError: explicit arguments that cannot fit.
        RuntimeError: an operation failed on a probe row (names the row and the columns).
    """
    facts = _current_nofile(_SESSION.host_facts())
    ms = engine.read_config()
    available = _input_rows(dataset)
    all_names = list(available) or engine.column_names(dataset)
    ins = [input_columns] if isinstance(input_columns, str) else list(input_columns or all_names[:1])
    outs = [output_columns] if isinstance(output_columns, str) else list(output_columns or ins)
    missing = [c for c in ins if c not in available]
    if missing:
        raise ValueError(f"ms_shm.map: input column(s) {missing} are not in the dataset's columns "
                         f"{all_names}. Fix: pass input_columns from that list.")
    count = min(len(v) for v in available.values()) if available else 0
    in_bytes = out_bytes = 0
    cpu = 0.0
    walls: list = []
    produced: dict = {c: [] for c in outs}
    for i in range(count):
        # Copies: an operation that works in place must not alter rows the pipeline will still serve.
        args = [a.copy() if hasattr(a, "copy") and hasattr(a, "nbytes") else a
                for a in (available[c][i] for c in ins)]
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            result = engine.run_operations(operations, args)
        except Exception as exc:
            raise RuntimeError(f"ms_shm.map: the operations raised {type(exc).__name__}: {exc} on probe row {i} "
                               f"(input columns {ins}), before any worker started. Fix the operation or "
                               f"input_columns.") from exc
        walls.append(time.perf_counter() - w0)
        cpu += time.thread_time() - c0
        in_bytes = max(in_bytes, sum(int(a.nbytes) for a in args if hasattr(a, "nbytes")))
        out_bytes = max(out_bytes, sum(int(r.nbytes) for r in result))
        if len(result) == len(outs):
            for name, value in zip(outs, result):
                produced[name].append(value)
    req = planner.Request(
        workers=num_parallel_workers, multiprocessing=map_kwargs.get("python_multiprocessing"),
        max_rowsize=map_kwargs.get("max_rowsize") if (map_kwargs.get("max_rowsize") or -1) > 0 else None,
        prefetch=ms.prefetch_size if ms and ms.prefetch_size else model.DEFAULT_PREFETCH,
        cpu_count=facts.cpu_count or facts.usable_cpus, usable_cpus=facts.usable_cpus)
    profile = model.profile_for(ms.version if ms else facts.mindspore_version)
    memory_left = facts.mem_available
    if facts.cgroup_mem_limit and facts.cgroup_mem_usage is not None:
        memory_left = min(memory_left or facts.cgroup_mem_limit, facts.cgroup_mem_limit - facts.cgroup_mem_usage)
    # The median, as for source rows: an operation's first call may set itself up (a lazy import, a table).
    p = planner.plan_map(in_bytes, out_bytes, statistics.median(walls) if walls else None,
                         (cpu / sum(walls)) if sum(walls) else None,
                         None, req, _budget(facts), profile, shmmax=facts.shmmax,
                         memory_left=memory_left)
    kwargs = dict(map_kwargs)
    kwargs["python_multiprocessing"] = p.python_multiprocessing
    result_ds = engine.map_dataset(dataset, operations, input_columns, output_columns,
                                dict(kwargs, num_parallel_workers=p.workers))
    reservation = _SESSION.ledger.reserve("map", p.predicted_shm, p.predicted_fds)
    weakref.finalize(result_ds, _SESSION.ledger.release, reservation.key)
    columns = {k: v for k, v in available.items() if k not in ins}
    columns.update({k: v for k, v in produced.items() if v})
    _attach(result_ds, p, columns)
    asked = dict(map_kwargs)
    if num_parallel_workers is not None:
        asked["num_parallel_workers"] = num_parallel_workers
    _log_plan(p, asked)
    return result_ds


def probe(ranks: int | None = None) -> host.HostFacts:
    """The host as ms_shm sees it now (no caching, no changes)."""
    return host.probe(ranks=ranks)


def reset() -> None:
    """Forget cached facts, live reservations and logged advice (tests, or after the host changed)."""
    with _SESSION.lock:
        _SESSION.facts = None
        _SESSION.ranks = None
        _SESSION.fraction = budget_mod.DEFAULT_FRACTION
        _SESSION.advised.clear()
    _SESSION.ledger.clear()


__all__ = ["tune", "build_dataset", "map", "plan_of", "probe", "reset", "TuneReport", "ShmBudgetError"]
