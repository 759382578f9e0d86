"""One base for every result ms_shm returns, so each prints well and turns into JSON the same way, and one
decorator (``record``) that makes result classes cheaply."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import PurePath
from typing import Any


def plain(value: Any) -> Any:
    """JSON-ready copy of a result: dataclasses become dicts, tuples lists, paths strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _is_size(name: str) -> bool:
    """Fields that hold bytes, by the names the results use."""
    return (name.endswith("bytes") or name.startswith(("shm_total", "shm_free", "mem_", "cgroup_mem_"))
            or name in ("predicted_shm", "shmmax"))


def _show(name: str, value: Any, indent: str) -> str:
    if isinstance(value, Result) and dataclasses.is_dataclass(value):
        return "\n" + "\n".join(indent + "  " + line for line in str(value).splitlines())
    if isinstance(value, (list, tuple)) and value and not all(isinstance(v, (int, float)) for v in value):
        return "".join(f"\n{indent}  - " + _show(name, v, indent + "    ").lstrip("\n") for v in value)
    if isinstance(value, int) and not isinstance(value, bool) and _is_size(name):
        return f"{mib(value)} ({value})" if value >= 1024 else mib(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value) if not isinstance(value, tuple) else str(list(value))


class Result:
    """Mixin for frozen dataclasses: ``to_dict()``, ``to_json()``, and ``str()`` as one field per line."""

    def __str__(self) -> str:
        lines = [type(self).__name__]
        for f in dataclasses.fields(self):
            if f.repr:
                shown = _show(f.name, getattr(self, f.name), "  ")
                lines.append(f"  {f.name}:{'' if shown.startswith(chr(10)) else ' '}{shown}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return plain(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)


def record(cls: type | None = None, *, frozen: bool = True) -> Any:
    """``dataclasses.dataclass(frozen=frozen)`` at a tenth of its cost to define a class.

    Why: ``dataclass`` compiles ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__`` and
    ``__delattr__`` from source (``exec``) for every class, ~1.4 ms a class on Python 3.11 (measured with 8
    fields: 1.43 ms frozen, 0.12 ms with those methods off). ms_shm defines ~60 result classes, ~40 of them
    before a pipeline is built, so that was ~60 ms of every ``tune()`` + ``build_dataset`` end to end. Here
    ``dataclass`` still does the fields (``fields()``, ``replace()``, ``asdict()``, ``is_dataclass`` work as
    before) and the methods are shared functions, built once per class without compiling anything. Behaviour
    is ``dataclass``'s: positional or keyword arguments, defaults and ``default_factory``, ``__post_init__``;
    frozen instances raise ``dataclasses.FrozenInstanceError`` on assignment and hash by the compared fields;
    mutable ones are unhashable; ``==`` compares the ``compare=True`` fields of instances of one class.
    """
    if cls is None:
        return lambda c: record(c, frozen=frozen)
    if not cls.__doc__:  # else ``dataclass`` writes one from ``inspect.signature`` (0.3 ms a class)
        cls.__doc__ = cls.__name__
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)  # (3.10+ sets ``__match_args__`` too)
    every = dataclasses.fields(cls)
    compared = tuple(f.name for f in every if f.compare)
    cls.__init__ = _init_for(cls, tuple(f for f in every if f.init))
    cls.__repr__ = _repr_for(tuple(f.name for f in every if f.repr))
    cls.__eq__ = _eq_for(compared)
    if frozen:
        cls.__setattr__, cls.__delattr__ = _refuse_assignment, _refuse_assignment
        cls.__hash__ = lambda self: hash(tuple(getattr(self, n) for n in compared))
    else:
        cls.__hash__ = None
    return cls


def _init_for(cls: type, params: tuple) -> Any:
    names = tuple(f.name for f in params)
    post_init = getattr(cls, "__post_init__", None)
    missing = dataclasses.MISSING

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(params):
            raise TypeError(f"{cls.__name__}.__init__() takes {len(params) + 1} positional arguments but "
                            f"{len(args) + 1} were given")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{cls.__name__}.__init__() got multiple values for argument '{name}'")
            object.__setattr__(self, name, value)
        for f in params[len(args):]:
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default is not missing:
                value = f.default
            elif f.default_factory is not missing:
                value = f.default_factory()
            else:
                raise TypeError(f"{cls.__name__}.__init__() missing 1 required argument: '{f.name}'")
            object.__setattr__(self, f.name, value)
        if len(kwargs) > 0:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument '{next(iter(kwargs))}'")
        if post_init is not None:
            post_init(self)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _repr_for(names: tuple) -> Any:
    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{type(self).__qualname__}({shown})"

    return __repr__


def _eq_for(names: tuple) -> Any:
    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

    return __eq__


def _refuse_assignment(self: Any, name: str, *value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def mib(nbytes: float | None) -> str:
    """Human size used in every log line and CLI table."""
    if nbytes is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def free_text(free: int, needed: int) -> str:
    """Free space as a refusal shows it: in bytes when one decimal of MiB would round it up to what is needed
    (a refusal reading "needs 2.0 MiB, has only 2.0 MiB" names no shortfall)."""
    return f"{free:,} B" if mib(free) == mib(needed) else mib(free)
