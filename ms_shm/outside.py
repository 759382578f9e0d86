"""What a probe child must not do: change the filesystem the program shares with it.

A fork throws away what the probe's reads changed in memory, not what they changed on disk. A map operation that
saves each sample with ``open(path, "xb")`` had its first rows written by the probe, and the real run then failed on
``FileExistsError`` where plain Python ran (an audit of ``ms-shm run``); a source or operation appending to a log
wrote 2-6 lines more. So in the child, Python's audit events that create, write, rename or remove a file are
refused (``OutsideEffect``, a ``PermissionError``) and counted; a probe that tried one is reported as not measured,
and the pipeline runs with the framework's own settings, its effects made once, by the run.

Reads, sockets and subprocesses stay allowed (a dataset that fetches over HTTP or decodes through ``ffmpeg`` is
measured as before); writes made by native code bypass Python's audit events and are not seen. Bytecode caches
(``__pycache__``) and ``/dev/null`` are not effects. Python's audit hooks cannot be removed: this is installed in a
probe child only, which ends with the probe.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
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
    if what is not None:
        _refused.append(what)
        raise OutsideEffect(f"ms_shm's probe process does not {what}: its reads run only to be measured")


def describe(event: str, args: tuple) -> str | None:
    """The file change an audit event makes, in words, or ``None`` for a read or no change."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if path is None or isinstance(path, int):  # a descriptor already open: the program's, not a new file
            return None
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        name = _name(path)
        if not writes or name == os.devnull or "__pycache__" in name:
            return None
        return f"open {name!r} for writing"
    if event not in _CHANGES or not args:
        return None
    name = _name(args[0])
    if event == "os.mkdir" and os.path.isdir(name):  # makedirs(exist_ok=True) on a directory that is there
        return None
    return f"{event.split('.')[-1]} {name!r}"


def _name(path: Any) -> str:
    try:
        return os.fsdecode(path)
    except TypeError:
        return repr(path)


__all__ = ["OutsideEffect", "arm", "refused", "describe"]
