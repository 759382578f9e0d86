"""Shared fixtures; and the rule that a run which skipped every real-MindSpore test is not a pass."""

from __future__ import annotations

import os

import pytest

from tests import isolated

_outcomes = {"passed": 0, "skipped": 0, "failed": 0}


@pytest.fixture
def private_shm():
    """Skip, with the reason, where a private /dev/shm cannot be made."""
    why = isolated.unavailable()
    if why:
        pytest.skip(f"private /dev/shm unavailable: {why}")
    return isolated


@pytest.fixture
def real_mindspore(private_shm):
    why = isolated.mindspore_missing()
    if why:
        pytest.skip(why)
    return private_shm


def pytest_runtest_logreport(report):
    if "mindspore" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[report.outcome] = _outcomes.get(report.outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    """With MS_SHM_REQUIRE_MINDSPORE=1 (``make test``), fail when real-MindSpore tests were skipped."""
    if os.environ.get("MS_SHM_REQUIRE_MINDSPORE") != "1":
        return
    ran = _outcomes["passed"] + _outcomes["failed"]
    if _outcomes["skipped"] and session.exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.write_line(
                f"ms_shm: {_outcomes['skipped']} real-MindSpore test(s) were skipped and {ran} ran; "
                "MS_SHM_REQUIRE_MINDSPORE=1 makes that a failure", red=True)
        session.exitstatus = 1
