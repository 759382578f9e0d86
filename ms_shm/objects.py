"""Reading the attributes of the user's objects (sources, operations) in the user's process.

``getattr(obj, name, default)`` and ``hasattr`` swallow only ``AttributeError``; an object whose ``__getattr__``
raises something else (a dict subclass answering ``KeyError``, a lazy proxy that loads on access) would then
fail inside ms_shm, at a call where raw MindSpore raises nothing. ms_shm only ever looks, so any exception here
means "not there", and MindSpore raises its own error where it does raw.
"""

from __future__ import annotations

from typing import Any


def attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, with ``default`` for any exception the lookup raises."""
    try:
        return getattr(obj, name)
    except Exception:  # see the module docstring: looking must not raise where MindSpore does not
        return default


_MISSING = object()


def has(obj: Any, name: str) -> bool:
    """``hasattr(obj, name)``, false for any exception the lookup raises."""
    return attribute(obj, name, _MISSING) is not _MISSING
