"""Python's cyclic garbage collector, kept from running a full collection of the program's heap for the modules ms_shm
loads.

Why: CPython runs a full collection once the objects that survived into the oldest generation since the last full
one pass a quarter of the objects there (``long_lived_pending > long_lived_total / 4``). Right after ``import
mindspore.dataset`` (~162,000 tracked objects on 2.10) a program is ~1,200 long-lived objects short of that;
ms_shm's modules and result classes make ~7,500. So ``import ms_shm`` tipped the collector into a full collection of
MindSpore's heap, ~50 ms of CPU here, inside ms_shm's own import; raw MindSpore pays it where the program's own
objects tip it (measured: a model built after the pipeline), or never in a short script. Under ``ms-shm run`` it was
one full collection more than plain ``python`` (3 against 2, ~45 ms of CPU).

While ms_shm's modules load, the collector is off. Before, the program's young generations are collected
(``gc.collect(1)``, ~1 ms: an audit's 400 MB cycle, dropped just before ``import ms_shm``, was otherwise moved to
the oldest generation and held until a full collection that did not come); at the end a young collection
(``gc.collect(0)``: the cycles the import made) frees what died, and ``gc.freeze()`` + ``gc.unfreeze()`` move what
lives — modules, classes, functions, alive for the process's life — into the oldest generation without counting
toward the next full collection (neither call touches ``long_lived_pending``). Only imports, a few per process:
around ms_shm's calls (a build, ``tune()``) an audit saw it go wrong — another thread's garbage piled up while a
slow probe ran (3.6 GB), and the program's own young objects, promoted at every build, waited for a full collection
that no longer came (50 MB held per epoch). An import moves the program's young objects once, at most the ~7,700 its
young generations hold, and only those alive (their garbage is collected first). Where the program turned the
collector off or froze objects itself, nothing is changed. A thread of the program's that turns the collector off
during those milliseconds finds it on again after.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from types import ModuleType
from typing import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The body (an import) runs with the collector off; what it made joins the oldest generation, uncounted.
    Nested uses pass through: the outermost one settles."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    _collect(1)  # the program's young garbage first: settling must move only what lives
    gc.disable()
    try:
        yield
    finally:
        settle()
        gc.enable()


def _collect(generation: int) -> None:
    try:
        gc.collect(generation)
    except Exception:  # noqa: BLE001 - an interpreter without it: the collector as it was
        pass


def load(name: str) -> ModuleType:
    """``importlib.import_module(name)``, quietly where it is not loaded yet (never settling for a module
    already there: a patched call asks for its modules at every call). A module another thread is still
    loading is waited for, as ``import`` does: two threads building their first pipelines at once, the second
    met ``ms_shm.api`` half made (``AttributeError: partially initialized module``)."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        return module
    with quiet():
        return importlib.import_module(name)


def settle() -> None:
    """Free the young cycles, then move the survivors to the oldest generation without a full collection."""
    _collect(0)
    try:
        if not gc.get_freeze_count():  # another thread froze objects meanwhile: leave them frozen
            gc.freeze()
            gc.unfreeze()
    except Exception:  # noqa: BLE001 - an interpreter without these calls: the collector as it was
        pass


_AT_FORK: list = []  # the hook below, once registered (``os.register_at_fork`` hooks cannot be removed)


def freeze_in_forked_children() -> None:
    """From now on (once per process), a child forked from here (a DataLoader's or GeneratorDataset's worker, a
    probe) first moves everything it inherited into the collector's permanent generation (``gc.freeze``: Python's
    own advice for fork without exec). Else a worker's first full collection walks the whole inherited heap,
    writing every object's GC header, and copies each page: an audit's worker with Lightning imported held 98 MiB
    of its own against 9.5 with the freeze, its first batch 0.3-1.7 s late. What is inherited stays shared and
    reference counting still frees it; only cycles among inherited objects are left to the parent's collector."""
    if not _AT_FORK and hasattr(os, "register_at_fork"):
        _AT_FORK.append(_freeze_inherited)
        os.register_at_fork(after_in_child=_freeze_inherited)


def _freeze_inherited() -> None:
    try:
        gc.freeze()
    except Exception:  # noqa: BLE001 - an interpreter without it: the collector as it was
        pass


__all__ = ["load", "quiet", "settle", "freeze_in_forked_children"]
