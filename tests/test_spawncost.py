"""``ms_shm.spawncost``: a spawned worker's own memory is a fresh interpreter's with the packages imported again,
measured, not the forked probe child's."""

from __future__ import annotations

import json  # noqa: F401  (a standard-library module this process has imported)
import logging

import numpy as np  # noqa: F401  (an installed package this process has imported)

from ms_shm import procfs, spawncost
from ms_shm.spawncost import SpawnedWorker


def test_the_packages_a_spawned_worker_imports_again_are_the_libraries_not_the_programs(monkeypatch):
    """site-packages and folders on ``PYTHONPATH`` (``pip install --target``) are libraries; the standard library
    and the program's own folder are not imported again in the fresh interpreter."""
    import os
    import sys
    import types

    monkeypatch.setattr(spawncost, "_program_folder", lambda: os.path.join(os.path.dirname(
        os.path.dirname(os.path.realpath(__file__))), ""))  # the repository: ``tests`` is the program's
    target = types.ModuleType("vendored")
    target.__file__ = "/opt/deps/vendored/__init__.py"  # pip install --target /opt/deps
    monkeypatch.setitem(sys.modules, "vendored", target)
    packages = spawncost.imported_packages()
    assert "numpy" in packages and "vendored" in packages, packages
    assert "json" not in packages and "tests" not in packages, packages


def test_a_fresh_interpreter_with_numpy_holds_memory_of_its_own():
    fresh = spawncost.measure.__wrapped__()
    assert fresh.why is None and fresh.private_bytes > (1 << 20) and "numpy" in fresh.modules, fresh


def test_forked_workers_keep_the_probe_childs_figure_and_spawned_ones_take_the_larger(monkeypatch):
    monkeypatch.setattr(spawncost, "measure", lambda: SpawnedWorker(100 << 20, ("numpy",)))
    assert spawncost.worker_bytes("fork", 5 << 20) == 5 << 20
    assert spawncost.worker_bytes("spawn", 5 << 20) == 100 << 20
    assert spawncost.worker_bytes("forkserver", None) == 100 << 20
    assert spawncost.worker_bytes("spawn", 200 << 20) == 200 << 20


def test_a_measurement_that_failed_prices_a_worker_at_this_process_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(spawncost, "measure", lambda: SpawnedWorker(None, why="not measured (TimeoutExpired)"))
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        priced = spawncost.worker_bytes("spawn", 5 << 20)
    assert priced >= max(5 << 20, (procfs.private_bytes() or 0) // 2)  # this process: tens of MiB
    assert "not measured (TimeoutExpired)" in caplog.text and "this process's own memory" in caplog.text
