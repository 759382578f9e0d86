"""Whether a DataLoader's samples can depend on the worker that reads them, read from the code alone (no call).

A dataset or ``collate_fn`` that calls ``get_worker_info()`` gives other samples in a worker than in the main
process (a per-worker shard, a tag, a per-worker cache), and one that seeds from ``torch.initial_seed()`` other
random streams (each worker's is the loader's base seed plus its id): ``num_workers`` chosen by ms_shm would
change what arrives. The probe cannot see it (its child is not a worker), so the code is read instead: the names
each code object uses (``co_names``: globals, attributes and imports alike, so ``get_worker_info()``,
``torch.utils.data.get_worker_info()`` and a local ``from ... import get_worker_info`` all show), through nested
code (lambdas, comprehensions, inner functions), the methods and module functions it names, and the objects the
dataset holds (a ``Subset``'s dataset, a transform's ``__call__``). Framework and standard-library code is not
read: torch's own collate asks for the worker only to place a batch in shared memory, not to change it.

Cheap: a bounded walk over code objects (``MAX_CODES``), no sample read. A reference that is never called only
keeps the framework's default ``num_workers``, which cannot change what arrives.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import types
from typing import Any, Iterator

NAMES = ("get_worker_info", "initial_seed")  # what a worker answers apart from the main process
ENTRY_POINTS = ("__getitem__", "__getitems__", "__iter__", "__call__")
FRAMEWORKS = frozenset({"torch", "mindspore", "numpy", "ms_shm", "builtins"})
MAX_CODES = 300  # code objects read at most: a dataset's own code is tens
HELD_DEPTH = 2  # objects held by the dataset, and by those: a Subset of a dataset holding a transform
HELD_ITEMS = 8  # of a held list or tuple (ConcatDataset's datasets), the first ones only
# the standard library's top-level modules (``sys.stdlib_module_names`` arrived in Python 3.10; before it, the
# modules a dataset's code commonly reaches)
STDLIB = getattr(sys, "stdlib_module_names", None) or frozenset({
    "abc", "collections", "contextlib", "copy", "dataclasses", "enum", "functools", "io", "itertools", "json",
    "math", "multiprocessing", "operator", "os", "pathlib", "pickle", "queue", "random", "re", "threading",
    "typing"})


def worker_info_use(dataset: Any, collate_fn: Any = None) -> str | None:
    """Where ``dataset`` or ``collate_fn`` refers to one of ``NAMES``, named for the log, or ``None``."""
    seen: set = set()
    for where, fn, owner in itertools.chain(_held_entries(dataset, seen), _collate_entries(collate_fn)):
        name = _refers(fn, owner, set(), [0])
        if name:
            return f"{where} calls {name}() (what it returns depends on the worker that reads it)"
    return None


def _user(fn: Any) -> bool:
    """Python code of the program (not a framework's, not the standard library's)."""
    if not isinstance(fn, types.FunctionType):
        return False
    top = (getattr(fn, "__module__", None) or "").split(".")[0]
    return top not in FRAMEWORKS and top not in STDLIB


def _function(value: Any) -> Any:
    """The Python function behind a function, method, ``functools.partial``, static or class method."""
    for _ in range(4):
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        else:
            break
    return value


def _entries(obj: Any) -> Iterator:
    """``(where, function, owner)`` for the entry points ``obj``'s class defines in the program's code."""
    cls = type(obj)
    for name in ENTRY_POINTS:
        try:
            fn = _function(inspect.getattr_static(cls, name))
        except AttributeError:
            continue
        if _user(fn):
            yield f"{cls.__name__}.{name}", fn, obj


def _held_entries(obj: Any, seen: set, depth: int = 0) -> Iterator:
    """The entry points of ``obj`` and of the objects it holds as attributes (``HELD_DEPTH`` levels down)."""
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    yield from _entries(obj)
    if depth >= HELD_DEPTH:
        return
    attrs = getattr(obj, "__dict__", None)
    for value in (list(attrs.values()) if isinstance(attrs, dict) else ()):
        items = value[:HELD_ITEMS] if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if getattr(item, "__dict__", None) is not None and not isinstance(item, type):
                yield from _held_entries(item, seen, depth + 1)


def _collate_entries(collate_fn: Any) -> Iterator:
    fn = _function(collate_fn)
    if fn is None:
        return
    if isinstance(fn, types.FunctionType):
        if _user(fn):
            yield f"collate_fn {getattr(fn, '__qualname__', fn)}", fn, None
    else:  # a callable object: its __call__, and what it holds
        yield from ((f"collate_fn {where}", f, owner) for where, f, owner in _held_entries(fn, set()))


def _names(code: types.CodeType) -> Iterator:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _refers(fn: Any, owner: Any, seen: set, count: list) -> str | None:
    """Which of ``NAMES`` ``fn`` or what it names (its owner's methods, its module's functions) refers to."""
    code = getattr(fn, "__code__", None)
    if code is None or code in seen or count[0] >= MAX_CODES:
        return None
    seen.add(code)
    count[0] += 1
    names = set(_names(code))
    found = next((name for name in NAMES if name in names), None)
    if found:
        return found
    for name in names:
        for target, target_owner in _named(name, fn, owner):
            found = _refers(target, target_owner, seen, count)
            if found:
                return found
    return None


def _named(name: str, fn: Any, owner: Any) -> Iterator:
    """The program's functions ``name`` may stand for in ``fn``: a method of its owner, a module function."""
    if owner is not None:
        try:
            method = _function(inspect.getattr_static(type(owner), name))
        except AttributeError:
            method = None
        if _user(method):
            yield method, owner
    value = _function(getattr(fn, "__globals__", {}).get(name))
    if _user(value):
        yield value, None


__all__ = ["worker_info_use", "NAMES", "MAX_CODES"]
