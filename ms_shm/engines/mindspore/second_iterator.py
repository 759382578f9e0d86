"""A new iterator on a pipeline whose earlier iterator is still alive, where ms_shm itself chose worker processes.

The earlier iterator's workers keep their shared-memory slots until it is gone, stopped or not (peek at one row
to check shapes, keep ``it``, then train through another iterator). The plan priced one set of slots; raw
MindSpore's default for the same call reads rows in its own thread and needs none. An audit (1.5 MiB rows, a
64 MB ``/dev/shm``): raw delivered every row, ms_shm stopped with ``ShmFullError`` in 4 runs of 4. Where
``/dev/shm`` has no room for a second set, the new iterator reads rows in this process (``Plan.in_process``):
as MindSpore's default for the call does where that reads in this process, else in the threads the call
allows. The same rows: worker processes are left only where rows do not depend on who reads them, said at
WARNING. MindSpore 2.0's default for a call with workers is processes, whose static slots a finished iterator
keeps: ``it = ds.create_tuple_iterator()`` per epoch failed its second epoch's pre-check under 64 MB ("Insufficient
shared memory available"), 6 runs of 6. Where the caller asked for worker processes (or rows depend on who reads
them), nothing changes: as raw.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from ms_shm._results import mib
from ms_shm.engines.mindspore import liveness
from ms_shm.plan import INLINE

log = logging.getLogger(__name__)


def install() -> None:
    liveness.before_made(fit_another)


def fit_another(top: Any) -> Callable[[], None] | None:
    """Before an iterator is made on ``top``: what puts back the one ``GeneratorDataset`` stage read in this
    process for this iterator, or ``None`` (nothing changed)."""
    from ms_shm import measure
    from ms_shm.state import SESSION

    for stage in liveness.stages(top):
        plan = measure.plan_of(stage)
        if plan is None or not plan.predicted_shm or not plan.in_process or not liveness.iterators_on(stage):
            continue
        room = SESSION.budget(SESSION.host_facts()).shm_bytes
        if room is None or room >= plan.predicted_shm:
            continue
        mode, workers = plan.in_process
        return read_in_process(stage, mode, workers, room, plan.predicted_shm)
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


def read_in_process(stage: Any, mode: str, workers: int, room: int, need: int) -> Callable[[], None]:
    """Set ``stage`` to read in this process (``Plan.in_process``) for the iterator being made (its copy of the
    tree is parsed from these attributes); the returned function puts the plan's settings back for later
    iterators."""
    before = stage.num_parallel_workers, stage.python_multiprocessing
    stage.num_parallel_workers = 1 if mode == INLINE else workers  # one worker: MindSpore's own thread
    stage.python_multiprocessing = False
    log.log(_level(stage), "ms_shm: a new iterator on %s while an earlier one is alive, whose worker processes "
            "keep their shared-memory slots: /dev/shm has %s left of the %s a second set needs, so this iterator "
            "reads rows %s, the same rows. To keep worker processes, let the earlier iterator go first (`del it`), "
            "or read every epoch through one iterator (create_tuple_iterator(num_epochs=N))", type(stage).__name__,
            mib(room), mib(need), "in MindSpore's own thread" if mode == INLINE else f"in {workers} threads")

    def put_back() -> None:
        stage.num_parallel_workers, stage.python_multiprocessing = before

    return put_back


__all__ = ["install", "fit_another", "read_in_process"]
