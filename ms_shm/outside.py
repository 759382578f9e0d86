"""What a probe child must not do: a change to the filesystem that the run's own reads would then fail on.

A fork throws away what the probe's reads changed in memory, not what they changed on disk. A map operation that
saves each sample with ``open(path, "xb")`` had its first rows written by the probe, and the real run then failed on
``FileExistsError`` where plain Python ran (an audit of ``ms-shm run``). So in the child, Python's audit events that
would make a second run of the same reads fail, or take away what they read, are refused (``OutsideEffect``, a
``PermissionError``) and counted: a file created exclusively (``"x"``, ``O_EXCL``), a directory made, a file or
directory removed, renamed, truncated or linked. A probe that tried one is reported as not measured, and the
pipeline runs with the framework's own settings, its changes made once, by the run.

Plain writes and appends stay allowed (a log line, a cache file written again with the same bytes: a probe that
refused them would leave every logging source unmeasured, and unprotected under a small ``/dev/shm``); so do reads,
sockets and subprocesses, and ``tempfile``'s own creations (fresh random names) and the removal of scratch files in
the temporary directory. Writes made by native code bypass Python's audit events. Python's audit hooks cannot be
removed: this is installed in a probe child only, which ends with the probe.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

_CHANGES = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.symlink", "os.link",
                      "shutil.rmtree"})
_EVENTS = _CHANGES | {"open"}

_refused: list = []  # in a probe child: the effects refused so far, described
_armed = False


class OutsideEffect(PermissionError):
    """Raised inside a probe child where the probe's reads would change a file."""


def arm() -> None:  # pragma: no cover - child side (a hook outlives the test process otherwise)
    """In a probe child, before the probe: refuse and count file changes from now on."""
    global _armed
    if not _armed:
        sys.addaudithook(_hook)
        _armed = True


def refused() -> str | None:
    """The first file change the probe tried, for the log, or ``None``."""
    return _refused[0] if _refused else None


def _hook(event: str, args: tuple) -> None:
    if event not in _EVENTS:
        return
    what = describe(event, args)
    if what is not None and sys._getframe(1).f_globals.get("__name__") != "tempfile":  # fresh random names
        _refused.append(what)
        raise OutsideEffect(f"ms_shm's probe process does not {what}: its reads run only to be measured")


def describe(event: str, args: tuple) -> str | None:
    """The file change an audit event makes that a second run of the same reads would fail on, in words, or
    ``None``."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if path is None or isinstance(path, int):  # a descriptor already open: the program's, not a new file
            return None
        exclusive = "x" in mode if isinstance(mode, str) else bool((flags or 0) & os.O_EXCL)
        name = _name(path)
        if not exclusive or "__pycache__" in name:
            return None
        return f"create {name!r} (exclusively: a second creation fails)"
    if event not in _CHANGES or not args:
        return None
    name = _name(args[0])
    if event == "os.mkdir" and os.path.isdir(name):  # makedirs(exist_ok=True) on a directory that is there
        return None
    if event != "os.mkdir" and os.path.dirname(os.path.abspath(name)) == tempfile.gettempdir():
        return None  # a scratch file the reads made and clean up (mkstemp, then remove)
    return f"{event.split('.')[-1]} {name!r}"


def _name(path: Any) -> str:
    try:
        return os.fsdecode(path)
    except TypeError:
        return repr(path)


__all__ = ["OutsideEffect", "arm", "refused", "describe"]
