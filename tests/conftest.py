"""Shared fixtures; and the rule that a required run which did not exercise the real framework is not a pass.

With ``MS_SHM_REQUIRE_MINDSPORE=1`` (``make test``, ``.ci/run``) the run fails unless at least one test marked
``mindspore`` actually ran (passed or failed), and fails if any test marked ``mindspore`` or ``privileged`` was
skipped. Deselecting them (``-m``, ``-k``, one file, ``PYTEST_ADDOPTS``) therefore fails the run instead of
leaving it green. Tests that use the ``private_shm`` fixture (directly or through ``real_mindspore``) are marked
``privileged`` here, and those using ``real_mindspore`` ``mindspore``, so none can skip uncounted.

Each framework is one entry of ``REQUIRED_FRAMEWORKS`` (marker -> environment variable, name); a ``torch``
marker required by ``MS_SHM_REQUIRE_TORCH=1`` is one more entry there (plus its marker in pyproject.toml).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest

from tests import isolated

# marker -> (the variable that makes a run fail unless tests with that marker ran and none skipped, its name)
REQUIRED_FRAMEWORKS = {"mindspore": ("MS_SHM_REQUIRE_MINDSPORE", "MindSpore"), "torch": ("MS_SHM_REQUIRE_TORCH", "torch")}
# markers whose skips fail a required run, without themselves being required to run
COUNTED_ONLY = ("privileged",)
# fixture -> the markers a test using it gets, so that it is counted whichever way it was written
FIXTURE_MARKERS = {"private_shm": ("privileged",), "real_mindspore": ("mindspore", "privileged")}

_final: dict = {}  # nodeid -> (markers, outcome): "failed" beats "skipped" beats "passed"
_RANK = {"passed": 0, "release": 0, "skipped": 1, "failed": 2}
# A skip whose reason carries this tag is a difference of the installed MindSpore release (2.0 has no
# ``dataset[i]``, gives a generator object once): the test has nothing to compare there, which is not a
# missing environment, so it does not fail a required run. ``release_skip(why)`` makes one.
RELEASE_TAG = "[not on this MindSpore release]"


def release_skip(why: str) -> None:
    pytest.skip(f"{RELEASE_TAG} {why}")
_verdict: list = []  # the lines pytest_terminal_summary prints


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, markers in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                for marker in markers:
                    if item.get_closest_marker(marker) is None:
                        item.add_marker(marker)


def _counted_markers() -> tuple:
    return (*REQUIRED_FRAMEWORKS, *COUNTED_ONLY)


def pytest_runtest_logreport(report):
    markers = tuple(m for m in _counted_markers() if m in report.keywords)
    if not markers:
        return
    outcome = report.outcome
    if outcome == "skipped" and RELEASE_TAG in str(report.longrepr):
        outcome = "release"
    if report.when == "call" or outcome != "passed":  # a setup skip or any failure decides too
        _, before = _final.get(report.nodeid, (markers, "passed"))
        if report.nodeid not in _final or _RANK[outcome] > _RANK[before]:
            _final[report.nodeid] = (markers, outcome)


def counts() -> dict:
    """marker -> Counter of final outcomes ("passed", "failed", "skipped") of the tests carrying it."""
    out = {marker: Counter() for marker in _counted_markers()}
    for markers, outcome in _final.values():
        for marker in markers:
            out[marker][outcome] += 1
    return out


def verdict(environ=os.environ) -> list:
    """Why this run must fail under the variables set in ``environ``; empty when it may pass."""
    required = [marker for marker, (var, _) in REQUIRED_FRAMEWORKS.items() if environ.get(var) == "1"]
    if not required:
        return []
    found = counts()
    problems = []
    for marker in required:
        ran = found[marker]["passed"] + found[marker]["failed"]
        var, name = REQUIRED_FRAMEWORKS[marker]
        if ran == 0:
            problems.append(f"{var}=1 but no real-{name} test ran ({found[marker]['skipped']} skipped, none passed "
                            f"or failed): select tests marked '{marker}' (this is not a pass)")
    for marker in (*required, *COUNTED_ONLY):
        if found[marker]["skipped"]:
            ran = found[marker]["passed"] + found[marker]["failed"]
            problems.append(f"{found[marker]['skipped']} test(s) marked '{marker}' were skipped and {ran} ran; "
                            f"{', '.join(REQUIRED_FRAMEWORKS[m][0] + '=1' for m in required)} makes a skip a failure")
    return problems


def pytest_sessionfinish(session, exitstatus):
    """With a framework required (``make test``), fail the run when the checks above say so."""
    _verdict[:] = verdict()
    if _verdict and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _verdict and session.config.pluginmanager.get_plugin("terminalreporter") is None:
        for line in _verdict:
            print("ms_shm: " + line, file=sys.stderr)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    found = counts()
    if any(var in os.environ for var, _ in REQUIRED_FRAMEWORKS.values()):
        terminalreporter.write_line("ms_shm: " + "; ".join(
            f"{marker}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
            + (f", {c['release']} not on this release" if c["release"] else "")
            for marker, c in found.items()
            if sum(c.values()) or os.environ.get(REQUIRED_FRAMEWORKS.get(marker, ("",))[0]) == "1"))
    for line in _verdict:
        terminalreporter.write_line("ms_shm: " + line, red=True)
