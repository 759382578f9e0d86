"""Benchmarks time ms_shm as an installed user runs it: byte-compiled.

``pip install`` compiles a package's bytecode; an editable checkout run under ``PYTHONDONTWRITEBYTECODE=1`` (set
on these machines) never writes it, so every benchmark child would compile ms_shm's sources again (~0.1-0.2 s, a
cost no installed user pays, and more than a short epoch's 5%). MindSpore's and torch's own bytecode was compiled
by pip.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def compile_bytecode(package: Path, python: str = sys.executable) -> None:
    """Byte-compile ``package`` for ``python`` (the interpreter the children run)."""
    subprocess.run([python, "-m", "compileall", "-q", str(package)], check=True)
