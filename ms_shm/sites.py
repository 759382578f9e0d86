"""Where a pipeline was built: the first frame of the caller's own code, outside MindSpore, ms_shm and the
libraries that build DataLoaders on a program's behalf.

Warnings under ``ms_shm.patch`` and ``ms-shm run --report`` name this ``file:line``, so a pipeline built deep
inside a model zoo's loader is found in the code that called it.
"""

from __future__ import annotations

import sys

FRAMEWORK_PACKAGES = ("mindspore", "ms_shm")
#: Libraries that make or remake a program's DataLoader (Lightning re-instantiates it with its own sampler,
#: accelerate and transformers' Trainer wrap it, torchdata derives from it): an audit's warnings named
#: ``lightning/fabric/utilities/data.py:325`` and ``accelerate/data_loader.py:428``, never the program's line.
WRAPPER_PACKAGES = ("torch", "torchdata", "lightning", "lightning_fabric", "pytorch_lightning", "accelerate",
                    "transformers")


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in FRAMEWORK_PACKAGES + WRAPPER_PACKAGES)


def call_site() -> str | None:
    """``file:line`` of the innermost frame whose module is none of those packages', or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _ours(str(frame.f_globals.get("__name__", ""))):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


__all__ = ["call_site", "FRAMEWORK_PACKAGES", "WRAPPER_PACKAGES"]
