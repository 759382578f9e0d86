"""Each release's behaviour, pinned where it is kept (``engines/mindspore/profiles.py``), and the rules that
read it. Figures are the measured ones of ``shared/MINDSPORE_SHM_FACTS.md``, written by hand."""

from __future__ import annotations

import pytest

from ms_shm.budget import Budget
from ms_shm.engines.mindspore import arithmetic, planning
from ms_shm.engines.mindspore.profiles import profile_for
from ms_shm.errors import ShmBudgetError
from ms_shm.plan import Request

MiB = 1 << 20


@pytest.mark.parametrize("version, static, transport, precheck_error", [
    ("2.0.0", 6, "shm-pool", "Exception"),
    ("2.3.1", 6, "shm-pool", "RuntimeError"),
    ("2.5.0", None, "shm-pool", "RuntimeError"),
    ("2.7.2", None, "sysv", "RuntimeError"),
    ("2.8.0", None, "sysv", "RuntimeError"),
    ("2.10.0", None, "sysv", "RuntimeError"),
    (None, None, "sysv", "RuntimeError"),
])
def test_release_profiles(version, static, transport, precheck_error):
    p = profile_for(version)
    assert (p.generator_default_max_rowsize_mb, p.map_transport, p.precheck_error) == (static, transport,
                                                                                      precheck_error)


def test_the_2_7_map_precheck_is_what_mindspore_asked_for():
    """2.7.2, 2 map workers, max_rowsize=16: MindSpore raised with 'Required: 201326592' under a 64 MB /dev/shm."""
    assert arithmetic.map_precheck_bytes(profile_for("2.7.2"), 2, 16) == 201326592
    assert arithmetic.map_precheck_bytes(profile_for("2.10.0"), 2, 16) == 0  # 2.8+ no longer checks


def test_plan_map_refuses_processes_the_2_7_precheck_would_stop():
    budget = Budget(int(0.8 * 64 * MiB), None, 1, 0.8, 0, 0, "test")
    req = Request(workers=2, multiprocessing=True, max_rowsize=16, cpu_count=2, usable_cpus=2)
    with pytest.raises(ShmBudgetError, match="map pre-check asks for 192.0 MiB"):
        planning.plan_map(MiB, MiB, None, None, 64, req, budget, profile_for("2.7.2"))
    p = planning.plan_map(MiB, MiB, None, None, 64, req, budget, profile_for("2.10.0"))
    assert p.mode == "processes"


@pytest.mark.parametrize("version, modeled", [("2.0", True), ("2.7.1", True), ("2.10", True), ("2.11", False),
                                              ("1.8", False), ("banana", False), ("2.10.0.1", False)])
def test_the_modeled_releases_are_one_span_kept_by_the_profiles(version, modeled):
    from ms_shm.engines.mindspore import profiles

    assert profiles.is_modeled(version) is modeled
    assert profiles.modeled_releases()[0] == "2.0" and profiles.modeled_releases()[-1] == "2.10"
