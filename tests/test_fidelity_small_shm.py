"""Fidelity where ms_shm must change the transport: under Docker's 64 MB /dev/shm, a seeded random source in
worker processes dies raw; through ms_shm it must give the rows raw MindSpore gives with room to spare.

The expectation is raw MindSpore itself, run under a 1 GB /dev/shm with the same seed: MindSpore reseeds each
worker process with ``seed + worker_id``, so switching to threads or one worker would change every row.
"""

from __future__ import annotations

import shlex
import sys

import pytest

from tests import isolated
from tests.conftest import release_skip
from tests.isolated import result_of as result

pytestmark = pytest.mark.mindspore


def run(name: str, mode: str, shm: str):
    """``name`` run ``mode`` (raw, ms_shm) under a ``shm`` /dev/shm. Raw under 64m may hang after its worker's bus
    error (MindSpore's SIGCHLD handler; a matrix run on 2.10 / Python 3.12 waited out the 600 s): it is killed
    after ``RAW_LIMIT``, a failure as the bus error is."""
    code = f"from tests.fidelity_scenarios import run_scenario; run_scenario({name!r}, {mode!r})"
    limit = isolated.RAW_LIMIT if mode == "raw" and shm == "64m" else ""
    return isolated.run_shell(f"exec {limit} {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm=shm,
                              timeout=600)



def test_seeded_random_rows_in_processes_survive_64m_unchanged(real_mindspore):
    from ms_shm.engines import get

    raw_small = run("seeded_processes", "raw", "64m")
    # dynamic slots (2.4+) die of a bus error; static ones (2.0) stop at MindSpore's own pre-check
    static = get().profile().generator_default_max_rowsize_mb
    needle = "Insufficient shared memory available" if static else "Bus error"
    assert raw_small.returncode != 0 and needle in raw_small.stdout + raw_small.stderr, isolated.describe(raw_small)
    expected = result(run("seeded_processes", "raw", "1g"))
    assert len(expected["rows"]) == 48 and len(set(expected["rows"][:24])) == 24
    ours = result(run("seeded_processes", "ms_shm", "64m"))
    assert ours["locked"] and ours["mode"] == "pipes"  # processes kept, rows through pipes instead of slots
    assert ours["rows"] == expected["rows"]


def test_spawn_workers_give_the_same_rows(real_mindspore):
    """Spawned workers unpickle the source (the runtime guard with it, where one is planned)."""
    expected = result(run("spawn", "raw", "1g"))
    if "unsupported" in expected:
        release_skip(f"spawn is not available on this release: {expected['unsupported']}")
    ours = result(run("spawn", "ms_shm", "1g"))
    assert len(expected["rows"]) == 16 and len(set(expected["rows"][:8])) == 8
    assert ours["rows"] == expected["rows"]


def test_a_small_dataset_over_several_epochs_of_one_iterator_fits_its_slots(real_mindspore):
    """A worker cycles through all its slots across the epochs of one iterator, not just the rows of one epoch:
    planned on one epoch's 8 rows per worker (8 slots of 18), an audit's 16 rows of 2 MiB over 3 epochs met
    ``RowTooLargeError`` mid-epoch 2 under 64 MB (2.7.2, 2.8.0), where raw dies."""
    raw_small = run("small_many_epochs", "raw", "64m")
    assert raw_small.returncode != 0, isolated.describe(raw_small)
    expected = result(run("small_many_epochs", "raw", "1g"))
    assert len(expected["rows"]) == 48 and expected["rows"][:16] == expected["rows"][16:32]
    ours = result(run("small_many_epochs", "ms_shm", "64m"))
    assert ours["rows"] == expected["rows"]
