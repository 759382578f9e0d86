"""What ms_shm changed in this process, with enough to undo it: the ``Change`` record, and the one setting that
belongs to no framework (the open-files soft limit). Framework settings are changed and undone by their
engine."""

from __future__ import annotations

import logging
import resource
from typing import Any

from ms_shm._results import Result, record

log = logging.getLogger(__name__)

NOFILE = "RLIMIT_NOFILE(soft)"


@record
class Change(Result):
    """One setting ms_shm changed: enough to undo it."""

    setting: str
    old: Any
    new: Any
    reason: str


def get_nofile() -> tuple:
    """``(soft, hard)`` open-files limits, ``None`` for unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return (None if soft == inf else soft), (None if hard == inf else hard)


def set_nofile_soft(value: int, reason: str) -> Change | None:
    """Raise the soft limit to ``value`` (never above the hard limit); ``None`` when nothing changed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    if value <= soft:
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
    return Change(NOFILE, soft, value, reason)


def undo_nofile(change: Change) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (change.old, hard))
    log.info("ms_shm restored %s to %s", change.setting, change.old)


__all__ = ["Change", "NOFILE", "get_nofile", "set_nofile_soft", "undo_nofile"]
