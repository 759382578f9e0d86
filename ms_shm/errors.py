"""Every error ms_shm raises, under one root: ``except ms_shm.Error`` catches them all.

Each also derives from the built-in class a caller would have caught before (``ValueError`` for bad input,
``RuntimeError`` for a pipeline that cannot run), so existing ``except`` clauses keep working. The message
always carries the numbers and the fix; the attributes carry them as data.

MindSpore re-raises a worker's exception in the main process as ``type(exc)(traceback_text)``: every class
here must therefore be constructible from a message alone.
"""

from __future__ import annotations

from typing import Any


class Error(Exception):
    """The root of every ms_shm error.

    Attributes:
        fix: the change that makes the error go away, as text (``None`` when only the message says it).
    """

    def __init__(self, message: str = "", *, fix: str | None = None):
        super().__init__(message)
        self.fix = fix

    @property
    def problem(self) -> str:
        """The message up to its `` Fix:``: what went wrong, as a decision's reason when ms_shm adapts instead."""
        return str(self).split(" Fix:")[0]


class RowError(Error, ValueError, RuntimeError):
    """A row MindSpore cannot carry, found before any worker starts. The message names the column, the row and
    the fix, and keeps MindSpore's own words; like MindSpore's error for the same row it is a ``RuntimeError``
    (and a ``ValueError``, as it was in ms_shm before)."""

    def __init__(self, message: str = "", column: str | None = None, row: Any = None, *, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.column = column
        self.row = row


class RowTypeError(RowError, TypeError):
    """A row whose value MindSpore refuses with a ``TypeError`` as the iterator yields it (an array of a dtype it
    has no tensor type for, inside a dict column): an ``except TypeError`` written for raw MindSpore catches it."""


class ShmBudgetError(Error, RuntimeError):
    """The settings the caller insisted on cannot fit this rank's shared-memory or fd budget.

    Raised before any worker starts, instead of a bus error later. The message has the numbers and the fix.

    Attributes:
        plan: the closest plan that was considered, when there is one.
    """

    def __init__(self, message: str = "", plan: Any = None, *, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.plan = plan


class RowTooLargeError(Error, RuntimeError):
    """A row larger than the shared memory planned for it; raised in the worker, before the row is written."""


class ShmFullError(Error, RuntimeError):
    """/dev/shm has less free space than a new slot needs (something else filled it after planning)."""


class SourceError(Error, RuntimeError):
    """What a source read in a worker process raised, where MindSpore could not raise it again in the main process:
    its message names the exception's class and its own message (MindSpore makes the class again from one message,
    and a class whose ``__init__`` takes more lost both to a ``TypeError``)."""


class UsageError(Error, ValueError, RuntimeError):
    """An ms_shm call was used wrongly (a bad argument, a watcher started twice); caught as ``ValueError`` or
    ``RuntimeError`` as before."""


class ProcessesUnavailableError(Error, RuntimeError):
    """``python_multiprocessing=True`` was asked for where MindSpore cannot start worker processes."""


class ReadOnlyError(Error, TypeError):
    """Code tried to change a ``SharedList``/``SharedDict``. A ``TypeError``, as for an immutable built-in, so
    ``except TypeError`` still catches it; the message names the source attribute it stands in for, when known."""


__all__ = ["Error", "RowError", "RowTypeError", "ShmBudgetError", "RowTooLargeError", "ShmFullError", "SourceError",
           "ProcessesUnavailableError",
           "UsageError", "ReadOnlyError"]
