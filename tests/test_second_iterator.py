"""Where a new iterator beside a live one may read instead of a second set of worker slots (``Plan.in_process``):
pure planning, no framework."""

from __future__ import annotations

import pytest

from ms_shm import budget, model
from ms_shm.engines.mindspore import planning
from ms_shm.plan import INLINE, PROCESSES, THREADS, Request
from ms_shm.rows import RowStats

MiB = model.MiB
GIL_BOUND = RowStats(True, 400, 8, (), (), MiB, MiB, 0.02, 1.0, 0.0)  # 20 ms of pure Python a row: processes win


def _planned(release: str = "2.10.0", **asked):
    room = budget.compute(4 << 30, 1, 65536, 10, 0, 0)
    req = Request(cpu_count=2, usable_cpus=2, **asked)
    return planning.plan_generator(GIL_BOUND, req, room, model.profile_for(release))


@pytest.mark.parametrize("release, asked, expected", [
    ("2.10.0", {}, (INLINE, 1)),  # MindSpore's default (one worker, its own thread), replaced by ms_shm
    ("2.10.0", dict(workers=2), (THREADS, 2)),  # workers given, the transport left: threads keep them
    ("2.0.0", dict(workers=2), (THREADS, 2)),  # 2.0's static slots outlive the epoch: the case that failed
    # worker processes asked for, or set so by ``api._lock_mode`` for rows that depend on who reads them: as raw
    ("2.10.0", dict(workers=2, multiprocessing=True), ()),
    ("2.0.0", dict(workers=2, multiprocessing=True), ()),
])
def test_a_new_iterator_reads_in_this_process_only_where_the_call_allows_it(release, asked, expected):
    p = _planned(release, **asked)
    assert p.mode == PROCESSES, p.decisions
    assert p.in_process == expected


def test_a_plan_without_worker_slots_has_nothing_to_fall_back_to():
    p = _planned(multiprocessing=False, workers=2)
    assert p.mode == THREADS and p.in_process == ()

