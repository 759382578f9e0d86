"""The only module that imports MindSpore: reads and sets the dataset config (recording each ``Change``),
builds ``GeneratorDataset`` / ``.map``, and answers questions about a pipeline tree.

What the installed MindSpore supports is detected here (``getattr``, signatures); how versions *behave* lives
in ``profiles.profile_for``. Every change is returned as a ``Change`` with its old value so it can be undone.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import importlib
import inspect
import itertools
import logging
import os
import pathlib
import sys
import threading
import time
import types
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import hooks, objects
from ms_shm._results import Result, record
from ms_shm.changes import Change, get_nofile, set_nofile_soft  # noqa: F401  (re-exported)
from ms_shm.engines.mindspore import liveness, polling, second_iterator
from ms_shm.engines.mindspore.liveness import follows_prefetch, in_use, iterators_reading, pipeline_of  # noqa: F401  (the engine's answers)
from ms_shm.engines.mindspore.settings import shared_mem

log = logging.getLogger(__name__)


@record
class MindSporeConfig(Result):
    """MindSpore's global dataset settings as they are now."""

    version: str | None
    prefetch_size: int | None
    shared_mem: bool | None
    start_method: str | None
    num_parallel_workers: int | None
    has_shared_mem_switch: bool
    generator_takes_max_rowsize: bool
    error_samples_mode: str | None = None  # ``ds.config.set_error_samples_mode``'s: RETURN, REPLACE or SKIP
    generator_poll_seconds: float = polling.POLL_SECONDS  # ``generator_poll_seconds()``


def _dataset_module():
    import mindspore.dataset as ds  # deferred: importing MindSpore takes seconds

    if not _backed_up:
        _back_up_watchdog()
        _watch_iterators()
        _commit_new_slots()
        _shorten_generator_poll()
    return ds


_backed_up = False


def _back_up_watchdog() -> None:
    """Tell ``sentinel`` each worker group MindSpore's watchdog is told of, so that a run the watchdog fails to
    end (its SIGCHLD handler can deadlock) still ends. MindSpore's modules call these through the ``cde`` module
    object, so wrapping its attributes reaches every pool (generator, map, batch); releases without them (2.0's
    watchdog is a Python thread) are left as they are."""
    global _backed_up
    _backed_up = True
    try:
        import mindspore._c_dataengine as cde
    except ImportError:
        return
    if getattr(cde, "register_worker_pids", None) is None or getattr(cde, "deregister_worker_pids", None) is None:
        return
    from ms_shm import sentinel

    def watching(register: Callable) -> Callable:
        def register_worker_pids(key, pids):
            result = register(key, pids)
            sentinel.watch(key, pids)
            return result
        return register_worker_pids

    def forgetting(deregister: Callable) -> Callable:
        def deregister_worker_pids(key):
            sentinel.forget(key)
            return deregister(key)
        return deregister_worker_pids

    hooks.wrap_once(cde, "register_worker_pids", watching)
    hooks.wrap_once(cde, "deregister_worker_pids", forgetting)


_SAMPLER_MODULE = "mindspore.dataset.engine.datasets_user_defined"


def _shorten_generator_poll() -> None:
    """A GeneratorDataset's main process polls its workers every ``polling.SHORTER_POLL`` instead of 0.1 s (see
    ``polling``): what arrives is the same, sooner. Left as it is where the release's loop differs."""
    try:
        module = importlib.import_module(_SAMPLER_MODULE)
    except ImportError:
        return
    if polling.installed(module):
        return
    process = getattr(getattr(module, "SamplerFn", None), "process", None)
    if getattr(module, "time", None) is not time or not polling.polls(getattr(process, "__code__", None)):
        log.debug("ms_shm: this MindSpore's GeneratorDataset does not poll as 2.0-2.10 do: its poll is kept")
        return
    module.time = polling.ShorterPoll()


def generator_poll_seconds() -> float:
    """How often a GeneratorDataset's main process looks for its workers' next row in this process."""
    return polling.SHORTER_POLL if polling.installed(sys.modules.get(_SAMPLER_MODULE)) else polling.POLL_SECONDS


def _commit_new_slots() -> None:
    """Commit the pages of every dynamic slot a worker creates (``posix_fallocate``) before the row is copied
    into it. MindSpore creates a slot as a sparse file and copies the row in; where another process took the
    pages between the guard's free-space check and the copy (4 ranks planned as alone in one 256 MB
    ``/dev/shm``, 8 MiB rows: a bus error in 5 of 7 runs), the copy is a SIGBUS. Committed first, a slot
    without room is the guard's ``ShmFullError``, sent to the main process as the worker's error; one with room
    costs no more (the copy then finds its pages). Releases without dynamic slots (2.0) are left as they are."""
    try:  # by its full name: ``mindspore.dataset.engine`` has the standard library's ``queue`` as an attribute
        ms_queue = importlib.import_module("mindspore.dataset.engine.queue")
    except ImportError:
        return
    shared = getattr(ms_queue, "_SharedQueue", None)
    if not hasattr(shared, "check_and_create_shm"):
        return
    handler = ms_queue.ExceptionHandler

    def committing(put: Callable) -> Callable:
        @functools.wraps(put)
        def put_committed(self, data, timeout=None):
            if getattr(self, "dynamic_shm", False) and not isinstance(data, handler):
                data = _slot_committed(self, data, ms_queue.get_total_size, handler)
            return put(self, data, timeout)
        return put_committed

    hooks.wrap_once(shared, "put", committing)


def _slot_committed(queue: Any, data: Any, total_size: Callable, handler: Any) -> Any:
    """``data``, with the slot it lands in created and its pages committed; where ``/dev/shm`` has no room
    for them, MindSpore's wrapper of the guard's ``ShmFullError`` in its place."""
    row = data if isinstance(data, tuple) else (data,)
    size = total_size(row)
    if size <= 0:
        return data
    pos = queue.seg_pos
    before = (queue.shm_list[pos], queue.fd_list[pos]) if len(queue.shm_list) > pos else None
    queue.check_and_create_shm(size)  # what put does first; it does nothing more when called again
    slot = queue.shm_list[pos]
    if before is not None and slot is before[0]:
        return data
    try:
        os.posix_fallocate(slot.fd(), 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            return data  # a mount without fallocate, or memory short (not room): the copy goes on as MindSpore's
        _put_back(queue, pos, before)  # the worker goes on: its next row must not land in the sparse slot
        from ms_shm.engines.mindspore import guard

        try:
            raise guard.slot_not_committed(size) from exc
        except Exception:  # noqa: BLE001  (MindSpore's handler reads the exception being handled)
            return handler(where="in GeneratorDataset worker process")
    return data


def _put_back(queue: Any, pos: int, before: tuple | None) -> None:
    """The slot at ``pos`` as it was before a failed commit (none, or the smaller one): the worker goes on after
    sending the error (as after a source's exception), and a row landing in the uncommitted slot was a SIGBUS
    (the next row of the same worker, 64 MB filled by another process: 3 of 3 runs)."""
    if before is None:
        del queue.shm_list[pos:], queue.fd_list[pos:]
    else:
        queue.shm_list[pos], queue.fd_list[pos] = before


def _watch_iterators() -> None:
    """Note every iterator MindSpore makes (``Iterator.__init__``, which every tuple and dict iterator,
    ``for row in dataset`` and ``Model.train`` run) and the stages of each tree one ran to its end on
    (``Iterator.__next__`` raising ``StopIteration``), so ``liveness.in_use`` can tell a pipeline that has run and ended
    from one not started, or only peeked at. The iterator itself is MindSpore's, unchanged; a failure to note
    it only keeps the pipeline counted as in use."""
    try:
        from mindspore.dataset.engine import iterators
    except ImportError:
        return
    def noting_made(make: Callable) -> Callable:
        @functools.wraps(make)
        def __init__(self, dataset, *args, **kwargs):
            with liveness.making(dataset) as changed:
                make(self, dataset, *args, **kwargs)
            liveness.note_made(self, bool(changed))
        return __init__

    def noting_finished(step: Callable) -> Callable:
        @functools.wraps(step)
        def __next__(self):
            try:
                return step(self)
            except StopIteration:
                liveness.note_finished(self)
                raise
        return __next__

    if hooks.wrap_once(iterators.Iterator, "__init__", noting_made):
        hooks.wrap_once(iterators.Iterator, "__next__", noting_finished)
        second_iterator.install()


def available() -> bool:
    try:
        _dataset_module()
    except ImportError:
        return False
    return True


def read_config() -> MindSporeConfig | None:
    """MindSpore's current dataset config, or ``None`` when MindSpore is not importable."""
    try:
        ds = _dataset_module()
        import mindspore
        from mindspore.dataset.core import config as core_config
    except ImportError as exc:
        log.debug("mindspore not importable: %s", exc)
        return None
    cfg = ds.config
    start = getattr(cfg, "get_multiprocessing_start_method", None)
    try:
        takes = "max_rowsize" in inspect.signature(ds.GeneratorDataset.__init__).parameters
    except (TypeError, ValueError):
        takes = False
    return MindSporeConfig(
        version=getattr(mindspore, "__version__", None),
        prefetch_size=cfg.get_prefetch_size(),
        shared_mem=shared_mem(core_config),
        start_method=start() if start else "fork",
        num_parallel_workers=cfg.get_num_parallel_workers(),
        has_shared_mem_switch=hasattr(cfg, "set_enable_shared_mem"),
        generator_takes_max_rowsize=takes,
        error_samples_mode=_error_samples_mode(cfg),
        generator_poll_seconds=generator_poll_seconds(),
    )


def _error_samples_mode(cfg: Any) -> str | None:
    try:
        return str(cfg.get_error_samples_mode().name)
    except Exception:  # noqa: BLE001 - a release without the setting: a failing row raises
        return None


def failing_row_fate(config: MindSporeConfig | None) -> str | None:
    """What MindSpore does with a row a map operation raises on (``ds.config.set_error_samples_mode``), for the
    probe's warning; ``None``: it raises it (``measure``'s default words). An audit's map failed on probe row 0
    under REPLACE and SKIP, and was told MindSpore would raise where MindSpore put another row in its place or
    dropped it."""
    mode = getattr(config, "error_samples_mode", None)
    if mode == "REPLACE":
        return "MindSpore's error_samples_mode REPLACE will put another row in its place when the pipeline reaches it"
    if mode == "SKIP":
        return "MindSpore's error_samples_mode SKIP will drop that row when the pipeline reaches it"
    return None


def set_prefetch_size(value: int, reason: str) -> Change | None:
    cfg = _dataset_module().config
    old = cfg.get_prefetch_size()
    if old == value:
        return None
    cfg.set_prefetch_size(int(value))
    return Change("prefetch_size", old, int(value), reason)


def set_shared_mem(value: bool, reason: str) -> Change | None:
    ds = _dataset_module()
    from mindspore.dataset.core import config as core_config

    old = shared_mem(core_config)
    if old is None or old == value:
        return None
    _quietly(ds.config.set_enable_shared_mem, bool(value))
    return Change("shared_mem", old, bool(value), reason)


def set_watchdog(value: bool, reason: str) -> Change | None:
    cfg = _dataset_module().config
    getter, setter = getattr(cfg, "get_enable_watchdog", None), getattr(cfg, "set_enable_watchdog", None)
    if getter is None or setter is None or bool(getter()) == value:
        return None
    old = bool(getter())
    setter(bool(value))
    _deathwatch(bool(value))
    return Change("enable_watchdog", old, bool(value), reason)


def _deathwatch(watchdog_on: bool) -> None:
    """A killed worker still ends the run while the watchdog is off (``deathwatch``)."""
    from ms_shm.engines.mindspore import deathwatch

    deathwatch.stop() if watchdog_on else deathwatch.start()


def _quietly(func, *args):
    """Call a deprecated MindSpore setter without its deprecation warning: ms_shm logs its own reason."""
    from mindspore import log as ms_log

    logger = getattr(ms_log, "_get_logger", None)
    target = logger() if logger else None
    level = target.level if target is not None else None
    try:
        if target is not None:
            target.setLevel(logging.ERROR)
        return func(*args)
    finally:
        if target is not None:
            target.setLevel(level)


def undo(changes: Sequence[Change]) -> None:
    """Put every setting back, newest change first."""
    for change in reversed(list(changes)):
        if change.setting == "prefetch_size":
            _dataset_module().config.set_prefetch_size(change.old)
        elif change.setting == "shared_mem":
            _quietly(_dataset_module().config.set_enable_shared_mem, change.old)
        elif change.setting == "enable_watchdog":
            _dataset_module().config.set_enable_watchdog(change.old)
            _deathwatch(bool(change.old))
        else:
            continue  # not MindSpore's: the session undoes it
        log.info("ms_shm restored %s to %s", change.setting, change.old)


def generator_dataset(source: Any, column_names: Any, kwargs: dict, threads_asked: bool = True):
    """``GeneratorDataset`` with MindSpore's deprecation log for an explicit ``max_rowsize`` left as it is.
    ``threads_asked``: the caller's own arguments read rows in worker threads; where they do not, threads ms_shm
    chooses (now or later) leave the program's signal handlers as they were (``_keep_program_signals``)."""
    if not threads_asked:
        _keep_program_signals(source)
    return _dataset_module().GeneratorDataset(source, column_names, **kwargs)


_THREADS_CHOSEN = objects.PerObject()  # the sources whose worker threads, if any, are ms_shm's choice


def _keep_program_signals(source: Any) -> None:
    """A ``GeneratorDataset``'s worker loop starts with ``cde.register_worker_handlers()``, meant for a worker
    process, and a worker thread runs it too (2.7.2-2.10; 2.0.0 has none): MindSpore's SIGTERM and SIGBUS handlers
    (and SIGSEGV and SIGFPE from 2.8: measured) then replace the program's for the whole process. An audit's preemption handler never
    ran, where raw read in MindSpore's own thread and the handler ran: MindSpore's SIGTERM handler ends the
    process (exit status 0 when the parent sent it, else by SIGTERM itself), with no ``finally`` run. Raw does
    that only where the call asked for threads. In threads ms_shm chose, the call is not made: it sets nothing
    else (its C++ source, 2.7.2-2.10), and putting the program's handlers back after it raced. Two threads set up
    at once, the second kept MindSpore's handlers as "the program's" and put them back (CI, 2.10: the program
    killed by its own SIGTERM, 1 run)."""
    _THREADS_CHOSEN.put(source, "threads", True)
    hooks.wrap_once(sys.modules.get("mindspore._c_dataengine"), "register_worker_handlers", _keeping_program_signals)


def _keeping_program_signals(original: Callable) -> Callable:
    def register_worker_handlers(*args: Any, **kwargs: Any) -> Any:
        if not _in_a_chosen_worker_thread(sys._getframe(1)):
            return original(*args, **kwargs)
        log.debug("ms_shm: a worker thread ms_shm chose leaves the program's signal handlers as they are")
        return None
    return register_worker_handlers


def _in_a_chosen_worker_thread(caller: Any) -> bool:
    """Called by a ``GeneratorDataset`` worker thread (``_generator_worker_loop(dataset, ..., is_multiprocessing,
    ...)``, not a worker process) reading a source ms_shm chose threads for."""
    if threading.current_thread() is threading.main_thread():
        return False
    own = caller.f_locals
    if own.get("is_multiprocessing", True) is not False:
        return False
    held = own.get("dataset")
    source = objects.attribute(held, "dataset", held)  # MindSpore's _PickleGeneratorSource holds the source
    return bool(_THREADS_CHOSEN.get(source, "threads", False))


def is_dataset(value: Any) -> bool:
    """Whether ``value`` is a ``mindspore.dataset`` pipeline (what ``map`` and ``batch`` are methods of)."""
    from mindspore.dataset.engine.datasets import Dataset

    return isinstance(value, Dataset)


def map_dataset(dataset: Any, operations: Any, input_columns: Any, output_columns: Any, kwargs: dict):
    return dataset.map(operations, input_columns=input_columns, output_columns=output_columns, **kwargs)


def patch_targets() -> tuple:
    """The classes ``ms_shm.patch`` patches in place: ``GeneratorDataset`` and ``Dataset`` (``map``, ``batch``)."""
    ds = _dataset_module()
    from mindspore.dataset.engine.datasets import Dataset

    return ds.GeneratorDataset, Dataset


def real_method(kind: str) -> Any:
    """MindSpore's ``GeneratorDataset.__init__`` (``kind="generator"``), ``Dataset.map`` or ``Dataset.batch``
    (patched or not: ``validate`` unwraps it)."""
    generator, dataset = patch_targets()
    return generator.__init__ if kind == "generator" else getattr(dataset, kind)


def batch_dataset(dataset: Any, batch_size: Any, drop_remainder: Any, kwargs: dict):
    return dataset.batch(batch_size, drop_remainder, **kwargs)


def arguments_fit(kind: str, *args: Any, **kwargs: Any) -> bool:
    """Whether ``GeneratorDataset(*args, **kwargs)`` (``kind="generator"``) or ``dataset.map(...)`` /
    ``dataset.batch(...)`` (``"map"``, ``"batch"``, ``args[0]`` the dataset) binds to MindSpore's signature.
    Where it does not, the caller makes the plain call, so the user gets MindSpore's (Python's) own
    ``TypeError`` before anything is probed. Likewise a map's operation that ``MapDataset`` refuses
    (``_refused_operation``): MindSpore's ``ValueError``, without running the operations in a probe first."""
    try:
        func = _dataset_module().GeneratorDataset if kind == "generator" else getattr(args[0], kind)
        signature = inspect.signature(func)
    except (TypeError, ValueError, AttributeError):
        return True  # cannot tell: go on
    try:
        bound = signature.bind(*(args if kind == "generator" else args[1:]), **kwargs)
    except TypeError:
        return False
    return not (kind == "map" and _refused_operation(bound.arguments.get("operations")))


def _refused_operation(operations: Any) -> bool:
    """What ``MapDataset.__init__`` refuses among ``operations``: a class where an instance was meant
    (``vision.HWC2CHW`` without parentheses), or something not callable."""
    ops = operations if isinstance(operations, (list, tuple)) else [operations] if operations is not None else []
    return any(type(op) is type or not callable(op) for op in ops)


# MindSpore's checker decorating each patched method, by release (2.0: ``check_generatordataset``)
_VALIDATORS = {"generator": ("check_generator_dataset", "check_generatordataset"), "map": ("check_map",),
               "batch": ("check_batch",)}


def validate(kind: str, real: Any, *args: Any, **kwargs: Any) -> None:
    """Run MindSpore's own argument checks of ``real`` (``GeneratorDataset.__init__``, ``Dataset.map`` or
    ``Dataset.batch`` as MindSpore defines them; ``args`` without ``self``) on the caller's arguments, without
    running the method: what MindSpore refuses (wrong types, ``num_parallel_workers`` above ``os.cpu_count()``,
    ...) raises MindSpore's own ``TypeError`` / ``ValueError``, word for word, before ms_shm reads any argument
    (``api.check_as_mindspore`` passes a worker count above the CPU count as that count, unless strict: ms_shm
    caps it, with a warning).
    The checker runs on a throw-away ``self`` (``check_map`` sets ``operator_mixed`` on it) and with MindSpore's
    logger quiet (the real call logs its deprecation warnings once). A release without the checker: nothing."""
    try:
        validators = _validators()
        checker = next(getattr(validators, name) for name in _VALIDATORS[kind] if hasattr(validators, name))
        signature = inspect.signature(inspect.unwrap(real))
    except (ImportError, AttributeError, KeyError, StopIteration, TypeError, ValueError):
        return

    def checked_body(*_args: Any, **_kwargs: Any) -> None:
        return None

    checked_body.__signature__ = signature  # parse_user_args binds the caller's arguments to the real signature
    stand_in = types.SimpleNamespace()
    try:
        with _iterating_no_user_code(validators):
            _quietly(lambda: checker(checked_body)(stand_in, *args, **kwargs))
    except (TypeError, ValueError, RuntimeError):
        raise  # MindSpore's own refusal
    except Exception as exc:  # the checker wanted more of ``self`` than a stand-in has: MindSpore's call checks
        log.debug("MindSpore's %s check was left to MindSpore's own call (%s: %s)", kind, type(exc).__name__, exc)
    else:
        _remember_no_network_operators(kind, stand_in, kwargs.get("operations"))


_CHECKING = threading.local()  # ``_iterating_no_user_code``: this thread runs MindSpore's checker ahead
_SHADOW_LOCK = threading.Lock()
_SHADOWING = [0]  # threads inside ``_iterating_no_user_code``: the shadow stays while any is


def _checked_iter(obj: Any, *sentinel: Any) -> Any:
    if getattr(_CHECKING, "active", False) and not sentinel \
            and isinstance(getattr(type(obj), "__iter__", None), types.FunctionType):
        return builtins.iter(())  # Python code of the caller's: iterable, as far as the check asks
    return builtins.iter(obj, *sentinel)


@contextlib.contextmanager
def _iterating_no_user_code(validators: Any):
    """While this thread runs MindSpore's checker ahead of MindSpore's own call: its ``iter(source)`` and
    ``iter(sampler)``, which only ask whether the object is iterable, do not run the object's own ``__iter__``.
    MindSpore's call runs them as raw does; run here too, they were one draw more: a sampler shuffling with
    ``np.random`` in ``__iter__`` gave every epoch another order than raw, and a source keeping an epoch count
    in ``__iter__`` other rows. Other threads' checks call ``iter`` as ever."""
    with _SHADOW_LOCK:
        if _SHADOWING[0] == 0:
            validators.iter = _checked_iter
        _SHADOWING[0] += 1
    _CHECKING.active = True
    try:
        yield
    finally:
        _CHECKING.active = False
        with _SHADOW_LOCK:
            _SHADOWING[0] -= 1
            if _SHADOWING[0] == 0 and validators.__dict__.get("iter") is _checked_iter:
                del validators.iter


def _remember_no_network_operators(kind: str, stand_in: Any, operations: Any) -> None:
    """Where ``check_map`` found no network operators in a map's lone function, ``network_operators_in`` is told
    so for the call (``source_code_read_once``) instead of reading the function's code again: the text of every
    global it names (a map function naming a global list of 1500 JPEGs: 2.0 s for ``ms_shm.map`` against raw's
    1.1 s). Where it found some, ``network_operators_in`` reads the code to name the module."""
    check = _validators().check_source_function
    found = getattr(check, "_ms_shm_found", None)
    if kind == "map" and found is not None and isinstance(operations, types.FunctionType) \
            and not getattr(stand_in, "operator_mixed", False):
        check._ms_shm_held.append(operations)  # its id stays its own for the call
        found[id(operations)] = None


def row_check():
    """MindSpore's own conversion of a source row (``_convert_row``), or ``None`` where it cannot be found: the
    probe refuses exactly what the installed release (and NumPy) refuses."""
    try:
        from mindspore.dataset.engine.datasets_user_defined import _convert_row
    except ImportError:
        return None
    return _convert_row


def column_dtypes(column_types: Any, schema: Any = None) -> tuple | None:
    """``GeneratorDataset(column_types=...)`` (else the types its ``schema`` declares: a ``Schema`` or the path of
    its JSON) as ``(numpy dtype or None, MindSpore's name)`` per column, a schema's with a third item, ``"its
    schema"`` (where the type was declared, for the error), or ``None`` when none were given.
    ``String`` is numpy's ``str_`` of any length (``refuse_column_types`` compares kinds). ``None`` stands for a
    type checked here by nothing (a type NumPy lacks, such as bfloat16): MindSpore alone decides on those."""
    if not column_types:
        return _schema_dtypes(schema) if schema is not None else None
    try:
        from mindspore.common.dtype import dtype_to_nptype
    except ImportError:
        return None
    out = []
    for t in column_types:
        if str(t) == "String":  # a text column: numpy's str arrays only (bytes refused too, 2.0 to 2.10, measured)
            out.append((np.dtype(np.str_), str(t)))
            continue
        try:
            # quietly: 2.7+ logs a deprecation warning on every call, one line per column that raw never prints
            out.append((np.dtype(_quietly(dtype_to_nptype, t)), str(t)))
        except Exception:  # a string type, bfloat16 under this NumPy, or no type at all: not ours to judge
            out.append((None, str(t)))
    return tuple(out)


def schema_columns(schema: Any) -> tuple | None:
    """``(name, MindSpore's type name)`` per column a ``GeneratorDataset(schema=...)`` declares (a ``Schema``, or
    the path of its JSON), or ``None`` where it cannot be read here (MindSpore reads it, and refuses it)."""
    import json

    try:
        text = schema.to_json() if hasattr(schema, "to_json") else pathlib.Path(os.fspath(schema)).read_text()
        columns = json.loads(text)["columns"]
        if isinstance(columns, dict):  # a schema file may key its columns by name
            return tuple((name, c.get("type")) for name, c in columns.items())
        return tuple((c.get("name"), c.get("type")) for c in columns)
    except Exception:  # noqa: BLE001
        return None


def _schema_dtypes(schema: Any) -> tuple | None:
    """The column types a schema declares, as ``column_dtypes`` gives them: MindSpore refuses a row of another
    dtype mid-epoch with the message ``column_types`` gets, naming no column (int64 ids in an int32 schema
    column, an audit)."""
    columns = schema_columns(schema)
    if columns is None:
        return None
    out = []
    for _, name in columns:
        try:
            dtype = np.dtype(np.str_) if name == "string" else np.dtype(name)
        except TypeError:
            dtype = None
        out.append((dtype if dtype is None or dtype.kind in "biufU" else None, name, "its schema"))
    return tuple(out)


def switch_workers(stage: Any, workers: int, processes: bool) -> None:
    """Set a built stage's workers for the iterators made on it from now on: MindSpore reads
    ``num_parallel_workers`` and ``python_multiprocessing`` from the stage as it parses a copy of the tree for
    each new iterator (``second_iterator`` relies on the same). One worker reads in MindSpore's own thread."""
    stage.num_parallel_workers = workers
    if workers > 1:
        stage.python_multiprocessing = processes


def rows_come_from(dataset: Any) -> Any:
    """The stage whose rows ``dataset`` yields unchanged (reordered, repeated or cut), or ``dataset`` itself:
    a ``map`` after ``.shuffle()`` can be measured on the rows of the stage before the shuffle."""
    ds = _dataset_module()
    passing = tuple(getattr(ds, name) for name in ("ShuffleDataset", "RepeatDataset", "TakeDataset", "SkipDataset")
                    if hasattr(ds, name))
    while isinstance(dataset, passing) and len(getattr(dataset, "children", [])) == 1:
        dataset = dataset.children[0]
    return dataset


def joined(dataset: Any) -> tuple | None:
    """``("concat" | "zip", the stages joined)`` where ``dataset`` joins pipelines (``a + b``, ``ds.zip``), each
    through ``rows_come_from``; else ``None``."""
    ds = _dataset_module()
    for kind, name in (("concat", "ConcatDataset"), ("zip", "ZipDataset")):
        cls = getattr(ds, name, None)
        if cls is not None and isinstance(dataset, cls) and getattr(dataset, "children", None):
            return kind, tuple(rows_come_from(child) for child in dataset.children)
    return None


def rows_per_epoch(dataset: Any, known: Callable[[Any], int | None]) -> int | None:
    """The rows ``dataset`` yields per epoch, counted from the first stage below whose count ``known`` gives
    (a stage ms_shm built) through the stages that reorder, rename, map, cut, repeat or batch them; ``None``
    where a stage's count cannot be told without running it (a callable batch size, ``zip``, ``concat``)."""
    ds = _dataset_module()
    count = known(dataset)
    children = getattr(dataset, "children", None) or []
    if count is None and not children:
        return _indexed_leaf_size(dataset, ds)
    if count is not None or len(children) != 1:
        return count
    below = rows_per_epoch(children[0], known)
    if below is None:
        return None
    same = tuple(getattr(ds, n) for n in ("ShuffleDataset", "MapDataset", "ProjectDataset", "RenameDataset")
                 if hasattr(ds, n))
    if isinstance(dataset, same):
        return below
    n = getattr(dataset, "count", None)
    if isinstance(dataset, getattr(ds, "RepeatDataset", ())) and isinstance(n, int):
        return below * n if n > 0 else None
    if isinstance(dataset, getattr(ds, "TakeDataset", ())) and isinstance(n, int):
        return min(below, n) if n >= 0 else below
    if isinstance(dataset, getattr(ds, "SkipDataset", ())) and isinstance(n, int):
        return max(0, below - n)
    if isinstance(dataset, getattr(ds, "BatchDataset", ())):
        return batches(below, dataset.batch_size, dataset.drop_remainder) \
            if getattr(dataset, "batch_size_func", None) is None else None
    return None


def _indexed_leaf_size(dataset: Any, ds: Any) -> int | None:
    """The rows of a leaf MindSpore reads from files by index (``ImageFolderDataset``, ``MindDataset``, ...), as
    its own ``get_dataset_size`` counts them (the folder listed or the file's header read: 6 ms for 10,000 files),
    which MindSpore keeps on the dataset, so ``Model.train``'s own call costs nothing after it. Not for sources
    built from Python (counting a stream runs it) nor a Python sampler; ``None`` where it fails. Priced at 1000
    rows, a cheap GIL-bound map over ImageNet's 1.28M images weighs a pool's fixed second against 1000 rows."""
    mappable = getattr(ds, "MappableDataset", None)
    sampler = getattr(dataset, "sampler", None)
    if (mappable is None or not isinstance(dataset, mappable) or "user_defined" in type(dataset).__module__
            or not (sampler is None or type(sampler).__module__.startswith("mindspore."))):
        return None
    try:
        size = dataset.get_dataset_size()
    except Exception as exc:  # noqa: BLE001  (priced at the default rows instead)
        log.debug("ms_shm: %s's rows not counted (%s: %s)", type(dataset).__name__, type(exc).__name__, exc)
        return None
    return size if isinstance(size, int) and size > 0 else None


def batches(rows: int | None, batch_size: Any, drop_remainder: bool) -> int | None:
    """Batches per epoch of ``rows`` rows, as ``Dataset.batch`` makes them."""
    if rows is None or not isinstance(batch_size, int) or batch_size <= 0:
        return None
    return rows // batch_size if drop_remainder else -(-rows // batch_size)


_DRAWS_READ = 100_000  # indices of a Python sampler read in the probe child, at most


def sampled_rows(kwargs: dict) -> Callable[[int], tuple] | None:
    """What the call's sampler draws from a source of ``length`` rows, as a function for the probe child:
    ``(rows, draws)``, the rows it may draw (a ``range`` or a sorted tuple; ``None``: any) and how many it draws
    an epoch (``None``: unknown). A Python sampler's ``__iter__`` runs only there, where its draws cannot move the
    program's. ``None`` where nothing limits the rows: no sampler, or a random or distributed one (any row may be
    drawn), or a sampler with a child (the child draws first)."""
    sampler = kwargs.get("sampler")
    if sampler is None:
        n, shards = kwargs.get("num_samples"), kwargs.get("num_shards")
        if shards is not None and kwargs.get("shuffle") is False and isinstance(kwargs.get("shard_id"), int):
            return functools.partial(_shard, shards, kwargs["shard_id"], n)  # MindSpore's unshuffled shard
        if n and kwargs.get("shuffle") is False and shards is None:  # MindSpore's sequential
            return lambda length: (range(min(n, length)) or None, min(n, length))
        return None
    try:
        from mindspore.dataset.engine import samplers
    except ImportError:
        return None
    if getattr(sampler, "child_sampler", None) is not None:
        return None
    n = getattr(sampler, "num_samples", None)
    if isinstance(sampler, samplers.DistributedSampler):
        if not _unshuffled(sampler.shuffle) or getattr(sampler, "offset", -1) not in (-1, None):
            return None
        return functools.partial(_shard, sampler.num_shards, sampler.shard_id, n)
    if isinstance(sampler, samplers.SequentialSampler):
        start = sampler.start_index or 0
        return lambda length: _capped(range(start, length if not n else min(length, start + n)), n)
    if isinstance(sampler, samplers.SubsetSampler):  # SubsetRandomSampler too
        indices = list(sampler.indices)
        return lambda length: (_valid(indices, length), min(len(indices), n) if n else len(indices))
    if isinstance(sampler, samplers.WeightedRandomSampler):
        weights = list(sampler.weights)
        return lambda length: (tuple(i for i, w in enumerate(weights[:length]) if w > 0) or None, n)
    if isinstance(sampler, samplers.BuiltinSampler) and not isinstance(sampler, samplers.Sampler):
        return None
    n = n if isinstance(sampler, samplers.Sampler) else kwargs.get("num_samples")  # a plain iterable's cap
    drawn = functools.partial(_drawn, sampler, n=n)
    drawn.runs_program_code = True  # the sampler's own ``__iter__``: in a probe child only (``measure._read_here``)
    return drawn


def probe_rows_drawn(kwargs: dict) -> bool:
    """Whether every row the probe reads is drawn by the call's epoch (rows spread over the source where no
    sampler limits them, else among ``sampled_rows``' pool), so that a row MindSpore refuses there is one the
    pipeline meets too, and is refused at build. Not so for a random draw of ``num_samples``, weights, a shuffled
    shard or a child sampler: a row the probe reads may never be drawn (an audit: shard 0 of 2 never reads row 19,
    a ``None`` that raw ran past and ms_shm refused at build)."""
    sampler = kwargs.get("sampler")
    if sampler is None and not kwargs.get("num_samples") and kwargs.get("num_shards") is None:
        return True
    try:
        from mindspore.dataset.engine import samplers
    except ImportError:
        return False
    if isinstance(sampler, samplers.RandomSampler):
        return not getattr(sampler, "replacement", True) and not getattr(sampler, "num_samples", None) and \
            getattr(sampler, "child_sampler", None) is None
    return not isinstance(sampler, samplers.WeightedRandomSampler) and sampled_rows(kwargs) is not None


def _unshuffled(shuffle: Any) -> bool:
    """A sampler's ``shuffle``: ``False`` on 2.0, ``Shuffle.FALSE`` on later releases."""
    return shuffle is False or getattr(shuffle, "value", None) == "false"


def _shard(shards: int, shard: int, n: int | None, length: int) -> tuple:
    """The rows an unshuffled shard draws, as MindSpore's ``DistributedSampler`` deals them (measured, 2.10: 21
    rows, shard 3 of 4 reads 3, 7, 11, 15, 19, then 2, round the end), and how many: ``(rows, draws)``."""
    if not 0 <= shard < shards or length <= 0:
        return None, None
    drawn = [(shard + j * shards) % length for j in range(-(-length // shards))][:n or None]
    return tuple(sorted(set(drawn))) or None, len(drawn)


def _capped(rows: range, n: int | None) -> tuple:
    return rows or None, min(len(rows), n) if n else len(rows)


def _valid(indices: Any, length: int) -> tuple | None:
    try:
        return tuple(sorted({int(i) for i in indices if 0 <= int(i) < length})) or None
    except (TypeError, ValueError):  # not indices MindSpore takes: it says so when it iterates
        return None


def _drawn(sampler: Any, length: int, *, n: int | None) -> tuple:
    """A Python sampler's draws, in the probe child: MindSpore tells a ``ds.Sampler`` the dataset's size first."""
    handshake = getattr(sampler, "_handshake", None)
    if handshake is not None:
        try:
            handshake(length)
        except TypeError:  # 2.0 passes num_samples too
            handshake(length, n)
    drawn = list(itertools.islice(iter(sampler), _DRAWS_READ + 1))
    draws = len(drawn) if len(drawn) <= _DRAWS_READ else None
    return _valid(drawn[:_DRAWS_READ], length), min(draws, n) if n and draws is not None else draws


def network_operators_in(source: Any) -> str | None:
    """The MindSpore compute module a source's code uses (``mindspore.ops``, ``nn``, ...), or ``None``.

    MindSpore itself reads the source's code for these (``check_source_function``) and then runs it with one
    worker; its compute runtime is not fork-safe, so such a source is not read in a probe child either.
    """
    try:
        check = _validators().check_source_function  # ``source_code_read_once``'s where active
        known = getattr(check, "_ms_shm_found", {})
        if id(source) not in known:
            text = str(check(source))  # the memo holds the source from here: its id stays its own
            known[id(source)] = next((m for m in ("mindspore.nn", "mindspore.ops", "mindspore.numpy",
                                                  "mindspore.compression") if m in text), None)
        return known[id(source)]
    except Exception:  # an old release without the check, or source code that cannot be read
        return None


def _validators() -> Any:
    from mindspore.dataset.engine import validators

    return validators


@contextlib.contextmanager
def source_code_read_once():
    """While a ``GeneratorDataset`` is checked, planned and built, MindSpore's ``check_source_function`` reads
    each source once: its ``str(inspect.getclosurevars(...))`` turns every global the source's code names into
    text (an audit's source named a global list of 1500 JPEGs: 4.7 s raw), and ms_shm's own check, its
    network-operator rule and MindSpore's construction each read it (14-15 s), and searched the text twice more
    (0.3 s each). The text, and ``network_operators_in``'s answer, are kept per source object for the call;
    nested calls share the outer memo."""
    try:
        validators = _validators()
        real = validators.check_source_function
    except (ImportError, AttributeError):
        yield
        return
    if getattr(real, "_ms_shm_once", False):
        yield
        return
    read: dict = {}

    def once(source):
        if id(source) not in read:
            read[id(source)] = (source, real(source))  # the source held: its id stays its own for the call
        return read[id(source)][1]

    once._ms_shm_once = True
    once._ms_shm_found = {}  # ``network_operators_in``'s answers, per source read
    once._ms_shm_held = []  # the functions ``validate`` answered for
    validators.check_source_function = once
    try:
        yield
    finally:
        if validators.check_source_function is once:
            validators.check_source_function = real


def one_worker_by_mindspore(kind: str, target: Any, dataset: Any = None) -> str | None:
    """Why MindSpore itself builds this stage with one worker, or ``None``. ``kind``: ``"generator"`` (``target``
    the source) or ``"map"`` (``target`` the operations, ``dataset`` the one mapped).

    MindSpore's checks read the code of a source, or of a map's single Python function, for ``mindspore.nn`` /
    ``ops`` / ``numpy`` / ``compression``, and then set ``num_parallel_workers`` to 1 with a warning (a source's
    only under the ``fork`` start method, in the releases that have that setting); the mark a map's check leaves
    on the mapped dataset pins its later maps too. ms_shm's wrappers (the thread cap, the guard) would hide that
    code from the check, and MindSpore would run the stage with the workers asked (MindSpore's own
    test_pyfunc), so such a stage is left for MindSpore to build. ``kind`` ``"batch"``: only debug mode
    applies."""
    serial = _debug_mode()
    if serial or kind == "batch":
        return serial
    if kind == "map":
        if objects.attribute(dataset, "operator_mixed") is True:
            return ("an earlier map of this dataset computes with MindSpore's network operators, so MindSpore runs "
                    "each map of it on one worker")
        if not isinstance(target, types.FunctionType):  # MindSpore reads a lone function only, not a list
            return None
    elif kind == "generator" and _start_method_setting() not in (None, "fork"):
        return None
    module = network_operators_in(target)
    if module is None:
        return None
    what = "the source" if kind == "generator" else "the map's function"
    return f"{what} computes with {module}, so MindSpore itself runs it on one worker, with its own warning"


def _debug_mode() -> str | None:
    """Why MindSpore runs every stage in this process's one thread (``ds.config.set_debug_mode(True)``), or
    ``None``: its debug mode ignores ``num_parallel_workers`` and ``python_multiprocessing``, so worker slots
    ms_shm would plan never exist (an audit: a pipeline raw ran in a 64 KiB /dev/shm was refused, and under 64
    MB ms_shm turned shared memory off for the whole program, for worker processes MindSpore never started)."""
    try:
        debug = _dataset_module().config.get_debug_mode()
    except Exception:  # noqa: BLE001 - a release without debug mode, or MindSpore not importable
        return None
    if debug is not True:
        return None
    return "MindSpore's debug mode (ds.config.set_debug_mode) runs every stage in this process, one row at a time"


def _start_method_setting() -> str | None:
    """``ds.config.get_multiprocessing_start_method()``, or ``None`` in a release without that setting."""
    try:
        start = getattr(_dataset_module().config, "get_multiprocessing_start_method", None)
        return start() if start else None
    except Exception:  # MindSpore not importable: nothing of it applies
        return None


def python_code_in(dataset: Any) -> str | None:
    """The first node of ``dataset``'s tree that runs Python code (a generator source, a Python operation, a
    ``per_batch_map``), or ``None`` when reading the tree runs only MindSpore's C++ and cannot have side effects
    on a later epoch's rows."""
    ds = _dataset_module()
    from mindspore.dataset.transforms.transforms import TensorOperation

    pure_sources = tuple(c for c in (getattr(ds, "NumpySlicesDataset", None), getattr(ds, "PaddedDataset", None))
                         if c is not None)
    stack = [dataset]
    while stack:
        node = stack.pop()
        if isinstance(node, ds.GeneratorDataset) and not isinstance(node, pure_sources):
            return f"{type(node).__name__} (a Python source)"
        ops = getattr(node, "operations", None) or []
        python_ops = [op for op in ops if not isinstance(op, TensorOperation)]
        if python_ops:
            return f"{type(node).__name__} with the Python operation {objects.attribute(python_ops[0], '__name__', python_ops[0])}"
        if getattr(node, "per_batch_map", None) is not None:
            return f"{type(node).__name__} with a per_batch_map"
        stack.extend(getattr(node, "children", []) or [])
    return None


def starts_python_pool(operations: Any) -> bool:
    """Whether ``map(python_multiprocessing=True)`` starts a Python worker pool for ``operations``: MindSpore
    (2.0 to 2.10, ``MapDataset.prepare_multiprocessing``) starts one only for an operation still callable once its
    C++ transforms are parsed; with none, they run in its C++ threads and no /dev/shm or SysV is used (an audit:
    2.0's RandomCrop + RandomHorizontalFlip with ``python_multiprocessing=True`` priced at 192 MiB of /dev/shm and
    refused under 64 MB, where raw ran). A transform whose implementation is not set yet is made C++ by
    ``MapDataset`` unless a Python one comes before it, which starts the pool anyway."""
    ops = operations if isinstance(operations, (list, tuple)) else [operations]
    return any(callable(op) and _runs_in_python(op) for op in ops)


def _runs_in_python(op: Any) -> bool:
    if "c_transforms" in (type(op).__module__ or ""):  # the old API's C++ transforms
        return False
    if type(op).__name__ in ("FuncWrapper", "ToNumpy") or not objects.has(op, "implementation"):
        return True  # MindSpore keeps these in Python, and a function or callable object is Python
    implementation = objects.attribute(op, "implementation")
    return implementation is not None and getattr(implementation, "name", str(implementation)) != "C"


def column_names(dataset: Any) -> list:
    return list(dataset.get_col_names())


def processes_blocker() -> str | None:
    """Why MindSpore's Python worker processes cannot run in this process, or ``None`` when they can.

    ``GeneratorDataset(python_multiprocessing=True)`` with more than one worker first calls
    ``psutil.Process(os.getpid()).memory_info()`` (2.10 ``__validate_memory_usage``). Where /proc is not mounted
    or not readable that raises ``psutil.NoSuchProcess`` when the iterator is created (measured), and later
    ``psutil.pid_exists`` would take live workers for dead ones.
    """
    import os

    import psutil

    try:
        psutil.Process(os.getpid()).memory_info()
    except (psutil.Error, OSError) as exc:
        return f"psutil cannot read this process ({type(exc).__name__}: {exc}): /proc is missing or unreadable"
    return None


def take_rows(dataset: Any, count: int) -> list:
    """The first rows of any dataset as numpy dicts; costs one short pipeline run.

    ``take`` adds a second consumer to ``dataset``; MindSpore refuses to build a tree from a node with two
    parents, so the parent list is put back afterwards.
    """
    parents = list(getattr(dataset, "parent", []))
    it = dataset.take(count).create_dict_iterator(output_numpy=True, num_epochs=1)
    try:
        return [dict(row) for row in it]
    finally:
        stop = getattr(it, "stop", None)
        if stop:
            stop()
        if hasattr(dataset, "parent"):
            dataset.parent = parents


__all__ = ["MindSporeConfig", "Change", "available", "arguments_fit", "read_config", "set_prefetch_size", "set_shared_mem", "set_watchdog", "get_nofile",
           "set_nofile_soft", "undo", "generator_dataset", "map_dataset", "batch_dataset", "patch_targets", "validate", "row_check", "column_dtypes", "rows_come_from",
           "python_code_in", "network_operators_in", "column_names", "processes_blocker", "take_rows"]
