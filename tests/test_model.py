"""``ms_shm.model`` against the numbers measured on MindSpore 2.10 (facts sheet sections 3 and 6). Pure.

Every expected value below is a measurement, not the formula run backwards: peaks are the statvfs peaks of
real pipelines (MiB, 2 decimals), crash outcomes are what happened under 64m / 256m / 1g tmpfs mounts, and
fd counts are the main process's extra descriptors.
"""

from __future__ import annotations

import pytest

from ms_shm import model
from ms_shm.engines.mindspore import arithmetic

MiB = model.MiB
LABEL = 4  # the measured rows carried a 4-byte int32 label column next to the data: one more page per slot


def _row(row_mib: float) -> int:
    return int(row_mib * MiB) + LABEL


def _mib(nbytes: int) -> float:
    return round(nbytes / MiB, 2)


# (row MiB, prefetch, dynamic peak MiB, static max_rowsize, static peak MiB) for W=2 and 64 rows (section 3)
W2_PEAKS = [
    (0.5, 2, 4.11, 1, 8.11), (0.5, 4, 6.12, 1, 12.12), (0.5, 16, 18.21, 1, 36.21),
    (1, 2, 8.11, 2, 16.11), (1, 4, 12.12, 2, 24.12), (1, 16, 36.21, 2, 72.21),
    (2, 2, 16.11, 3, 24.11), (2, 4, 24.12, 3, 36.12), (2, 16, 72.21, 3, 108.21),
    (4, 2, 32.11, 5, 40.11), (4, 4, 48.12, 5, 60.12), (4, 16, 144.21, 5, 180.21),
    (8, 2, 64.11, 9, 72.11), (8, 4, 96.12, 9, 108.12), (8, 16, 288.21, 9, 324.21),
    (16, 2, 128.11, 17, 136.11), (16, 4, 192.12, 17, 204.12), (16, 16, 576.21, 17, 612.21),
]


@pytest.mark.parametrize("row_mib, prefetch, dynamic, rowsize, static", W2_PEAKS)
def test_generator_peak_matches_measured_w2_table(row_mib, prefetch, dynamic, rowsize, static):
    row = _row(row_mib)
    assert _mib(model.generator_peak(row, 2, prefetch, rows=64)) == dynamic
    assert model.static_rowsize_for(int(row_mib * MiB)) == rowsize
    assert _mib(model.generator_peak(row, 2, prefetch, rows=64, max_rowsize_mb=rowsize)) == static


def test_generator_peak_is_exact_to_the_byte():
    # 8 MiB + label, W=2, P=2: 2 workers x 4 slots x (8 MiB + 1 page) + (6*2+7) semaphore pages.
    assert model.generator_peak(_row(8), 2, 2, rows=64) == 2 * 4 * (8 * MiB + 4096) + 19 * 4096
    assert model.generator_peak(_row(8), 2, 16, rows=64) == 2 * 18 * (8 * MiB + 4096) + 19 * 4096


# W=4 and W=8 (fake CPU count), 1 MiB rows: the sheet's 16.18/24.21/72.40 and 32.34/32.34/80.53 MiB are
# reached only when every worker fills all of its S slots (rows >= W*S). Re-measured with 64 rows (this
# test's author, statvfs polled every 0.5 ms): P=16 gives 64.37 (W=4) and 64.46 (W=8), since each worker
# then delivers only 16 / 8 rows, fewer than its 18 / 10 slots. P=2/4 are the same either way.
WIDE_PEAKS = [
    (4, 2, 16.18, 16.18), (4, 4, 24.21, 24.21), (4, 16, 72.40, 64.37),
    (8, 2, 32.34, 32.34), (8, 4, 32.34, 32.34), (8, 16, 80.53, 64.46),
]


@pytest.mark.parametrize("workers, prefetch, all_slots, sixty_four_rows", WIDE_PEAKS)
def test_generator_peak_matches_measured_w4_w8(workers, prefetch, all_slots, sixty_four_rows):
    assert _mib(model.generator_peak(_row(1), workers, prefetch)) == all_slots
    assert _mib(model.generator_peak(_row(1), workers, prefetch, rows=256)) == all_slots
    assert _mib(model.generator_peak(_row(1), workers, prefetch, rows=64)) == sixty_four_rows


def test_few_rows_use_few_slots():
    # rows=8, W=2, P=16: measured exactly 4 slots per worker (8.11 MiB for 1 MiB rows).
    assert _mib(model.generator_peak(_row(1), 2, 16, rows=8)) == 8.11


@pytest.mark.parametrize("workers, shared_mem, expected", [
    (1, True, 0),  # in-process: nothing
    (0, True, 0),
    (2, False, 19 * 4096),  # pipes: only the semaphore pages
    (8, False, 55 * 4096),
])
def test_no_slots_without_worker_processes_or_shared_memory(workers, shared_mem, expected):
    assert model.generator_peak(_row(8), workers, 16, rows=64, shared_mem=shared_mem) == expected


@pytest.mark.parametrize("prefetch, workers, q", [
    (16, 2, 16), (16, 4, 16), (16, 8, 8), (4, 8, 2), (2, 8, 2), (1, 2, 2), (1, 1, 2), (16, 1, 16),
])
def test_queue_size(prefetch, workers, q):
    assert model.queue_size(prefetch, workers) == q
    assert model.slots(prefetch, workers) == q + 2


SHM = {"64m": 64 * MiB, "256m": 256 * MiB, "1g": 1024 * MiB}
SIZES = ("64m", "256m", "1g")

# Outcomes under 64m / 256m / 1g from the section 3 table (W=2, 64 rows): dynamic, then static.
OUTCOMES = [
    (0.5, 2, "ok ok ok", "ok ok ok"), (0.5, 4, "ok ok ok", "ok ok ok"), (0.5, 16, "ok ok ok", "ok ok ok"),
    (1, 2, "ok ok ok", "ok ok ok"), (1, 4, "ok ok ok", "ok ok ok"), (1, 16, "ok ok ok", "RTE ok ok"),
    (2, 2, "ok ok ok", "ok ok ok"), (2, 4, "ok ok ok", "ok ok ok"), (2, 16, "BUS ok ok", "RTE ok ok"),
    (4, 2, "ok ok ok", "ok ok ok"), (4, 4, "ok ok ok", "RTE ok ok"), (4, 16, "BUS ok ok", "RTE ok ok"),
    (8, 2, "BUS ok ok", "RTE ok ok"), (8, 4, "BUS ok ok", "RTE ok ok"), (8, 16, "BUS BUS ok", "RTE RTE ok"),
    (16, 2, "BUS ok ok", "RTE ok ok"), (16, 4, "BUS ok ok", "RTE ok ok"),
    (16, 16, "BUS BUS ok", "RTE RTE ok"),
]


def _predict_dynamic(row_mib: float, prefetch: int, free: int) -> str:
    return "BUS" if model.generator_peak(_row(row_mib), 2, prefetch, rows=64) > free else "ok"


def _predict_static(row_mib: float, prefetch: int, free: int) -> str:
    rowsize = model.static_rowsize_for(int(row_mib * MiB))
    return "RTE" if model.static_precheck_fails(2, prefetch, rowsize, free) else "ok"


@pytest.mark.parametrize("row_mib, prefetch, dynamic, static", OUTCOMES)
def test_crash_rules_predict_every_measured_outcome(row_mib, prefetch, dynamic, static):
    assert " ".join(_predict_dynamic(row_mib, prefetch, SHM[s]) for s in SIZES) == dynamic
    assert " ".join(_predict_static(row_mib, prefetch, SHM[s]) for s in SIZES) == static


def test_crash_rules_cover_all_22_measured_crashes():
    predicted = sum(
        (_predict_dynamic(r, p, SHM[s]) != "ok") + (_predict_static(r, p, SHM[s]) != "ok")
        for r, p, _, _ in OUTCOMES for s in SIZES)
    measured = sum(o != "ok" for _, _, d, st in OUTCOMES for o in (d + " " + st).split())
    assert measured == 22
    assert predicted == 22


@pytest.mark.parametrize("workers, prefetch, rowsize, free, device_num, fails", [
    (2, 4, 5, 64 * MiB, 1, True),  # 60 MiB >= 51.2 MiB
    (2, 2, 5, 64 * MiB, 1, False),  # 40 MiB < 51.2 MiB
    (2, 2, 5, 64 * MiB, 2, True),  # device_num multiplies the requirement
    (2, 4, 17, 256 * MiB, 1, False),  # 204 MiB < 204.8 MiB: just passes
    (2, 4, 16, 160 * MiB, 1, True),  # 192 MiB >= 128 MiB
    (2, 2, 8, 80 * MiB, 1, True),  # 64 MiB == 64 MiB: ">=" refuses at exactly 80%
])
def test_static_precheck_threshold(workers, prefetch, rowsize, free, device_num, fails):
    assert model.static_precheck_fails(workers, prefetch, rowsize, free, device_num) is fails


@pytest.mark.parametrize("row_bytes, rowsize, fits", [
    (4 * MiB, 4, False),  # exactly max_rowsize MiB: pickled through the pipe (measured 1.09 s vs 0.29 s)
    (4 * MiB - 1, 4, True),
    (4 * MiB + 1, 5, True),
    (5 * MiB, 5, False),
])
def test_static_row_must_be_strictly_smaller(row_bytes, rowsize, fits):
    assert model.static_row_fits(row_bytes, rowsize) is fits
    assert model.static_row_fits(row_bytes, model.static_rowsize_for(row_bytes))


@pytest.mark.parametrize("version, generator_rowsize, map_transport, map_rowsize, map_checks, rowsize_dep, "
                         "switch_dep", [
                             ("2.2", 6, "shm-pool", 16, True, False, False),
                             ("2.3.1", 6, "shm-pool", 16, True, False, False),
                             ("2.5", None, "shm-pool", None, True, False, False),
                             ("2.7.0", None, "sysv", None, True, True, False),
                             ("2.10.0", None, "sysv", None, False, True, True),
                             (None, None, "sysv", None, False, True, True),
                             ("garbage", None, "sysv", None, False, True, True),
                         ])
def test_profile_for(version, generator_rowsize, map_transport, map_rowsize, map_checks, rowsize_dep,
                     switch_dep):
    p = model.profile_for(version)
    assert p.version == version
    assert p.generator_default_max_rowsize_mb == generator_rowsize
    assert p.map_transport == map_transport
    assert p.map_default_max_rowsize_mb == map_rowsize
    assert p.map_checks_dev_shm is map_checks
    assert p.max_rowsize_deprecated is rowsize_dep
    assert p.shared_mem_switch_deprecated is switch_dep
    assert p.note


@pytest.mark.parametrize("version", [None, "garbage", ""])
def test_unknown_version_says_so(version):
    assert "unknown" in model.profile_for(version).note


@pytest.mark.parametrize("version, parsed", [
    ("2.10.0", (2, 10)), ("2.3.1", (2, 3)), ("2.7.0rc1", (2, 7)), ("v2", None), (None, None), ("", None),
])
def test_parse_version(version, parsed):
    assert model.parse_version(version) == parsed


# Main-process fds added, 1 MiB rows, 64 rows (measured; the W=4/W=8 cases with a fake CPU count).
FDS = [(2, 16, 53), (2, 2, 25), (2, 4, 29), (4, 16, 92), (8, 16, 116), (8, 2, 85)]


@pytest.mark.parametrize("workers, prefetch, measured", FDS)
def test_generator_fds_match_measurements(workers, prefetch, measured):
    assert abs(model.generator_fds(workers, prefetch, rows=64) - measured) <= 2


@pytest.mark.parametrize("workers, prefetch, rows, expected", [
    (1, 16, 64, 0),
    (2, 16, None, 5 + 2 * (6 + 18)),
    (4, 16, 256, 101),  # measured 101 with 256 rows: every slot in use
])
def test_generator_fds_edges(workers, prefetch, rows, expected):
    assert model.generator_fds(workers, prefetch, rows) == expected


def test_pipes_need_no_slot_fds():
    assert model.generator_fds(2, 16, 64, shared_mem=False) == model.FD_BASE + 2 * model.FD_PER_WORKER


@pytest.mark.parametrize("version, workers, out_bytes, dev_shm, sysv", [
    # 2.10: 8 MiB output -> two 8 MiB SysV segments, only the semaphore pages in /dev/shm (68 KiB)
    ("2.10.0", 2, 8 * MiB, 17 * 4096, 2 * (8 * MiB + 4096)),
    # <=2.3: six 16 MiB slots per worker in /dev/shm
    ("2.3", 1, 8 * MiB, 6 * 16 * MiB + 17 * 4096, 0),
    ("2.3", 2, 1 * MiB, 2 * 6 * 16 * MiB + 17 * 4096, 0),
])
def test_map_pool_cost(version, workers, out_bytes, dev_shm, sysv):
    cost = model.map_pool_cost(model.profile_for(version), workers, 1024, out_bytes)
    assert (cost.dev_shm, cost.sysv) == (dev_shm, sysv)


def test_a_dev_shm_map_pool_with_shared_memory_off_sends_rows_through_pipes():
    """2.0-2.6 honour ``set_enable_shared_mem(False)`` for a map's pool (rows through pipes, no pre-check): an
    audit's 2.0 ``map`` of 8 MiB rows was refused in 64 MB where raw ran with it off. SysV segments ignore it."""
    old, new = model.profile_for("2.0.0"), model.profile_for("2.10.0")
    assert model.map_pool_cost(old, 2, MiB, 8 * MiB, shared_mem=False) == model.MapCost(17 * 4096, 0, 0)
    assert model.map_precheck_bytes(old, 2, 16, shared_mem=False) == 0
    assert model.map_pool_cost(new, 2, MiB, 8 * MiB, shared_mem=False) == model.map_pool_cost(new, 2, MiB, 8 * MiB)


def test_map_pool_of_no_workers_costs_nothing():
    assert model.map_pool_cost(model.profile_for("2.10"), 0, MiB, MiB) == model.MapCost(0, 0, 0)
    assert model.map_fds(0) == 0


# (mode, prefetch, rows, the largest rss + shmem MiB a 2-worker GeneratorDataset of 8 MiB rows added on
# MindSpore 2.10, its reader slower than the workers so every queue fills), worker processes' pages 12 MiB each.
# 48 rows: 5-6 runs each, the cgroup's rss + shmem. 120 rows, a reader sleeping 80 ms per row (a training step):
# the main process's RSS, threads 41.4 and 54.4 rows' worth (a 1000 MiB container planned on the older rule, 40
# rows, was OOM-killed at 16 MiB rows).
MEMORY_PEAKS = [("threads", 4, 120, 347), ("threads", 16, 120, 451),
                ("processes", 2, 48, 152), ("processes", 5, 48, 224), ("processes", 16, 48, 481),
                ("inline", 2, 48, 57), ("inline", 16, 48, 153)]


@pytest.mark.parametrize("mode, prefetch, rows, measured", MEMORY_PEAKS)
def test_generator_memory_covers_the_measured_peak_with_a_full_queue(mode, prefetch, rows, measured):
    workers, row = (1 if mode == "inline" else 2), 8 * MiB
    shm = arithmetic.generator_peak(row, workers, prefetch, rows, None, shared_mem=True) if mode == "processes" else 0
    predicted = arithmetic.generator_memory(mode, row, workers, prefetch, shm, 12 * MiB, rows) / MiB
    assert measured * 0.9 <= predicted <= measured * 1.25, predicted


# (workers, prefetch, output rows' worth the main process held: a map growing rows to 8 MiB, 120 rows, a reader
# sleeping 80 ms per row, MindSpore 2.10, threads; processes held 31.5 and 54.5 at prefetch 8 and 16)
MAP_ROWS_HELD = [(2, 4, 17.0), (2, 11, 38.4), (2, 16, 53.5), (1, 16, 36.4), (2, 8, 31.5)]


@pytest.mark.parametrize("workers, prefetch, measured", MAP_ROWS_HELD)
def test_map_rows_in_flight_cover_the_measured_peak(workers, prefetch, measured):
    """The older rule (prefetch + 4 workers + 4: 23 rows at 11) let a 700 MiB container be OOM-killed."""
    assert measured <= arithmetic.map_rows_in_flight(workers, prefetch) <= measured * 1.2
