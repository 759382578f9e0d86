"""Which mode a new iterator beside a live one may go back to: pure, no framework."""

from __future__ import annotations

import pytest

from ms_shm.engines.mindspore.second_iterator import own_mode
from ms_shm.plan import INLINE, PIPES, PROCESSES, THREADS, Decision


@pytest.mark.parametrize("chosen, own, expected", [
    (PROCESSES, INLINE, INLINE),  # MindSpore's default (one worker, its own thread), replaced by ms_shm
    (PROCESSES, THREADS, THREADS),  # python_multiprocessing=False asked, or MindSpore's default with workers
    (PROCESSES, PROCESSES, None),  # the caller's worker processes (or MindSpore's own): as raw, unchanged
    (PIPES, PROCESSES, None),  # MindSpore's own mode was processes: nothing of the caller's to go back to
    (THREADS, INLINE, None),  # no worker processes, no slots
])
def test_only_a_mode_ms_shm_chose_in_place_of_mindsporeS_own_goes_back_to_it(chosen, own, expected):
    decisions = (Decision("prefetch_size", 4, 16, "-"), Decision("mode", chosen, own, "-"))
    assert own_mode(decisions) == expected


def test_no_mode_decision_changes_nothing():
    assert own_mode((Decision("prefetch_size", 4, 16, "-"),)) is None
