"""The dead-worker watch ms_shm runs while MindSpore 2.0's watchdog is off: a worker a signal ended is told from
one a teardown ended, read without reaping it. The real run is ``test_releases.py``'s killed-worker test."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from types import SimpleNamespace

from ms_shm import procfs
from ms_shm.engines.mindspore import deathwatch


def _zombie(how: str) -> int:
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        faulthandler.disable()  # pytest's, inherited: it would print a "Fatal Python error" for the SIGSEGV sent
        os.write(told, b"!")  # only now may it be killed (a SIGSEGV that came first printed one in a full suite)
        if how == "exit":
            os._exit(3)
        time.sleep(60)
        os._exit(0)
    os.close(told)
    os.read(ready, 1)
    os.close(ready)
    if how != "exit":
        os.kill(pid, getattr(signal, how))
    for _ in range(200):  # until it is a zombie
        if procfs.is_zombie(pid):
            break
        time.sleep(0.01)
    return pid


def test_the_signal_that_ended_an_unreaped_child_is_read_without_reaping_it():
    killed, exited = _zombie("SIGKILL"), _zombie("exit")
    try:
        assert procfs.death_signal(killed) == signal.SIGKILL
        assert procfs.death_signal(exited) is None  # ended by itself
        assert procfs.death_signal(os.getpid()) is None  # alive
        assert procfs.is_zombie(killed)  # still there for its owner to reap
        assert procfs.exit_status(exited) == 3 << 8 and procfs.exit_status(os.getpid()) is None
        assert procfs.parent_of(killed) == os.getpid()
        assert procfs.exit_status(killed, parent=os.getpid()) == signal.SIGKILL
        assert procfs.exit_status(killed, parent=os.getppid()) is None  # not that process's child: not its worker
    finally:
        os.waitpid(killed, 0)
        os.waitpid(exited, 0)


def _worker(pid: int, returncode: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, name=f"w{pid}", _popen=SimpleNamespace(returncode=returncode))


def test_a_worker_its_owner_closed_is_ended_and_the_watch_goes_on():
    """MindSpore 2.0's ``close_all_workers`` calls ``close()`` on its workers, and ``.pid`` then raises
    ``ValueError``: the watch stopped for the rest of the run (an audit: 3 runs of 24), so a worker killed later
    left the pipeline waiting, MindSpore's own watchdog turned off."""
    import multiprocessing

    closed = multiprocessing.get_context("fork").Process(target=int)
    closed.start()
    closed.join()
    closed.close()
    ended, oom = [], _worker(4, -signal.SIGKILL)
    assert deathwatch.killed_worker([closed, oom], ended.append) == (oom, signal.SIGKILL)
    assert ended == [closed, oom]


def test_a_kill_ends_the_run_a_teardown_does_not():
    ended = []
    teardown = [_worker(1, -signal.SIGTERM), _worker(2, -signal.SIGINT), _worker(3, 0)]
    assert deathwatch.killed_worker(teardown, ended.append) is None
    assert len(ended) == 3  # each judged once, then forgotten
    oom = _worker(4, -signal.SIGKILL)
    assert deathwatch.killed_worker([_worker(os.getpid())] + [oom]) == (oom, signal.SIGKILL)
    killed = _zombie("SIGSEGV")
    try:  # not reaped yet by its owner: read from /proc
        assert deathwatch.killed_worker([_worker(killed)])[1] == signal.SIGSEGV
    finally:
        os.waitpid(killed, 0)
