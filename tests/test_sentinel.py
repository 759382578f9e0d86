"""``ms_shm.sentinel``: the process outside a run that ends it when MindSpore's watchdog should have and is stuck.

The rule is pure (``ended_badly``, ``sentinel_main.Watcher.overdue``); the sentinel itself is checked with real processes: a
stand-in for a run registers a real child as its worker, the test kills that child, and the run must end (or
not) the way the watchdog would end it. No framework is needed: MindSpore's side (its ``register_worker_pids``
reaching the sentinel, a real stuck watchdog) is ``test_releases.py::test_a_run_whose_watchdog_is_stuck_...``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ms_shm import procfs, sentinel, sentinel_main

RUN = r"""
import json, os, signal, subprocess, sys, time
from ms_shm import sentinel, sentinel_main
sentinel.GRACE = 0.5
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(12)]  # a run's pipes get fds above 9 (sh's limit)
mode = sys.argv[1]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],  # never waited on: a zombie
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
sentinel.watch(7, [os.getpid(), worker.pid])
if mode == "forget":
    sentinel.forget(7)
if mode == "ignores-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(json.dumps({"worker": worker.pid, "sentinel": sentinel._process.pid}), flush=True)
if mode == "waits-for-all":  # a program that waits for every child it has: the sentinel is none of them
    worker.terminate()
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
time.sleep(float(sys.argv[2]))
print("SURVIVED", flush=True)
"""


def start_run(mode: str, lasts: float = 30.0) -> tuple:
    proc = subprocess.Popen([sys.executable, "-c", RUN, mode, str(lasts)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    pids = json.loads(proc.stdout.readline())
    return proc, pids


def finish(proc, timeout: float = 30.0) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run was still there {timeout} s on: {err}")
    return out, err


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("status, words", [
    (signal.SIGKILL, "was killed by signal: Killed"),
    (signal.SIGSEGV, "was killed by signal: Segmentation fault"),
    (signal.SIGTERM, None),  # a teardown's: MindSpore and Ctrl-C end workers so
    (signal.SIGINT, None),
    (3 << 8, "exited unexpectedly with exit code 3"),
    (0, None),
    (None, None),  # alive, reaped or unread
])
def test_the_ends_the_watchdog_ends_a_run_for(status, words):
    assert sentinel.ended_badly(status) == words


class FakeProcfs:
    def __init__(self, statuses: dict):
        self.statuses = statuses

    def exit_status(self, pid, parent=None):
        return self.statuses.get(pid)

    def start_ticks(self, pid):
        return 1


def test_a_bad_end_is_overdue_only_after_the_grace_and_only_while_its_group_is_registered():
    procfs = FakeProcfs({11: signal.SIGKILL, 1: signal.SIGKILL})
    watcher = sentinel_main.Watcher(os.getppid(), procfs, grace=3.0)
    watcher.hear("watch 5 1 10 11")  # the first pid is the main process: never judged
    assert watcher.overdue(100.0) is None  # first seen
    assert watcher.overdue(102.9) is None
    assert watcher.overdue(103.0) == ("5", 11, "was killed by signal: Killed")
    watcher.hear("forget 5")
    assert watcher.overdue(200.0) is None


def test_a_worker_reaped_meanwhile_starts_its_grace_afresh():
    procfs = FakeProcfs({11: signal.SIGKILL})
    watcher = sentinel_main.Watcher(os.getppid(), procfs, grace=1.0)
    watcher.hear("watch 5 1 11")
    watcher.overdue(0.0)
    del procfs.statuses[11]  # reaped (the pid could come back as another process)
    assert watcher.overdue(5.0) is None
    procfs.statuses[11] = signal.SIGKILL
    assert watcher.overdue(5.5) is None


def test_a_pid_deregistered_and_registered_again_gets_the_whole_grace_again():
    procfs = FakeProcfs({11: signal.SIGKILL})
    watcher = sentinel_main.Watcher(os.getppid(), procfs, grace=3.0)
    watcher.hear("watch 5 1 11")
    assert watcher.overdue(0.0) is None  # first seen, then its group torn down
    watcher.hear("forget 5")
    watcher.hear("watch 6 1 11")  # the pid, reused by a worker of a new group, found dead at once
    assert watcher.overdue(100.0) is None
    assert watcher.overdue(103.0) == ("6", 11, "was killed by signal: Killed")


def test_a_run_whose_watchdog_does_nothing_is_terminated_naming_the_worker():
    proc, pids = start_run("stuck")
    os.kill(pids["worker"], signal.SIGKILL)
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGTERM and "SURVIVED" not in out, err
    assert f"ms_shm: Dataset worker process {pids['worker']} was killed by signal: Killed." in err
    assert f"sentinel terminates the main process {proc.pid}" in err
    assert gone(pids["sentinel"])


def test_a_run_that_ignores_sigterm_and_does_nothing_is_killed():
    proc, pids = start_run("ignores-sigterm")
    os.kill(pids["worker"], signal.SIGKILL)
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, err
    assert "it is stuck; the sentinel kills it (SIGKILL)" in err


@pytest.mark.parametrize("mode, signum", [("forget", signal.SIGKILL), ("stuck", signal.SIGTERM)])
def test_a_deregistered_worker_or_a_teardowns_sigterm_leaves_the_run_alone(mode, signum):
    proc, pids = start_run(mode, lasts=2.5)  # five graces
    os.kill(pids["worker"], signum)
    out, err = finish(proc)
    assert proc.returncode == 0 and "SURVIVED" in out, err
    assert "sentinel" not in err
    assert gone(pids["sentinel"])  # and it leaves with the run


def test_the_sentinel_holds_none_of_the_runs_pipes_but_its_stderr_and_leaves_with_it():
    proc, pids = start_run("stuck", lasts=0.5)
    assert os.readlink(f"/proc/{pids['sentinel']}/fd/1") == "/dev/null"
    out, err = finish(proc)  # the run's stdout and stderr reach their end: nobody else holds them
    assert "SURVIVED" in out
    assert gone(pids["sentinel"])
    os.kill(pids["worker"], signal.SIGKILL)


def test_the_sentinel_is_not_a_child_a_program_waits_for():
    proc, pids = start_run("waits-for-all", lasts=0.1)
    out, err = finish(proc)
    assert proc.returncode == 0 and "SURVIVED" in out, err
    assert gone(pids["sentinel"])


def test_without_a_pidfd_the_main_process_is_gone_once_its_pid_is_another_process_or_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        main = sentinel_main.MainProcess(child.pid, procfs)
        main.fd = None
        main.started = procfs.start_ticks(child.pid)
        assert main.started is not None and not main.gone(0.1)
        main.started += 1
        assert main.gone()  # the pid is another process's
        main.started -= 1
        child.kill()
        assert main.gone(5.0)  # a zombie, not reaped yet
        child.wait()
        assert main.gone()
    finally:
        child.kill()
        child.wait()


def test_a_sentinel_that_cannot_start_is_a_warning_not_an_error(monkeypatch, caplog):
    monkeypatch.setattr(sentinel, "_process", None)
    monkeypatch.setattr(sentinel, "_failed", False)
    monkeypatch.setattr(sys, "executable", "")
    sentinel.watch(1, [os.getpid(), 1])
    sentinel.watch(2, [os.getpid(), 1])  # said once
    warnings = [r for r in caplog.records if r.name == "ms_shm.sentinel" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not run" in warnings[0].getMessage()
