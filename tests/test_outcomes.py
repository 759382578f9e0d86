"""``engines/mindspore/outcomes``: what each release does with a pipeline at a /dev/shm size (``ms-shm plan``'s
table, ``doctor``'s typical figure). Pure, so no MindSpore and no root.

Expected peaks are worked out by hand from the facts sheet's formulas (shared/MINDSPORE_SHM_FACTS.md sections 3, 6
and 10), never from ``arithmetic``:
  Q = max(2, min(P, 4P // W)), S = Q + 2 slots per worker, semaphores (6W + 7) pages
  dynamic (2.4+): peak = W * S * ceil(B / page) * page + (6W + 7) * page
  static (<= 2.3): peak = W * S * (6 MiB + page) + (6W + 7) * page
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ms_shm import engines, sizes
from ms_shm.engines.mindspore import outcomes, profiles
from tests.fakes import host_facts

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096
PEAK_W8_8MIB = 8 * 10 * 8 * MiB + 55 * PAGE  # W=8, P=16: Q = 8, S = 10
PEAK_W8_STATIC6 = 8 * 10 * (6 * MiB + PAGE) + 55 * PAGE


def facts(**kw):
    """Docker's default 64 MiB /dev/shm on an otherwise roomy host."""
    return host_facts(**{"shm_total": 64 * MiB, "shm_free": 64 * MiB, **kw})


@pytest.mark.parametrize("version, peak, outcome", [
    ("2.0", PEAK_W8_STATIC6, "Exception at launch: 'Insufficient shared memory available'"),
    ("2.3", PEAK_W8_STATIC6, "RuntimeError at launch: 'Insufficient shared memory available'"),
    ("2.10", PEAK_W8_8MIB, "Bus error when /dev/shm fills"),
])
def test_each_release_fails_its_own_way_in_64m(version, peak, outcome):
    o = outcomes.outcome(8 * MiB, 8, 16, 1, 64 * MiB, version)
    assert (o.per_rank, o.all_ranks, o.fits) == (peak, peak, False)
    assert o.outcome.startswith(outcome)
    assert o.failure == outcome and outcome in o.why


def test_failure_wording_comes_from_the_profile():
    """The tools never branch on a version: change the profile and every word follows."""
    static = dataclasses.replace(profiles.profile_for("2.3"), precheck_error="ValueError")
    dynamic = dataclasses.replace(profiles.profile_for("2.10"), dynamic_failure="SIGSEGV when /dev/shm fills")
    assert outcomes.failure(static) == "ValueError at launch: 'Insufficient shared memory available'"
    assert outcomes.failure(dynamic) == "SIGSEGV when /dev/shm fills"
    assert "ValueError" in outcomes.why_it_fails(static) and "SIGSEGV" in outcomes.why_it_fails(dynamic)


def test_static_slots_ignore_the_row_and_pickle_large_rows():
    small = outcomes.outcome(MiB, 8, 16, 1, 10 * GiB, "2.3")
    large = outcomes.outcome(8 * MiB, 8, 16, 1, 10 * GiB, "2.3")
    assert small.per_rank == large.per_rank == PEAK_W8_STATIC6 and small.slot_mb == 6
    assert small.outcome == "fits" and "pickled through pipes" in large.outcome and large.fits


def test_pre_check_counts_ranks_up_to_eight():
    # 8 workers x 10 slots x 6 MiB = 480 MiB per rank; the check multiplies by min(ranks, 8) against 80% free
    assert outcomes.outcome(MiB, 8, 16, 2, 1300 * MiB, "2.3").fits  # 960 MiB < 1040 MiB
    assert not outcomes.outcome(MiB, 8, 16, 2, 1100 * MiB, "2.3").fits  # 960 MiB >= 880 MiB


def test_dynamic_headroom_band_and_unknowns():
    band = outcomes.outcome(8 * MiB, 8, 16, 1, int(PEAK_W8_8MIB * 1.1), "2.10")
    assert band.fits and "without the 20% headroom" in band.outcome
    assert not outcomes.outcome(8 * MiB, 8, 16, 1, None, "2.10").fits
    assert "unknown" in outcomes.outcome(8 * MiB, 8, 16, 1, None, "2.3").outcome
    one = outcomes.outcome(8 * MiB, 1, 16, 1, 0, "2.10")
    assert (one.per_rank, one.fits, one.need, one.size) == (0, True, 0, None)


def test_need_and_size_are_the_sizes_rules():
    o = outcomes.outcome(8 * MiB, 8, 16, 8, None, "2.10")
    assert o.all_ranks == 8 * PEAK_W8_8MIB and o.need == sizes.with_headroom(o.all_ranks)
    assert o.size == sizes.shm_size_flag(o.need) == "7g"  # MindSpore's "5 GB", with headroom


def test_map_pool_per_release():
    new, old = (outcomes.outcome(8 * MiB, 8, 16, 1, None, v).map for v in ("2.10", "2.3"))
    assert (new.transport, new.sysv_segment) == ("sysv", 8 * MiB + PAGE) and "SysV" in new.where
    assert (old.transport, old.sysv, old.dev_shm) == ("shm-pool", 0, 8 * 6 * 16 * MiB + 17 * PAGE)


def test_outcome_is_a_json_ready_frozen_result():
    o = outcomes.outcome(8 * MiB, 8, 16, 1, 64 * MiB, "2.3")
    data = json.loads(json.dumps(o.to_dict()))
    assert {"version", "profile", "transport", "per_rank", "all_ranks", "outcome", "fits", "map"} <= set(data)
    assert set(data["map"]) >= {"dev_shm", "sysv", "sysv_segment", "transport"} and "release" not in data
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.fits = True


def test_the_engine_answers_with_outcomes():
    engine = engines.get("mindspore")
    assert engine.outcome(8 * MiB, 8, 16, 1, 64 * MiB, "2.3") == outcomes.outcome(8 * MiB, 8, 16, 1, 64 * MiB, "2.3")
    assert {s.engine for s in engine.signatures("2.0")} == {"mindspore"}


def test_table_versions():
    assert outcomes.table_versions("2.10.0") == profiles.KNOWN_VERSIONS
    assert outcomes.table_versions("2.0") == profiles.KNOWN_VERSIONS + ("2.0",)


def test_what_if_report():
    report = outcomes.what_if(facts(), 8 * MiB, 8, 16, ranks=8, shm=64 * MiB)
    data = json.loads(json.dumps(report.to_dict()))
    assert list(data) == ["input", "shm", "versions", "plan", "plan_note", "fits"]
    assert data["input"] == {"row_bytes": 8 * MiB, "workers": 8, "prefetch": 16, "ranks": 8, "mindspore": "2.10.0",
                             "rows": None}
    assert data["shm"] == {"total": 64 * MiB, "free": 64 * MiB, "source": "given with --shm"}
    assert report.asked.version == "2.10" and report.asked.per_rank == PEAK_W8_8MIB
    assert data["fits"] is False and data["plan"]["mode"] == "threads" and data["plan_note"] is None
    old = outcomes.what_if(facts(mindspore_version=None), 8 * MiB, 8, 16, version="2.0")
    assert [o.version for o in old.versions] == list(profiles.KNOWN_VERSIONS) + ["2.0"]
    assert old.asked.outcome.startswith("Exception at launch") and old.shm.source == "this host's /dev/shm"
