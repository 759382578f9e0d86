"""A new iterator on a pipeline whose earlier iterator is still alive, where ms_shm itself chose worker processes.

The earlier iterator's workers keep their shared-memory slots until it is gone, stopped or not (peek at one row
to check shapes, keep ``it``, then train through another iterator). The plan priced one set of slots; raw
MindSpore's default for the same call reads rows in its own thread and needs none. An audit (1.5 MiB rows, a
64 MB ``/dev/shm``): raw delivered every row, ms_shm stopped with ``ShmFullError`` in 4 runs of 4. Where
``/dev/shm`` has no room for a second set, the new iterator reads rows as MindSpore would have for that call:
the same rows (ms_shm chooses worker processes only for rows that do not depend on who reads them), said at
WARNING. Where the caller (or MindSpore's default) chose the worker processes, nothing changes: as raw.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from ms_shm._results import mib
from ms_shm.engines.mindspore import liveness
from ms_shm.plan import INLINE, PROCESSES, THREADS

log = logging.getLogger(__name__)


def install() -> None:
    liveness.before_made(fit_another)


def fit_another(top: Any) -> Callable[[], None] | None:
    """Before an iterator is made on ``top``: what puts back the one ``GeneratorDataset`` stage read in
    MindSpore's own way for this iterator, or ``None`` (nothing changed)."""
    from ms_shm import measure
    from ms_shm.state import SESSION

    for stage in liveness.stages(top):
        guard = liveness.guard_of(stage)
        plan = measure.plan_of(stage) if guard is not None else None
        if plan is None or not plan.predicted_shm or not liveness.iterators_reading(guard):
            continue
        own = own_mode(plan.decisions)
        room = SESSION.budget(SESSION.host_facts()).shm_bytes
        if own is None or room is None or room >= plan.predicted_shm:
            continue
        return read_as_mindspore(stage, own, room, plan.predicted_shm)
    return None


_SAID: Any = weakref.WeakSet()  # stages already warned about: one WARNING each, then INFO (``it`` per epoch)


def _level(stage: Any) -> int:
    try:
        if stage in _SAID:
            return logging.INFO
        _SAID.add(stage)
    except TypeError:  # not weak-referenceable: said every time
        pass
    return logging.WARNING


def own_mode(decisions: tuple) -> str | None:
    """MindSpore's own mode for the call, where ms_shm chose another (worker processes) in its place; ``None``
    where the mode is the caller's or MindSpore's own (a change there would not be raw's)."""
    mode = next((d for d in decisions if d.setting == "mode"), None)
    if mode is None or mode.value != PROCESSES or mode.default not in (INLINE, THREADS):
        return None
    return mode.default


def read_as_mindspore(stage: Any, own: str, room: int, need: int) -> Callable[[], None]:
    """Set ``stage`` to MindSpore's ``own`` mode for the iterator being made (its copy of the tree is parsed
    from these attributes); the returned function puts the plan's settings back for later iterators."""
    before = stage.num_parallel_workers, stage.python_multiprocessing
    if own == INLINE:
        stage.num_parallel_workers = 1  # MindSpore reads one worker in its own thread, whatever the flag says
    else:
        stage.python_multiprocessing = False
    log.log(_level(stage), "ms_shm: a new iterator on %s while an earlier one is alive, whose worker processes "
            "keep their shared-memory slots: /dev/shm has %s left of the %s a second set needs, so this iterator "
            "reads rows as MindSpore's default for this call does (%s), the same rows. To keep worker processes, "
            "let the earlier iterator go first (`del it`), or read every epoch through one iterator "
            "(create_tuple_iterator(num_epochs=N))", type(stage).__name__, mib(room), mib(need),
            "in its own thread" if own == INLINE else "in threads")

    def put_back() -> None:
        stage.num_parallel_workers, stage.python_multiprocessing = before

    return put_back


__all__ = ["install", "fit_another", "own_mode", "read_as_mindspore"]
