"""Every script in ``examples/`` runs to the end on real MindSpore (the README's ``make demo`` is one of them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import isolated

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))

pytestmark = pytest.mark.mindspore


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    why = isolated.mindspore_missing()
    if why:
        pytest.skip(why)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=str(script.parent.parent))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
