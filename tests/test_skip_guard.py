"""The skip guard in ``conftest.py``: a required run that did not run the real framework must not be green.

Each case runs pytest in a child on a tiny copy of the suite: this ``conftest.py``, a stand-in ``isolated``
module that says whether a private /dev/shm can be made, and three tests (plain, ``mindspore``-marked, one
using ``private_shm``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

ISOLATED = """
import os
def unavailable():
    return os.environ.get("STUB_UNAVAILABLE") or None
def mindspore_missing():
    return None
"""

TESTS = """
import pytest
def test_plain():
    pass
@pytest.mark.mindspore
def test_real_framework():
    pass
def test_uses_private_shm(private_shm):
    pass
"""

INI = """[pytest]
markers =
    mindspore: runs the real MindSpore dataset engine
    privileged: needs root
"""


@pytest.fixture
def suite(tmp_path):
    pkg = tmp_path / "tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(HERE / "conftest.py", pkg / "conftest.py")
    (pkg / "isolated.py").write_text(ISOLATED)
    (pkg / "test_inner.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text(INI)

    def run(*args: str, require: bool = True, unavailable: str = "") -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MS_SHM_REQUIRE_MINDSPORE", "MS_SHM_REQUIRE_TORCH", "PYTEST_ADDOPTS", "PYTHONPATH")}
        if require:
            env["MS_SHM_REQUIRE_MINDSPORE"] = "1"
        if unavailable:
            env["STUB_UNAVAILABLE"] = unavailable
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                              capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    return run


def test_a_required_run_without_a_real_framework_test_fails_and_says_so(suite):
    r = suite("-k", "plain")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MS_SHM_REQUIRE_MINDSPORE=1 but no real-MindSpore test ran" in r.stdout


def test_deselecting_the_marker_fails_the_run(suite):
    r = suite("-m", "not mindspore")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no real-MindSpore test ran" in r.stdout


def test_a_skipped_privileged_test_fails_the_run_even_without_the_marker(suite):
    """``test_uses_private_shm`` carries no marker: the fixture marks it, so its skip is counted."""
    r = suite(unavailable="not root")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 test(s) marked 'privileged' were skipped and 0 ran" in r.stdout
    assert "privileged: 0 passed, 0 failed, 1 skipped" in r.stdout


def test_a_full_required_run_passes_and_reports_its_counts(suite):
    r = suite()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mindspore: 1 passed, 0 failed, 0 skipped; privileged: 1 passed, 0 failed, 0 skipped" in r.stdout


def test_without_the_variable_a_partial_run_is_left_alone(suite):
    r = suite("-k", "plain", require=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ms_shm:" not in r.stdout
