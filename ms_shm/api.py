"""The public calls: ``tune``, ``build_dataset``, ``map``, ``plan_of``. Composition only: facts from ``host``
and ``measure``, decisions from the engine's planner, changes through the engine, state in the ``Session``.

The framework is reached only through its engine (``ms_shm.engines.get()``), so ``tests/test_composition.py``
runs these calls in-process on a fake engine.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import multiprocessing
import numbers
import os
import sys
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

from ms_shm import advice, engines, host, hostcost, measure, rows, sites, sizes, spawncost, threads
from ms_shm import budget as budget_mod
from ms_shm import changes as changes_mod
from ms_shm import plan as plan_mod
from ms_shm._results import Result, mib, record
from ms_shm.errors import ProcessesUnavailableError, UsageError
from ms_shm.plan import EXPLICIT, PIPES, Decision, Plan, Request, ShmBudgetError, unasked
from ms_shm.state import BUILT_THROUGH_MS_SHM, SESSION, Session

log = logging.getLogger("ms_shm")


def _engine():
    return engines.get("mindspore")


def _pipeline_engine():
    """The engine, for a pipeline being built (``_log_plan`` says the advice ``ms-shm run`` held back for it)."""
    return _engine()


# Settings a plan lowers or switches to fit this host's room (``_budget_binds``)
_BUDGET_SETTINGS = ("prefetch_size", "shared_mem", "max_rowsize", "memory_kept_for_next_stage", "memory_overcommitted")


def _budget_binds(p: Plan) -> bool:
    """Whether this host's room shaped ``p``: a candidate it priced did not fit, a setting was lowered or switched
    to fit, or worker processes run unmeasured (their room unknown)."""
    return (not p.fits or any(not c.fits for c in p.alternatives)
            or any(d.setting in _BUDGET_SETTINGS and d.value != d.default for d in p.decisions)
            or (p.row_bytes == 0 and p.python_multiprocessing))


def session() -> Session:
    """This process's ms_shm state: cached facts, live reservations, every change made (``restore()``)."""
    return SESSION


@record
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
        SESSION.restore(self.changes)

    def __str__(self) -> str:
        lines = [f"ms_shm.tune: budget {mib(self.budget.shm_bytes)} of /dev/shm per pipeline "
                 f"({self.budget.reason}), {mib(self.budget.memory_bytes)} of memory ({self.budget.memory_reason})"]
        lines += [f"  decided {d}" for d in self.decisions]
        lines += [f"  changed {c.setting}: {c.old} -> {c.new}" for c in self.changes]
        lines += [f"  advice: {a.problem} -> {a.fix}" for a in self.advice]
        return "\n".join(lines)


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
    SESSION.start(facts, shm_fraction, ranks)
    eng = _engine()
    config = eng.read_config() if _mindspore_in_use() else None
    b = SESSION.budget(facts, reserved=(0, 0, 0))
    w = workers or advice.typical_workers(facts)
    p = config.prefetch_size if config and config.prefetch_size else eng.arithmetic.DEFAULT_PREFETCH
    decisions = [d for d in (_nofile_decision(facts, w, p, eng, _mindspore_in_use()),) if d]
    if config is not None:
        decisions += eng.planning.plan_startup(config, b.shm_bytes, w, row_mb, prefetch, facts.mindspore_version)
    made = () if dry_run else _apply_startup(decisions, eng, raise_nofile)
    torch_decisions, torch_made = _torch_startup(facts, dry_run)
    decisions, made = decisions + list(torch_decisions), tuple(made) + torch_made
    notes = facts.notes + (() if config else (
        ("mindspore is not importable: only host facts and the open-files limit were handled",) if
        _mindspore_in_use() else ("a torch program that has not imported mindspore: MindSpore's settings were not "
                                  "read (importing it would cost seconds)",)))
    report = TuneReport(facts, config, b, tuple(decisions), tuple(made),
                        tuple(advice.diagnose(_as_changed(facts, made), config, mindspore=_mindspore_in_use())),
                        dry_run, tuple(notes))
    _log_tune(report)
    if clean and facts.ranks.local_rank == 0 and not dry_run:
        _clean_leftovers()
    return report


def _as_changed(facts: host.HostFacts, made: Sequence[Any]) -> host.HostFacts:
    """The host as ``tune()`` left it: advice about an open-files soft limit it has just raised would be stale."""
    raised = [c.new for c in made if c.setting == changes_mod.NOFILE and isinstance(c.new, int)]
    return replace(facts, nofile_soft=raised[-1]) if raised else facts


def _torch_startup(facts: host.HostFacts, dry_run: bool) -> tuple:
    """``loaders.startup`` once torch is imported; the DataLoader modules are not loaded for a MindSpore program."""
    if "torch" not in sys.modules:
        return (), ()
    from ms_shm import loaders

    return loaders.startup(facts, dry_run)


def _mindspore_in_use() -> bool:
    """Whether ``tune()`` should read (and so import) MindSpore: not for a torch program that has not imported it."""
    return "mindspore" in sys.modules or "torch" not in sys.modules


def _nofile_decision(facts: host.HostFacts, workers: int, prefetch: int, eng: Any,
                     mindspore: bool = True) -> Decision | None:
    """A train and an eval pipeline need their fds under the soft limit (one fd per shared-memory slot). A
    program without MindSpore (a torch one under ``ms-shm run``) is told it in a DataLoader's terms."""
    need = advice.fds_needed(facts, workers, prefetch, pipelines=2)
    soft, hard = facts.nofile_soft, facts.nofile_hard
    if soft is None or soft >= need:
        return None
    target = sizes.nofile_within(need, hard)
    why = (f"{need} needed by two {workers}-worker pipelines at prefetch {prefetch} (one fd per shared-memory slot)"
           if mindspore else f"{need}, the fds of two {workers}-worker data pipelines (a DataLoader holds one per "
                             f"tensor storage in flight, and per batch the program keeps)")
    return Decision(changes_mod.NOFILE, target, soft, f"soft open-files limit {soft} < {why}")


def _apply_startup(decisions: Sequence[Decision], eng: Any, raise_nofile: bool) -> list:
    made = []
    for d in decisions:
        if d.setting == changes_mod.NOFILE:
            if raise_nofile and d.value > d.default:
                made.append(changes_mod.set_nofile_soft(d.value, d.reason))
        elif d.value != d.default:
            made.append(eng.apply_setting(d.setting, d.value, d.reason if d.setting != "prefetch_size" else "tune()"))
    return SESSION.record(made, eng.undo)


def _log_tune(report: TuneReport) -> None:
    """The budget and each decision at INFO; each change made to a setting of the process (the soft open-files
    limit, MindSpore's globals) also at WARNING, as a pipeline's are: an audit's ``ms-shm run`` under ``ulimit
    -Sn 64`` raised the limit to 20000 with nothing shown at the default level."""
    b = report.budget
    log.info("ms_shm.tune: /dev/shm budget %s per pipeline: %s; memory %s: %s", mib(b.shm_bytes), b.reason,
             mib(b.memory_bytes), b.memory_reason)
    for d in report.decisions:
        log.info("ms_shm.tune%s: %s", " (dry run)" if report.dry_run else "", d)
    for change in report.changes:
        log.warning("ms_shm.tune changed %s from %s to %s: %s", change.setting, change.old, change.new, change.reason)
    SESSION.log_advice_once(report.facts, [a for a in report.advice if a.code not in _SAID_WHEN_USED],
                            BUILT_THROUGH_MS_SHM)


# Advice kept in the report (``ms-shm doctor`` shows it) but not logged by ``tune()``: it concerns an API that
# says it itself where it is used (``build_dataloader`` logs MindSpore's DataLoader under NumPy 2), and was noise
# in every GeneratorDataset-only script's log.
_SAID_WHEN_USED = frozenset({"msloader-numpy2"})


def _clean_leftovers() -> None:
    from ms_shm import cleanup

    result = cleanup.clean(dry_run=False)
    log.info("ms_shm.tune: cleaned leftovers of crashed runs: %s freed", mib(result.bytes_freed))
    for note in result.notes:  # what was kept (a live job's young files) or could not be read, as `ms-shm clean` says
        log.info("ms_shm.tune: clean: %s", note)


def _request(kwargs: dict, config: Any, facts: host.HostFacts, eng: Any, explicit: str | None = None) -> Request:
    """What the caller asked for, with the framework's globals as they are now; ``explicit`` says whether the
    caller's explicit settings are orders (``None``, ``"order"``: kept, or ``ShmBudgetError``) or preferences
    (``"preference"``, unchanged code under ``ms_shm.patch``: adapted where they cannot fit)."""
    return Request(
        workers=kwargs.get("num_parallel_workers"),
        multiprocessing=kwargs.get("python_multiprocessing"),
        max_rowsize=eng.arithmetic.max_rowsize_mb(kwargs.get("max_rowsize")),
        prefetch=config.prefetch_size if config and config.prefetch_size else eng.arithmetic.DEFAULT_PREFETCH,
        shared_mem=bool(config.shared_mem) if config and config.shared_mem is not None else True,
        can_switch_shared_mem=bool(config and config.has_shared_mem_switch),
        start_method=(config.start_method if config else None) or "fork",
        cpu_count=facts.cpu_count or facts.usable_cpus,
        usable_cpus=facts.usable_cpus,
        explicit=explicit,
    )


def _profile(config: Any, facts: host.HostFacts, eng: Any) -> Any:
    return eng.profile(config.version if config else facts.mindspore_version)


def _copies(holders: Sequence[tuple], facts: host.HostFacts, start_method: str) -> list:
    """What one worker process of a stage comes to copy of the big lists and dicts its ``(name, object)``
    holders keep or their code reads (the source, a map's operations; copy-on-read), walked once per stage:
    the plan counts it in each worker's memory and the warnings scale it to the workers it picks."""
    from ms_shm import cow

    return cow.findings_in(holders, 1, facts.ranks.local_size, start_method)


def _with_worker_memory(probe: measure.StageProbe, copies: Sequence, start_method: str,
                        facts: host.HostFacts) -> measure.StageProbe:
    """The probe with each worker process's ``copies`` added to the worker's own memory: a source holding 2M
    paths planned processes at 479 of a 485 MiB memory budget and was OOM-killed, as raw MindSpore was.
    Threads and inline read the one copy, so they stay. Where memory may bind, a spawned worker's own memory
    is a fresh interpreter's with its imports (``spawncost``), not the forked probe child's."""
    copied = sum(f.bytes_per_worker for f in copies)
    if probe.stats is None:
        return probe
    own = probe.stats.worker_bytes
    if start_method != "fork" and _worker_pages(facts):
        own = spawncost.worker_bytes(start_method, own)
    if not copied and own == probe.stats.worker_bytes:
        return probe
    if copied:
        log.debug("ms_shm: each worker process would copy ~%s of the %s's lists and dicts (copy-on-read); "
                  "counted in its memory", mib(copied), copies[0].holder)
    return replace(probe, stats=replace(probe.stats, worker_bytes=(own or 0) + copied))


def _inspect_copy_on_read(copies: Sequence, workers: int, facts: host.HostFacts, effects: Any = None,
                          share_lists_of: Any = None) -> None:
    """Each big container the ``workers`` will copy, said (local rank 0), or swapped for shared storage in
    ``share_lists_of``, the source, where the call asked (``build_dataset``'s ``share_lists``)."""
    from ms_shm import cow

    if not copies:
        return
    findings = cow.for_workers(copies, workers)
    if share_lists_of is not None:
        cow.share_lists(share_lists_of, findings, effects=effects)
    elif facts.ranks.local_rank == 0:
        cow.log_findings(findings, effects, offer_share_lists=findings[0].holder == SOURCE)


@contextlib.contextmanager
def _copies_said_on_refusal(copies: Sequence, req: Request, facts: host.HostFacts, probe: measure.StageProbe):
    """A plan refused for memory that the workers' copies took is said with them, before the error: an audit's
    refusal named only "250 MiB of memory", never the module global every worker copied, nor its fix."""
    try:
        yield
    except ShmBudgetError:
        _inspect_copy_on_read(copies, req.workers or 1, facts, probe.effects)
        raise


SOURCE = "source"  # the holder name of a GeneratorDataset's source (``_copies``), the one share_lists swaps


def _operation_holders(operations: Any) -> list:
    """A map's operations of the program's own, as ``(name, object)`` copy-on-read holders: a lookup table or
    vocabulary kept on an operation object, or a module global or closure variable an operation function reads,
    is copied by every map worker process as the source's lists are (``cow.code_holders``)."""
    from ms_shm import cow

    return cow.code_holders(operations if isinstance(operations, (list, tuple)) else [operations], "map operation")


def _column_names(column_names: Any, kwargs: dict, eng: Any) -> tuple | None:
    if isinstance(column_names, str):
        return (column_names,)
    if column_names is not None:
        return tuple(column_names)
    columns = eng.compat.schema_columns(kwargs["schema"]) if kwargs.get("schema") is not None else None
    return tuple(name for name, _ in columns) if columns else None


def _probe_blocker(source: Any, kwargs: dict, eng: Any) -> str | None:
    """Why a random-access source is not read ahead at all."""
    if kwargs.get("batch_sampler") is not None:
        return "a batch_sampler (and collate_fn) make the rows, so single rows say little: not read ahead"
    ops = eng.compat.network_operators_in(source)
    if ops:
        return f"the source computes with {ops}, whose runtime cannot run in a forked probe"
    return None


def _lock_mode(req: Request, why: str, default_workers: int, default_multiprocessing: bool) -> tuple:
    """Rows that depend on which worker reads them keep MindSpore's own mode and workers."""
    workers = req.workers if req.workers is not None else default_workers
    multiprocessing = req.multiprocessing if req.multiprocessing is not None else default_multiprocessing
    reason = (f"{why}: rows must be read by the workers MindSpore itself would start, so its own mode is kept "
              f"(num_parallel_workers={workers}, python_multiprocessing={multiprocessing}); only prefetch and "
              f"the shared-memory switch may change")
    return replace(req, workers=workers, multiprocessing=multiprocessing), Decision("mode_locked", True, False,
                                                                                  reason)


def _program_start_method_kept(req: Request, raw_starts_processes: bool, default_multiprocessing: bool) -> tuple:
    """``(request, decision or None)``: no worker processes the call did not start raw, where the program chose a
    start method other than fork. MindSpore's pools set ``multiprocessing``'s start method to ``"fork"`` for the
    whole program once they have started their workers (2.10: ``SamplerFn.launch`` and the map pool's
    ``launch`` call ``set_start_method("fork", True)``), so processes ms_shm chose would change every later
    ``Pool`` and DataLoader of the program's (an audit: ``spawn`` became ``fork`` after a ``GeneratorDataset``
    of default arguments ms_shm planned as 2 processes). Likewise where MindSpore's own start method
    (``ds.config.set_multiprocessing_start_method``, ``req.start_method``) is not fork: each such worker imports
    the program anew, without what it set as it ran (an audit: a source and a map of the script's own, under
    ``spawn``, raised ``NameError`` in every worker ms_shm started, where raw read them in its threads)."""
    chosen = multiprocessing.get_start_method(allow_none=True)
    if raw_starts_processes or req.multiprocessing is False:
        return req, None
    if chosen not in (None, "fork"):
        why = (f"the program set multiprocessing's start method to {chosen!r}, and MindSpore's worker processes set "
               f"it to 'fork' for the whole program once they start")
    elif req.start_method not in (None, "fork"):
        why = (f"MindSpore's start method is {req.start_method!r} (ds.config.set_multiprocessing_start_method): "
               f"each worker process would import the program anew, without what it set as it ran (names set "
               f"under if __name__ == '__main__')")
    else:
        return req, None
    reason = (f"{why}; raw MindSpore starts none for this call, so ms_shm starts none either (pass "
              f"python_multiprocessing=True and num_parallel_workers to have them)")
    asked = req.multiprocessing is not None
    return replace(req, multiprocessing=False), Decision(
        "python_multiprocessing", False, req.multiprocessing if asked else default_multiprocessing, reason, asked)


def check_as_mindspore(kind: str, real: Any, named: dict, strict: bool = False) -> None:
    """MindSpore's own argument errors, word for word, before ms_shm reads an argument: what a raw call raises
    at once (a ``num_parallel_workers`` of 0 or ``"2"``, a ``python_multiprocessing`` of ``1``, column names that
    are not strings), ms_shm raises, instead of planning over it or failing in its own words. ``named``: the
    call's arguments by name (``source`` or ``operations`` included, the dataset not); ``real``: MindSpore's
    ``GeneratorDataset.__init__`` / ``Dataset.map`` / ``Dataset.batch``. One explicit setting ms_shm adapts
    instead, unless ``strict``: ``num_parallel_workers`` above the CPU count, which every planner caps at the CPU
    count with a warning (``planning.cap_workers``), so it is checked at that count."""
    workers, cpus = named.get("num_parallel_workers"), os.cpu_count() or 1
    if not strict and type(workers) is int and workers > cpus:
        named = dict(named, num_parallel_workers=cpus)
    _engine().compat.validate(kind, real, **named)


def _named(kind: str, real: Any, leading: tuple, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name, its positional ones bound in MindSpore's own order (``GeneratorDataset``'s
    third is ``column_types``); ``leading``: the arguments before ``args`` (``self`` excluded). Arguments that do
    not bind are left to MindSpore's own call to refuse."""
    if not args:
        return kwargs
    try:
        sig = inspect.signature(inspect.unwrap(real))
        bound = sig.bind(None, *leading, *args, **kwargs)
    except (TypeError, ValueError):
        raise TypeError(f"{kind}: too many positional arguments for MindSpore's signature") from None
    return by_name(bound, 1 + len(leading))


def by_name(bound: inspect.BoundArguments, skip: int = 1) -> dict:
    """A bound call's arguments by name, ``**kwargs`` spread among them, less its first ``skip`` parameters
    (``self``, and those the caller holds apart)."""
    params = list(bound.signature.parameters.values())
    apart = {p.name for p in params[:skip]}
    named = {name: value for name, value in bound.arguments.items() if name not in apart}
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            named.update(named.pop(p.name, {}))
    return named


def build_dataset(source: Any, column_names: Sequence[str] | str | None = None, *generator_args: Any,
                  share_lists: bool = False, _explicit: str | None = None, **generator_kwargs: Any):
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
        ms_shm.RowError: a probe row MindSpore cannot carry (names the column, the row and the fix); under
            ``ms_shm.patch`` it is logged instead, and MindSpore raises its own error while iterating.
        ms_shm.ShmBudgetError: explicit arguments that cannot fit, before any worker starts.
        ms_shm.ProcessesUnavailableError: ``python_multiprocessing=True`` where MindSpore cannot start worker
            processes (no /proc).
    """
    eng = _pipeline_engine()
    with eng.compat.source_code_read_once():
        return _build_dataset(eng, source, column_names, generator_args, share_lists, _explicit, generator_kwargs)


def _build_dataset(eng: Any, source: Any, column_names: Any, generator_args: tuple, share_lists: bool,
                   _explicit: str | None, generator_kwargs: dict):
    real = eng.compat.real_method("generator")
    generator_kwargs = _named("GeneratorDataset", real, (source, column_names), generator_args, generator_kwargs)
    if not eng.compat.arguments_fit("generator", source, column_names, **generator_kwargs):
        return eng.compat.generator_dataset(source, column_names, generator_kwargs)  # MindSpore's own TypeError
    if _explicit is None:  # patched calls were checked at the call
        check_as_mindspore("generator", real, dict(generator_kwargs, source=source, column_names=column_names))
    if "num_parallel_workers" in generator_kwargs and generator_kwargs["num_parallel_workers"] is None:
        return _workers_none(eng, source, column_names, generator_kwargs, _explicit)
    facts, config = SESSION.host_facts(), eng.read_config()
    names = _column_names(column_names, generator_kwargs, eng)
    req = _request(generator_kwargs, config, facts, eng, _explicit)
    if not rows.is_random_access(source):
        p = eng.planning.plan_iterable(req, SESSION.budget(facts), _profile(config, facts, eng))
        lineage = measure.IterableLineage(source, names) if names else measure.Unavailable("no column names")
        return _build(eng, source, column_names, generator_kwargs, p, config, lineage, "iterable", _explicit)
    pinned = eng.compat.one_worker_by_mindspore("generator", source)
    if pinned:
        return eng.compat.generator_dataset(source, column_names,
                                            _as_mindspore_pins("generator", pinned, generator_kwargs, _explicit, eng))
    blocked = _probe_blocker(source, generator_kwargs, eng)
    probe = measure.StageProbe(None, unmeasured=blocked) if blocked else \
        measure.probe_random_access(source, names, eng.compat.row_check(), _worker_pages(facts),
                                    # patched, or a row the epoch may never draw: MindSpore raises it if met
                                    defer_row_errors=_explicit is not None or
                                    not eng.compat.probe_rows_drawn(generator_kwargs),
                                    column_dtypes=eng.compat.column_dtypes(generator_kwargs.get("column_types"),
                                                                          generator_kwargs.get("schema")),
                                    beside=_beside_probe(facts), sampled=eng.compat.sampled_rows(generator_kwargs))
    copies = _copies([(SOURCE, source)], facts, req.start_method)
    # what share_lists will swap is not copied; what it must leave (a module global, a tuple) still is
    probe = _with_worker_memory(probe, [f for f in copies if not (share_lists and f.swappable)], req.start_method, facts)
    with _copies_said_on_refusal(copies, req, facts, probe):
        p = _plan_source(probe, req, generator_kwargs, config, facts, eng)
    if p.python_multiprocessing and p.workers > 1:
        _inspect_copy_on_read(copies, p.workers, facts, probe.effects, source if share_lists else None)
    lineage = measure.SourceLineage(source, names, probe.stats.indices[:4]) if probe.stats and names else \
        measure.Unavailable(probe.unmeasured or "no column names")
    p, feed = threads.cap_source(p, _guarded(source, p, facts, eng), facts.usable_cpus,  # threads per worker
                                 _threads_started(probe))
    feed = eng.guard.CarriedErrors(feed) if _moved_into_processes(p, generator_kwargs) else feed
    return _build(eng, feed, column_names, generator_kwargs, p, config, lineage, type(source).__name__, _explicit)


_WORKERS_NONE = ("num_parallel_workers=None: MindSpore's GeneratorDataset takes it, then fails its first epoch "
                 "(\"TypeError: '>' not supported between instances of 'NoneType' and 'int'\" for a random-access "
                 "source, \"incompatible constructor arguments\" for a generator; 2.0 to 2.10). Fix: pass an int, "
                 "or leave it out (MindSpore's default is 1)")


def _workers_none(eng: Any, source: Any, column_names: Any, kwargs: dict, explicit: str | None):
    """``GeneratorDataset(num_parallel_workers=None)``: ``ms_shm.UsageError`` with the fix from the API; unchanged
    code under ``ms_shm.patch`` gets MindSpore's dataset as asked, which fails where raw's does, said first. Planned,
    it had its workers chosen and every row arrived, hiding MindSpore's error (an audit of MindSpore's unit
    tests)."""
    if explicit is None:
        raise UsageError(_WORKERS_NONE)
    log.warning("ms_shm generator: built as asked, unplanned, at %s: %s", sites.call_site(), _WORKERS_NONE)
    return eng.compat.generator_dataset(source, column_names, kwargs)


def _plan_source(probe: measure.StageProbe, req: Request, kwargs: dict, config: Any, facts: host.HostFacts,
                 eng: Any) -> Plan:
    """The plan for a random-access source: measured, locked to MindSpore's mode, or as asked."""
    decisions = []
    if probe.stats is not None:
        req = replace(req, rows_per_epoch=_rows_per_epoch(kwargs, probe.stats.length, probe.stats.sampled))
    bound = probe.effects.mode_bound or (probe.stats.reused_buffer if probe.stats is not None else None)
    if bound:
        req, locked = _lock_mode(req, bound, 1, True)
        decisions.append(locked)
    blocker = eng.compat.processes_blocker() if config is not None else None
    if blocker:
        req = _without_processes(req, blocker)
        decisions.append(Decision("python_multiprocessing", False, True, blocker))
    req, kept = _program_start_method_kept(req, req.multiprocessing is not False and (req.workers or 1) > 1, True)
    decisions += [kept] if kept else []
    profile = _profile(config, facts, eng)
    if probe.stats is None:
        p = eng.planning.plan_unmeasured(req, SESSION.budget(facts), profile, probe.unmeasured)
    else:
        polled = getattr(config, "generator_poll_seconds", None)  # the engine's poll in this process, where known
        costs = eng.planning.Costs(**({"poll_seconds": polled} if polled else {})).on_this_host(
            hostcost.for_rows(probe.stats.row_bytes_max, _serial_epoch(probe.stats, req)))
        p = _with_room(lambda b: _fit(lambda r: eng.planning.plan_generator(probe.stats, r, b, profile, costs), req,
                                      bool(bound)), facts)
    return replace(p, decisions=tuple(decisions) + p.decisions, rows_per_epoch=req.rows_per_epoch)


PREFERENCE, ORDER = "preference", "order"
_EXPLICIT_SETTINGS = (("num_parallel_workers", "workers"), ("python_multiprocessing", "multiprocessing"),
                      ("max_rowsize", "max_rowsize"))


def _serial_epoch(stats: Any, req: Request) -> float | None:
    rows_ = req.rows_per_epoch if req.rows_per_epoch is not None else stats.length
    return None if stats.seconds_per_row is None or rows_ is None else stats.seconds_per_row * rows_


def _fit(plan_for: Any, req: Request, locked: bool) -> Plan:
    """``plan_for(req)``. Where the explicit settings are preferences (unchanged code under ``ms_shm.patch``) and
    nothing honouring them fits, or fits only by taking the memory a stage after it needs, the fastest plan that
    fits without them, which keeps the rows identical; never where the rows depend on which worker reads them
    (``locked``): then ``ShmBudgetError`` as for orders, or the plan honouring them."""
    asked = ", ".join(f"{name}={getattr(req, field)}" for name, field in _EXPLICIT_SETTINGS
                      if getattr(req, field) is not None)
    adaptable = req.explicit == PREFERENCE and not locked and asked
    try:
        kept = plan_for(req)
    except ShmBudgetError as exc:
        if not adaptable:
            raise
        p, why = plan_for(unasked(req)), exc.problem
    else:
        if not (adaptable and _left_no_room(kept)):
            return kept
        p = plan_for(unasked(req))
        if _left_no_room(p):
            return kept
        why = next(d.reason for d in kept.decisions if d.setting == "memory_kept_for_next_stage")
    adapted = Decision(EXPLICIT, "adapted", asked,
                       f"{why}; the call's explicit {asked} are preferences here (ms_shm.patch), so the fastest "
                       f"configuration that fits and yields the same rows is used instead")
    return replace(p, decisions=(adapted,) + p.decisions)


def _with_room(plan_with: Callable[[budget_mod.Budget], Plan], facts: host.HostFacts) -> Plan:
    """``plan_with(budget)``. Where nothing fits, the stages planned before whose iterator is not made yet switch
    to their leanest settings (``Plan.lean``), those giving back the most first and no more of them than needed,
    and this plan takes the room: train and eval built up front in a 1000 MB container (8 MiB rows, no settings
    of their own) had the eval refused beside the train's fastest plan, where raw ran both; the train source
    then reads in MindSpore's own thread, as raw's default does. Raises the first refusal where that is not
    enough, and no plan fits beside what the live pipelines hold now either (``_overcommitted``)."""
    try:
        return plan_with(SESSION.budget(facts))
    except ShmBudgetError as refused:
        while True:  # a stage that fails to switch is not asked again: planned anew without it
            chosen, p = _fewest_to_lean(plan_with, facts)
            if p is None:
                p = _overcommitted(plan_with, facts, refused) or _beside_the_largest_idle(plan_with, facts, refused)
                if p is None:
                    raise
                return p
            if len(SESSION.ledger.go_lean(chosen)) == len(chosen):
                return p


def _overcommitted(plan_with: Callable[[budget_mod.Budget], Plan], facts: host.HostFacts,
                   refused: ShmBudgetError) -> Plan | None:
    """The leanest plan the call allows, planned on the memory left now, where nothing fits beside the
    reservations of pipelines an iterator runs and none may switch to leaner settings; said at WARNING, with the
    fix. A running pipeline's reservation is its worst case (every queue full behind a slow loop), and what it
    holds shows in the memory left now: an eval pipeline built while the train's iterator ran was refused in a
    1000 MB container, even in MindSpore's own thread, where raw ran both at a 578 MiB peak. Pipelines built
    and not iterated yet hold nothing now and keep their reservations (an audit: planned on the memory left
    beside them, stages built up front were OOM-killed). ``None`` where no running pipeline reserved memory, or
    nothing fits the memory left now."""
    running = sum(r.memory for r in SESSION.ledger.running(SESSION.ledger.live()))
    if not running:
        return None
    now = SESSION.budget(facts, held_now=True)
    p = _leanest(plan_with, now)
    if p is None:
        return None
    if p.lean is not None and p.lean.by_prefetch[-1][2] < p.predicted_memory:
        p = _leaned(p, "the leanest settings, as the memory is overcommitted")
    why = (f"the running pipelines reserve {mib(running)} of memory, their worst case (every queue full), and "
           f"none of this call's settings fits beside that; it runs as {p.mode} x{p.workers}, the least memory "
           f"the call allows, up to {mib(p.predicted_memory)}, planned on the memory left now "
           f"({now.memory_reason}){_weighed_at(p.budget, now)}")
    log.warning("ms_shm: overcommitting memory for the pipeline built at %s: %s. If the container runs out of "
                "memory: %s; or build this pipeline before the running one's iterator starts (then both are "
                "planned to fit), or give the running pipeline num_parallel_workers=1", sites.call_site(), why,
                refused.fix or str(refused).split(" Fix: ", 1)[-1].rstrip("."))
    return replace(p, budget=now, decisions=(Decision("memory_overcommitted", True, False, why),) + p.decisions)


def _beside_the_largest_idle(plan_with: Callable[[budget_mod.Budget], Plan], facts: host.HostFacts,
                             refused: ShmBudgetError) -> Plan | None:
    """The plan beside the largest of several pipelines built and not iterated yet, where nothing fits beside
    all of them at once; said at WARNING. Each keeps its worst-case reservation until it has run (train and eval
    built up front may run at once), but a search or a k-fold builds many and runs them one after another: an
    audit's 80 pipelines built up front were refused from the 47th on ("17.6 GiB reserved by live pipelines",
    with 21.9 GiB of memory available), where raw built and ran all 80. ``None`` where fewer than two are idle,
    or nothing fits beside the largest either."""
    idle = SESSION.ledger.following(SESSION.ledger.live())
    pipelines: dict = {}
    for r in idle:
        pipelines.setdefault(r.group or (r.key,), []).append(r)
    if len(pipelines) < 2:
        return None
    largest = max(pipelines.values(), key=lambda stages: sum(r.memory + r.shm_bytes for r in stages))
    b = SESSION.budget(facts, held_now=True, excluded=frozenset(r.key for r in idle if r not in largest))
    p = _plan_or_none(plan_with, b)
    if p is None:
        return None
    why = (f"{len(pipelines)} pipelines built and not iterated yet reserve {mib(sum(r.memory for r in idle))} of "
           f"memory and {mib(sum(r.shm_bytes for r in idle))} of /dev/shm, and none of this call's settings fits "
           f"beside all of them at once; planned beside the largest ({_labels([r.label for r in largest])}): "
           f"pipelines built up front and run one after another need no more")
    log.log(_once_per_site(), "ms_shm: the pipeline built at %s: %s. If they run at once, memory may run out: %s",
            sites.call_site(), why, refused.fix or str(refused).split(" Fix: ", 1)[-1].rstrip("."))
    return replace(p, decisions=(Decision("memory_overcommitted", True, False, why),) + p.decisions)


_WARNED: set = set()  # what ``_first_warning`` was told: an audit's loop said one warning 34 times, another 96


def _first_warning(*key: Any) -> bool:
    """Whether ``key`` (a call site, and what is said there) comes for the first time; remembered."""
    first = key not in _WARNED
    _WARNED.add(key)
    return first


def _once_per_site() -> int:
    """WARNING the first time for this call site, INFO after: a loop building at one line said it 34 times."""
    return logging.WARNING if _first_warning(sites.call_site()) else logging.INFO


def _weighed_at(leanest: budget_mod.Budget, now: budget_mod.Budget) -> str:
    """Where ``_leanest`` bisected the memory budget: the plan's other settings were refused against that, not
    against the memory left, and its reasons quote it."""
    if leanest.memory_bytes is None or leanest.memory_bytes == now.memory_bytes:
        return ""
    return (f"; the other settings were weighed against the least memory that yields a plan, "
            f"{mib(leanest.memory_bytes)}, not against the {mib(now.memory_bytes)} left")


def _leanest(plan_with: Callable[[budget_mod.Budget], Plan], b: budget_mod.Budget) -> Plan | None:
    """``plan_with``'s plan at the least memory it fits in, up to ``b``'s: the leanest the call allows (under
    ``ms_shm.patch``, explicit settings that hold more give way, as where they do not fit), or ``None``."""
    best = _plan_or_none(plan_with, b)
    if best is None or b.memory_bytes is None:
        return best
    low, high = 0, b.memory_bytes
    while high - low > max(1 << 20, high >> 6):  # to within a MiB or 1/64: plans differ by rows of memory
        mid = (low + high) // 2
        p = _plan_or_none(plan_with, replace(b, memory_bytes=mid))
        if p is None:
            low = mid
        else:
            best, high = p, mid
    return best


def _fewest_to_lean(plan_with: Callable[[budget_mod.Budget], Plan], facts: host.HostFacts) -> tuple:
    """``(stages, plan)``: the fewest stages that may switch to their leanest settings, most giving first, with
    which ``plan_with`` fits, and its plan; ``((), None)`` where none do."""
    leanable = SESSION.ledger.leanable()
    for n in range(1, len(leanable) + 1):
        p = _plan_or_none(plan_with, SESSION.budget(facts, leaned=frozenset(r.key for r in leanable[:n])))
        if p is not None:
            return leanable[:n], p
    return (), None


def _plan_or_none(plan_with: Callable[[budget_mod.Budget], Plan], b: budget_mod.Budget) -> Plan | None:
    try:
        return plan_with(b)
    except ShmBudgetError:
        return None


def _lean_switch(dataset: Any, p: Plan, label: str, eng: Any) -> Callable[[Any, Any], bool] | None:
    """What switches ``dataset`` (built, its iterator not made yet) to its plan's leanest settings, from its
    reservation ``before`` to ``after``, said at WARNING, with the plan ``plan_of`` gives updated; ``None`` where
    it has none."""
    lean = p.lean
    try:
        ref = weakref.ref(dataset) if lean is not None else None
    except TypeError:
        ref = None
    if ref is None:
        return None

    def switch(before: Any, after: Any) -> bool:
        stage = ref()
        if stage is None:
            return False
        eng.compat.switch_workers(stage, lean.workers, processes=False)  # a lean stage reads in this process
        log.warning("ms_shm: %s switches to %s x%d (planned %s x%d) for its iterators from now on: a stage "
                    "built after it found no room beside it while its iterator was not made yet, and there it holds "
                    "%s of memory instead of %s (~%s s/epoch instead of ~%s), the same rows. To keep its settings, "
                    "give the container more memory, or build the later pipeline after this one has run",
                    label, lean.mode, lean.workers, p.mode, p.workers, mib(after.memory), mib(before.memory),
                    _seconds(lean.seconds), _seconds(p.estimated_seconds))
        measure.remember(stage, _leaned(p), measure.lineage_of(stage) or measure.Unavailable("switched"))
        return True

    return switch


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _leaned(p: Plan, why: str = "switched to leave room for a pipeline built after it") -> Plan:
    """``p`` at its leanest settings."""
    lean = p.lean
    shm, fds, memory = lean.by_prefetch[-1]
    decision = Decision("mode", lean.mode, p.mode, why)
    return replace(p, mode=lean.mode, workers=lean.workers, python_multiprocessing=False, max_rowsize=None,
                   predicted_shm=shm, predicted_fds=fds, predicted_memory=memory, guard_slots=0,
                   guard_worker_bytes=0, estimated_seconds=lean.seconds, by_prefetch=lean.by_prefetch, lean=None,
                   decisions=(decision,) + p.decisions)


def _left_no_room(p: Plan) -> bool:
    """Whether ``p`` takes memory a stage after it needs (an audit's source kept its explicit 2 workers under
    ``ms-shm run`` in a 600 MB container and the map after it was refused; without the explicit workers the
    source left the map its room and the run fitted)."""
    return any(d.setting == "memory_kept_for_next_stage" and not d.value for d in p.decisions)


def _adapted(p: Plan) -> bool:
    return any(d.setting == EXPLICIT for d in p.decisions)


def _moved_into_processes(p: Plan, asked: dict) -> bool:
    """Whether the plan reads the source in worker processes where the call, as MindSpore takes it, reads it in
    MindSpore's own process (one worker, its default, or ``python_multiprocessing=False``)."""
    asked_workers = asked.get("num_parallel_workers")
    raw_processes = isinstance(asked_workers, numbers.Integral) and asked_workers > 1 and \
        asked.get("python_multiprocessing", True)
    return p.workers > 1 and bool(p.python_multiprocessing) and not raw_processes


def _guarded(source: Any, p: Plan, facts: host.HostFacts, eng: Any) -> Any:
    """The source, wrapped by the runtime guard only where rows go through dynamic shared-memory slots."""
    if not (p.guard_slots and p.guard_worker_bytes):
        return source
    spec = eng.guard.GuardSpec(p.guard_slots, p.guard_worker_bytes, p.row_bytes, _ROW_FIX, p.workers,
                               facts.shm_path, p.budget, max(1, facts.ranks.local_size), os.getpid())
    return eng.guard.GuardedSource(source, spec)


def _build(eng: Any, feed: Any, column_names: Any, asked: dict, p: Plan, config: Any, lineage: measure.Lineage,
           what: str, explicit: str | None = None):
    """Apply the plan: MindSpore's globals first, then ``GeneratorDataset`` with only the settings it changed."""
    made = _apply_globals(p, config, eng, quiet=explicit is not None)
    kwargs = dict(asked)
    _set_if_changed(kwargs, "num_parallel_workers", p.workers, 1)
    if p.workers > 1:  # one worker runs in MindSpore's own thread whatever the flag says
        _set_if_changed(kwargs, "python_multiprocessing", p.python_multiprocessing, True)
    if p.max_rowsize is not None and kwargs.get("max_rowsize") is None:
        kwargs["max_rowsize"] = p.max_rowsize
    elif _adapted(p) and eng.arithmetic.max_rowsize_mb(kwargs.get("max_rowsize")) != p.max_rowsize:
        kwargs["max_rowsize"] = p.max_rowsize  # the caller's static slots did not fit: dynamic ones
    dataset = eng.compat.generator_dataset(feed, column_names, kwargs, threads_asked=_threads_asked(asked))
    if made:
        p = replace(p, decisions=p.decisions + tuple(Decision(c.setting, c.new, c.old, c.reason) for c in made))
    _register(dataset, p, lineage, f"GeneratorDataset({what})")
    _log_plan(p, asked, explicit)
    return dataset


def _threads_asked(asked: dict) -> bool:
    """The caller's own arguments read rows in MindSpore's worker threads (more than one worker, processes off)."""
    workers = asked.get("num_parallel_workers")
    return isinstance(workers, int) and workers > 1 and asked.get("python_multiprocessing", True) is False


def _set_if_changed(kwargs: dict, key: str, value: Any, default: Any) -> None:
    """Pass a setting only when it differs from what MindSpore would use, so the call stays the user's."""
    if kwargs.get(key, default) != value:
        kwargs[key] = value


def _worker_pages(facts: host.HostFacts) -> bool:
    return budget_mod.memory_may_bind(SESSION.budget(facts))


def _beside_probe(facts: host.HostFacts) -> bool:
    """Whether this process reads the stage's code while a probe child runs, on a CPU the child leaves idle; with
    one usable CPU it would slow the child's reads, and is read after. The native thread pools are not read
    here: 15-28 ms with MindSpore loaded, which a child of cheap rows would wait for; only where the plan has
    worker processes whose probe rows started a native thread (``threads.plan_cap``)."""
    return facts.usable_cpus >= 2


def _register(dataset: Any, p: Plan, lineage: measure.Lineage, label: str) -> None:
    eng = _engine()
    compat = eng.compat
    lean = p.lean.by_prefetch if p.lean is not None else ()
    reservation = SESSION.ledger.reserve(label, p.predicted_shm, p.predicted_fds, p.predicted_memory,
                                         in_use=compat.in_use(dataset), by_prefetch=p.by_prefetch,
                                         follows_prefetch=compat.follows_prefetch(dataset), lean=lean,
                                         go_lean=_lean_switch(dataset, p, label, eng),
                                         group=compat.pipeline_of(dataset))
    weakref.finalize(dataset, SESSION.ledger.release, reservation.key)
    measure.remember(dataset, p, lineage)


def _adopt(dataset: Any, built: Any) -> None:
    """``ms_shm.patch``: ``dataset`` (the caller's instance) takes over the plan and reservation of ``built``."""
    p = measure.plan_of(built)
    if p is not None and dataset is not built:
        _register(dataset, p, measure.lineage_of(built) or measure.Unavailable("adopted"),
                  _STAGE_NAMES.get(p.kind, p.kind))


def _rows_per_epoch(kwargs: dict, length: int | None, sampled: int | None = None) -> int | None:
    """This rank's rows per epoch, as MindSpore's sampler draws them: the shard first (rounded up), then at most
    ``num_samples`` of it (60 rows, 2 shards, ``num_samples=24``: 24 rows, not 12); ``sampled``: what the
    caller's sampler draws, where the probe read it (a ``SubsetRandomSampler`` of 10 rows of 200,000 was planned
    as 200,000 rows, ~118 s an epoch, and given 2 worker processes)."""
    if sampled is not None:
        return sampled
    n = length
    if kwargs.get("num_shards") and n:
        n = -(-n // kwargs["num_shards"])
    if kwargs.get("num_samples"):
        n = min(n or kwargs["num_samples"], kwargs["num_samples"])
    return n


_ROW_FIX = ("lower num_parallel_workers, or pass python_multiprocessing=False (to build_dataset, or to the "
            "GeneratorDataset of a script run by ms-shm run)")


def _without_processes(req: Request, why: str) -> Request:
    """MindSpore's worker processes cannot start here: plan threads, or stop now if the caller insisted."""
    if req.multiprocessing is True and (req.workers or 1) > 1:
        raise ProcessesUnavailableError(
            f"python_multiprocessing=True cannot work here: {why}, and MindSpore's GeneratorDataset reads its own "
            f"process through psutil before starting workers. Fix: mount /proc (or make it readable), or pass "
            f"python_multiprocessing=False.")
    log.warning("ms_shm: %s; worker processes are not planned, threads are", why)
    return replace(req, multiprocessing=False)


def _apply_globals(p: Plan, config: Any, eng: Any, quiet: bool = False) -> list:
    """Global MindSpore settings the plan needs. Both only ever go down, so other pipelines stay safe; each is
    recorded in the session (``ms_shm.session().restore()``) and logged as a warning (under ``ms_shm.patch``,
    ``quiet``: at INFO, the pipeline's one warning names them)."""
    from ms_shm import collector

    collector.freeze_in_forked_children()  # its workers, if any, and any later ones
    if config is None:
        return []
    wanted = []
    if config.prefetch_size and p.prefetch < config.prefetch_size:
        wanted.append(("prefetch_size", p.prefetch, _reason(p, "prefetch_size", "plan")))
    if p.mode == PIPES and config.shared_mem:
        wanted.append(("shared_mem", False, _reason(p, "shared_mem", "rows go through pipes")
                       + "; this also applies to pipelines launched later in this process"))
    wanted += [(d.setting, d.value, d.reason) for d in p.decisions if d.setting == "enable_watchdog"]
    return _changed_globals(SESSION.record([eng.apply_setting(*w) for w in wanted], eng.undo), quiet)


def _changed_globals(made: list, quiet: bool) -> list:
    """Each global change said; a lowered prefetch stays for the rest of the process, and says so (an audit: a
    pipeline rebuilt while the one before it was still bound lowered it once, and every later build ran at it)."""
    for change in made:
        stays = (" (for the rest of this process: later pipelines are planned at it; ms_shm.session().restore() "
                 "puts it back)" if change.setting == "prefetch_size" else "")
        log.log(logging.INFO if quiet else logging.WARNING, "ms_shm changed MindSpore's global %s from %s to %s: %s%s",
                change.setting, change.old, change.new, change.reason, stays)
        if change.setting == "prefetch_size":
            _follow_prefetch(change.new)
    return made


def _follow_prefetch(prefetch: int) -> None:
    """The pipelines planned before whose next iterator is not made yet run at the lowered prefetch too: their
    reservations hold what they hold there (``Budget.at_prefetch``, which the plan that lowered it counted)."""
    changed = SESSION.ledger.lower_prefetch(prefetch)
    if changed:  # one line per lowering: a search building 80 pipelines up front logged 2,054, one per pipeline
        log.info("ms_shm: the reservations of %d pipeline(s) not iterated yet (%s) follow MindSpore's global "
                 "prefetch down to %d: memory %s -> %s, /dev/shm %s -> %s", len(changed),
                 _labels([before.label for before, _ in changed]), prefetch,
                 mib(sum(b.memory for b, _ in changed)), mib(sum(a.memory for _, a in changed)),
                 mib(sum(b.shm_bytes for b, _ in changed)), mib(sum(a.shm_bytes for _, a in changed)))


def _labels(labels: list, shown: int = 3) -> str:
    return ", ".join(labels[:shown]) + (f" and {len(labels) - shown} more" if len(labels) > shown else "")


def _reason(p: Plan, setting: str, fallback: str) -> str:
    """The plan's own reason for ``setting``: a global change says why the plan made it, in its words."""
    return next((d.reason for d in p.decisions if d.setting == setting), fallback)


_STAGE_NAMES = {"generator": "GeneratorDataset", "map": "map", "batch": "batch(per_batch_map=...)"}
_GLOBAL_SETTINGS = ("prefetch_size", "shared_mem", "enable_watchdog", EXPLICIT)


def _log_plan(p: Plan, asked: dict, explicit: str | None = None) -> None:
    """The plan at INFO, each decision at its level. Under ``ms_shm.patch`` (``explicit`` set) whatever differs
    from what the caller's own call would do is ONE warning, naming the caller's file:line."""
    SESSION.advise_held(_budget_binds(p))
    log.info("ms_shm %s", p.summary())
    changed = [d for d in p.decisions if d.value != d.default and (
        d.setting in asked or d.setting in _GLOBAL_SETTINGS
        or (d.setting == "mode" and {"num_parallel_workers", "python_multiprocessing"} & asked.keys()))]
    changed = [d for i, d in enumerate(changed) if all(e.setting != d.setting for e in changed[:i])]
    if explicit and changed:
        site = sites.call_site()  # the same adaptation at the same line (a loop, a search): once at WARNING
        first = _first_warning(site, p.kind, tuple((d.setting, str(d.default), str(d.value)) for d in changed))
        level = logging.INFO if site is not None and not first else logging.WARNING
        log.log(level, "ms_shm adapted %s at %s: %s%s", _STAGE_NAMES.get(p.kind, p.kind), site,
                "; ".join(f"{d.setting} {d.default} -> {d.value} ({d.reason})" for d in changed),
                _edits_note(changed))
    for d in p.decisions:
        mine = d.setting in asked and asked[d.setting] != d.value
        level = logging.WARNING if mine else logging.INFO if d.setting in _SAID_AT_INFO else logging.DEBUG
        log.log(min(level, logging.INFO) if explicit else level, "ms_shm decision %s", d)


_PROCESS_MODES = ("processes", "pipes")
# decisions that change a plan no argument asked (python_multiprocessing: processes not planned, the program's
# start method or /proc the reason, the fix in it)
_SAID_AT_INFO = ("mode_locked", "memory_kept_for_next_stage", "python_multiprocessing", "num_parallel_workers")


def _edits_note(changed: list) -> str:
    """What a change between worker processes and this process's readers means for the program's own edits of
    the source or operations while an iterator runs (an audit's epoch-end callback set ``source.mosaic``)."""
    for d in changed:
        if d.setting == "mode" and (d.default in _PROCESS_MODES) != (d.value in _PROCESS_MODES):
            was_processes = d.default in _PROCESS_MODES
            when = ("at once, not only with the next iterator" if was_processes else
                    "only with the next iterator, not at once")
            return (f". Edits the program makes to the source or operations while an iterator runs now reach "
                    f"the rows {when}: pass python_multiprocessing={was_processes} to keep "
                    f"{'processes' if was_processes else 'this process'}")
    return ""


def plan_of(dataset: Any) -> Plan | None:
    """The plan ms_shm built ``dataset`` with, or ``None`` for a dataset it did not build."""
    return measure.plan_of(dataset)


def _input_lineage(dataset: Any, eng: Any, stage: str) -> measure.Lineage:
    """How the probe child can make the input rows of a ``map`` or ``batch`` stage: the input's own lineage, or
    (for a tree that runs no Python code, whose reading has no side effects) a few rows read now."""
    lineage = _built_lineage(eng, eng.compat.rows_come_from(dataset))
    if lineage is not None:
        return lineage
    python = eng.compat.python_code_in(dataset)
    if python:
        between = _stage_after_ours(eng.compat.rows_come_from(dataset))
        if between:  # an audit read "not built by ms_shm" of a map after ms_shm.batch, both built by ms_shm
            return measure.Unavailable(f"its input rows pass through a {between} stage after the stages ms_shm "
                                       f"built, and ms_shm makes no rows again through one in a probe")
        return measure.Unavailable(f"the input pipeline was not built by ms_shm and runs Python code ({python}): "
                                   f"reading rows ahead could change what it yields")
    log.info("ms_shm.%s: the input dataset was not built by ms_shm; reading %d rows of it to measure the "
             "operations (one short pipeline run)", stage, measure.PROBE_ROWS_FOR_MAP)
    try:
        taken = eng.compat.take_rows(dataset, measure.PROBE_ROWS_FOR_MAP)
    except Exception as exc:  # the pipeline will raise it again where MindSpore raises it
        return measure.Unavailable(f"reading the input rows ahead raised {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:200]}")
    out: dict = {}
    for row in taken:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return measure.TakenRows(out)


def _built_lineage(eng: Any, node: Any) -> measure.Lineage | None:
    """The lineage of a stage ms_shm built, or of pipelines it built joined by ``concat`` / ``zip``
    (``JoinedLineage``): a map after ``a + b`` was left unmeasured ("not built by ms_shm"), and on 2.0.0 its
    explicit worker processes failed MindSpore's launch check under 64 MB where a map after one source fitted
    (an audit, 3 runs of 3)."""
    lineage = measure.lineage_of(node)
    joined = eng.compat.joined(node) if lineage is None and hasattr(eng.compat, "joined") else None
    if joined is None:
        return lineage
    parts = tuple(_built_lineage(eng, part) for part in joined[1])
    return measure.JoinedLineage(joined[0], parts) if parts and all(p is not None for p in parts) else None


def _stage_after_ours(dataset: Any) -> str | None:
    """The type of ``dataset`` (a ``BatchDataset``, a ``ProjectDataset``) where a stage below it, along single
    children, was built by ms_shm; else ``None``."""
    node = dataset
    while len(getattr(node, "children", None) or []) == 1:
        node = node.children[0]
        if measure.lineage_of(node) is not None:
            return type(dataset).__name__
    return None


def _asked(kwargs: dict, num_parallel_workers: int | None) -> dict:
    """What a map or batch call passed explicitly, ``num_parallel_workers`` (a named parameter) included."""
    return dict(kwargs, **({} if num_parallel_workers is None else {"num_parallel_workers": num_parallel_workers}))


def _as_mindspore_pins(kind: str, why: str, asked: dict, explicit: str | None, eng: Any) -> dict:
    """The arguments of a stage MindSpore runs on one worker whatever it is asked (``why``), passed on as asked
    and unwrapped, so that MindSpore's own check sees the user's code, pins it and warns as raw MindSpore does."""
    log.info("ms_shm %s: built as asked, unplanned: %s", kind, why)
    return _cap_unplanned(asked, explicit, eng, kind)


def _cap_unplanned(asked: dict, explicit: str | None, eng: Any, kind: str = "batch") -> dict:
    """A call ms_shm passes on unplanned (a batch without ``per_batch_map`` or with a callable batch size, a stage
    MindSpore pins to one worker) keeps the one rule every planner applies (``planning.cap_workers``):
    ``num_parallel_workers`` above ``os.cpu_count()``, which MindSpore refuses, is capped there with a warning,
    unless the caller's settings are orders (``patch(strict=True)``)."""
    asked_workers = asked.get("num_parallel_workers")
    if explicit == ORDER or type(asked_workers) is not int:  # another type is MindSpore's own error to raise
        return asked
    workers, capped = eng.planning.cap_workers(asked_workers, os.cpu_count() or 1)
    if not capped:
        return asked
    log.warning("ms_shm %s: num_parallel_workers %d -> %d (%s)%s", kind, capped[0].default, workers, capped[0].reason,
                f" at {sites.call_site()}" if explicit else "")
    return dict(asked, num_parallel_workers=workers)


def _names_list(columns: Any) -> list | None:
    if columns is None:
        return None
    return [columns] if isinstance(columns, str) else list(columns)


def map(dataset: Any, operations: Any = None, input_columns: Sequence[str] | str | None = None,
        output_columns: Sequence[str] | str | None = None, num_parallel_workers: int | None = None, *,
        _explicit: str | None = None, **map_kwargs: Any):
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
    eng = _pipeline_engine()
    _a_dataset(eng, dataset, "map")
    with eng.compat.source_code_read_once():  # MindSpore's check and ms_shm's: one read of the function's code
        return _map(eng, dataset, operations, input_columns, output_columns, num_parallel_workers, _explicit,
                    map_kwargs)


def _a_dataset(eng: Any, dataset: Any, call: str) -> None:
    """``ms_shm.map`` / ``ms_shm.batch`` take the pipeline ``dataset.map`` / ``.batch`` is a method of: anything
    else is refused by name (an audit's ``ms_shm.map([1, 2], f)`` met an ``AttributeError`` from inside ms_shm).

    Raises:
        UsageError: ``dataset`` is not a MindSpore dataset.
    """
    if not eng.compat.is_dataset(dataset):
        raise UsageError(f"ms_shm.{call} takes a mindspore.dataset pipeline (ms_shm.build_dataset's, a "
                         f"GeneratorDataset, a map or batch of one), as dataset.{call}(...) is its method; got "
                         f"{type(dataset).__name__}")


def _map(eng: Any, dataset: Any, operations: Any, input_columns: Any, output_columns: Any,
         num_parallel_workers: int | None, _explicit: str | None, map_kwargs: dict):
    asked = _asked(map_kwargs, num_parallel_workers)
    if not eng.compat.arguments_fit("map", dataset, operations, input_columns, output_columns, **asked):
        return eng.compat.map_dataset(dataset, operations, input_columns, output_columns, asked)  # its TypeError
    if _explicit is None:
        check_as_mindspore("map", eng.compat.real_method("map"), dict(asked, operations=operations,
                                                                      input_columns=input_columns,
                                                                      output_columns=output_columns))
    pinned = eng.compat.one_worker_by_mindspore("map", operations, dataset)
    if pinned:
        return eng.compat.map_dataset(dataset, operations, input_columns, output_columns,
                                      _as_mindspore_pins("map", pinned, asked, _explicit, eng))
    facts, config = SESSION.host_facts(), eng.read_config()
    lineage = _input_lineage(dataset, eng, "map")
    ins = _names_list(input_columns) or eng.compat.column_names(dataset)[:1]
    outs = _names_list(output_columns) or ins
    probe = measure.probe_operations(lineage, operations, ins, outs, _worker_pages(facts),
                                     defer_row_errors=_explicit is not None, beside=_beside_probe(facts),
                                     fate=eng.compat.failing_row_fate(config))
    req = _request(asked, config, facts, eng, _explicit)
    copies = _copies(_operation_holders(operations), facts, req.start_method)
    probe = _with_worker_memory(probe, copies, req.start_method, facts)
    with _copies_said_on_refusal(copies, req, facts, probe):
        p = _plan_operations(probe, req, config, facts, eng, eng.compat.rows_per_epoch(dataset, _rows_known), "map",
                             eng.compat.starts_python_pool(operations))
    if p.python_multiprocessing and p.workers > 1:
        _inspect_copy_on_read(copies, p.workers, facts, probe.effects)
    kwargs = _stage_kwargs(map_kwargs, p, num_parallel_workers, config)
    p, fed = threads.cap_operations(p, operations, facts.usable_cpus, _threads_started(probe))  # per worker
    _apply_globals(p, config, eng, quiet=_explicit is not None)
    result = eng.compat.map_dataset(dataset, fed, input_columns, output_columns, kwargs)
    _register(result, p, measure.MapLineage(lineage, operations, tuple(ins), tuple(outs)), "map")
    _log_plan(p, asked, _explicit)
    return result


def _stage_kwargs(given: dict, p: Plan, num_parallel_workers: int | None, config: Any) -> dict:
    """A map's or batch's own keyword arguments with the plan's transport and workers (only where they differ
    from what MindSpore would use, or the caller passed them); a static ``max_rowsize`` the plan dropped goes."""
    kwargs = dict(given)
    _set_if_changed(kwargs, "python_multiprocessing", p.python_multiprocessing, False)
    if num_parallel_workers is not None or p.workers != _map_default_workers(config):
        kwargs["num_parallel_workers"] = p.workers
    if _adapted(p) and "max_rowsize" in kwargs and p.max_rowsize is None:
        del kwargs["max_rowsize"]
    elif p.max_rowsize is not None and kwargs.get("max_rowsize") is None:
        kwargs["max_rowsize"] = p.max_rowsize  # smaller static slots the plan chose (2.0-2.6's /dev/shm pool)
    return kwargs


def batch(dataset: Any, batch_size: Any, drop_remainder: bool = False, num_parallel_workers: int | None = None, *,
          _explicit: str | None = None, **batch_kwargs: Any):
    """``dataset.batch(...)``; with a ``per_batch_map``, its workers and transport are planned like ``map``'s,
    the batch being the row: ``per_batch_map`` runs on a probe batch in a forked probe child (rows re-made from
    the input stage's lineage), which measures the batch's bytes in and out and its cost. Yields exactly what
    ``dataset.batch`` yields with the same arguments; without a ``per_batch_map`` it is that call.

    Returns:
        mindspore.dataset.Dataset: the batched dataset; its plan is ``ms_shm.plan_of(result)``.

    Raises:
        ms_shm.ShmBudgetError: explicit arguments that cannot fit.
    """
    eng = _pipeline_engine()
    _a_dataset(eng, dataset, "batch")
    asked = _asked(batch_kwargs, num_parallel_workers)
    per_batch_map = batch_kwargs.get("per_batch_map")
    if per_batch_map is None or isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
            not eng.compat.arguments_fit("batch", dataset, batch_size, drop_remainder, **asked):
        result = eng.compat.batch_dataset(dataset, batch_size, drop_remainder, _cap_unplanned(asked, _explicit, eng))
        if per_batch_map is None:
            hold_room_for_batches(result, dataset, batch_size, quiet=_explicit is not None)
        return result
    if _explicit is None:
        check_as_mindspore("batch", eng.compat.real_method("batch"), dict(asked, batch_size=batch_size,
                                                                          drop_remainder=drop_remainder))
    pinned = eng.compat.one_worker_by_mindspore("batch", per_batch_map)
    if pinned:
        return eng.compat.batch_dataset(dataset, batch_size, drop_remainder,
                                        _as_mindspore_pins("batch", pinned, asked, _explicit, eng))
    facts, config = SESSION.host_facts(), eng.read_config()
    ins = _names_list(batch_kwargs.get("input_columns")) or eng.compat.column_names(dataset)
    outs = _names_list(batch_kwargs.get("output_columns")) or ins
    probe = measure.probe_batch(_input_lineage(dataset, eng, "batch"), per_batch_map, batch_size, ins, outs,
                                _worker_pages(facts), defer_row_errors=_explicit is not None,
                                beside=_beside_probe(facts))
    rows = eng.compat.batches(eng.compat.rows_per_epoch(dataset, _rows_known), batch_size, drop_remainder)
    req = _request(asked, config, facts, eng, _explicit)
    p = _plan_operations(_with_worker_memory(probe, (), req.start_method, facts), req, config, facts, eng, rows, "batch",
                         slot_rows=batch_size if isinstance(batch_size, int) and batch_size > 0 else 1)
    kwargs = _stage_kwargs(batch_kwargs, p, num_parallel_workers, config)
    p, kwargs["per_batch_map"] = threads.cap_operations(p, per_batch_map, facts.usable_cpus,  # threads per worker
                                                        _threads_started(probe))
    _apply_globals(p, config, eng, quiet=_explicit is not None)
    result = eng.compat.batch_dataset(dataset, batch_size, drop_remainder, kwargs)
    _register(result, p, measure.Unavailable("rows after a per_batch_map are not re-made in a probe"), "batch")
    _log_plan(p, asked, _explicit)
    return result


def hold_room_for_batches(result: Any, dataset: Any, batch_size: Any, quiet: bool) -> None:
    """A plain batch (``result``, built as asked) over a pipeline ms_shm planned, priced in memory
    (``arithmetic.batch_memory``) and reserved beside it; where the global prefetch lets it hold more than the
    memory left, prefetch lowered to the largest that fits (the batches are the same), or a warning with the
    container fix where none does. Over a pipeline ms_shm did not plan, nothing. Never raises."""
    if type(batch_size) is not int or batch_size <= 0:
        return
    try:
        read = _batch_readings(dataset, batch_size)
    except Exception as exc:  # noqa: BLE001 - a reading that failed: the batch goes unpriced, as before
        log.debug("ms_shm batch: not priced (%s: %s)", type(exc).__name__, exc)
        return
    if read is None:
        return
    eng, row, prefetch, batches, b = read
    left = b.memory_bytes
    need = functools.partial(eng.arithmetic.batch_memory, row, batch_size, batches_per_epoch=batches)
    fitting = eng.planning.plain_batch_prefetch(row, batch_size, prefetch, batches, b)
    what = (f"batch({batch_size}) of {mib(row)} rows may hold ~{mib(need(prefetch))} of memory at prefetch "
            f"{prefetch} (~{eng.arithmetic.BATCH_HELD[0]} + {eng.arithmetic.BATCH_HELD[1]} x prefetch batches "
            f"where the loop is slower than the pipeline, measured), with {mib(left)} of this rank's memory budget "
            f"left after the pipeline below it")
    if fitting is None:
        log.log(_once_per_site(), "ms_shm batch: %s: it may be OOM-killed. Fix: %s, or a smaller batch_size", what,
                plan_mod.memory_fix(need(1), b))
    elif fitting < prefetch:
        back = (b.at_prefetch(fitting).memory_bytes or 0) - left
        given = f", and the stages below it give back {mib(back)} there (their iterator is not made yet)" if back \
            else ""
        _changed_globals(SESSION.record([eng.apply_setting("prefetch_size", fitting, f"{what}; at prefetch {fitting} "
                                                           f"it holds ~{mib(need(fitting))}{given}")], eng.undo),
                         quiet)
    reservation = SESSION.ledger.reserve("batch", 0, 0, need(fitting or 1), in_use=eng.compat.in_use(result),
                                         by_prefetch=tuple((0, 0, need(p)) for p in range(1, (fitting or 1) + 1)),
                                         follows_prefetch=eng.compat.follows_prefetch(result),
                                         group=eng.compat.pipeline_of(result))
    weakref.finalize(result, SESSION.ledger.release, reservation.key)


def _batch_readings(dataset: Any, batch_size: int) -> tuple | None:
    """``(engine, row bytes, global prefetch, batches per epoch, budget)`` for a batch over ``dataset``, or
    ``None`` where ms_shm planned no stage below it or the memory left is not known."""
    row = _planned_row_below(dataset)
    if not row:
        return None
    eng = _engine()
    config = eng.read_config()
    prefetch = config.prefetch_size if config is not None else None
    b = SESSION.budget(SESSION.host_facts()) if prefetch else None
    if b is None or b.memory_bytes is None:
        return None
    return eng, row, prefetch, eng.compat.batches(eng.compat.rows_per_epoch(dataset, _rows_known), batch_size,
                                                  False), b


def _planned_row_below(dataset: Any, depth: int = 8) -> int | None:
    """The row size of the nearest stage at or below ``dataset`` that ms_shm planned (through ``project``,
    ``rename``, ``shuffle``...: their first child), or ``None``."""
    stage = dataset
    for _ in range(depth):
        p = measure.plan_of(stage)
        if p is not None:
            return p.row_bytes
        children = getattr(stage, "children", None)
        if not children:
            return None
        stage = children[0]
    return None


def _threads_started(probe: measure.StageProbe) -> int | None:
    """Native threads the stage's probe rows left running, or ``None`` where the stage was not measured."""
    return probe.stats.threads_started if probe.stats is not None else None


def _map_default_workers(config: Any) -> int:
    return config.num_parallel_workers if config and config.num_parallel_workers else 1


def _default_workers_changed(p: Plan, req: Request, config: Any) -> tuple:
    """The workers ms_shm chose for a map or batch that passed none, where MindSpore would run its global
    ``num_parallel_workers`` (an audit: a program's ``ds.config.set_num_parallel_workers(1)``, one thread raw,
    became 2 worker processes with no line above DEBUG)."""
    default = _map_default_workers(config)
    if req.workers is not None or p.workers == default:
        return ()
    return (Decision("num_parallel_workers", p.workers, default,
                     f"fastest that fits; MindSpore would run the global num_parallel_workers={default} "
                     f"(ds.config.set_num_parallel_workers): pass num_parallel_workers to keep a number"),)


def _rows_known(dataset: Any) -> int | None:
    """The rows per epoch of a stage ms_shm built, or ``None``."""
    p = measure.plan_of(dataset)
    return p.rows_per_epoch if p is not None else None


def _plan_operations(probe: measure.StageProbe, req: Request, config: Any, facts: host.HostFacts, eng: Any,
                     rows: int | None, kind: str, python_pool: bool = True, slot_rows: int = 1) -> Plan:
    """The plan for a map (or batch) stage of ``rows`` rows (batches) per epoch, where known: measured, or
    MindSpore's own settings where rows cannot be measured or depend on which worker computes them.
    ``python_pool``: whether worker processes would run any of the operations (``compat.starts_python_pool``);
    ``slot_rows``: a batch stage's batch size (MindSpore sizes its pool's slots by it)."""
    profile = _profile(config, facts, eng)
    req = replace(req, rows_per_epoch=rows)
    why = probe.unmeasured or probe.effects.mode_bound
    if why:
        req = replace(req, workers=req.workers if req.workers is not None else _map_default_workers(config),
                      multiprocessing=bool(req.multiprocessing))
    req, kept = _program_start_method_kept(req, req.multiprocessing is True and (
        req.workers if req.workers is not None else _map_default_workers(config)) > 1, False)
    if probe.stats is None:
        p = eng.planning.plan_unmeasured(req, SESSION.budget(facts), profile, probe.unmeasured, kind=kind)
    else:
        st = probe.stats
        costs = eng.planning.Costs().on_this_host(hostcost.for_rows(
            max(st.in_bytes, st.out_bytes), (st.seconds_per_row or 0) * eng.planning.priced_rows(rows)))
        p = _with_room(lambda b: _fit(
            lambda r: eng.planning.plan_map(st.in_bytes, st.out_bytes, st.seconds_per_row, st.cpu_fraction, rows, r,
                                            b, profile, shmmax=facts.shmmax, worker_bytes=st.worker_bytes,
                                            costs=costs, parallel_fraction=st.parallel_fraction,
                                            python_pool=python_pool, slot_rows=slot_rows, cores_busy=st.cores_busy),
            req, bool(why)), facts)
    p = replace(p, kind=kind, rows_per_epoch=rows,
                decisions=((kept,) if kept else ()) + _default_workers_changed(p, req, config) + p.decisions)
    if not why:
        return p
    return replace(p, decisions=(Decision("mode_locked", True, False,
                                          f"{why}: MindSpore's own {p.kind} settings are kept"),) + p.decisions)


def probe(ranks: int | None = None) -> host.HostFacts:
    """The host as ms_shm sees it now (no caching, no changes)."""
    return host.probe(ranks=ranks)


def reset() -> None:
    """Forget cached facts, live reservations, logged advice and recorded changes (tests, or after the host
    changed). Changes are forgotten, not undone: ``session().restore()`` undoes them."""
    SESSION.reset()
    _WARNED.clear()


__all__ = ["tune", "build_dataset", "map", "batch", "plan_of", "probe", "reset", "session", "TuneReport", "ShmBudgetError"]
