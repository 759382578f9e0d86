"""Wrapping a framework's function where it lives, once per process.

ms_shm's hooks on MindSpore (the watchdog's worker lists, a worker's new slot, iterators, a worker thread's
signal handlers, the fork hooks) stay for the process's life: a second ``tune()`` or pipeline must not wrap a
wrapper, or every call would run ms_shm's part twice. The wrapper carries the function it wraps as
``_ms_shm_original``, which is how a later call knows it is there.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("ms_shm")


def wrapped(function: Any) -> bool:
    """Whether ``function`` is one of ms_shm's wrappers."""
    return getattr(function, "_ms_shm_original", None) is not None


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """``owner.name = make(owner.name)``, unless it is missing or wrapped already; whether it was wrapped. A
    module or class that takes no attribute keeps its own function (said at DEBUG): the hook is a help, never a
    condition of the call."""
    original = getattr(owner, name, None)
    if original is None or wrapped(original):
        return False
    wrapper = make(original)
    wrapper._ms_shm_original = original
    try:
        setattr(owner, name, wrapper)
    except (AttributeError, TypeError) as exc:
        log.debug("ms_shm: %s.%s not wrapped (%s: %s)", getattr(owner, "__name__", owner), name,
                  type(exc).__name__, exc)
        return False
    return True
