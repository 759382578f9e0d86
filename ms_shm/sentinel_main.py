"""The sentinel process itself (``sentinel`` starts it, ``python -I -S`` on this file): what it watches, when a
worker's end is one the watchdog should have answered, and what it does then.

It imports what it needs only: the standard library's cheapest modules and ``procfs``, loaded by its path; and
``logging`` only once it has something to say (measured: 40-50 ms of CPU to start with ``logging`` and
``subprocess`` imported, 20-30 ms without, CPU the run's workers would otherwise have).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE = 3.0  # seconds the watchdog gets to end the run (it takes milliseconds; raw 2.0's Python one, 1.3 s)
TICK = 0.25  # seconds between looks
TEARDOWN = frozenset({signal.SIGTERM, signal.SIGINT})  # how MindSpore and Ctrl-C end workers: not a death
STUCK_AFTER = 2  # graces after its SIGTERM a main process gets before it counts as stuck
IDLE_SHARE = 0.05  # below this share of one CPU it is stuck (measured: 1.2% for one stuck holding the GIL, from
#                    the threads that wait for it; a SIGTERM handler at work uses far more)


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

    def __init__(self, parent: int, procfs: object, grace: float = GRACE):
        self.procfs, self.grace = procfs, grace
        self.groups: dict = {}
        self.first_seen: dict = {}
        self.main = MainProcess(parent, procfs)

    @property
    def parent(self) -> int:
        return self.main.pid

    def hear(self, line: str) -> None:
        """A group registered or deregistered. A pid no group holds any more is forgotten with its first sighting:
        come back as another worker (pids are reused), its bad end gets the whole grace again."""
        words = line.split()
        if len(words) >= 2 and words[0] == "watch":
            self.groups[words[1]] = [int(w) for w in words[2:] if w.isdigit()]
        elif len(words) == 2 and words[0] == "forget":
            self.groups.pop(words[1], None)
        held = {pid for pids in self.groups.values() for pid in pids}
        self.first_seen = {pid: at for pid, at in self.first_seen.items() if pid in held}

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
        _log().critical("ms_shm: Dataset worker process %s %s. MindSpore's watchdog, which ends the run then, has "
                        "not in %g s (its SIGCHLD handler can deadlock in malloc); ms_shm's sentinel terminates the "
                        "main process %s as the watchdog would.", pid, how, self.grace, self.parent)
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
            _log().critical("ms_shm: the main process %s neither ended on SIGTERM nor used %d%% of a CPU in %g s: "
                            "it is stuck; the sentinel kills it (SIGKILL)", self.parent, IDLE_SHARE * 100, window)
            _kill(self.parent, signal.SIGKILL)


class MainProcess:
    """The main process, as the sentinel sees it end. The sentinel is not its child (``sentinel._start``), so a
    pidfd (Linux 5.3+), readable the instant it ends, tells; without one, its ``/proc`` entry does: gone, a zombie,
    or another process's (its start time changed: pids are reused)."""

    def __init__(self, pid: int, procfs: object):
        self.pid, self.procfs = pid, procfs
        try:
            self.fd: int | None = os.pidfd_open(pid)  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            self.fd = None
        self.started = procfs.start_ticks(pid) if self.fd is None else None

    def gone(self, timeout: float = 0.0) -> bool:
        """Whether it has ended, waiting up to ``timeout`` s for it to."""
        if self.fd is not None:
            return bool(select.select([self.fd], [], [], max(0.0, timeout))[0])
        deadline = time.monotonic() + timeout
        while not self._ended():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(TICK / 5, left))
        return True

    def _ended(self) -> bool:
        started = self.procfs.start_ticks(self.pid)
        return started is None or started != self.started or self.procfs.is_zombie(self.pid)


def _log():
    """The sentinel's logger, its lines on stderr (the run's) as the run's own; ``logging`` imported only now."""
    import logging

    logging.basicConfig(format="%(message)s")
    return logging.getLogger("ms_shm.sentinel")


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


def _load_procfs() -> object:
    """``procfs`` by its path: the sentinel runs isolated (``-I -S``), without the package or site-packages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ms_shm_procfs", os.path.join(os.path.dirname(__file__),
                                                                               "procfs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle; the sentinel goes with it
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
        _log().warning("ms_shm: the sentinel stopped (%s: %s); a run MindSpore's watchdog fails to end may now "
                       "wait", type(exc).__name__, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

__all__ = ["ended_badly", "Watcher", "MainProcess", "main", "GRACE", "TICK", "TEARDOWN"]
