"""A small process outside the run that ends it when MindSpore's watchdog should have and could not.

MindSpore's C++ watchdog (2.7.2, 2.8.0, 2.10.0 here) ends a run whose registered dataset worker died: its SIGCHLD
handler sends the other workers and then the main process SIGTERM. That handler builds strings and log lines,
so it calls ``malloc``, which is not async-signal-safe: when SIGCHLD lands on a thread that is itself inside
``malloc`` the handler waits forever for the allocator lock its own thread holds. The kernel hands a process's
signal to the main thread first, and the main thread is often allocating right then: it is building the error
for the row the dead worker owed. Measured, a generator worker SIGKILLed mid-epoch, 1 MiB rows: raw MindSpore
hung (alive, silent, 0% CPU) in 5 of 40 runs on 2.8.0, 3 of 30 on 2.7.2, 6 of 30 on 2.10.0, and ms_shm's runs
the same; gdb showed the main thread in ``SIGCHLDHandler`` → ``LogStream`` → ``malloc``, interrupted inside
``malloc`` under ``Status::GetErrDescriptionChar``, holding the GIL. Nothing inside the process can help then
(the one thread able to run Python is the stuck one), so a process outside, started with the first worker group
MindSpore registers, watches what the watchdog watches.

The sentinel is told each group MindSpore registers and deregisters (``watch`` / ``forget``, the pids the
watchdog gets). It reads each pid's state from ``/proc`` four times a second without reaping it. A worker that
ended the way the watchdog ends a run for (killed by a signal other than a teardown's SIGTERM / SIGINT, or
exited with a non-zero code) and is still an unreaped child of the main process and still registered ``GRACE``
seconds later, while the main process lives, means the watchdog is stuck: the sentinel does what it would have
done, after a line naming the worker (worded as MindSpore's, so ``ms-shm explain`` reads it the same). A main
process still there two graces after that SIGTERM that used under 5% of a CPU meanwhile is stuck too, and is
killed; one at work (a SIGTERM handler saving a checkpoint) is left alone.

It holds none of the run's pipes but its stderr (a harness reading the run's output to its end does not wait for
it), writes its lines there, and exits when the main process has gone. The process itself is ``sentinel_main``:
the standard library's cheapest modules and ``procfs`` (measured: 11.6 MiB resident, 20-30 ms of CPU to start).
Where it cannot start, the run goes on as raw MindSpore's would, with a warning.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Iterable

from ms_shm import sentinel_main
from ms_shm.sentinel_main import GRACE, TEARDOWN, ended_badly  # noqa: F401  (one rule, read here too)

log = logging.getLogger("ms_shm.sentinel")

_lock = threading.Lock()
_process: Any = None  # the sentinel this process started (``Started``)
_failed = False


class Started:
    """A sentinel as its starter holds it: its pid, and the write end of the pipe that is its stdin."""

    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd


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
    """Tell the sentinel, starting it first if there is none (or a new one, if it has ended); never raises into
    MindSpore's code."""
    global _process, _failed
    with _lock:
        if _failed or (_process is None and line.startswith("forget")):  # nothing watched yet
            return
        try:
            for attempt in (1, 2):
                if _process is None:
                    _process = _start()
                try:
                    os.write(_process.fd, (line + "\n").encode())
                    return
                except BrokenPipeError:
                    os.close(_process.fd)
                    _process = None
                    if attempt == 2:
                        raise
        except Exception as exc:  # noqa: BLE001 - whatever keeps it from running, the run goes on as raw's would
            _failed = True
            log.warning("ms_shm: the sentinel that ends a run MindSpore's watchdog fails to end could not run "
                        "(%s: %s); a dataset worker killed at the wrong instant may leave this run waiting, as it "
                        "can on raw MindSpore", type(exc).__name__, exc)


def _start() -> Started:
    """The sentinel, started by ``/bin/sh`` in the background so that it is not this process's child: a program
    that waits for all its children (``os.wait()`` until ``ECHILD``) waited for it forever, and a ``Popen`` kept
    for it warned "subprocess is still running" at exit under ``-W default``. The shell exits at once (~2 ms)."""
    import subprocess  # only the run that registers workers pays for it

    script = sentinel_main.__file__
    if not sys.executable:
        raise OSError("no Python interpreter path (sys.executable is empty)")
    if not os.path.isfile(script):
        raise OSError(f"{script} is not a file (a zipped install?)")
    read, write = os.pipe()
    try:
        shell = subprocess.run(  # a job in the background reads /dev/null unless told: the pipe goes by fd 3
            ["/bin/sh", "-c", 'exec 3<&0; "$@" <&3 3<&- >/dev/null & echo $!', "sh",
             sys.executable, "-I", "-S", os.path.abspath(script), str(os.getpid()), str(GRACE)],
            stdin=read, stdout=subprocess.PIPE, timeout=30, check=True)
        pid = int(shell.stdout)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    log.debug("ms_shm: sentinel %s backs up MindSpore's watchdog for this process", pid)
    return Started(pid, write)


__all__ = ["watch", "forget", "ended_badly", "GRACE", "TEARDOWN"]
