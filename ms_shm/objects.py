"""Reading the attributes of the user's objects (sources, operations) in the user's process.

``getattr(obj, name, default)`` and ``hasattr`` swallow only ``AttributeError``; an object whose ``__getattr__``
raises something else (a dict subclass answering ``KeyError``, a lazy proxy that loads on access) would then
fail inside ms_shm, at a call where raw MindSpore raises nothing. ms_shm only ever looks, so any exception here
means "not there", and MindSpore raises its own error where it does raw.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections import deque
from typing import Any


def attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, with ``default`` for any exception the lookup raises."""
    try:
        return getattr(obj, name)
    except Exception:  # see the module docstring: looking must not raise where MindSpore does not
        return default


_MISSING = object()

FRAMEWORKS = frozenset({"torch", "mindspore", "numpy", "ms_shm", "builtins"})
# Data libraries whose objects keep caches of their own while they are read (pandas' ``DataFrame.iloc`` adds to its
# block manager's): not the program's state, and their draws go through numpy's global generator, which the probe
# watches. Read as the program's code, a dataset over a DataFrame lost its workers to "DataFrame.__getitem__ adds
# to self.blocks" (an audit).
LIBRARIES = frozenset({"pandas", "pyarrow", "polars", "scipy", "sklearn", "PIL", "cv2", "h5py", "zarr", "tables",
                       "matplotlib", "numba", "jax", "tensorflow"})
# the standard library's top-level modules (``sys.stdlib_module_names`` arrived in Python 3.10; before it, the
# modules a dataset's code commonly reaches)
STDLIB = getattr(sys, "stdlib_module_names", None) or frozenset({
    "abc", "collections", "contextlib", "copy", "dataclasses", "enum", "functools", "io", "itertools", "json",
    "math", "multiprocessing", "operator", "os", "pathlib", "pickle", "queue", "random", "re", "threading",
    "typing"})


def of_program(module_name: str) -> bool:
    """Whether code of the module ``module_name`` is the program's: neither a framework's, a data library's nor
    the standard library's (a model zoo installed from PyPI is the program's: its transforms draw)."""
    top = module_name.split(".")[0]
    return top not in FRAMEWORKS and top not in LIBRARIES and top not in STDLIB


# The built-in containers, whose subclasses may read their items through the program's own code
_BUILT_IN_CONTAINERS = (list, tuple, dict, set, frozenset, deque)


def _built_in_base(container: Any) -> type | None:
    return next((base for base in _BUILT_IN_CONTAINERS if isinstance(container, base)), None)


def stored_length(container: Any) -> int:
    """``len(container)`` as its built-in base counts its items, never through a subclass's own ``__len__``."""
    base = _built_in_base(container)
    return base.__len__(container) if base is not None else len(container)


def as_stored(container: Any) -> Any:
    """A built-in container's items as its built-in base holds them: a subclass's own ``__getitem__``,
    ``__iter__`` or ``items`` is the program's code (a list that decodes each item as it is read: an audit's
    200,000-item one had 1,000 items decoded by the copy-on-read estimate, in the program, at build time, where
    raw decoded none). Such a subclass is copied (its references only, ~8 bytes an item) into its built-in
    base; any other container (``OrderedDict``, ``defaultdict``: reads written in C) is returned as it is."""
    base = _built_in_base(container)
    if base is None or not _reads_in_python(type(container), base):
        return container
    if base is dict:
        return dict(dict.items(container))
    return base(base.__iter__(container))


_READS = ("__getitem__", "__iter__", "__len__", "items", "values", "keys", "__contains__")


def _reads_in_python(cls: type, base: type) -> bool:
    """A class below ``base`` defines a way of reading its items in Python (the program's code)."""
    return any(isinstance(vars(klass).get(name), types.FunctionType) for klass in cls.__mro__
               if klass is not base and klass is not object and not issubclass(base, klass) for name in _READS)


def has(obj: Any, name: str) -> bool:
    """``hasattr(obj, name)``, false for any exception the lookup raises."""
    return attribute(obj, name, _MISSING) is not _MISSING


class PerObject:
    """Values kept beside live objects of the user's, by identity, gone with the object: a dataset may define
    ``__eq__`` without ``__hash__`` or compare equal to another, and ``id()`` alone is reused once it dies.
    An object that takes no weak reference keeps nothing (each use of it is then as the first)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, dict]] = {}

    def __len__(self) -> int:
        """The live objects something is kept for."""
        return len(self._entries)

    def get(self, obj: Any, key: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1].get(key, default)

    def put(self, obj: Any, key: Any, value: Any) -> None:
        at = id(obj)
        entry = self._entries.get(at)
        if entry is None or entry[0]() is not obj:
            try:
                ref = weakref.ref(obj, lambda _: self._entries.pop(at, None))
            except TypeError:
                return
            entry = self._entries[at] = (ref, {})
        entry[1][key] = value


OWN_PREFIX = "_ms_shm_"


class Transparent:
    """Base of the wrappers MindSpore holds in place of the user's object (``dataset.source``, a map operation):
    to whoever reads or writes its attributes it is the user's object. Names it lacks are read from the wrapped
    object, and every assignment or deletion lands there too (``dataset.source.scale = 2`` between epochs must
    reach the rows), except the wrapper's own state, kept under ``_ms_shm_`` names so that no name of the user's
    is shadowed (a source with its own ``source`` or ``spec`` attribute). Subclasses set ``_ms_shm_wrapped``."""

    def __getattr__(self, name: str) -> Any:
        # Only called for names the wrapper lacks. Before __dict__ is filled (unpickling, copy) there is nothing
        # to forward to: no recursion, and pickle's ``__setstate__`` lookup finds none.
        wrapped = self.__dict__.get(OWN_PREFIX + "wrapped", _MISSING)
        if wrapped is _MISSING:
            raise AttributeError(name)
        return getattr(wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(OWN_PREFIX):
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__[OWN_PREFIX + "wrapped"], name, value)

    def __delattr__(self, name: str) -> None:
        if name.startswith(OWN_PREFIX):
            object.__delattr__(self, name)
        else:
            delattr(self.__dict__[OWN_PREFIX + "wrapped"], name)

    def __repr__(self) -> str:
        return repr(self.__dict__.get(OWN_PREFIX + "wrapped"))
