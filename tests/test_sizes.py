"""The rules several tools print, each pinned once: the --shm-size a need rounds to, headroom, fd needs and
targets. Constants are written by hand, not computed by the module under test."""

from __future__ import annotations

import pytest

from ms_shm import sizes
from ms_shm.errors import UsageError

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("nbytes, flag", [
    (0, "64m"), (64 * MiB, "64m"), (64 * MiB + 1, "128m"), (300 * MiB, "512m"), (800 * MiB, "1g"),
    (GiB, "1g"), (GiB + 1, "2g"), (int(6.25 * GiB), "7g"),
])
def test_one_shm_size_rounding(nbytes, flag):
    """The rule doctor, plan, tune, the guard and watch share (it gave 512m, 320m and 300m for one need before)."""
    assert sizes.shm_size_flag(nbytes) == flag


def test_headroom_is_mindspores_own_80_percent():
    assert sizes.HEADROOM == 0.8
    assert sizes.with_headroom(80 * MiB) == 100 * MiB


@pytest.mark.parametrize("text, nbytes", [("64m", 64 * MiB), ("2g", 2 * GiB), ("512Mi", 512 * MiB), ("4096", 4096)])
def test_parse_size(text, nbytes):
    assert sizes.parse_size(text) == nbytes


def test_a_bad_size_is_a_usage_error_and_still_a_value_error():
    with pytest.raises(UsageError):
        sizes.parse_size("lots")
    with pytest.raises(ValueError):
        sizes.parse_size("-1m")


def test_fd_need_counts_open_fds_and_the_margin_once_for_two_pipelines():
    """A train and an eval pipeline: two pipelines' fds, but the process's open fds and margin only once."""
    assert sizes.fds_needed(100, open_fds=30, pipelines=2) == 30 + 8 + 200
    assert sizes.fds_needed(100, open_fds=None) == 108


@pytest.mark.parametrize("need, target", [(10, 65536), (65536, 65536), (65537, 262144), (300000, 1048576)])
def test_nofile_target(need, target):
    assert sizes.nofile_target(need) == target


def test_k8s_spelling():
    assert sizes.k8s_size("512m") == "512Mi" and sizes.k8s_size("7g") == "7Gi"
