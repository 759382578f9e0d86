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


# One large row the probe does not read among 1 MiB rows, 2 worker processes, and a setting the program changes
# after building: raw ran each of these in 64 MB (audits, 3 of 3), and ms_shm's guard stopped them counting the
# slots the plan was made for.
AFTER_BUILDING = """
import hashlib, json, sys
import numpy as np
import mindspore.dataset as ds
case, mode = sys.argv[1], sys.argv[2]
rows, big, mib = (80, 60, 20) if case == "late_row" else (40, 3, 34)

class Rows:
    def __len__(self):
        return rows
    def __getitem__(self, i):
        return (np.full((mib if i == big else 1) << 20, i % 251, np.uint8),)

kw = dict(shuffle=False, num_parallel_workers=2, python_multiprocessing=True)
if mode == "ms_shm":
    import ms_shm
    ms_shm.tune()
    dataset = ms_shm.build_dataset(Rows(), ["data"], **kw)
else:
    dataset = ds.GeneratorDataset(Rows(), ["data"], **kw)
if case == "prefetch_after":
    ds.config.set_prefetch_size(2)
if case == "shared_memory_off_after":
    ds.config.set_enable_shared_mem(False)
out = [hashlib.sha256(r[0].tobytes()).hexdigest() for r in dataset.create_tuple_iterator(output_numpy=True,
                                                                                       num_epochs=1)]
print("RESULT " + json.dumps({"rows": out}), flush=True)
"""


@pytest.mark.parametrize("case", ["prefetch_after", "shared_memory_off_after", "late_row"])
def test_a_large_row_after_settings_changed_after_building_arrives_as_raws(real_mindspore, tmp_path, case):
    """The prefetch lowered to 2 (4 slots a worker, not the planned 18) or shared memory turned off after
    building, with one 34 MiB row; or a 20 MiB row 60 of 80, when every worker has made its 18 slots: ms_shm in
    64 MB gives the rows raw MindSpore gives (raw in 1 GB, the expectation)."""
    from ms_shm.engines import get

    if get().profile().generator_default_max_rowsize_mb:
        release_skip("static slots: no runtime guard on this release")
    script = tmp_path / "after_building.py"
    script.write_text(AFTER_BUILDING)

    def go(mode: str, shm: str):
        return isolated.run_shell(f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} {case} {mode}",
                                  shm=shm, timeout=600)

    expected = result(go("raw", "1g"))
    assert len(expected["rows"]) == (80 if case == "late_row" else 40)
    assert result(go("ms_shm", "64m"))["rows"] == expected["rows"]
