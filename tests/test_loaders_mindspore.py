"""MindSpore 2.8+'s ``mindspore.dataset.dataloader.DataLoader``, raw and through ``ms_shm.build_dataloader``.

With NumPy 1.x (the release matrix's 2.8.0 environment) it runs for real under Docker's 64 MB ``/dev/shm`` and a
starved open-files limit; with NumPy 2 (``pip install mindspore==2.10.0`` brings 2.4) its workers cannot work, so
ms_shm refuses explicit workers with the fix and keeps samples in the main process otherwise.
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import sys

import pytest

from tests import isolated
from tests.conftest import release_skip

pytestmark = [pytest.mark.mindspore, pytest.mark.privileged]


@pytest.fixture(scope="module")
def loader(real_mindspore_module):
    try:
        import mindspore.dataset.dataloader  # noqa: F401
    except ImportError:
        release_skip("MindSpore's DataLoader arrived in 2.8")
    import numpy as np

    return int(np.__version__.split(".")[0])


@pytest.fixture(scope="module")
def real_mindspore_module():
    why = isolated.unavailable() or isolated.mindspore_missing()
    if why:
        pytest.skip(why)
    return isolated


run = functools.partial(isolated.run_loader_scenario, "mindspore")
result = isolated.result_of


def numpy1(major: int) -> None:
    if major >= 2:
        release_skip("MindSpore's DataLoader workers need NumPy 1.x (the release matrix's numpy<2 environments)")


def test_numpy2_workers_fail_raw_and_ms_shm_says_why(loader):
    if loader < 2:
        release_skip("NumPy 1.x here: MindSpore's DataLoader workers work")
    raw = run("persistent", "raw", "2g")  # fails per batch (SystemError), or gets through with NumPy's warning
    assert "compiled using NumPy 1.x" in raw.stderr + raw.stdout, isolated.describe(raw)
    warned = run("persistent", "ms_shm", "2g")  # explicit workers: MindSpore accepts them, ms_shm says why not
    assert "numpy<2" in warned.stderr, isolated.describe(warned)
    ours = result(run("big", "ms_shm", "2g"))  # num_workers not passed: samples stay in the main process
    assert ours["plan"]["workers"] == 0 and len(ours["digests"]) == 8


def test_64m_raw_dies_ms_shm_delivers_every_batch_in_order(loader):
    numpy1(loader)
    expected = result(run("big", "raw", "2g"))["digests"]
    raw = run("big", "raw")
    assert raw.returncode != 0 and "bus error" in (raw.stderr + raw.stdout).lower(), isolated.describe(raw)
    ours = result(run("big", "ms_shm"))
    assert ours["digests"] == expected and ours["plan"]["shm"] <= 64 << 20


def test_epochs_whose_workers_fork_while_the_loop_holds_a_batch_fit_from_the_first_to_the_last(loader):
    """As torch's (``test_loaders_torch``): each epoch's forked workers keep the batch the loop holds mapped, one
    batch more from the second epoch on (a user script under 64 MB ran its first epoch and failed in the second)."""
    numpy1(loader)
    expected = result(run("epochs_held", "raw", "2g"))["digests"]
    # raw's 4 batches of 16 MiB land just at 64 MB: it died in 2.8.0's run and the audit's, and got through once on
    # 2.9.0 (the same DataLoader code), so its failure is not asserted here (torch's test asserts it)
    for mode in ("ms_shm", "patch"):
        ours = result(run("epochs_held", mode))
        assert ours["digests"] == expected and len(expected) == 3 * 16, mode
        assert ours["plan"]["shm"] <= 64 << 20, ours["plan"]


@pytest.mark.parametrize("scenario, batches", [("drawn", 12), ("drawn_persistent", 12), ("drawn_class", 16)])
def test_workers_that_must_stay_deliver_through_their_pipes_where_dev_shm_is_too_small(loader, scenario, batches):
    """As torch's: 32 MiB batches whose samples draw from each worker's NumPy seed (the loader's generator seeded),
    2 workers (and persistent ones), 2 epochs, 64 MB. Fewer workers would change the batches, so each travels
    through its worker's pipe: raw's batches with room to spare, bit for bit, and almost no /dev/shm. Also 24 MiB
    batches as a ``collate_fn``'s own batch class, which the probe weighed as 0 B and the pipes left to
    MindSpore's shared-memory pickling: a bus error, as raw."""
    numpy1(loader)
    reference = result(run(scenario, "raw", "2g"))["digests"]
    raw = run(scenario, "raw", timeout=120)  # the shell's "Bus error", or MindSpore's "Unexpected bus error ..."
    assert raw.returncode != 0 and "bus error" in (raw.stderr + raw.stdout).lower(), isolated.describe(raw)
    isolated.assert_through_pipes(run, scenario, reference, batches)


def test_an_epoch_left_early_ends_its_piped_workers_at_once(loader):
    """Each epoch left after 2 batches: MindSpore's worker joined its result queue's feeder thread at its end,
    and a pickled batch of MiBs still in the pipe, which no one read any more, held it until ``terminate()`` killed
    the worker 5 s later ("failed to join within 5 seconds"): 10 s per epoch left early, with 2 workers (an audit).
    Raw's batches, and no worker left to be killed."""
    numpy1(loader)
    reference = result(run("drawn_break", "raw", "2g"))["digests"]
    for mode in ("ms_shm", "patch"):
        proc = run("drawn_break", mode)
        assert "failed to join" not in proc.stderr, isolated.describe(proc)
        ours = result(proc)
        assert ours["digests"] == reference and len(reference) == 4, mode
        assert any(d.startswith("transport=pipes") for d in ours["plan"]["decisions"]), ours["plan"]


def fd_starved(scenario: str) -> tuple:
    """``(raw's batches with fds to spare, ms_shm's run under ulimit -Sn 256)``, after raw failed there."""
    expected = result(run(scenario, "raw", "1g"))["digests"]
    try:
        raw = run(scenario, "raw", "1g", nofile=256, timeout=90)
        assert raw.returncode != 0, isolated.describe(raw)
    except subprocess.TimeoutExpired:  # out of fds, a worker's queue can block for good: a hang is a failure too
        pass
    return expected, result(run(scenario, "ms_shm", "1g", nofile=256))


def test_fd_starved_soft_limit_raised(loader):
    numpy1(loader)
    expected, ours = fd_starved("many_small")
    assert ours["digests"] == expected


def test_batches_the_program_keeps_raise_the_soft_limit(loader):
    """MindSpore's DataLoader passes a DupFd per storage as torch's file_descriptor does, and a batch the program
    keeps holds it (measured on 2.10: 300 kept batches of 2 workers under ``ulimit -Sn 128``, raw "received 0
    items of ancdata")."""
    numpy1(loader)
    expected, ours = fd_starved("kept")
    assert ours["digests"] == expected
    assert any(d.startswith("RLIMIT_NOFILE") and "keep" in d for d in ours["plan"]["decisions"]), ours["plan"]


def test_iterable_persistent_and_batch_sampler_as_raw(loader):
    numpy1(loader)
    for scenario in ("stream", "persistent"):
        assert result(run(scenario, "ms_shm", "2g"))["digests"] == result(run(scenario, "raw", "2g"))["digests"]

    def go(mode):
        code = f"from tests.loader_scenarios import run_batch_sampler; run_batch_sampler('mindspore', {mode!r})"
        return result(isolated.run_shell(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm="2g"))

    assert go("ms_shm")["digests"] == go("raw")["digests"]



SLOW_SAMPLES_LOOP = """
import time
import numpy as np
from mindspore.dataset.dataloader import DataLoader, Dataset

class Slow(Dataset):
    def __getitem__(self, index):
        time.sleep(2)
        return np.array(index, dtype=np.uint8)

    def __len__(self):
        return 100

if __name__ == "__main__":
    for _ in DataLoader(Slow(), num_workers=4):
        pass
"""


def test_ctrl_c_while_a_loader_waits_ends_the_program_as_raw(loader, tmp_path):
    """MindSpore installs its SIGINT handler at its first fork hook, once; ms_shm's probe put Python's back (a
    GeneratorDataset never runs those hooks raw), so the loader's workers started with Python's: Ctrl-C raised
    ``KeyboardInterrupt`` and the program ended 5.3-6.0 s later (rc -2), where raw's handler ended it at once
    (rc -15; an audit of MindSpore's test_kill_main_process, 2.8, under ``ms-shm run``). The loader's own fork
    now sets MindSpore's handler again."""
    import os
    import signal
    import time

    import psutil

    numpy1(loader)
    script = tmp_path / "slow_loop.py"
    script.write_text(SLOW_SAMPLES_LOOP)
    ends = {}
    for way, command in (("raw", [sys.executable, str(script)]),
                         ("ms_shm", [sys.executable, "-m", "ms_shm", "run", str(script)])):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=isolated.as_from_a_terminal)
        deadline = time.time() + 120
        while len(psutil.Process(proc.pid).children(recursive=True)) < 4 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        kids = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGINT)
        try:
            ends[way] = proc.wait(timeout=60)
        finally:
            for kid in kids:
                try:
                    kid.kill()
                except psutil.Error:
                    pass
    assert ends["ms_shm"] == ends["raw"], ends


def test_numpy2_under_patch_keeps_mindsporeS_checks_of_the_worker_arguments_it_drops(loader):
    """Under NumPy 2 unchanged code's workers are dropped (its samples read in the main process); the worker-only
    arguments went with them unchecked, so ``prefetch_factor=0``, ``timeout=-1``, ``num_workers=-1`` or a bogus
    ``multiprocessing_context``, which raw refuses at the call, were built and ran (an audit of MindSpore's unit
    tests)."""
    if loader < 2:
        release_skip("NumPy 1.x here: MindSpore's DataLoader workers work and are kept")
    import numpy as np
    from mindspore.dataset.dataloader import DataLoader, Dataset

    import ms_shm

    class Samples(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return np.array(i)

    def refusal(**kwargs):
        try:
            DataLoader(Samples(), batch_size=2, **kwargs)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)
        return None

    bad = [dict(num_workers=2, prefetch_factor=0), dict(num_workers=2, timeout=-1), dict(num_workers=-1),
           dict(num_workers=2, multiprocessing_context="bogus")]
    raw = [refusal(**kwargs) for kwargs in bad]
    with ms_shm.patched():
        patched = [refusal(**kwargs) for kwargs in bad]
    assert all(raw) and patched == raw, (raw, patched)
