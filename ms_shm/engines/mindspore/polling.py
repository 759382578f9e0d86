"""MindSpore's GeneratorDataset polls its workers every 0.1 s; ms_shm makes the poll shorter. The same rows.

With two or more workers (threads or processes), MindSpore's main process (2.0 to 2.10, ``SamplerFn.process``)
takes row i from worker i % W and, where that worker's result queue is empty, sleeps 0.1 s before it looks again.
Each worker meanwhile makes at most the rows it holds indices for, so where the workers make rows slower than the
main process takes them, an epoch runs no faster than ``W x (depth + 1)`` rows per poll, and every iterator's
first row waits a whole poll. Measured on 2.10, 2 workers, 16 KiB rows of pure Python (600 rows; the poll as
MindSpore makes it / 2 ms):

- rows of 0.5 ms: 2.6 / 0.55 ms a row in processes, 1.7 / 0.58 on threads (0.5 inline);
- rows of 1 ms: 3.1 / 0.88 in processes, 2.8 / 1.0 on threads; rows of 2 ms: 3.2 / 1.4 in processes;
- rows of 20 ms: 10.1 / 10.5 in processes, 20.3 / 20.5 on threads (the poll is not what holds them);
- an iterator of 20 rows of 1 ms: 0.23 / 0.13 s in processes, 0.11 / 0.02 s on threads.

The poll is MindSpore's ``time.sleep(0.1)``, looked up through the module's ``time`` at each call: ms_shm gives
that module a ``time`` whose ``sleep`` makes that one pause ``SHORTER_POLL`` and passes every other call on. A
poll of 2 ms costs a waiting main process a few microseconds of CPU 500 times a second. Where a release's loop
does not poll so (``polls``), nothing is changed and the planner prices MindSpore's own poll.
"""

from __future__ import annotations

import time
import types
from typing import Any

POLL_SECONDS = 0.1  # MindSpore's own poll (2.0 to 2.10)
SHORTER_POLL = 0.002


class ShorterPoll(types.ModuleType):
    """The ``time`` module as MindSpore's ``datasets_user_defined`` sees it once ms_shm installed it: its 0.1 s poll
    is ``SHORTER_POLL``; everything else is ``time``'s own."""

    def __init__(self) -> None:
        super().__init__("time", "the time module, with MindSpore's GeneratorDataset poll made shorter by ms_shm")

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(SHORTER_POLL if seconds == POLL_SECONDS else seconds)


def polls(code: Any) -> bool:
    """Whether a release's ``SamplerFn.process`` (its code object) polls as described: it sleeps, and 0.1 s is
    among its constants."""
    return code is not None and "sleep" in code.co_names and POLL_SECONDS in code.co_consts


def installed(module: Any) -> bool:
    return isinstance(getattr(module, "time", None), ShorterPoll)


__all__ = ["POLL_SECONDS", "SHORTER_POLL", "ShorterPoll", "polls", "installed"]
