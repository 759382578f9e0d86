"""``ms_shm.sandbox``: what a probe's reads changed in the process. Pure (torch where installed)."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from ms_shm import sandbox


def draw_random():
    return random.random()


def draw_numpy():
    return np.random.random()


def own_generator():
    return np.random.default_rng(3).random()  # a generator of its own: the same rows in any worker


@pytest.mark.parametrize("run, draws", [(draw_random, True), (draw_numpy, True), (own_generator, False)])
def test_draws_from_the_global_generators_are_seen_and_a_local_generator_is_not(run, draws):
    _, effects = sandbox.watch_effects(run, [])
    assert bool(effects.order_dependent) == draws, effects


def test_draws_from_torchs_global_generator_are_seen():
    torch = pytest.importorskip("torch")
    _, effects = sandbox.watch_effects(lambda: torch.rand(1), [])
    assert effects.order_dependent, effects


def test_numpy_random_is_imported_in_the_parent_once_not_in_every_fork():
    """NumPy 2 imports numpy.random on first use (11-22 ms) and the child reads its state: the parent imports it."""
    code = ("import sys; from ms_shm import sandbox; before = 'numpy.random' in sys.modules; "
            "sandbox.run_in_fork(lambda: 1); print(before, 'numpy.random' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "True", out


def test_the_child_holds_its_pair_until_the_parents_meanwhile_returns():
    """The parent's read of the host runs beside the child's first reads; a pair of threads timed at once must not
    share the CPUs with it, so ``wait_for_parent`` returns only once it is done (one clock: CLOCK_MONOTONIC)."""
    import time

    done = []

    def meanwhile():
        time.sleep(0.2)
        done.append(time.monotonic())

    def child():
        started = time.monotonic()
        sandbox.wait_for_parent()
        return started, time.monotonic()

    outcome = sandbox.run_in_fork(child, meanwhile=meanwhile)
    started, released = outcome.value
    assert done and released >= done[0] > started, (started, released, done)


def test_a_failing_meanwhile_does_not_fail_the_probe_and_without_one_the_child_never_waits():
    import time

    def broken():
        raise OSError("no /proc")

    def child():
        t0 = time.monotonic()
        sandbox.wait_for_parent()
        return time.monotonic() - t0

    assert sandbox.run_in_fork(child, meanwhile=broken).error is None
    waited = sandbox.run_in_fork(child).value
    assert waited < 1.0, waited  # no gate: at once (GATE_SECONDS is 5)
