"""The public calls: ``tune``, ``build_dataset``, ``map``, ``plan_of``. Each composes probe -> plan -> apply.

State that must outlive one call lives in ``_SESSION``: the host facts taken before the first pipeline
started (later readings would count our own pipelines' slots as "used by someone else"), the ledger of live
pipelines, and whether recommendations were already logged.
"""

from __future__ import annotations

import logging
import resource
import textwrap
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ms_shm import advice, host, measure, rows, sizes
from ms_shm import budget as budget_mod
from ms_shm._results import Result, mib
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import compat as engine
from ms_shm.engines.mindspore import planning as planner
from ms_shm.engines.mindspore.guard import GuardedSource, GuardSpec
from ms_shm.engines.mindspore.profiles import profile_for
from ms_shm.errors import ProcessesUnavailableError
from ms_shm.plan import PIPES, Decision, Plan, Request, ShmBudgetError

log = logging.getLogger("ms_shm")



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
    w = workers or advice.typical_workers(facts)
    current_p = ms.prefetch_size if ms and ms.prefetch_size else model.DEFAULT_PREFETCH

    # Open files: one fd per shm slot in the main process, per worker.
    need_fds = advice.fds_needed(facts, w, current_p, pipelines=2)
    if facts.nofile_soft is not None and facts.nofile_soft < need_fds:
        hard = facts.nofile_hard
        target = sizes.nofile_target(need_fds) if hard is None else min(hard, sizes.nofile_target(need_fds))
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
            p = advice.fitting_prefetch(int(row_mb * model.MiB), w, b.shm_bytes, current_p)
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

    found = _advise(facts, ms)
    report = TuneReport(facts, ms, b, tuple(decisions), tuple(c for c in changes if c), found, dry_run,
                        tuple(notes))
    log.info("ms_shm.tune: /dev/shm budget %s per pipeline: %s", mib(b.shm_bytes), b.reason)
    for d in decisions:
        log.info("ms_shm.tune%s: %s", " (dry run)" if dry_run else "", d)
    _log_advice_once(facts, found)
    if clean and facts.ranks.local_rank == 0 and not dry_run:
        try:
            from ms_shm import cleanup
        except ImportError:
            log.warning("ms_shm.tune(clean=True): cleanup is not available in this build")
        else:
            result = cleanup.clean(dry_run=False)
            log.info("ms_shm.tune: cleaned leftovers of crashed runs: %s freed", mib(result.bytes_freed))
    return report


def _budget(facts: host.HostFacts, reserved: tuple | None = None) -> budget_mod.Budget:
    shm_used, fds_used = reserved if reserved is not None else _SESSION.ledger.totals()
    return budget_mod.compute(facts.shm_free, facts.ranks.local_size, facts.nofile_soft, facts.open_fds,
                              shm_used, fds_used, _SESSION.fraction, facts.ranks.source)


def _current_nofile(facts: host.HostFacts) -> host.HostFacts:
    """The fd limit may have been raised by tune() since the facts were cached."""
    soft, hard = engine.get_nofile()
    inf = resource.RLIM_INFINITY
    return replace(facts, nofile_soft=None if soft == inf else soft, nofile_hard=None if hard == inf else hard)


def _request(kwargs: dict, ms: Any, facts: host.HostFacts, rows_per_epoch: int | None) -> Request:
    return Request(
        workers=kwargs.get("num_parallel_workers"),
        multiprocessing=kwargs.get("python_multiprocessing"),
        max_rowsize=model.max_rowsize_mb(kwargs.get("max_rowsize")),
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


def _column_names(column_names: Any, kwargs: dict) -> tuple | None:
    if isinstance(column_names, str):
        return (column_names,)
    if column_names is not None:
        return tuple(column_names)
    schema = kwargs.get("schema")
    names = getattr(schema, "columns", None)
    if isinstance(names, list):
        return tuple(c.get("name") if isinstance(c, dict) else str(c) for c in names)
    return None


def _probe_blocker(kwargs: dict) -> str | None:
    """Why a random-access source is not read ahead at all (MindSpore makes its rows some other way)."""
    if kwargs.get("batch_sampler") is not None:
        return "a batch_sampler (and collate_fn) make the rows, so single rows say little: not read ahead"
    return None


def _lock_mode(req: Request, why: str, default_multiprocessing: bool) -> tuple:
    """Rows that depend on which worker reads them keep MindSpore's own mode and workers."""
    workers = req.workers if req.workers is not None else 1
    multiprocessing = req.multiprocessing if req.multiprocessing is not None else default_multiprocessing
    reason = (f"{why}: rows depend on which process or thread reads them, so MindSpore's own mode is kept "
              f"(num_parallel_workers={workers}, python_multiprocessing={multiprocessing}); only prefetch and "
              f"the shared-memory switch may change")
    return replace(req, workers=workers, multiprocessing=multiprocessing), Decision("mode_locked", True, False,
                                                                                  reason)


def build_dataset(source: Any, column_names: Sequence[str] | str | None = None, share_lists: bool = False,
                  **generator_kwargs: Any):
    """A ``mindspore.dataset.GeneratorDataset`` whose transport, workers and prefetch fit this host.

    Takes every ``GeneratorDataset`` argument and yields exactly what ``GeneratorDataset`` yields with them.
    A random-access source is measured first, in a forked probe child (a few rows spread over it), so the
    probe has no effect on the source, the random state or the rows; the pipeline's peak shared memory is
    predicted, and the fastest configuration that fits is built. An iterable or generator source is read by
    MindSpore in the main process and uses no shared memory: it is passed on untouched. Arguments passed
    explicitly are kept; where rows depend on which worker reads them (the source draws random numbers or
    keeps state), MindSpore's own mode and workers are kept too.

    Args:
        source: random-access source (``__getitem__`` and ``__len__``), iterable, or generator function.
        column_names: as for ``GeneratorDataset``.
        share_lists: replace large Python lists held by the source with ``ms_shm.SharedList``
            (copy-on-read fix), logging each swap.
        **generator_kwargs: passed to ``GeneratorDataset``.

    Returns:
        mindspore.dataset.GeneratorDataset: its plan is ``ms_shm.plan_of(dataset)``.

    Raises:
        ms_shm.RowError: a probe row MindSpore cannot carry (names the column, the row and the fix).
        ms_shm.ShmBudgetError: explicit arguments that cannot fit, before any worker starts.
        RuntimeError: ``python_multiprocessing=True`` where MindSpore cannot start worker processes (no /proc).
    """
    facts = _current_nofile(_SESSION.host_facts())
    ms = engine.read_config()
    names = _column_names(column_names, generator_kwargs)
    random_access = rows.is_random_access(source)
    req = _request(generator_kwargs, ms, facts, None)
    profile = profile_for(ms.version if ms else facts.mindspore_version)
    b = _budget(facts)
    if not random_access:
        p = planner.plan_iterable(req, b, profile)
        lineage = measure.IterableLineage(source, names) if names else measure.Unavailable("no column names")
        return _build(source, column_names, generator_kwargs, p, ms, lineage, "iterable")
    blocked = _probe_blocker(generator_kwargs)
    probe = measure.StageProbe(None, unmeasured=blocked) if blocked else \
        measure.probe_random_access(source, names, engine.row_check())
    decisions = []
    if probe.stats is not None:
        req = replace(req, rows_per_epoch=_rows_per_epoch(generator_kwargs, probe.stats.length))
    if probe.effects.order_dependent:
        req, locked = _lock_mode(req, probe.effects.order_dependent, True)
        decisions.append(locked)
    blocker = engine.processes_blocker() if ms is not None else None
    if blocker:
        req = _without_processes(req, blocker)
    if probe.stats is None:
        p = planner.plan_unmeasured(req, b, profile, probe.unmeasured)
    else:
        p = planner.plan_generator(probe.stats, req, b, profile)
    if blocker:
        decisions.append(Decision("python_multiprocessing", False, True, blocker))
    p = replace(p, decisions=tuple(decisions) + p.decisions)
    if p.python_multiprocessing and p.workers > 1:
        _inspect_copy_on_read(source, p.workers, facts, req.start_method, share_lists)
    feed = source
    if p.guard_slots and p.guard_worker_bytes:
        feed = GuardedSource(source, GuardSpec(
            p.guard_slots, p.guard_worker_bytes, p.row_bytes, _ROW_FIX, p.workers, facts.shm_path,
            max(1, facts.ranks.local_size) / max(p.budget.fraction, 0.01)))
    lineage = measure.SourceLineage(source, names, probe.stats.indices[:4]) if probe.stats and names else \
        measure.Unavailable(probe.unmeasured or "no column names")
    return _build(feed, column_names, generator_kwargs, p, ms, lineage, type(source).__name__)


def _build(feed: Any, column_names: Any, asked: dict, p: Plan, ms: Any, lineage: measure.Lineage, what: str):
    """Apply the plan: MindSpore's globals first, then ``GeneratorDataset`` with only the settings it changed."""
    changes = _apply_globals(p, ms)
    kwargs = dict(asked)
    _set_if_changed(kwargs, "num_parallel_workers", p.workers, 1)
    _set_if_changed(kwargs, "python_multiprocessing", p.python_multiprocessing, True)
    if p.max_rowsize is not None and kwargs.get("max_rowsize") is None:
        kwargs["max_rowsize"] = p.max_rowsize
    dataset = engine.generator_dataset(feed, column_names, kwargs)
    if changes:
        p = replace(p, decisions=p.decisions + tuple(Decision(c.setting, c.new, c.old, c.reason)
                                                     for c in changes))
    _register(dataset, p, lineage, f"GeneratorDataset({what})")
    _log_plan(p, asked)
    return dataset


def _set_if_changed(kwargs: dict, key: str, value: Any, default: Any) -> None:
    """Pass a setting only when it differs from what MindSpore would use, so the call stays the user's."""
    if kwargs.get(key, default) != value:
        kwargs[key] = value


def _register(dataset: Any, p: Plan, lineage: measure.Lineage, label: str) -> None:
    reservation = _SESSION.ledger.reserve(label, p.predicted_shm, p.predicted_fds)
    weakref.finalize(dataset, _SESSION.ledger.release, reservation.key)
    measure.remember(dataset, p, lineage)


def _rows_per_epoch(kwargs: dict, length: int | None) -> int | None:
    """This rank's rows per epoch, as MindSpore's sampler will draw them (``num_samples``, ``num_shards``)."""
    n = length
    if kwargs.get("num_samples"):
        n = min(n or kwargs["num_samples"], kwargs["num_samples"])
    if kwargs.get("num_shards") and n:
        n = -(-n // kwargs["num_shards"])
    return n


_ROW_FIX = "lower num_parallel_workers, or pass python_multiprocessing=False to build_dataset"


def _without_processes(req: Request, why: str) -> Request:
    """MindSpore's worker processes cannot start here: plan threads, or stop now if the caller insisted."""
    if req.multiprocessing is True and (req.workers or 1) > 1:
        raise ProcessesUnavailableError(f"python_multiprocessing=True cannot work here: {why}, and MindSpore's GeneratorDataset "
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
    if p.mode == PIPES and ms.shared_mem:
        out.append(engine.set_shared_mem(False, "rows go through pipes: shared-memory slots would not fit; this "
                                             "also applies to pipelines launched later in this process"))
    for change in out:
        if change:
            log.warning("ms_shm changed MindSpore's global %s from %s to %s: %s", change.setting, change.old,
                        change.new, change.reason)
    return [c for c in out if c]


def _log_plan(p: Plan, asked: dict) -> None:
    log.info("ms_shm %s", p.summary())
    for d in p.decisions:
        explicit = d.setting in asked and asked[d.setting] != d.value
        level = logging.WARNING if explicit else logging.INFO if d.setting == "mode_locked" else logging.DEBUG
        log.log(level, "ms_shm decision %s", d)


def plan_of(dataset: Any) -> Plan | None:
    """The plan ms_shm built ``dataset`` with, or ``None`` for a dataset it did not build."""
    return measure.plan_of(dataset)


def _input_lineage(dataset: Any) -> measure.Lineage:
    """How the probe child can make the input rows of a ``map``: the stage's own lineage, or (for a tree that
    runs no Python code, whose reading has no side effects) a few rows read now."""
    lineage = measure.lineage_of(engine.rows_come_from(dataset))
    if lineage is not None:
        return lineage
    python = engine.python_code_in(dataset)
    if python:
        return measure.Unavailable(f"the input pipeline was not built by ms_shm and runs Python code ({python}): "
                                   f"reading rows ahead could change what it yields")
    log.info("ms_shm.map: the input dataset was not built by ms_shm; reading %d rows of it to measure the "
             "operations (one short pipeline run)", measure.PROBE_ROWS_FOR_MAP)
    out: dict = {}
    for row in engine.take_rows(dataset, measure.PROBE_ROWS_FOR_MAP):
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return measure.TakenRows(out)


def _names_list(columns: Any) -> list | None:
    if columns is None:
        return None
    return [columns] if isinstance(columns, str) else list(columns)


def map(dataset: Any, operations: Any = None, input_columns: Sequence[str] | str | None = None,
        output_columns: Sequence[str] | str | None = None, num_parallel_workers: int | None = None,
        **map_kwargs: Any):
    """``dataset.map(...)`` with workers and transport that fit this host, measured on real rows.

    The operations run on a few input rows first, in a forked probe child (so an operation that draws random
    numbers or keeps state is not advanced): that measures the output rows (which may be much larger than
    the input, e.g. a decode) and their cost. Yields exactly what ``dataset.map`` yields with the same
    arguments; an operation that fails on a probe row is left for MindSpore to report where it would.

    Returns:
        mindspore.dataset.Dataset: the mapped dataset; its plan is ``ms_shm.plan_of(result)``.

    Raises:
        ms_shm.ShmBudgetError: explicit arguments that cannot fit.
    """
    facts = _current_nofile(_SESSION.host_facts())
    ms = engine.read_config()
    lineage = _input_lineage(dataset)
    ins = _names_list(input_columns) or engine.column_names(dataset)[:1]
    outs = _names_list(output_columns) or ins
    probe = measure.probe_operations(lineage, operations, ins, outs)
    req = Request(
        workers=num_parallel_workers, multiprocessing=map_kwargs.get("python_multiprocessing"),
        max_rowsize=model.max_rowsize_mb(map_kwargs.get("max_rowsize")),
        prefetch=ms.prefetch_size if ms and ms.prefetch_size else model.DEFAULT_PREFETCH,
        cpu_count=facts.cpu_count or facts.usable_cpus, usable_cpus=facts.usable_cpus)
    profile = profile_for(ms.version if ms else facts.mindspore_version)
    decisions = []
    if probe.stats is None or probe.effects.order_dependent:
        why = probe.unmeasured or probe.effects.order_dependent
        req = replace(req, workers=num_parallel_workers if num_parallel_workers is not None else
                      (ms.num_parallel_workers if ms and ms.num_parallel_workers else 1),
                      multiprocessing=bool(map_kwargs.get("python_multiprocessing", False)))
        decisions.append(Decision("mode_locked", True, False, f"{why}: MindSpore's own map settings are kept"))
    p = _plan_map(probe.stats, req, facts, profile) if probe.stats is not None else \
        planner.plan_unmeasured(req, _budget(facts), profile, probe.unmeasured, kind="map")
    p = replace(p, decisions=tuple(decisions) + p.decisions)
    kwargs = dict(map_kwargs)
    _set_if_changed(kwargs, "python_multiprocessing", p.python_multiprocessing, False)
    if num_parallel_workers is not None or p.workers != req.workers:
        kwargs["num_parallel_workers"] = p.workers
    result = engine.map_dataset(dataset, operations, input_columns, output_columns, kwargs)
    _register(result, p, measure.MapLineage(lineage, operations, tuple(ins), tuple(outs)), "map")
    asked = dict(map_kwargs)
    if num_parallel_workers is not None:
        asked["num_parallel_workers"] = num_parallel_workers
    _log_plan(p, asked)
    return result


def _plan_map(stats: measure.OperationStats, req: Request, facts: host.HostFacts, profile: Any) -> Plan:
    memory_left = facts.mem_available
    if facts.cgroup_mem_limit and facts.cgroup_mem_usage is not None:
        memory_left = min(memory_left or facts.cgroup_mem_limit, facts.cgroup_mem_limit - facts.cgroup_mem_usage)
    return planner.plan_map(stats.in_bytes, stats.out_bytes, stats.seconds_per_row, stats.cpu_fraction, None,
                            req, _budget(facts), profile, shmmax=facts.shmmax, memory_left=memory_left)


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
