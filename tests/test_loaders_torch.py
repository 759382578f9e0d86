"""PyTorch's DataLoader, raw and through ``ms_shm.build_dataloader``, in a private namespace: Docker's 64 MB
``/dev/shm``, a starved open-files limit, spawn, iterable datasets, batch samplers, persistent workers, and a
batch that outgrows its plan. Raw failures are asserted; ms_shm's batches must be the raw loader's, in order
(the reference is raw torch with room to spare).
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import sys

import pytest

from tests import isolated

pytestmark = [pytest.mark.torch, pytest.mark.privileged]


@pytest.fixture(scope="module")
def real_torch():
    why = isolated.unavailable()
    if why:
        pytest.skip(f"private /dev/shm unavailable: {why}")
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"torch is not installed ({exc}): pip install 'ms_shm[torch]'")
    return isolated


run = functools.partial(isolated.run_loader_scenario, "torch")
result = isolated.result_of


def raw_fails(scenario: str, **kw) -> str:
    """How raw torch fails: its error text, or "hang" (out of fds, a worker's queue feeder can block for good:
    measured under ``ulimit -Sn 256``)."""
    try:
        proc = run(scenario, "raw", timeout=90, **kw)
    except subprocess.TimeoutExpired:
        return "hang"
    assert proc.returncode != 0, isolated.describe(proc)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(real_torch):
    """Raw torch with room to spare: the batches every run must deliver."""
    return {name: result(run(name, "raw", "2g"))["digests"] for name in ("big", "many_small", "stream", "persistent")}


def test_64m_raw_torch_dies_ms_shm_delivers_every_batch_in_order(reference):
    failed = raw_fails("big")  # ENOSPC or SIGBUS; or a hang: a worker blocked on a full /dev/shm (seen in CI)
    assert failed == "hang" or "No space left on device" in failed or "Bus error" in failed, failed[-3000:]
    ours = result(run("big", "ms_shm"))
    assert ours["digests"] == reference["big"]
    assert ours["plan"]["shm"] <= 64 << 20


def test_spawn_gives_the_same_batches(reference):
    ours = result(run("big_spawn", "ms_shm", "2g"))
    assert ours["digests"] == reference["big"] and ours["plan"]["workers"] >= 1


def test_fd_starved_soft_limit_raw_dies_ms_shm_raises_the_soft_limit(reference):
    how = raw_fails("many_small", shm="1g", nofile=256)
    assert how == "hang" or "Too many open files" in how, how[-2000:]
    ours = result(run("many_small", "ms_shm", "1g", nofile=256))
    assert ours["digests"] == reference["many_small"]


def test_fd_starved_hard_limit_switches_to_file_system(reference):
    raw_fails("many_small", shm="1g", nofile=256, hard=256)
    ours = result(run("many_small", "ms_shm", "1g", nofile=256, hard=256))
    assert ours["digests"] == reference["many_small"]
    assert ours["strategy"] == "file_system"  # tune() at start-up (hard limit < 4096), or build_dataloader


def test_iterable_dataset_and_persistent_workers_as_raw(reference):
    assert result(run("stream", "ms_shm", "2g"))["digests"] == reference["stream"]
    ours = result(run("persistent", "ms_shm", "2g"))
    assert ours["digests"] == reference["persistent"] and ours["plan"]["workers"] == 2


def test_batch_sampler_as_raw(real_torch):
    def go(mode):
        code = f"from tests.loader_scenarios import run_batch_sampler; run_batch_sampler('torch', {mode!r})"
        return result(isolated.run_shell(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm="2g"))

    assert go("ms_shm")["digests"] == go("raw")["digests"]


def test_a_batch_that_outgrows_its_plan_meets_the_guard(real_torch):
    proc = run("growing", "ms_shm", "256m")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "RowTooLargeError" in text and "planned" in text and "Fix:" in text, \
        isolated.describe(proc)
    assert "unable to allocate shared memory" not in text and "killed by signal" not in text
