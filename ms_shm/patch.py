"""``ms_shm.patch()``: unchanged code built on raw MindSpore goes through ms_shm.

Once patched, ``mindspore.dataset.GeneratorDataset(...)``, ``Dataset.map(...)`` and
``Dataset.batch(..., per_batch_map=...)`` are ``ms_shm.build_dataset``, ``ms_shm.map`` and ``ms_shm.batch``
with the same arguments, wherever the call is made (a script, a model zoo's loader, a name imported before
``patch()``): the class and its methods are patched in place, nothing is replaced in a namespace.

``GeneratorDataset`` stays the very same class, and only its ``__init__`` is patched: ``type(d) is
ds.GeneratorDataset``, ``isinstance``, pickling, ``copy.deepcopy`` (MindSpore copies datasets for each iterator)
and MindSpore's own subclasses (``NumpySlicesDataset``, ...) are untouched. The caller's instance is initialised
once, by MindSpore's own ``__init__``, with the arguments ``build_dataset`` chose (ms_shm's own construction is
redirected to it), and carries the plan. (``__new__`` is not patched: CPython cannot take a ``__new__`` back
exactly once set on a class.) Inside ms_shm's own calls (a thread-local depth) every patched name is the
original: no recursion.

Explicit arguments in patched code are preferences (``strict=False``): where they cannot fit, ms_shm adapts them
and logs one warning naming the caller's ``file:line``; ``strict=True`` keeps them and raises
``ShmBudgetError``. ``unpatch()`` puts back exactly what was there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import inspect
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator

from ms_shm import objects, sites

log = logging.getLogger("ms_shm")

_LOCAL = threading.local()
_LOCK = threading.RLock()
_STATE: dict = {}  # while patched: the classes, what their dicts held, and strict
_PIPELINES: list = []  # every pipeline built through the patch: kind, call site, plan, seconds
_TUNES: list = []  # seconds each ``tune()`` of ``ms-shm run`` took


def _api() -> Any:
    """``ms_shm.api``, imported when a patched name is first used: ``ms-shm run`` installs the patch before the
    script's first line, and the planner's modules cost ~0.1 s that a script building no pipeline never needs."""
    from ms_shm import collector

    return collector.load("ms_shm.api")  # the planner's modules, without a full collection of the program's heap


def _depth() -> int:
    return getattr(_LOCAL, "depth", 0)


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    _LOCAL.depth = _depth() + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def is_patched() -> bool:
    return bool(_STATE)


def _explicit() -> str:
    return _api().ORDER if _STATE.get("strict") else _api().PREFERENCE


def _record(kind: str, result: Any, site: str | None, seconds: float) -> None:
    """One pipeline for the report; ``seconds``: what building it took here (ms_shm's probe and plan, and the
    framework's construction), the part of a run's time ms_shm can add."""
    plan = _api().plan_of(result)
    _PIPELINES.append({"kind": kind, "call_site": site, "plan": plan.to_dict() if plan is not None else None,
                       "seconds": round(seconds, 6)})


def record_tune(seconds: float) -> None:
    """``ms-shm run``'s ``tune()`` took ``seconds``: in the report beside the pipelines."""
    _TUNES.append(round(seconds, 6))


def _routed(kind: str, call: Any, result: Any = None) -> Any:
    """``call()`` inside ms_shm (every patched name is the original there), recorded with the caller's site;
    ``result`` is what the caller gets when it is not what ``call()`` returns (an initialised instance)."""
    site, started = sites.call_site(), time.perf_counter()
    with _inside():
        built = call()
    if result is not None:
        _api()._adopt(result, built)
    _record(kind, built if result is None else result, site, time.perf_counter() - started)
    return built


def _mindspore_checks(kind: str, real: Any, bound: inspect.BoundArguments) -> None:
    """MindSpore's own argument errors, word for word, before ms_shm reads an argument: what raw code raises at
    the call, patched code raises (``api.check_as_mindspore``). ``bound``: the call's arguments, ``self`` first."""
    _api().check_as_mindspore(kind, real, _api().by_name(bound), strict=bool(_STATE.get("strict")))


def _frameworks_own(cls: type, real: type) -> bool:
    """Whether an instance of ``cls`` being initialised is left to the framework: its own subclasses
    (``NumpySlicesDataset``, ``PaddedDataset``) make their sources themselves. A user's subclass (a model zoo's
    ``class MyDataset(GeneratorDataset)`` calling ``super().__init__(...)``) is planned like a direct call."""
    return cls is not real and cls.__module__.split(".")[0] == real.__module__.split(".")[0]


def _make_init(real: type, real_init: Any) -> Any:
    """``GeneratorDataset.__init__``: at the caller's level, ``build_dataset`` decides the arguments and this
    very instance is initialised once, by MindSpore's own ``__init__``, with them (ms_shm's construction is
    redirected to it); inside ms_shm, MindSpore's subclasses and pickling it is the original."""
    init_sig = inspect.signature(real_init)
    first = next(iter(init_sig.parameters))

    @functools.wraps(real_init)
    def __init__(self, *args, **kwargs):
        into = getattr(_LOCAL, "into", None)
        if into is not None and _depth():
            _LOCAL.into = None  # ms_shm's own GeneratorDataset(...) call: it initialises the caller's instance
            return real_init(into, *args, **kwargs)
        if _frameworks_own(type(self), real) or _depth() or not _STATE:
            return real_init(self, *args, **kwargs)
        try:
            bound = init_sig.bind(self, *args, **kwargs)
        except TypeError:
            return real_init(self, *args, **kwargs)  # MindSpore's own TypeError
        given = dict(bound.arguments)
        given.pop(first)
        source, names = given.pop("source", None), given.pop("column_names", None)
        with _api()._engine().compat.source_code_read_once():  # MindSpore's check and ms_shm's: one read
            _mindspore_checks("generator", real_init, bound)
            _LOCAL.into = self
            try:
                shell = _routed("GeneratorDataset", lambda: _api().build_dataset(source, names,
                                                                               _explicit=_explicit(), **given), self)
            finally:
                _LOCAL.into = None
        del shell  # ms_shm's own instance, never initialised: the caller's instance holds the plan now
        return None

    return __init__


def _make_map(real_map: Any) -> Any:
    sig = inspect.signature(real_map)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(real_map)
    def map(self, *args, **kwargs):  # noqa: A001 - MindSpore's name
        if _depth() or not _STATE:
            return real_map(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return real_map(self, *args, **kwargs)
        given = dict(bound.arguments)
        given.pop(next(iter(sig.parameters)))
        extra = given.pop(varkw, {}) if varkw else {}
        operations = given.pop("operations", None)
        with _api()._engine().compat.source_code_read_once():  # MindSpore's check and ms_shm's: one read
            _mindspore_checks("map", real_map, bound)
            return _routed("map", lambda: _api().map(self, operations, **given, **extra, _explicit=_explicit()))

    return map


def _make_batch(real_batch: Any) -> Any:
    sig = inspect.signature(real_batch)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(real_batch)
    def batch(self, *args, **kwargs):
        if _depth() or not _STATE:
            return real_batch(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return real_batch(self, *args, **kwargs)
        given = dict(bound.arguments)
        given.pop(next(iter(sig.parameters)))
        extra = given.pop(varkw, {}) if varkw else {}
        if extra.get("per_batch_map") is None or "batch_size" not in given:
            result = real_batch(self, *args, **kwargs)
            if extra.get("per_batch_map") is None:  # its batches held in memory beside a pipeline ms_shm planned
                _api().hold_room_for_batches(result, self, given.get("batch_size"), quiet=True)
            return result
        _mindspore_checks("batch", real_batch, bound)
        size = given.pop("batch_size")
        return _routed("batch", lambda: _api().batch(self, size, **given, **extra, _explicit=_explicit()))

    return batch


def _make_padded_batch(real_padded_batch: Any) -> Any:
    """``padded_batch`` as asked, its batches held in memory priced beside a pipeline ms_shm planned, as a plain
    batch's: an audit's ``padded_batch(4)`` of 4 MiB rows added ~120 MiB over its source, unpriced, and a 420 MB
    container that the source's plan fitted was OOM-killed."""
    sig = inspect.signature(real_padded_batch)

    @functools.wraps(real_padded_batch)
    def padded_batch(self, *args, **kwargs):
        result = real_padded_batch(self, *args, **kwargs)
        if not _depth() and _STATE:
            try:
                size = sig.bind(self, *args, **kwargs).arguments.get("batch_size")
            except TypeError:  # MindSpore took it: nothing of ours to read
                return result
            _api().hold_room_for_batches(result, self, size, quiet=True)
        return result

    return padded_batch


# PyTorch-style DataLoaders, by the module that defines the class: (class, engine), patched when that module is (or
# gets) imported. torchdata's StatefulDataLoader derives from torch's but never calls its ``__init__`` (an audit: it
# went unplanned, and died under 64 MB as raw).
_LOADERS = {"torch.utils.data.dataloader": ("DataLoader", "torch"),
            "mindspore.dataset.dataloader.dataloader": ("DataLoader", "mindspore-dataloader"),
            "torchdata.stateful_dataloader.stateful_dataloader": ("StatefulDataLoader", "torch")}


def _make_loader_init(cls: type, real_init: Any, engine: str) -> Any:
    """``DataLoader.__init__``: ``loaders.prepare`` decides the arguments (explicit ones are preferences unless
    strict) and this very instance is initialised once, by the framework's own ``__init__``, with them."""

    @functools.wraps(real_init)
    def __init__(self, dataset, *args, **kwargs):
        if _depth() or not _STATE:
            return real_init(self, dataset, *args, **kwargs)
        from ms_shm import collector

        engines, loaders = collector.load("ms_shm.engines"), collector.load("ms_shm.loaders")
        from ms_shm.plan import EXPLICIT

        site, started = sites.call_site(), time.perf_counter()
        with _inside():
            arguments, plan = loaders.prepare(engines.get(engine), cls, dataset, args, kwargs,
                                              preferences=not _STATE.get("strict"), made=type(self))
        real_init(self, **arguments)
        if plan is not None:
            loaders.register(self, plan, site)
            changed = [d for d in plan.decisions if d.value != d.default and d.setting != "num_workers"]
            if any(d.setting == EXPLICIT for d in changed):
                _say_adapted(dataset, site, changed)
        _record("DataLoader", self, site, time.perf_counter() - started)
        return None

    return __init__


_ADAPTED = objects.PerObject()  # dataset -> {what was adapted: the site that said it first}
_ADAPTED_AT: set = set()  # (site, what was adapted) said at WARNING once


def _say_adapted(dataset: Any, site: str | None, changed: list) -> None:
    """One warning per dataset and adaptation (the settings changed, whatever the numbers in the reasons) where a
    library remakes the loader (Lightning with its own sampler, accelerate for ``skip_first_batches``) or a loop
    makes it again at the same line: an audit's run said the same warning twice per rank. The repeats are said at
    INFO, naming the first site. So is the same adaptation at the same line of another dataset: Trainer's
    ``evaluate`` makes a new ``datasets.Dataset`` each call (its unused columns removed), and an audit's 3 epochs
    said the same warning 5 times. A loader of the same dataset the program makes at another line (train, then
    eval) is its own warning."""
    what = "; ".join(f"{d.setting} {d.default} -> {d.value} ({d.reason})" for d in changed)
    key = tuple((d.setting, str(d.default), str(d.value)) for d in changed)
    said = _ADAPTED.get(dataset, key)
    if (said is not None and (said == (site or "?") or sites.made_by_a_library())) or \
            (site is not None and (site, key) in _ADAPTED_AT):
        log.info("ms_shm adapted DataLoader at %s as at %s: %s", site or "?", said or site, what)
        return
    log.warning("ms_shm adapted DataLoader at %s: %s", site or "?", what)
    _ADAPTED.put(dataset, key, site or "?")  # no weak references to it: each loader of it says it
    if site is not None:
        _ADAPTED_AT.add((site, key))


def _patch_loader(module_name: str) -> None:
    """Patch the DataLoader class of an imported ``module_name`` (once; recorded for ``unpatch``)."""
    class_name, engine = _LOADERS[module_name]
    cls = getattr(sys.modules.get(module_name), class_name, None)
    if cls is None or (cls, "__init__") in _STATE.get("saved", {}):
        return
    real = vars(cls)["__init__"]
    _STATE["saved"][(cls, "__init__")] = real
    cls.__init__ = _make_loader_init(cls, real, engine)


def _patch_spawned_ranks() -> None:
    """``torch.multiprocessing.spawn`` / ``start_processes`` tell the ranks they start how many share this host
    (``MS_SHM_LOCAL_RANKS``, where no launcher says): an audit's 2 ranks of gloo DDP under 64 MB each planned its
    loaders as the host's only rank, and one died of ``ShmFullError`` "planned for 1 rank(s)"."""
    module = sys.modules.get(_TORCH_SPAWN)
    package = sys.modules.get("torch.multiprocessing")
    real = getattr(module, "start_processes", None)
    if real is None or (module, "start_processes") in _STATE["saved"]:
        return

    @functools.wraps(real)
    def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
        from ms_shm import host

        told = host.detect_ranks(os.environ).source != host.NO_LAUNCHER or not isinstance(nprocs, int) or nprocs < 2
        before = os.environ.get("MS_SHM_LOCAL_RANKS")
        if not told:
            os.environ["MS_SHM_LOCAL_RANKS"] = str(nprocs)
        try:
            return real(fn, args, nprocs, *rest, **kwargs)
        finally:
            if not told and before is None:  # the ranks have their copy of the environment; ours is as it was
                os.environ.pop("MS_SHM_LOCAL_RANKS", None)
            elif not told:
                os.environ["MS_SHM_LOCAL_RANKS"] = before

    _STATE["saved"][(module, "start_processes")] = real
    module.start_processes = start_processes
    if getattr(package, "start_processes", None) is real:
        _STATE["saved"][(package, "start_processes")] = real
        package.start_processes = start_processes


_MINDSPORE_DATASET = "mindspore.dataset"  # defines GeneratorDataset and Dataset (map, batch) once imported
_TORCH_SPAWN = "torch.multiprocessing.spawn"  # defines start_processes, which torch.multiprocessing.spawn calls
FRAMEWORKS = ("mindspore", "torch")  # top-level packages: imported in full once their own import returns
_ON_IMPORT: list = []  # callbacks run once a framework is imported while patched (``ms-shm run``'s tune)


def _patch_mindspore() -> None:
    """Patch ``GeneratorDataset.__init__``, ``Dataset.map`` and ``Dataset.batch`` of the imported MindSpore
    (once; recorded for ``unpatch``)."""
    gd, dataset_cls = _api()._engine().compat.patch_targets()
    saved = _STATE["saved"]
    if (gd, "__init__") in saved:
        return
    saved.update({(gd, "__init__"): vars(gd)["__init__"], (dataset_cls, "map"): vars(dataset_cls)["map"],
                  (dataset_cls, "batch"): vars(dataset_cls)["batch"]})
    gd.__init__ = _make_init(gd, saved[(gd, "__init__")])
    dataset_cls.map = _make_map(saved[(dataset_cls, "map")])
    dataset_cls.batch = _make_batch(saved[(dataset_cls, "batch")])
    if "padded_batch" in vars(dataset_cls):  # MindSpore 2.0 on
        saved[(dataset_cls, "padded_batch")] = vars(dataset_cls)["padded_batch"]
        dataset_cls.padded_batch = _make_padded_batch(saved[(dataset_cls, "padded_batch")])


def _patch_imported(module_name: str) -> None:
    if module_name == _MINDSPORE_DATASET:
        _patch_mindspore()
    elif module_name == _TORCH_SPAWN:
        _patch_spawned_ranks()
    else:
        _patch_loader(module_name)


class _FrameworkImports:
    """Patches a framework module right after it is imported (``mindspore.dataset``, a DataLoader module), for
    code that imports it after ``patch()`` (``ms-shm run``): ms_shm never imports a framework itself, so a
    torch script is not made to import MindSpore (seconds) nor the reverse. A meta path finder needs only
    ``find_spec``; not deriving from ``importlib.abc.MetaPathFinder`` spares a MindSpore script that module's
    import (~10 ms: it loads ``importlib.resources``, which MindSpore does not)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        watched = name in _LOADERS or name in (_MINDSPORE_DATASET, _TORCH_SPAWN) or (name in FRAMEWORKS and _ON_IMPORT)
        if not watched or not _STATE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            with _LOCK:
                if not _STATE:
                    return
                if name in FRAMEWORKS:
                    _framework_imported(name)
                else:
                    _patch_imported(name)

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _FrameworkImports()
FINDER = _FINDER  # for ms-shm run's children: the framework import that patched one is handed to it


def _framework_imported(name: str, callbacks: Any = None) -> None:
    for callback in list(_ON_IMPORT if callbacks is None else callbacks):
        try:
            callback(name)
        except Exception as exc:  # raising here would fail the user's own import statement
            log.warning("ms_shm: at the import of %s, %s raised %s: %s; pipelines are still planned when built",
                        name, getattr(callback, "__name__", "a callback"), type(exc).__name__, exc)


def on_framework_import(callback: Any) -> None:
    """``callback(package)`` once ``mindspore`` or ``torch`` is imported in full while patched (at once for one
    imported already): ``ms-shm run`` tunes there, when the script has imported its framework, instead of
    importing one itself before the script runs."""
    if callback in _ON_IMPORT:  # a run inside a run
        return
    _ON_IMPORT.append(callback)
    for name in FRAMEWORKS:
        if name in sys.modules and not getattr(getattr(sys.modules[name], "__spec__", None), "_initializing", False):
            _framework_imported(name, [callback])


def patch(strict: bool = False) -> None:
    """Route MindSpore's ``GeneratorDataset``, ``Dataset.map`` and ``Dataset.batch(per_batch_map=...)`` and the
    torch / MindSpore DataLoaders through ms_shm, in this process: those already imported now, the others as
    they are imported (nothing is imported here). Idempotent (a second call only sets ``strict``);
    ``unpatch()`` undoes it exactly.

    Args:
        strict: keep explicit ``python_multiprocessing`` / ``num_parallel_workers`` / ``max_rowsize`` as orders
            and raise ``ms_shm.ShmBudgetError`` where they cannot fit (default: adapt them, with a warning).
    """
    with _LOCK:
        if _STATE:
            _STATE["strict"] = bool(strict)
            return
        _STATE.update(saved={}, strict=bool(strict))
        for module_name in (_MINDSPORE_DATASET, _TORCH_SPAWN, *_LOADERS):
            if module_name in sys.modules:
                _patch_imported(module_name)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    log.info("ms_shm.patch: GeneratorDataset, Dataset.map, Dataset.batch(per_batch_map=...) and the torch / MindSpore "
             "DataLoaders go through ms_shm (explicit arguments are %s)", "kept (strict)" if strict else "preferences")


def unpatch() -> None:
    """Put back exactly what ``patch()`` replaced (a no-op when not patched)."""
    with _LOCK:
        if not _STATE:
            return
        for (cls, name), value in _STATE["saved"].items():
            setattr(cls, name, value)
        _STATE.clear()
        _ON_IMPORT.clear()
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    log.info("ms_shm.unpatch: MindSpore's own GeneratorDataset, map and batch are back")


@contextlib.contextmanager
def patched(strict: bool = False) -> Iterator[None]:
    """``with ms_shm.patched(): ...``: patched inside the block; as before after it (a patch made earlier
    stays, with its own ``strict``)."""
    with _LOCK:
        before = dict(_STATE)
        patch(strict)
    try:
        yield
    finally:
        with _LOCK:
            if before:
                _STATE["strict"] = before["strict"]
            else:
                unpatch()


def pipelines() -> list:
    """Every pipeline built through the patch in this process: ``kind``, ``call_site``, ``plan`` (a dict)."""
    return list(_PIPELINES)


def write_report(path: str) -> None:
    """``ms-shm run --report``: the pipelines as JSON (schema 1), and the seconds ``tune()`` took."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"schema": 1, "pipelines": pipelines(), "tune_seconds": list(_TUNES)}, fh, indent=2,
                  default=str)


__all__ = ["patch", "unpatch", "patched", "is_patched", "pipelines", "write_report"]
