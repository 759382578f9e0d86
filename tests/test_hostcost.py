"""``ms_shm.hostcost``: this host's copy and pipe costs, and the planner's per-row costs scaled by them."""

from __future__ import annotations

import pytest

from ms_shm import hostcost
from ms_shm.engines.mindspore.planning import Costs
from ms_shm.plan import INLINE, PIPES, PROCESSES, THREADS

MiB = 1 << 20


def test_ratios_against_the_reference_machine():
    same = hostcost.TransferCosts(hostcost.REFERENCE_COPY_S_PER_MIB, hostcost.REFERENCE_PIPE_S_PER_MIB)
    assert same.copy_ratio == pytest.approx(1.0) and same.pipe_ratio == pytest.approx(1.0)
    unknown = hostcost.TransferCosts(None, None, "not measured")
    assert unknown.copy_ratio == unknown.pipe_ratio == 1.0
    noise = hostcost.TransferCosts(1.3 * hostcost.REFERENCE_COPY_S_PER_MIB, 0.8 * hostcost.REFERENCE_PIPE_S_PER_MIB)
    assert noise.copy_ratio == noise.pipe_ratio == 1.0  # within one machine's run-to-run spread


def test_costs_scale_their_per_mib_part_only():
    slow = hostcost.TransferCosts(2 * hostcost.REFERENCE_COPY_S_PER_MIB, 3 * hostcost.REFERENCE_PIPE_S_PER_MIB)
    ref, here = Costs(), Costs().on_this_host(slow)
    for mode in (INLINE, THREADS, PROCESSES):
        assert here.row(mode, 0) == pytest.approx(ref.row(mode, 0))  # the constant part stays
        assert here.row(mode, MiB) - here.row(mode, 0) == pytest.approx(2 * (ref.row(mode, MiB) - ref.row(mode, 0)))
    assert here.row(PIPES, MiB) - here.row(PIPES, 0) == pytest.approx(3 * (ref.row(PIPES, MiB) - ref.row(PIPES, 0)))


def test_measure_gives_positive_figures_once_per_process():
    first = hostcost.measure()
    assert first.copy_s_per_mib > 0 and first.pipe_s_per_mib > 0
    assert hostcost.measure() is first


def test_small_rows_and_short_epochs_use_the_reference():
    assert "small" in hostcost.for_rows(1024, 10.0).note
    assert "short" in hostcost.for_rows(8 * MiB, 0.1).note and hostcost.for_rows(8 * MiB, None).copy_ratio == 1.0
    assert hostcost.for_rows(8 * MiB, 5.0) is hostcost.measure()
