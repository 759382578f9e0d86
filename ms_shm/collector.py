"""Python's cyclic garbage collector, kept from running a full collection of the program's heap for objects
ms_shm made.

Why: CPython runs a full collection once the objects that survived into the oldest generation since the last
full one pass a quarter of the objects there (``long_lived_pending > long_lived_total / 4``). Right after
``import mindspore.dataset`` (~162,000 tracked objects on 2.10) a program is ~1,200 long-lived objects short of
that; ms_shm's modules, result classes and session make ~7,800 (import 1,500, ``tune()`` 5,900, a build 350).
So ``import ms_shm`` tipped the collector into a full collection of MindSpore's heap, ~50 ms of CPU here,
inside ms_shm's own call; raw MindSpore pays it where the program's own objects tip it (measured: a model built
after the pipeline), or never in a short script (measured: none in a raw build and epoch).

While ms_shm's own calls run, the collector is off; at their end, a young collection (``gc.collect(0)``: the
cycles just made, ~1 ms) frees what died, and ``gc.freeze()`` + ``gc.unfreeze()`` move what lives into the
oldest generation the way a program's long-lived objects get there, without counting toward the next full
collection (neither call touches ``long_lived_pending``). Nothing is left frozen: the collector runs as before,
and every object is still collected when it becomes garbage. Where the program froze objects itself
(``gc.get_freeze_count()``) or turned the collector off, nothing is changed here.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The body runs with the collector off; what it made joins the oldest generation, uncounted. Nested
    uses pass through: the outermost one settles."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        settle()
        gc.enable()


def settle() -> None:
    """Free the young cycles, then move the survivors to the oldest generation without a full collection."""
    try:
        gc.collect(0)
        if not gc.get_freeze_count():  # another thread froze objects meanwhile: leave them frozen
            gc.freeze()
            gc.unfreeze()
    except Exception:  # noqa: BLE001 - an interpreter without these calls: the collector as it was
        pass


def quietly(function: Callable) -> Callable:
    """``function`` run inside ``quiet()``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with quiet():
            return function(*args, **kwargs)

    return wrapper


__all__ = ["quiet", "quietly", "settle"]
