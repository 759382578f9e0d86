"""Where a pipeline was built: the first frame of the caller's own code, outside MindSpore, ms_shm and the
libraries that build DataLoaders on a program's behalf.

Warnings under ``ms_shm.patch`` and ``ms-shm run --report`` name this ``file:line``, so a pipeline built deep
inside a model zoo's loader is found in the code that called it.
"""

from __future__ import annotations

import functools
import os
import site as site_module
import sys
import sysconfig
from typing import Any

FRAMEWORK_PACKAGES = ("mindspore", "ms_shm")
#: Libraries that make or remake a program's DataLoader (Lightning re-instantiates it with its own sampler,
#: accelerate and transformers' Trainer wrap it, torchdata derives from it): an audit's warnings named
#: ``lightning/fabric/utilities/data.py:325`` and ``accelerate/data_loader.py:428``, never the program's line.
REMAKING_LIBRARIES = ("lightning", "lightning_fabric", "pytorch_lightning", "accelerate", "transformers")
WRAPPER_PACKAGES = ("torch", "torchdata") + REMAKING_LIBRARIES


def _in(module: str, packages: tuple) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _ours(module: str) -> bool:
    return _in(module, FRAMEWORK_PACKAGES + WRAPPER_PACKAGES)


def call_site() -> str | None:
    """``file:line`` of the innermost frame whose module is none of those packages', or ``None``; where that is a
    package of the program's (a model zoo's ``create_loader``), with the script's line that called into it: two
    loaders an audit's package made at one line read as one warning said twice."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not _ours(module):
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            main = None if module == "__main__" else _script_frame(frame.f_back)
            return site if main is None else f"{site} (from {main.f_code.co_filename}:{main.f_lineno})"
        frame = frame.f_back
    return None


def _script_frame(frame: Any) -> Any:
    """The innermost frame of the script (``__main__``) at or above ``frame``, or ``None``."""
    while frame is not None and frame.f_globals.get("__name__") != "__main__":
        frame = frame.f_back
    return frame


def installed(path: str, standard: bool = True) -> bool:
    """Whether a module's file lies where the interpreter keeps installed modules (site-packages, the user
    site) or, with ``standard``, its standard library: a library's, not the program's."""
    real = os.path.realpath(path)
    return real.startswith(_roots("purelib", "platlib", site=True)) or \
        (standard and real.startswith(_roots("stdlib", "platstdlib")))


def standard(path: str) -> bool:
    """Whether a module's file is the standard library's (site-packages may lie inside its folder)."""
    real = os.path.realpath(path)
    return real.startswith(_roots("stdlib", "platstdlib")) and not real.startswith(
        _roots("purelib", "platlib", site=True))


@functools.lru_cache(maxsize=2)
def _roots(*names: str, site: bool = False) -> tuple:
    folders = {sysconfig.get_path(name) for name in names}
    if site:
        folders.update(getattr(site_module, "getsitepackages", lambda: [])())
        folders.add(getattr(site_module, "USER_SITE", None) or "")
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders if f)


def made_by_a_library() -> bool:
    """Whether a library that remakes a program's loaders (Lightning, accelerate, transformers) is on the stack.
    Their loops also read a loader one batch ahead (accelerate's ``DataLoaderShard`` to know the last batch,
    Lightning's prefetching fetcher): an audit's Trainer with persistent workers under 64 MB had 4 batches of
    16 MiB in use against the 3 planned. A program that merely imports them iterates as a plain ``for``."""
    frame = sys._getframe(1)
    while frame is not None:
        if _in(str(frame.f_globals.get("__name__", "")), REMAKING_LIBRARIES):
            return True
        frame = frame.f_back
    return False


__all__ = ["call_site", "made_by_a_library", "FRAMEWORK_PACKAGES", "WRAPPER_PACKAGES"]
