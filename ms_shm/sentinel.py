"""A small process outside the run that ends it when MindSpore's watchdog should have and could not.

MindSpore (2.x with its C++ watchdog) ends a run whose registered dataset worker died: its SIGCHLD handler sends
the other workers and then the main process SIGTERM. That handler builds strings and log lines, so it calls
``malloc``, which is not async-signal-safe: when SIGCHLD lands on a thread that is itself inside ``malloc`` the
handler waits forever for the allocator lock its own thread holds. The kernel hands a process's signal to the
main thread first, and the main thread is often allocating right then: it is building the error for the row
the dead worker owed. Measured, MindSpore 2.8.0, a worker SIGKILLed mid-epoch, 1 MiB rows: raw MindSpore hung
(alive, silent, 0% CPU) in about one run in ten, and ms_shm's runs the same; gdb showed the main thread in
``SIGCHLDHandler`` → ``LogStream`` → ``malloc``, under ``Status::GetErrDescriptionChar`` → ``malloc``, holding
the GIL. Nothing inside the process can help then (its one thread able to run Python is the stuck one), so
ms_shm asks a process outside, started with the first worker group MindSpore registers, to watch what the
watchdog watches.

The sentinel is told each group MindSpore registers and deregisters (``watch`` / ``forget``, the same pids the
watchdog gets). It reads each pid's state from ``/proc`` four times a second without reaping it. A worker that
ended the way the watchdog ends a run for (killed by a signal other than a teardown's SIGTERM / SIGINT, or
exited with a non-zero code) and is still unreaped and still registered ``GRACE`` seconds later, while the main
process lives, means the watchdog is stuck: the sentinel does what it would have done, after a line naming the
worker (worded as MindSpore's, so ``ms-shm explain`` reads it the same). A main process still there ``GRACE``
seconds after that SIGTERM that has used no CPU since is stuck too, and is killed. One that is busy (a SIGTERM
handler saving a checkpoint) is left alone.

It holds none of the run's pipes (a harness reading the run's output to its end does not wait for it), writes
its one line through the main process's stderr, and exits when the main process has gone. It imports no more
than the standard library and ``procfs`` (about 8 MB, a few ms to start). Where it cannot start, the run goes
on as raw MindSpore's would, with a warning.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

log = logging.getLogger("ms_shm.sentinel")

GRACE = 3.0  # seconds the watchdog gets to end the run (it takes milliseconds; raw 2.0's Python one, 1.3 s)
TICK = 0.25  # seconds between looks
TEARDOWN = frozenset({signal.SIGTERM, signal.SIGINT})  # how MindSpore and Ctrl-C end workers: not a death

_lock = threading.Lock()
_process: Any = None  # the sentinel (``subprocess.Popen``) this process started
_failed = False


def _forget_after_fork() -> None:
    """A forked child (a worker, a user's own process) has no sentinel of its own yet: its parent's is not its."""
    global _lock, _process, _failed
    _lock, _process, _failed = threading.Lock(), None, False


os.register_at_fork(after_in_child=_forget_after_fork)


def watch(key: Any, pids: Iterable[int]) -> None:
    """Watch ``pids`` (the main process's pid first, as MindSpore registers them) under ``key``."""
    _send(f"watch {key} " + " ".join(str(int(pid)) for pid in pids))


def forget(key: Any) -> None:
    _send(f"forget {key}")


def _send(line: str) -> None:
    """Tell the sentinel, starting it first if there is none; never raises into MindSpore's code."""
    global _process, _failed
    with _lock:
        if _failed:
            return
        try:
            if _process is None or _process.poll() is not None:
                if line.startswith("forget"):
                    return  # nothing watched yet
                _process = _start()
            _process.stdin.write((line + "\n").encode())
            _process.stdin.flush()
        except (OSError, ValueError) as exc:
            _failed = True
            log.warning("ms_shm: the sentinel that ends a run MindSpore's watchdog fails to end could not run "
                        "(%s: %s); a dataset worker killed at the wrong instant may leave this run waiting, as it "
                        "can on raw MindSpore", type(exc).__name__, exc)


def _start() -> subprocess.Popen:
    if not sys.executable:
        raise OSError("no Python interpreter path (sys.executable is empty)")
    if not os.path.isfile(__file__):
        raise OSError(f"{__file__} is not a file (a zipped install?)")
    process = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(GRACE)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
    log.debug("ms_shm: sentinel %s backs up MindSpore's watchdog for this process", process.pid)
    return process


# ------------------------------------------------------------------------------------- the sentinel itself


def ended_badly(status: int | None) -> str | None:
    """How a worker's end reads in MindSpore's words, where its watchdog ends the run for it; else ``None``."""
    if status is None:
        return None
    signum = status & 0x7F
    if signum:
        return None if signum in TEARDOWN else f"was killed by signal: {signal.strsignal(signum) or signum}"
    code = (status >> 8) & 0xFF
    return f"exited unexpectedly with exit code {code}" if code else None


class Watcher:
    """The sentinel's state: the registered groups and when each dead worker was first seen."""

    def __init__(self, parent: int, procfs: Any, grace: float = GRACE):
        self.parent, self.procfs, self.grace = parent, procfs, grace
        self.groups: dict = {}
        self.first_seen: dict = {}
        self.main = Parent(parent)

    def hear(self, line: str) -> None:
        words = line.split()
        if len(words) >= 2 and words[0] == "watch":
            self.groups[words[1]] = [int(w) for w in words[2:] if w.isdigit()]
        elif len(words) == 2 and words[0] == "forget":
            self.groups.pop(words[1], None)

    def overdue(self, now: float) -> tuple | None:
        """``(group, pid, how)`` for a worker whose bad end the watchdog has left unanswered for ``grace``."""
        for key, pids in self.groups.items():
            for pid in pids[1:]:  # the first is the main process
                how = ended_badly(self.procfs.exit_status(pid, parent=self.parent))
                if how is None:
                    self.first_seen.pop(pid, None)
                    continue
                if now - self.first_seen.setdefault(pid, now) >= self.grace:
                    return key, pid, how
        return None

    def end_run(self, key: str, pid: int, how: str) -> None:
        """What the watchdog does (the group's other processes, then the main one, by SIGTERM), then SIGKILL
        for a main process still there ``STUCK_AFTER`` graces later that used next to no CPU meanwhile."""
        log.critical("ms_shm: Dataset worker process %s %s. MindSpore's watchdog, which ends the run then, has not "
                     "in %g s (its SIGCHLD handler can deadlock in malloc); ms_shm's sentinel terminates the main "
                     "process %s as the watchdog would.", pid, how, self.grace, self.parent)
        for other in self.groups.get(key, [])[1:]:
            if other != pid and self.procfs.parent_of(other) == self.parent and self.procfs.exit_status(other) is None:
                _kill(other, signal.SIGTERM)
        before = self.procfs.process_cpu_ticks(self.parent)
        _kill(self.parent, signal.SIGTERM)
        window = STUCK_AFTER * self.grace
        if self.main.gone(window):
            return
        after = self.procfs.process_cpu_ticks(self.parent)
        if before is not None and after is not None and after - before < IDLE_SHARE * 100 * window:
            log.critical("ms_shm: the main process %s neither ended on SIGTERM nor used %d%% of a CPU in %g s: it "
                         "is stuck; the sentinel kills it (SIGKILL)", self.parent, IDLE_SHARE * 100, window)
            _kill(self.parent, signal.SIGKILL)


STUCK_AFTER = 2  # graces after its SIGTERM a main process gets before it counts as stuck
IDLE_SHARE = 0.05  # below this share of one CPU it is stuck (measured: 1.2% for one stuck holding the GIL, from
#                    the threads that wait for it; a SIGTERM handler at work uses far more)


class Parent:
    """The main process, as the sentinel sees it end. A pidfd (Linux 5.3+) is readable the instant it ends, so the
    sentinel holds the run's stderr no longer than the run; without one the parent pid is polled (the sentinel
    is re-parented when the run ends)."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            self.fd = None

    def gone(self, timeout: float = 0.0) -> bool:
        """Whether it has ended, waiting up to ``timeout`` s for it to."""
        deadline = time.monotonic() + timeout
        while os.getppid() == self.pid:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd is not None:
                return bool(select.select([self.fd], [], [], left)[0]) or os.getppid() != self.pid
            time.sleep(min(TICK / 5, left))
        return True


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone meanwhile
        pass


def _lines(fd: int, pending: bytearray) -> tuple:
    """``(lines, open)``: what ``fd`` has (read when it is readable); ``open`` is false once it has closed."""
    chunk = os.read(fd, 65536)
    pending.extend(chunk)
    *lines, rest = pending.split(b"\n")
    pending[:] = rest
    return [line.decode(errors="replace") for line in lines], bool(chunk)


def _load_procfs() -> Any:
    """``procfs`` by its path: the sentinel runs isolated (``-I -S``), without the package or site-packages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ms_shm_procfs", os.path.join(os.path.dirname(__file__),
                                                                               "procfs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle; the sentinel goes with it
    logging.basicConfig(format="%(message)s")  # its stderr is the run's: its lines read as the run's own
    watcher = Watcher(int(argv[1]), _load_procfs(), float(argv[2]))
    main_fd = [] if watcher.main.fd is None else [watcher.main.fd]
    pending, reading = bytearray(), True
    try:
        while not watcher.main.gone():
            ready = select.select(([0] if reading else []) + main_fd, [], [], TICK)[0]
            if 0 in ready:
                lines, reading = _lines(0, pending)
                for line in lines:
                    watcher.hear(line)
            found = watcher.overdue(time.monotonic())
            if found is not None and not watcher.main.gone():
                watcher.end_run(*found)
                return 0
    except Exception as exc:  # never a traceback in the run's log: one line, and the run goes on unwatched
        log.warning("ms_shm: the sentinel stopped (%s: %s); a run MindSpore's watchdog fails to end may now wait",
                    type(exc).__name__, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

__all__ = ["watch", "forget", "ended_badly", "Watcher", "GRACE", "TEARDOWN"]
