"""What MindSpore's watchdog does for a dead worker, while ms_shm keeps the watchdog off (MindSpore 2.0).

On 2.0 ms_shm turns the watchdog off where it plans worker processes: it reaps every child of the process
(``waitpid(-1)``), and ~18% of iterators then left a worker's static slots committed, so a fresh iterator failed
the pre-check (``profiles.watchdog_leaks_slots``). But the watchdog is also what ends a pipeline whose worker was
killed (the OOM killer's SIGKILL, a segfault in a decoder): without it the main process waits for that worker's
row forever (measured, 2.0.0: a map worker SIGKILLed mid-epoch, raw exits by SIGTERM in 1.3 s; with the
watchdog off, alive and waiting after 90 s, the worker a zombie).

So while the watchdog is off, a daemon thread looks at MindSpore's worker processes twice a second and does what
the watchdog would: one killed by a signal other than the SIGTERM / SIGINT of a normal teardown ends the other
workers and then this process with SIGTERM, after a log line naming the worker and the signal. It reads each
worker's status from ``/proc`` without reaping it (``procfs.death_signal``): reaping is what leaked the slots.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing.process
import os
import signal
import threading
import weakref
from typing import Any, Callable, Iterable

from ms_shm import procfs
from ms_shm.sentinel import TEARDOWN  # one rule for what is not a death, here and outside

log = logging.getLogger("ms_shm.deathwatch")
# seconds between looks: a dead worker ends the run within this (raw 2.0.0: 1.3 s). A worker is known from the
# first look that finds it alive; one killed before that and reaped by MindSpore's own poll is not seen.
INTERVAL = 0.25
_lock = threading.Lock()
_stop: threading.Event | None = None


def start() -> None:
    """Watch from now until ``stop()``; idempotent."""
    global _stop
    with _lock:
        if _stop is not None:
            return
        _stop = threading.Event()
        threading.Thread(target=_watch, args=(_stop,), name="ms_shm-deathwatch", daemon=True).start()


def stop() -> None:
    global _stop
    with _lock:
        if _stop is not None:
            _stop.set()
        _stop = None


def _watch(stopped: threading.Event) -> None:
    seen: weakref.WeakSet = weakref.WeakSet()  # workers once seen: MindSpore's own polls reap a dead one, and
    while not stopped.wait(INTERVAL):          # ``multiprocessing`` then forgets it (measured: gone in 0.3 s)
        try:
            seen.update(_workers())
            dead = killed_worker(list(seen), ended=seen.discard)
        except Exception as exc:  # never the program's problem: stop watching, and say so
            log.warning("ms_shm: the dead-worker watch stopped (%s: %s); a killed dataset worker may now leave "
                        "the pipeline waiting", type(exc).__name__, exc)
            return
        if dead is not None and not stopped.is_set():
            _end(*dead)
            return


def _workers() -> list:
    """MindSpore's worker processes among this process's live ``multiprocessing`` children (their classes are
    MindSpore's)."""
    return [p for p in _children() if type(p).__module__.startswith("mindspore.dataset")]


def _children() -> list:
    return list(getattr(multiprocessing.process, "_children", ()))


def _cleaners() -> list:
    """The orphan cleaners MindSpore starts beside its workers (plain ``Process`` objects, held as its pools'
    ``cleaning_process``), which its watchdog ends too: left alive, one waits for a main process its parent has
    not reaped yet, and holds the pipes the run's output goes to (a harness reading them to the end waited 120 s).
    Read from the referrers once, when the run ends: ``Process.start()`` drops the target that would tell."""
    plain = [p for p in _children() if type(p).__module__.startswith("multiprocessing")]
    return [p for p in plain if any(isinstance(r, dict) and r.get("cleaning_process") is p
                                    for r in gc.get_referrers(p))]


def killed_worker(workers: Iterable[Any], ended: Callable[[Any], None] = lambda worker: None) -> tuple | None:
    """``(worker, signal)`` for the first worker a signal other than a teardown's ended, else ``None``;
    ``ended(worker)`` for each worker found ended, whatever ended it (each is judged once)."""
    for worker in workers:
        pid = _pid(worker)
        if pid is None:
            if _closed(worker):
                ended(worker)
            continue
        code = getattr(getattr(worker, "_popen", None), "returncode", None)  # reaped by its owner already
        signum = -code if isinstance(code, int) and code < 0 else procfs.death_signal(pid)
        if code is not None or signum:
            ended(worker)
        if signum and signum not in TEARDOWN:
            return worker, signum
    return None


def _pid(worker: Any) -> int | None:
    """A worker's pid, or ``None``: not started, or ``close()``d by its owner (2.0's ``close_all_workers``),
    where ``.pid`` raises ``ValueError`` (the watch stopped on it, 3 runs of 24)."""
    try:
        return getattr(worker, "pid", None)
    except ValueError:
        return None


def _closed(worker: Any) -> bool:
    return bool(getattr(worker, "_closed", False))


def _shown(logger: logging.Logger) -> bool:
    """Whether a handler other than a ``NullHandler`` (ms_shm's, as a library's) will take a CRITICAL record."""
    current: Any = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and h.level <= logging.CRITICAL for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _end(worker: Any, signum: int) -> None:
    """As MindSpore's watchdog: the other workers and the cleaners first, then this process, by SIGTERM."""
    name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
    record = log.makeRecord(log.name, logging.CRITICAL, __file__, 0, (
        "ms_shm: dataset worker %s (pid %s) was killed by %s%s; MindSpore's watchdog, which ends the run then, is "
        "off (ms_shm turned it off: it leaks static slots on this release), so ms_shm ends this process as it "
        "would: the pipeline would otherwise wait for that worker forever"), (
        getattr(worker, "name", "?"), worker.pid, name, " (the OOM killer sends SIGKILL)" if signum == signal.SIGKILL
        else ""), None)
    log.handle(record)
    if not _shown(log):  # the program's last words: said on stderr even where it set up no logging (raw's are)
        logging.lastResort.handle(record)
    for other in _workers() + _cleaners():
        pid = _pid(other)
        if other is not worker and pid and procfs.death_signal(pid) is None:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:  # gone meanwhile
                pass
    os.kill(os.getpid(), signal.SIGTERM)


__all__ = ["start", "stop", "killed_worker", "INTERVAL"]
