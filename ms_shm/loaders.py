"""``ms_shm.build_dataloader``: PyTorch's ``DataLoader`` or MindSpore 2.8+'s, with workers, prefetch and sharing
strategy that fit this host. Composition only: the framework is reached through its engine
(``engines/torch``, ``engines/mindspore_dataloader``), the rules live in ``engines/torchstyle``.

It returns the framework's own ``DataLoader``, built with the caller's arguments; only what ms_shm chose is
added (``num_workers`` and ``prefetch_factor`` where they were not passed, a guard around ``collate_fn`` in
workers), and process-wide changes (the sharing strategy, the soft open-files limit) are recorded in the session
and undone by ``ms_shm.session().restore()``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import multiprocessing
import numbers
import os
import stat
import sys
import weakref
from dataclasses import replace
from typing import Any, Callable

from ms_shm import budget as budget_mod
from ms_shm import changes as changes_mod
from ms_shm import codescan, engines, measure, objects, sandbox, sites, spawncost
from ms_shm._results import mib
from ms_shm.engines.torchstyle import arithmetic, probe
from ms_shm.engines.torchstyle.guard import GuardedCollate, guard_fix, used_now
from ms_shm.engines.torchstyle.planning import LoaderRequest
from ms_shm.errors import ShmBudgetError, UsageError
from ms_shm.plan import EXPLICIT, PIPES, Decision, Plan
from ms_shm.state import SESSION

log = logging.getLogger(__name__)

FRAMEWORKS = ("torch", "mindspore-dataloader")
_ALIASES = {"torch": "torch", "pytorch": "torch", "mindspore": "mindspore-dataloader",
            "mindspore-dataloader": "mindspore-dataloader"}
# meant for workers: torch and MindSpore refuse (or, MindSpore's timeout, ignore) them with num_workers=0
_WORKER_ONLY = ("num_workers", "prefetch_factor", "persistent_workers", "timeout", "multiprocessing_context")
_PIPES_SAID: set = set()  # call sites whose loader's batches through pipes were said at WARNING
_PROBED = objects.PerObject()  # dataset -> {what a probe batch depends on: (the collate_fn, the probe's answer)}
KIND = "dataloader"  # the ledger's kind of a DataLoader's reservation: planned apart from the others (``Ledger``)


def _engine_for(dataset: Any, framework: str | None) -> Any:
    """The engine named by ``framework``, or the one whose Dataset class ``dataset`` is."""
    if framework is not None:
        if framework not in _ALIASES:
            raise UsageError(f"framework={framework!r}: expected one of 'torch', 'mindspore'")
        return engines.get(_ALIASES[framework])
    for name in FRAMEWORKS:
        eng = engines.get(name)
        if eng.compat.owns(dataset):
            return eng
    loaded = [eng for eng in map(engines.get, FRAMEWORKS) if eng.compat.loaded()]
    if len(loaded) == 1:  # a list or an array, which torch's DataLoader takes too (an audit was refused)
        log.info("ms_shm: %s is neither framework's Dataset: %s's DataLoader, the only one this program imported",
                 type(dataset).__name__, loaded[0].name)
        return loaded[0]
    raise UsageError(f"{type(dataset).__name__} is neither a torch.utils.data nor a mindspore.dataset.dataloader "
                     f"Dataset / IterableDataset: pass framework='torch' or framework='mindspore'")


def _start_method(context: Any) -> str:
    if isinstance(context, str):
        return context
    if context is not None and hasattr(context, "get_start_method"):
        return context.get_start_method()
    return multiprocessing.get_start_method(allow_none=True) or "fork"


def _request(eng: Any, asked: dict, facts: Any, locked: str | None, reader_bound: bool = False) -> LoaderRequest:
    profile = eng.profile()
    prefetch = asked.get("prefetch_factor")
    kept = _prefetch_kept(locked, bool(asked.get("persistent_workers")), reader_bound) and \
        bool(asked.get("num_workers"))
    if kept and prefetch is None:  # how far ahead: kept too
        prefetch = eng.arithmetic.DEFAULT_PREFETCH_FACTOR
    return LoaderRequest(eng.name, asked.get("num_workers"), prefetch,
                         eng.compat.sharing_strategy(), profile.can_switch_strategy, locked,
                         bool(asked.get("pin_memory", False)), _start_method(asked.get("multiprocessing_context")),
                         facts.usable_cpus, facts.nofile_soft, facts.nofile_hard,
                         1 if _seeds_once(eng, asked) else 0, bool(asked.get("persistent_workers", False)),
                         read_ahead=1 if sites.made_by_a_library() else 0, prefetch_locked=kept)


def _prefetch_kept(locked: str | None, persistent: bool, reader_bound: bool) -> bool:
    """Whether how far ahead the workers read decides what arrives, so ``prefetch_factor`` stays as asked (or at
    the framework's default): the sampler draws from a generator as far ahead as they read (``DRAWS_AHEAD``), or
    persistent workers read samples that depend on who reads them (``reader_bound``: ``_reader_bound``): they go
    on after a ``break`` from where they stopped, the samples read ahead of it having moved their generators and
    state (an audit: ``torch.rand`` per sample, 2 persistent workers, 2 batches an epoch: at prefetch 1, under 64
    MB, the later epochs' values were raw's at prefetch 1, not at its 2). Other reasons to keep the workers (an
    iterable dataset sharded by worker, ``in_order=False``) leave it free."""
    return locked == DRAWS_AHEAD or (persistent and reader_bound)


def _reader_bound(effects: Any, dataset: Any, asked: dict) -> bool:
    """Whether persistent workers' samples depend on who reads them: the probe saw them draw, read back different
    or change state per read, or the code draws from a global generator where the probe may not see it (only
    read for persistent workers, where it matters)."""
    if not asked.get("persistent_workers") or not asked.get("num_workers"):
        return False
    if effects is not None and (effects.draws_random or effects.rereads_differ or effects.state_per_read):
        return True
    return _global_draw(dataset, asked) is not None


def _global_draw(dataset: Any, asked: dict) -> str | None:
    """``codescan.global_draw`` of what the call's loader runs per sample and per index."""
    return codescan.global_draw(dataset, asked.get("collate_fn"), asked.get("sampler"), asked.get("batch_sampler"),
                                asked.get("batch_size", 1))


def _seeds_once(eng: Any, asked: dict) -> bool:
    """Whether the loader asked for draws its seed once, where one without workers would draw it every epoch:
    torch draws it from the global generator (or ``generator``) for every iterator, and a loader with
    ``persistent_workers`` makes one iterator only. Adapted to ``num_workers=0`` under ``ms_shm.patch``, such a
    loader moved the generator every epoch: the audit's shuffle order and next ``torch.rand`` differed from the
    second epoch on. So at least one worker stays."""
    workers = asked.get("num_workers")
    return bool(getattr(eng.compat, "EVERY_ITERATOR_DRAWS_SEED", False) and asked.get("persistent_workers") is True
                and type(workers) is int and workers > 0)


def _asked_lock(eng: Any, dataset: Any, asked: dict, cls: Any = None) -> str | None:
    """Why ``num_workers`` must stay as asked, from the call and the code alone (before any probe): what
    arrives would change with workers, or the framework's own check of an argument must see its default."""
    if _checkpointed(cls):
        return CHECKPOINTED.format(name=cls.__name__)
    if eng.compat.is_iterable(dataset):
        return "an iterable dataset (each worker iterates its own copy)"
    if asked.get("worker_init_fn") is not None:
        return "worker_init_fn is passed (it runs in each worker, and only there)"
    if _draws_ahead(asked):
        return DRAWS_AHEAD
    used = codescan.worker_info_use(dataset, asked.get("collate_fn")) or _global_draw(dataset, asked)
    if used:
        return used
    moved = codescan.sampler_writes(asked.get("sampler"), asked.get("batch_sampler"))
    if moved:
        return (f"{moved}: with workers the framework runs the sampler ahead of the loop, as far as they read, and "
                f"calls a plain __iter__ twice per epoch, so that state would move on other than without them")
    if asked.get("num_workers") is not None:
        return None
    only = _worker_only(asked)
    if only:
        return (f"{only} passed without num_workers (meant for workers: the framework's own check sees them "
                f"with its default num_workers, as it would without ms_shm)")
    unsent = _not_sent_at_start(asked)
    if unsent:
        return unsent
    if not asked.get("in_order", True):
        return "in_order=False (workers would deliver batches in the order they finish)"
    return None


# An explicit num_workers=0 with memory to spare: no batch in /dev/shm, no fds, and never more workers (ms_shm only
# adapts what cannot fit), so a probe could only cost time: 145 ms per loader in an audit, two loaders per
# Trainer.train/evaluate/predict call (Trainer passes dataloader_num_workers=0 by default).
NO_WORKERS_PASSED = "num_workers=0 is passed and memory is no constraint here"

CHECKPOINTED = ("a {name} (its state_dict holds each worker's state: a checkpoint saved with one number of workers "
                "fails to load into a loader with another, as accelerate's resume did when 2 workers became 0)")


def _checkpointed(cls: Any) -> bool:
    """A loader whose position is saved and restored (torchdata's ``StatefulDataLoader``, accelerate's stateful
    loaders): torch's own DataLoader has no ``state_dict``."""
    return cls is not None and callable(getattr(cls, "state_dict", None)) and \
        callable(getattr(cls, "load_state_dict", None))


DRAWS_AHEAD = ("a random generator is passed (to the loader or its sampler): the sampler draws from it as far ahead "
               "as the workers read (num_workers x prefetch_factor batches; torch's RandomSampler draws its next "
               "permutation as one runs out), so an epoch left early leaves it elsewhere and every later epoch's "
               "order moves (MindSpore's DataLoader also draws its workers' seeds from it)")


def _draws_ahead(asked: dict) -> bool:
    """Whether ``asked`` shuffles with a generator of the caller's: ``generator=``, or a sampler holding one (torch's
    ``generator``, a custom sampler's ``self.rng``; not the dataset's, which a sampler may hold too). An audit's
    seeded loader, 2 workers at prefetch 2 adapted to none under 64 MB, left epoch 0 after 2 of 6 batches: epoch 1
    came in another order, 3 runs of 3 (raw's second ``randperm`` had been drawn ahead); a sampler drawing each
    index from its own ``default_rng``, read for a fixed number of steps, as much."""
    samplers = [s for s in (asked.get("sampler"), asked.get("batch_sampler")) if s is not None]
    named = samplers + [objects.attribute(s, "sampler") for s in samplers]  # torch's: ``generator``, of any kind
    if asked.get("generator") is not None or any(objects.attribute(s, "generator") is not None for s in named):
        return True
    held = [(s, sandbox.held_generators([s], apart=[asked.get("dataset")])) for s in samplers]
    return any(found and not codescan.draws_once_per_epoch(s, found) for s, found in held)


# Under ``ms_shm.patch`` a loader its code left at ``num_workers=0`` keeps it: workers would change what the loop
# sees in ways no probe reads (an exception re-raised as the framework's wrapper, ``torch.initial_seed()``, the
# dataset changes the loop makes between epochs, batches that must pickle). ms_shm only lowers what cannot fit.
_UNCHANGED_CODE = "num_workers is not passed in unchanged code (ms_shm.patch adds no workers it did not ask for)"


def _not_sent_at_start(asked: dict) -> str | None:
    """Where workers would not fork (spawn, forkserver), why they would not read as the program does: what each
    one is sent at its start (the dataset, ``collate_fn``, ``worker_init_fn``) cannot be pickled, or, as each
    imports the program anew, what the program set as it ran is not theirs (an audit: a scale read from the
    command line into a module global under ``if __name__ == "__main__":``, and ``torch.set_default_dtype``,
    each gave other batches in workers ms_shm added); ``None`` where workers fork."""
    context = asked.get("multiprocessing_context")
    method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: None)() \
        if context is not None else multiprocessing.get_start_method(allow_none=True)  # None: never sets it
    method = method or ("fork" if sys.platform == "linux" and sys.version_info < (3, 14) else "spawn")
    if method == "fork":
        return None
    for name in ("dataset", "collate_fn", "worker_init_fn"):
        if asked.get(name) is not None:
            why = probe.why_not_sent(asked[name], f"the {name}")
            if why:
                return f"{why} (each {method} worker is sent it at its start)"
    return (f"workers would start by {method}: each imports the program anew, without what it set as it ran (the "
            f"globals set under if __name__ == '__main__', torch's default dtype), so none is added")


def _worker_only(asked: dict) -> str:
    """The arguments passed that only mean something with workers, as passed (``timeout=0`` and
    ``persistent_workers=False`` are the defaults, so not among them)."""
    return ", ".join(f"{name}={asked[name]!r}" for name in _WORKER_ONLY[1:] if _given(name, asked.get(name)))


def _given(name: str, value: Any) -> bool:
    if value is None:
        return False
    try:
        return bool(value > 0) if name == "timeout" else bool(value) if name == "persistent_workers" else True
    except TypeError:  # a value the framework refuses: its own check must see it, as without ms_shm
        return True


def _not_as_from_workers(stats: Any) -> str | None:
    """Why the probe's batch would not arrive from a worker as it arrives without one, or ``None``: it cannot
    be sent, or it is the dataset's or the ``collate_fn``'s own (``aliases``): a view of a tensor or array the
    dataset holds, a record dict it keeps, a buffer the collate fills for every batch. A worker sends a copy, and
    the loop's in-place changes (``x.sub_(mean)``, ``record["seen"] += 1``) then no longer reach the dataset, nor
    does the next batch overwrite one kept (audits: raw's dataset changed, and its later epochs with it; ms_shm's
    workers repeated the first, and batches kept in a list were not raw's)."""
    if stats is None:
        return None
    if stats.unsent:
        return stats.unsent
    if stats.shared_bytes:
        return (f"the batches are views of {mib(stats.shared_bytes)} of tensors the dataset holds: without workers "
                f"the loop gets the dataset's own memory, and what it changes in place changes the dataset; a "
                f"worker would send a copy")
    if stats.own:
        return (f"the batch holds {stats.own}: without workers the loop gets it as it is, and what it changes in "
                f"place changes the dataset (or the next batch overwrites it); a worker would send a copy")
    if stats.thread_bound:
        return f"the samples run {stats.thread_bound}"
    return None


def _descriptor_held(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a dataset) holds, as an ``int`` attribute, a descriptor open on a file now, itself or
    through what it holds (a ``Subset``'s dataset, a list or a dict of shards; 3 levels, 64 items each): one
    opened before the workers are forked, whose offset they all share. One the code opens in each worker (``if
    self.fd is None: self.fd = os.open(...)``) is none yet, and leaves workers free, as ``_opened_by_each_reader``
    does for file objects. Not ``sandbox._reach``'s walk: it goes on into the module globals the code names, whose
    small int constants (``HEADER = 16``) would read as whatever descriptor has that number."""
    if type(value) is int:
        return value > 2 and _open_file(value)
    if depth >= 3:
        return False
    held = getattr(value, "__dict__", None)
    items = list(held.values()) if isinstance(held, dict) else list(value[:64]) if isinstance(value, (list, tuple)) \
        else list(itertools.islice(value.values(), 64)) if isinstance(value, dict) else []
    return any(_descriptor_held(item, depth + 1) for item in items)


def _open_file(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISBLK(mode)


def _locked(asked_lock: str | None, effects: Any) -> str | None:
    """Why ``num_workers`` must stay as asked: the call or the code says so, or the probe saw samples that
    depend on who reads them."""
    if asked_lock:
        return asked_lock
    if effects.draws_random:
        return f"{effects.draws_random} (each worker would draw from its own copy of the generator, or its own seed)"
    if effects.holds_handle:  # forked workers share a descriptor opened before them: one offset for all
        return effects.holds_handle
    if effects.rereads_differ:
        return f"{effects.rereads_differ} (each worker would read it from its own copy)"
    if effects.state_per_read:  # workers are processes: their copies would change, the program's object not
        return f"{effects.state_per_read} (workers would change their own copies, never the program's object)"
    return None


def build_dataloader(dataset: Any, *args: Any, framework: str | None = None, **kwargs: Any) -> Any:
    """``DataLoader(dataset, *args, **kwargs)`` of the dataset's framework, sized to this host.

    A probe batch is read and collated in a forked child (the parent's samplers and generators do not move):
    its bytes, tensor storages (one shared-memory file and fd each) and seconds per sample. ``num_workers`` and
    ``prefetch_factor`` passed explicitly are kept; otherwise ms_shm picks the fastest that fits ``/dev/shm``,
    the open-files limit and memory, keeping the framework's ``num_workers=0`` where workers would change what
    arrives (an iterable dataset, samples that draw random numbers or read back different, a ``worker_init_fn``,
    code that calls ``get_worker_info()``, ``in_order=False``) or where arguments meant for workers were passed
    without them (``persistent_workers``, ``prefetch_factor``, ``timeout``, ``multiprocessing_context``: the
    framework's own error or behaviour arrives unchanged); those are not probed. With torch, the sharing
    strategy becomes ``file_system`` where the fds of ``file_descriptor`` cannot fit, and workers that must stay
    (they change what arrives) send their batches through their pipes where nothing with shared memory fits.

    Raises:
        ms_shm.ShmBudgetError: explicit arguments that cannot fit, before any worker starts.
        ms_shm.UsageError: an unknown framework.
    """
    eng = _engine_for(dataset, framework)
    cls = eng.compat.loader_class()
    arguments, p = prepare(eng, cls, dataset, args, kwargs)
    loader = cls(**arguments)
    if p is not None:
        register(loader, p)
    return loader


def prepare(eng: Any, cls: Any, dataset: Any, args: tuple, kwargs: dict, preferences: bool = False,
            made: Any = None) -> tuple:
    """``(arguments, plan)``: what to call the framework's ``DataLoader`` with, and why (``None``: as asked).

    With ``preferences`` (unchanged code under ``ms_shm.patch``), explicit ``num_workers`` / ``prefetch_factor``
    that cannot fit are adapted where that cannot change what arrives, with the reason in the plan. ``made``: the
    class being made, a subclass of ``cls`` (the one whose ``__init__`` takes these arguments) perhaps: a subclass of
    the program's that saves and restores its state keeps its workers as a ``StatefulDataLoader`` does."""
    try:
        bound = inspect.signature(cls).bind(dataset, *args, **kwargs)
    except TypeError:
        cls(dataset, *args, **kwargs)  # the framework's own error
        raise
    asked = dict(bound.arguments)
    if _not_a_count(asked):
        cls(**asked)  # the framework's own error, as raw raises it (a count given as a string: torch's TypeError)
        return asked, None  # one it takes that ms_shm cannot size (2.0): as asked, failing where raw fails
    if isinstance(asked.get("collate_fn"), GuardedCollate):  # another loader's (Lightning, accelerate rebuild)
        asked["collate_fn"] = asked["collate_fn"].collate
    facts = SESSION.host_facts()
    b = SESSION.budget(facts, apart=KIND)
    asked_lock, problem = _asked_lock(eng, dataset, asked, made or cls), eng.compat.numpy_problem()
    if preferences and asked.get("num_workers") is None:
        asked_lock = asked_lock or _UNCHANGED_CODE
    kept = asked_lock or problem
    if kept and asked.get("num_workers") is None:  # workers stay at the framework's default: nothing to size
        return asked, eng.planning.kept_plan(_request(eng, asked, facts, kept), b, eng.profile())
    if asked.get("num_workers") == 0 and type(asked["num_workers"]) is int and not budget_mod.memory_may_bind(b):
        return asked, eng.planning.kept_plan(_request(eng, asked, facts, NO_WORKERS_PASSED), b, eng.profile())
    timed = asked.get("num_workers") is None
    stats, effects, why = _probe(eng, dataset, asked, b, timed, _no_workers(eng, asked, facts, b) if timed else None)
    locked = _locked(asked_lock, effects) or (_not_as_from_workers(stats) if timed else None)
    req = _request(eng, asked, facts, locked or problem, _reader_bound(effects, dataset, asked))
    refused = None
    if problem and preferences and req.workers and not locked:  # workers cannot work here: samples inline
        cls(**asked)  # the framework's own checks of the worker arguments dropped below (no worker starts yet)
        req, refused = replace(req, workers=None, prefetch_factor=None), Decision(
            EXPLICIT, "num_workers=0", f"num_workers={asked['num_workers']}", problem)
    elif problem and asked.get("num_workers"):  # MindSpore accepts it: said, then as asked
        log.warning("ms_shm build_dataloader: num_workers=%s: %s%s", asked["num_workers"], problem,
                    f" (kept: {locked})" if preferences else "")
    if stats is None:
        outside = _read_outside_a_worker(dataset, asked) if why.startswith(probe.RAISED) else ""
        log.log(logging.INFO if outside else logging.WARNING, "ms_shm build_dataloader: %s%s; the DataLoader is "
                "built as asked%s", why.replace(probe.WILL_RAISE, "") if outside else why, outside,
                f", without workers ({problem})" if refused else "")
        if refused:
            return _warned(eng, asked, {k: v for k, v in asked.items() if k not in _WORKER_ONLY}), None
        return _warned(eng, asked, _unplanned_fds(eng, req, asked)), None
    copies = _copies(dataset, asked, facts, req.start_method)
    stats = replace(stats, copied_bytes=sum(f.bytes_per_worker for f in copies)) if copies else stats
    try:
        try:
            p = _plan(eng, stats, req, b, preferences, lambda: _probe(eng, dataset, asked, b, timed=True))
        except ShmBudgetError as error:
            p = _through_pipes(eng, stats, req, b, asked, preferences, error)
    except ShmBudgetError:
        _say_copies(copies, req.workers or 0, facts, effects)  # part of why
        raise
    _say_copies(copies, p.workers, facts, effects)
    if refused is not None:
        p = replace(p, decisions=(refused,) + p.decisions)
    _apply(eng, p.decisions)
    return _warned(eng, asked, _strategy_in_workers(eng, asked, _arguments(eng, asked, p, b), p.workers)), p


def _read_outside_a_worker(dataset: Any, asked: dict) -> str:
    """Why a probe batch's error says nothing of the loader: the dataset or collate reads ``get_worker_info()``,
    or a ``worker_init_fn`` sets it up, and the probe reads outside any worker (torch's own tests: 29 warnings
    of 46 in a run of test_dataloader.py named an error the loader never met). ``""``: nothing of the kind."""
    if asked.get("worker_init_fn") is not None:
        return " (read outside a worker: the worker_init_fn passed runs in workers only)"
    used = codescan.worker_info_use(dataset, asked.get("collate_fn"))
    return f" (read outside a worker: {used})" if used else ""


def _unplanned_fds(eng: Any, req: LoaderRequest, asked: dict) -> dict:
    """The caller's arguments for a loader whose batches were not measured, with what its workers need of the
    open-files limits whatever they send (``planning.unplanned_fd_decisions``): an audit's loader whose probe
    failed got no soft-limit raise, and died under ``ulimit -Sn 64`` where a measured one lived."""
    workers = asked.get("num_workers") or 0
    if not workers or isinstance(workers, bool):
        return asked
    _apply(eng, eng.planning.unplanned_fd_decisions(req))
    return _strategy_in_workers(eng, asked, asked, workers)


def _copies(dataset: Any, asked: dict, facts: Any, start_method: str) -> list:
    """What each worker process comes to copy over an epoch of the big lists and dicts the dataset holds or
    its code and the ``collate_fn`` read (copy-on-read; the probe's few samples touch few of their pages). An
    audit: a dataset of 500k token lists and ``num_workers=8``, planned at ~100 MiB of workers' memory, was
    OOM-killed in 1560 MB as raw was in 1500 MB, and nothing named the lists."""
    from ms_shm import cow

    collate = asked.get("collate_fn")
    holders = [("source", dataset)] + cow.code_holders([collate] if collate is not None else [], "collate_fn")
    return cow.findings_in(holders, 1, facts.ranks.local_size, start_method)


def _say_copies(copies: list, workers: int, facts: Any, effects: Any) -> None:
    """Each big container the ``workers`` will copy, as ``build_dataset`` says it (local rank 0 only)."""
    if not workers or not copies or facts.ranks.local_rank != 0:
        return
    from ms_shm import cow

    cow.log_findings(cow.for_workers(copies, workers), effects, offer_share_lists=False)


def _through_pipes(eng: Any, stats: Any, req: LoaderRequest, b: Any, asked: dict, preferences: bool,
                   error: ShmBudgetError) -> Plan:
    """The last resort where nothing with shared memory fits and the workers asked must stay (they change what
    arrives: samples drawn from each worker's seed, ``persistent_workers``; or unchanged code under
    ``ms_shm.patch`` that no fewer workers could serve): those workers, each batch through its pipe. Else the
    error raised. Explicit workers passed to ``build_dataloader`` that could change keep their error, which
    names the fixes."""
    if not (getattr(eng.profile(), "can_pipe", False) and req.workers and
            (req.workers_locked or req.min_workers or preferences)):
        raise error
    try:
        profile = eng.profile()
        return eng.planning.plan_loader(stats, replace(req, pipes=True, custom_collate=profile.collate_in_shm and
                                                       asked.get("collate_fn") is not None and
                                                       stats.collate_shares is not False), b, profile)
    except ShmBudgetError:
        raise error from None


def _warned(eng: Any, asked: dict, arguments: dict) -> dict:
    """``arguments``, after the framework's own warning about the workers the call asked for where they differ
    (``compat.warn_as_asked``): raw code gets it at construction, so does the same code under ms_shm."""
    workers = asked.get("num_workers")
    if type(workers) is int and workers > 0 and arguments.get("num_workers") != workers:
        try:
            eng.compat.warn_as_asked(workers)
        except Exception as exc:  # the framework's check, on a value it would have checked itself: never ours
            log.debug("ms_shm build_dataloader: the framework's worker check raised %s: %s", type(exc).__name__,
                      exc)
    return arguments


def _plan(eng: Any, stats: Any, req: LoaderRequest, b: Any, preferences: bool, timed_probe: Any) -> Plan:
    """The plan for ``req``; under ``preferences``, explicit arguments that cannot fit give way to the fastest
    configuration that does, priced from ``timed_probe()`` when the first probe read no timing (nor read a
    sample twice: whether samples depend on who reads them matters only once the workers asked may change)."""
    try:
        return eng.planning.plan_loader(stats, req, b, eng.profile())
    except ShmBudgetError as exc:
        asked = ", ".join(f"{k}={v}" for k, v in (("num_workers", req.workers),
                                                   ("prefetch_factor", req.prefetch_factor)) if v is not None)
        if not preferences or not asked:
            raise
        if req.workers_locked and req.workers:
            return _workers_kept(eng, stats, req, b, exc)
        why, error = exc.problem, exc
    if stats.seconds_per_sample is None:  # only the explicit workers were priced: now the others are
        timed, effects, _ = timed_probe()
        lock = _locked(None, effects)
        if req.workers and lock:
            return _kept(eng, stats, replace(req, workers_locked=lock), b, error)
        stats = timed or stats
    try:
        p = eng.planning.plan_loader(stats, replace(req, workers=None, prefetch_factor=None), b, eng.profile())
    except ShmBudgetError as exc:
        if not req.min_workers:
            raise
        raise ShmBudgetError(f"ms_shm could not adapt the explicit num_workers={req.workers}: no configuration "
                             f"with workers fits, and none without them keeps persistent_workers=True's batches "
                             f"(without workers the framework draws the loader's seed from the random generator "
                             f"every epoch, persistent workers once: the shuffle order and the program's random "
                             f"numbers would change from the second epoch on). {exc}") from None
    now = f"num_workers={p.workers}" + (f", prefetch_factor={p.prefetch}" if p.workers else "")
    adapted = Decision(EXPLICIT, now, asked,
                       f"{why}; the call's explicit {asked} are preferences here (ms_shm.patch), so the fastest "
                       f"configuration that fits and yields the same batches is used instead")
    return replace(p, decisions=(adapted,) + p.decisions)


def _kept(eng: Any, stats: Any, req: LoaderRequest, b: Any, error: ShmBudgetError) -> Plan:
    """The explicit ``num_workers`` kept, as the timed probe found workers change what arrives: the plan's own
    error then names the fixes that keep the batches first (``planning._no_fit``)."""
    try:
        return eng.planning.plan_loader(stats, req, b, eng.profile())
    except ShmBudgetError as exc:
        return _workers_kept(eng, stats, req, b, exc)


def _workers_kept(eng: Any, stats: Any, req: LoaderRequest, b: Any, error: ShmBudgetError) -> Plan:
    """``num_workers`` stays as asked (workers change what arrives), and an explicit ``prefetch_factor`` that
    cannot fit gives way to the largest that does: it changes how many batches wait, never which arrive
    (MindSpore 2.8's DataLoader, 8 MiB samples, 2 workers at prefetch 2 under 64 MB: an error where prefetch 1
    delivered raw's batches). Else the error, saying why the workers stayed."""
    if req.prefetch_factor is not None and not req.prefetch_locked:
        try:
            p = eng.planning.plan_loader(stats, replace(req, prefetch_factor=None), b, eng.profile())
        except ShmBudgetError as exc:
            error = exc
        else:
            why = error.problem
            adapted = Decision(EXPLICIT, f"prefetch_factor={p.prefetch}",
                               f"prefetch_factor={req.prefetch_factor}",
                               f"{why}; num_workers={req.workers} is kept ({req.workers_locked}), and the explicit "
                               f"prefetch_factor is a preference here (ms_shm.patch): the largest that fits is used")
            return replace(p, decisions=(adapted,) + p.decisions)
    raise _unadapted(error, req.workers, req.workers_locked) from None


def _unadapted(error: ShmBudgetError, workers: int, lock: str) -> ShmBudgetError:
    """Under ``ms_shm.patch`` explicit arguments that cannot fit are preferences, but not ``num_workers`` where
    workers change what arrives: the error says why it stayed (``ms-shm run bigrand.py`` said only "drop the
    explicit num_workers=2", which would change every batch)."""
    return ShmBudgetError(f"ms_shm could not adapt the explicit num_workers={workers}, because {lock}: with "
                          f"another number of workers what arrives would change (each worker has its own random "
                          f"streams and runs the code meant for workers). {error}")


def _no_workers(eng: Any, asked: dict, facts: Any, b: Any) -> Callable:
    """The planner's ``why_no_workers`` for the probe child, on the request as it stands before the probe: what
    the probe finds later (samples that draw, read back different) only keeps workers out."""
    return functools.partial(eng.planning.why_no_workers, req=_request(eng, asked, facts, None), budget=b,
                             profile=eng.profile())


def _probe(eng: Any, dataset: Any, asked: dict, b: Any, timed: bool, no_workers: Callable | None = None) -> tuple:
    """The probe batch; ``timed``: its samples timed too, where the plan picks ``num_workers`` by them;
    ``no_workers``: ``probe.measure_batch``'s (where workers cannot be chosen, what only they need is not read).

    A loader a library makes again (Lightning, accelerate, Trainer: ``sites.made_by_a_library``) of the same
    dataset, batch size, ``collate_fn`` and kind of batch sampler (``_batching``) takes the probe of the one
    before (``_PROBED``), with its own sampler's length: they remake the program's loader with a sampler of
    their own at once, and each probe had cost a fork and a batch read again (0.3-0.6 s per Lightning ``fit``,
    ~75 ms per Trainer loader in audits). The samples a sampler picks differ; what the plan reads of them
    (bytes, storages, seconds per sample) does not. The program's own loaders are probed each time: a dataset
    whose samples grow between epochs (progressive resizing) planned from its old probe crashed where raw ran.
    A batch sampler's batches are its own (a bucket's padding), so another kind of it is probed anew; a probe that
    ruled workers out (``BatchStats.workers_ruled_out``) is taken again only where ``no_workers`` still does, on
    this loader's epoch, request and budget."""
    batched = asked.get("batch_size", 1) is not None or asked.get("batch_sampler") is not None
    collate = asked.get("collate_fn") or eng.compat.default_collate(batched)
    memory, method = budget_mod.memory_may_bind(b), _start_method(asked.get("multiprocessing_context"))
    key = (eng.name, timed, memory, method, _batching(asked))
    before = _PROBED.get(dataset, key) if sites.made_by_a_library() else None
    if before is not None and _same_callable(before[0], collate):
        stats, effects, why = before[1]
        if stats.samples is not None:
            stats = replace(stats, samples=probe.epoch_samples(dataset, asked.get("sampler"),
                                                               asked.get("batch_sampler"), stats.batch_size))
        if stats.workers_ruled_out:  # it read too little for workers: taken again only where they stay out
            still = no_workers(stats) if no_workers is not None else None
            stats = replace(stats, workers_ruled_out=still) if still else None
        if stats is not None:
            log.info("ms_shm build_dataloader: the probe batch of a DataLoader made before of this dataset taken "
                     "again (same batch size, collate_fn and kind of batch sampler)")
            return stats, effects, why
    measured = probe.probe_loader(dataset, asked.get("batch_size", 1), collate, eng.compat.weigh,
                                  eng.compat.is_iterable(dataset), asked.get("sampler"), asked.get("batch_sampler"),
                                  memory, None if timed else eng.compat.twin, eng.compat.tensor_bytes,
                                  reread=timed, read=eng.compat.sample_reader(batched),
                                  shares=eng.compat.collate_shares if asked.get("collate_fn") else None,
                                  by_threads=_thread_watch(eng) if timed else None, no_workers=no_workers)
    stats, effects, why = measured
    code = (dataset, asked.get("collate_fn"))
    effects = _opened_by_each_reader(effects.with_writes(codescan.stage_writes(*code), codescan.stage_grows(*code)),
                                     [dataset, collate])
    offsets = codescan.stage_offsets(*code) if effects.holds_handle is None else None
    if offsets is not None and _descriptor_held(dataset):  # workers forked after it share its offset
        effects = replace(effects, holds_handle=offsets)
    if stats is not None and method != "fork" and memory:  # a spawned worker imports torch again: its own pages
        stats = replace(stats, worker_bytes=spawncost.worker_bytes(method, stats.worker_bytes))
    held = _weak_callable(collate)
    if stats is not None and held is not None:  # a probe that failed is tried again: it may not fail twice; one
        # that ruled workers out is taken again only where it still does (it read too little for workers)
        _PROBED.put(dataset, key, (held, (stats, effects, why)))
    return stats, effects, why


def _not_a_count(asked: dict) -> bool:
    """``num_workers`` or ``prefetch_factor`` given as something other than an integer: the planner's own
    comparisons raised their own ``TypeError`` (``'>'`` where torch's says ``'<'``, from ms_shm's frames)."""
    return any(asked.get(name) is not None and (isinstance(asked[name], bool) or
                                                not isinstance(asked[name], numbers.Integral))
               for name in ("num_workers", "prefetch_factor"))


def _thread_watch(eng: Any) -> Callable | None:
    """The engine's watch of thread-count-bound work (``compat.thread_bound``), where this process splits work
    over more threads than a worker would (torch's workers run one): else nothing to tell apart."""
    watch, threads = getattr(eng.compat, "thread_bound", None), getattr(eng.compat, "main_threads", lambda: 1)()
    return functools.partial(watch, threads=threads) if watch is not None and threads > 1 else None


def _opened_by_each_reader(effects: Any, objects_: list) -> Any:
    """``effects``, without the open handle the probe's reads opened themselves (``if self.f is None: self.f =
    open(...)``, the "open it in the worker" idiom): the program's objects still hold none, so each worker
    process, forked from them, opens its own, as the program's first read does without workers. A handle the
    program's objects hold already is shared by every worker forked after it, and keeps ``num_workers`` (an audit:
    a lazily opened file kept 0 workers, 1.3-4.5x slower than raw's 2)."""
    if effects.holds_handle is None or sandbox.held_handles(objects_) is not None:
        return effects
    return replace(effects, holds_handle=None)


def _batching(asked: dict) -> tuple:
    """How a loader's batches are cut, as far as a probe batch shows: a batch size alone, or a batch sampler of
    the framework's or accelerate's (``BatchSamplerShard`` re-cuts the same sizes for each rank) with its size;
    a batch sampler of another kind picks its batches itself (a bucket's padding), so it is its own."""
    batch_sampler = asked.get("batch_sampler")
    if batch_sampler is None:
        return "size", asked.get("batch_size", 1)
    size = objects.attribute(batch_sampler, "batch_size")
    if type(batch_sampler).__module__.startswith(("torch.utils.data", "accelerate.")):
        return "size", size
    return type(batch_sampler), size


def _weak_callable(fn: Any) -> tuple | None:
    """``fn`` held without keeping it alive (a ``collate_fn`` may hold the dataset, which would then never go):
    a bound method as its object and function, for ``loader.collate_fn`` makes a new one each time it is read."""
    try:
        if inspect.ismethod(fn):
            return weakref.ref(fn.__self__), fn.__func__
        return weakref.ref(fn), None
    except TypeError:  # no weak references to it: nothing to match a later loader's by
        return None


def _same_callable(held: tuple, fn: Any) -> bool:
    ref, function = held
    if function is not None:
        return inspect.ismethod(fn) and fn.__func__ is function and ref() is fn.__self__
    return ref() is fn


def _strategy_in_workers(eng: Any, asked: dict, arguments: dict, workers: int) -> dict:
    """Workers started by spawn or forkserver get the sharing strategy ms_shm set in this process (here or at
    ``tune()``), through a ``worker_init_fn`` that then calls the caller's (``compat.StrategyInWorker``): such a
    worker starts at the framework's default, and the sender's strategy decides how a batch travels."""
    wrap = getattr(eng.compat, "StrategyInWorker", None)
    if wrap is None or not workers or _start_method(asked.get("multiprocessing_context")) == "fork" or \
            not any(c.setting == "sharing_strategy" for c in list(SESSION.changes)):
        return arguments
    return dict(arguments, worker_init_fn=wrap(eng.compat.sharing_strategy(), asked.get("worker_init_fn")))


def _arguments(eng: Any, asked: dict, p: Plan, b: Any) -> dict:
    """The caller's arguments with ms_shm's choices: only what was not passed (or was adapted), and the
    collate guard."""
    arguments = dict(asked)
    adapted = any(d.setting == EXPLICIT for d in p.decisions)
    if p.workers != asked.get("num_workers", 0) and ("num_workers" not in asked or adapted):
        arguments["num_workers"] = p.workers
    if not p.workers and adapted:
        for name in _WORKER_ONLY[1:]:
            arguments.pop(name, None)
    elif p.workers and p.prefetch != (asked.get("prefetch_factor") or arithmetic.DEFAULT_PREFETCH_FACTOR) and \
            (asked.get("prefetch_factor") is None or adapted):  # None passed is the default (Trainer passes it)
        arguments["prefetch_factor"] = p.prefetch
    if p.workers and (b.shm_bytes or p.mode == PIPES):
        arguments["collate_fn"] = _guarded(eng, asked, p, b)
    return arguments


def _guarded(eng: Any, asked: dict, p: Plan, b: Any) -> GuardedCollate:
    """The caller's ``collate_fn`` (or the framework's default) checked in the workers against the planned
    batch (``p.row_bytes``, with any margin for samples that vary) and ``/dev/shm``'s free space."""
    batch_sampler = asked.get("batch_sampler") is not None
    batched = asked.get("batch_size", 1) is not None or batch_sampler
    collate = asked.get("collate_fn") or eng.compat.default_collate(batched)
    fix = guard_fix(asked.get("batch_size", 1), batch_sampler, p.workers, p.prefetch)
    # the batches yet to be written: one the loop holds as new workers fork is in /dev/shm already, out of the
    # free space the guard reads (the plan counts it against the budget)
    return GuardedCollate(collate, eng.compat.weigh, eng.compat.worker_info, p.row_bytes,
                          arithmetic.batches_in_flight(p.workers, p.prefetch), b.shm_bytes, fix,
                          getattr(eng.compat, "unshared_bytes", None), b.ranks,
                          functools.partial(budget_mod.shm_to_give, b),
                          getattr(eng.compat, "share", None), used_now(),
                          functools.partial(eng.compat.piped, default=asked.get("collate_fn") is None)
                          if p.mode == PIPES else None)


def _apply(eng: Any, decisions: Any) -> None:
    from ms_shm import collector

    collector.freeze_in_forked_children()  # the loader's workers, if any, and any later ones
    made, quiet = [], []
    for d in decisions:
        if d.setting == changes_mod.NOFILE:
            made.append(changes_mod.set_nofile_soft(d.value, d.reason))
        elif d.setting == "sharing_strategy":
            made.append(eng.apply_setting(d.setting, d.value, d.reason))
        else:
            continue
        if d.precaution:
            quiet.append(made[-1])
    _say_changed(SESSION.record(made, eng.undo), quiet)


def _say_changed(changes: Any, quiet: list) -> None:
    """Process-wide changes (a kill -9 under ``file_system`` may leave files in ``/dev/shm``): each a warning, but
    a precaution (``Decision.precaution``) at INFO."""
    for change in changes:
        log.log(logging.INFO if any(change is q for q in quiet) else logging.WARNING,
                "ms_shm changed %s from %s to %s: %s", change.setting, change.old, change.new, change.reason)


def register(loader: Any, p: Plan, site: str | None = None) -> None:
    """Reserve the loader's predicted peak for its life, apart from other DataLoaders (``Ledger``: loaders of a
    process are assumed to iterate one after the other, and the plan line says so where others are alive), and
    tell its guard which ones were, for the ``ShmFullError`` of a worker that meets them iterating at once.
    Batches through pipes are said at WARNING once per call ``site`` (unchanged code under ``ms_shm.patch``):
    an audit's Trainer said it for every loader, twice per ``train()`` and ``evaluate()``."""
    before = _live_loaders()
    persistent = bool(getattr(loader, "persistent_workers", False)) and bool(getattr(loader, "num_workers", 0))
    reservation = SESSION.ledger.reserve("dataloader", p.predicted_shm, p.predicted_fds, p.predicted_memory, KIND,
                                         held_apart=p.predicted_memory if persistent else 0)
    weakref.finalize(loader, SESSION.ledger.release, reservation.key)
    guard = getattr(loader, "collate_fn", None)
    if isinstance(guard, GuardedCollate):
        guard.others = functools.partial(other_loaders, reservation.key)
    measure.remember(loader, p, measure.Unavailable("a DataLoader's batches are not re-made in a probe"))
    apart = "" if not before else (
        f"; planned apart from {len(before)} DataLoader(s) built before it ({mib(budget_mod.sums(before)[0])} "
        f"of /dev/shm): loaders of this process are assumed to iterate one after the other")
    memory = "" if p.budget.memory_bytes is None else \
        f", memory {mib(p.predicted_memory)} of {mib(p.budget.memory_bytes)} ({p.budget.memory_reason})"
    warn = p.mode == PIPES and (site is None or site not in _PIPES_SAID)  # slower than shared memory: seen, with why
    if p.mode == PIPES and site is not None:
        _PIPES_SAID.add(site)
    log.log(logging.WARNING if warn else logging.INFO,
            "ms_shm build_dataloader%s: workers=%s prefetch_factor=%s batch=%s predicted /dev/shm %s of %s, %s fds%s; "
            "%s%s", f" at {site}" if site else "", p.workers, p.prefetch or "-", mib(p.row_bytes),
            mib(p.predicted_shm), mib(p.budget.shm_bytes), p.predicted_fds, memory,
            "; ".join(str(d) for d in p.decisions), apart)


def other_loaders(key: int) -> str:
    """The other live DataLoaders with batches in ``/dev/shm`` this process knows of, but ``key``: in a
    worker, those alive when it was forked (its copy of the ledger; a spawn worker knows none: ``""``)."""
    others = _live_loaders(but=key)
    if not others:
        return ""
    return (f"{len(others)} other DataLoader(s) of this process, alive when this worker started "
            f"({mib(budget_mod.sums(others)[0])} of /dev/shm in flight while iterating), were planned as "
            f"iterating one after the other with this one: if one iterates at the same time, it holds that room")


def _live_loaders(but: int | None = None) -> list:
    """The live DataLoaders' reservations with batches in ``/dev/shm``, but the one of key ``but``."""
    return [r for r in SESSION.ledger.live() if r.kind == KIND and r.key != but and r.shm_bytes]


def startup(facts: Any, dry_run: bool) -> tuple:
    """``tune()``'s part for PyTorch, when torch is already imported (never imported here): the sharing
    strategy a low hard open-files limit needs. ``(decisions, changes made)``."""
    if "torch" not in sys.modules:
        return (), ()
    eng = engines.get("torch")
    try:
        decision = eng.planning.startup_strategy(facts.nofile_hard, eng.compat.sharing_strategy())
    except Exception as exc:  # a torch that cannot say: leave it as it is, and say so
        log.info("ms_shm.tune: torch's sharing strategy not read (%s: %s)", type(exc).__name__, exc)
        return (), ()
    if decision is None:
        return (), ()
    made = () if dry_run else tuple(SESSION.record([eng.apply_setting(decision.setting, decision.value,
                                                                     decision.reason)], eng.undo))
    return (decision,), made  # said at WARNING by tune(), with its other changes


__all__ = ["build_dataloader", "prepare", "register", "startup"]
