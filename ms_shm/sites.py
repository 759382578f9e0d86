"""Where a pipeline was built: the first frame of the caller's own code, outside MindSpore and ms_shm.

Warnings under ``ms_shm.patch`` and ``ms-shm run --report`` name this ``file:line``, so a pipeline built deep
inside a model zoo's loader is found in the code that called it.
"""

from __future__ import annotations

import sys

FRAMEWORK_PACKAGES = ("mindspore", "ms_shm")


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in FRAMEWORK_PACKAGES)


def call_site() -> str | None:
    """``file:line`` of the innermost frame whose module is neither MindSpore's nor ms_shm's, or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _ours(str(frame.f_globals.get("__name__", ""))):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


__all__ = ["call_site", "FRAMEWORK_PACKAGES"]
