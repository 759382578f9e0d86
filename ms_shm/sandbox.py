"""Run a probe in a forked child, so nothing it does can reach the pipeline it plans.

Reading rows to measure them has side effects a drop-in must not have: a source that counts calls, draws
from ``random`` / ``numpy.random``, caches, or advances an iterator would give the pipeline other rows than
raw MindSpore gives it. A forked child gets a copy-on-write image of this process; whatever the probe
changes there (Python objects, RNG states, iterators) is thrown away with it. Only the measurement, a small
picklable result, comes back through a pipe. The child is also what a forked MindSpore worker is, so its
timings are a worker's.

What a fork cannot isolate: the outside world (files written, sockets). An open file's offset, shared with
the parent, is rewound in the child after the probe, and a pipe it inherited reads as empty (``fdguard``).

The child also reports whether the probe changed state the pipeline depends on (``Effects``): the global
``random`` / ``numpy.random`` states, and the shallow state of the objects it was given (a counter, a cache,
a generator held as an attribute). Those decide whether ms_shm may change the transport: rows that depend
on which process or thread reads them must keep MindSpore's own mode.
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import faulthandler
import functools
import io
import itertools
import logging
import mmap
import os
import pickle
import random
import select
import signal
import sys
import threading
import time
import traceback
import types
import zlib
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import collector, fdguard, host, objects, outside, procfs
from ms_shm._results import Result, mib, record
from ms_shm.hooks import wrap_once

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # seconds; a probe that hangs (a lock held at fork) must not hang the user's script
TIMEOUT_ENV = "MS_SHM_PROBE_TIMEOUT"


@record
class Effects(Result):
    """What the probe saw in the child: each a reason, or ``None`` for "nothing seen".

    Attributes:
        draws_random: reading advanced the global ``random`` / ``numpy.random`` state, or a generator the
            source or an operation holds (at any depth: ``held_generators``).
        rereads_differ: the same row, read again, came back different.
        mutates_state: reading changed the objects' own attributes (a counter, a cache, lazy set-up).
        state_per_read: the objects' attributes changed again on a later read, not only on the first (lazy
            set-up): a counter, a cache, a list of what was read. What the rows see of it depends on who reads
            them: one reader counts every read in order, threads interleave their reads on the shared object,
            worker processes count in their own copies (and the program's object stays as it was), so the
            framework's own workers read them. Rows that depend on that state only past the probe's reads (an
            augmentation switched off after 25 reads) read back the same in the probe.
        holds_handle: after the probe's reads the objects hold an open stream or connection (``held_handles``),
            opened lazily or before: its position and its thread belong to whoever reads it, so the workers'
            kind and count stay the framework's (threads sharing one file race on its offset).
    """

    draws_random: str | None = None
    rereads_differ: str | None = None
    mutates_state: str | None = None
    state_per_read: str | None = None
    holds_handle: str | None = None

    @property
    def order_dependent(self) -> str | None:
        """Why rows may depend on which worker (process or thread) reads them, or ``None``."""
        return self.draws_random or self.rereads_differ

    @property
    def mode_bound(self) -> str | None:
        """Why the framework's own workers (kind and count) must read the rows, or ``None``: a handle before a
        row read twice that came back different, which two threads of the probe racing on that handle's offset
        make too (an audit: deterministic sources over a file told as "source[0] read twice differs")."""
        return self.draws_random or self.holds_handle or self.rereads_differ or self.state_per_read

    def with_writes(self, writes: str | None, grows: str | None = None) -> Effects:
        """These effects, with the state the code writes on reads the probe did not make (``writes``:
        ``codescan.stage_writes``) taken as state kept per read, where the probe's reads changed nothing: had
        they changed it, they told lazy set-up from state kept per read already. State the code adds to
        (``grows``: ``codescan.stage_grows``) is kept per read either way: lazy set-up only ever sets."""
        if self.state_per_read is not None:
            return self
        if grows is not None:
            return replace(self, state_per_read=f"{grows} on reads the probe did not make: state kept per read")
        if writes is None or self.mutates_state is not None:
            return self
        return replace(self, state_per_read=f"{writes}, which the probe's reads did not change: state kept on "
                                            f"the reads it did not make")


@record
class Outcome:
    """The child's result, or why there is none.

    Attributes:
        value: what the probe function returned.
        error: the exception the probe raised (the child's object, with ``remote_traceback`` as its text).
        unavailable: why the probe did not run or did not finish (no fork, timeout, child killed).
    """

    value: Any = None
    error: BaseException | None = None
    remote_traceback: str = ""
    unavailable: str | None = None
    private_bytes: int | None = None  # what the child held alone when it finished: a forked worker's growth
    threads_started: int | None = None  # threads the probe left running in the child (``_threads_started``)
    beside: Any = None  # what ``meanwhile`` returned in the parent while the child ran
    fork_seconds: float | None = None  # the parent's ``os.fork()`` call: copying this process's page tables, the
    # part of a worker's start that grows with the program's memory (2 ms at ~300 MB, 28 ms at ~1.3 GB: measured)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def timeout_seconds() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def run_in_fork(probe: Callable[[], Any], timeout: float | None = None, worker_pages: bool = False,
                meanwhile: Callable[[], Any] | None = None, watched: Sequence[Any] = ()) -> Outcome:
    """``probe()`` in a forked child; its return value (pickled) or its exception comes back, and with
    ``worker_pages`` the memory the child held alone at the end (``Outcome.private_bytes``; reading it walks
    the whole address space, ~20 ms with MindSpore loaded, so only where memory may bind).

    ``meanwhile()`` runs here while the child starts and reads its first rows alone, on a CPU the child leaves
    idle: a short read the plan needs next (the stage's code, 3-10 ms), which the caller would otherwise pay
    after the child. Its value comes back as ``Outcome.beside`` (``None`` where it raised: logged, and the caller
    reads again). The child holds its reads of two rows at once (``wait_for_parent``) until it returns, so they
    never share the CPUs with it: a long read here (the native thread pools, 15-28 ms with MindSpore loaded)
    would hold up cheap rows' probe by as much.

    ``watched``: the objects whose code the probe runs (a source, a map's operations). What they write through
    a buffered file is flushed first (else the child's first flush would write it again), and a lock they hold
    that another thread holds at the fork ends the probe at once, unmeasured (``_unless_held``).

    Never raises for the child's sake: a fork that fails, a child that dies or hangs past ``timeout`` gives an
    ``Outcome`` with ``unavailable`` set, and the caller plans without a measurement.
    """
    if not hasattr(os, "fork"):
        return Outcome(unavailable="os.fork is not available on this platform")
    timeout = timeout_seconds() if timeout is None else timeout
    probe = _unless_held(_ready_for_fork(watched), probe)
    _load_numpy_random()
    collector.freeze_in_forked_children()  # the child inherits as a worker will: frozen (what it copies is measured)
    gate = os.pipe() if meanwhile is not None else ()
    forked = _Forked()
    thread = threading.Thread(target=forked.run, args=(probe, timeout, worker_pages, gate), name="ms_shm-probe",
                              daemon=True)
    try:
        thread.start()
        beside = None
        if gate:  # once the child holds its end of the gate (the thread closes the parent's read end)
            forked.forked.wait()
            beside = _run_meanwhile(meanwhile, gate[1])
        forked.done.wait()
    except BaseException:  # Ctrl-C, SIGTERM's handler: the child's reads are no one's now
        forked.stop()
        raise
    return replace(forked.outcome, beside=beside)


class _HeldAtFork(BaseException):
    """In a probe child: a lock the reads take was held by another thread of the program at the fork. A
    ``BaseException``: the probe's handling of a row's own errors must not take it for one."""


_LOCK_KINDS = (type(threading.Lock()), type(threading.RLock()), threading._RLock, threading.Semaphore)


def _ready_for_fork(watched: Sequence[Any]) -> list:
    """Before the fork: flush the writable files ``watched`` reach (a header the program wrote, still in the
    file's buffer, came out twice in an audit's log: the child's flush wrote it, then the program's), and list
    the ``(where, lock)`` they reach, for the child to try."""
    locks = []
    for where, value in _reach(watched, stop=_LOCK_KINDS) if watched else ():
        if isinstance(value, _LOCK_KINDS):
            locks.append((where, value))
        elif isinstance(value, io.IOBase) and not objects.attribute(value, "closed", True):
            _flush(value)
    return locks


def _flush(stream: Any) -> None:
    try:
        if stream.writable():
            stream.flush()
    except Exception as exc:  # noqa: BLE001 - a stream that cannot flush now: the child may write it again
        log.debug("ms_shm probe: %r not flushed before the fork (%s: %s)", stream, type(exc).__name__, exc)


def _unless_held(locks: list, probe: Callable[[], Any]) -> Callable[[], Any]:
    """``probe``, first trying each lock of ``locks`` in the child: a lock another thread held at the fork is
    held there for good (that thread is not in the child), so a read that takes it would wait the probe's 60 s
    (an audit: a dataset built inside ``with self.lock:``, which its ``__getitem__`` takes too; a module lock a
    thread of the program holds most of the time). Said at once instead, and the stage runs unmeasured."""
    if not locks:
        return probe

    def tried_first() -> Any:  # pragma: no cover - runs in the child
        for where, lock in locks:
            if not lock.acquire(blocking=False):
                raise _HeldAtFork(f"{_named(where, lock)} held by a thread of the program when the probe process "
                                  f"was forked (a thread that process does not have): a read there would wait for "
                                  f"it for ever, so nothing is read ahead")
            lock.release()
        return probe()

    return tried_first


# One probe fork with MindSpore's hooks at a time: two pipelines built at once on two threads each kept the signal
# handlers while the other's hooks had MindSpore's in, and put those back last (as MindSpore's worker threads
# did: ``compat._keep_program_signals``). The child's copy, held, is replaced there (``_child``).
_HOOKED_FORK = threading.Lock()


class _Forked:
    """The probe child, forked, collected and reaped by a thread of its own (``ms_shm-probe``), never by the
    caller's: the kernel sends a child's SIGCHLD to the thread that forked it, and MindSpore's SIGCHLD handler
    (installed once a pipeline has started workers) is not safe to run inside a ``fork``. A child forked by the
    main thread ended while that thread forked MindSpore's next workers, and the handler deadlocked there
    (``DoReleaseShmAndMsg``: a mutex, or ``malloc``): MindSpore's own test_reset.py under ``ms_shm.patch`` hung 4
    runs of 4 in test 27 of 32, raw never. This thread takes the signal while it waits for the child's exit."""

    def __init__(self) -> None:
        self.forked, self.done = threading.Event(), threading.Event()  # the fork returned (or failed); all done
        self.outcome, self.pid = None, None

    def run(self, probe: Callable[[], Any], timeout: float, worker_pages: bool, gate: tuple) -> None:
        try:
            self.outcome = self._fork(probe, timeout, worker_pages, gate)
        except BaseException as exc:  # noqa: BLE001 - never the caller's failure: it plans without the probe
            if self.pid is not None:
                _kill(self.pid)
                self.pid = None
            self.outcome = Outcome(unavailable=f"the probe could not run ({type(exc).__name__}: {exc})")
        finally:
            self.forked.set()
            self.done.set()
        if self.pid is not None:  # its exit (tens of ms with MindSpore loaded) while the caller goes on
            _reap(self.pid)

    def _fork(self, probe: Callable[[], Any], timeout: float, worker_pages: bool, gate: tuple) -> Outcome:
        parent = os.getpid()
        read_end, write_end = os.pipe()
        hooks = _mindspore_fork_hooks()
        with _HOOKED_FORK if hooks is not None else contextlib.nullcontext():
            kept = signal_actions() if hooks is not None else {}
            _call_hook(hooks, "prepare_before_fork")
            try:
                # os.fork itself: warnings.catch_warnings() here made Python forget every warning it had shown
                # once (torch's "will create 3 worker processes" came again for each DataLoader: 2 lines raw, 8
                # under ms_shm)
                began = time.perf_counter()
                pid = os.fork()
                fork_seconds = time.perf_counter() - began
            except OSError as exc:
                _parent_after_fork(hooks, kept)
                for fd in (read_end, write_end, *gate[:1]):  # the gate's write end is the caller's, closed after
                    os.close(fd)
                return Outcome(unavailable=f"fork failed ({type(exc).__name__}: {exc})")
            if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
                _call_hook(hooks, "child_at_fork")
                _die_with(parent)
                os.close(read_end)
                _hold_at_gate(gate)
                _child(probe, write_end, worker_pages)
            self.pid = pid
            _parent_after_fork(hooks, kept)
        for fd in (write_end, *gate[:1]):
            os.close(fd)
        self.forked.set()
        outcome, reaped = _collect(pid, read_end, timeout)
        if reaped:
            self.pid = None
        return replace(outcome, fork_seconds=fork_seconds)

    def stop(self) -> None:
        """The caller was interrupted: the child is killed and reaped, whatever it had read."""
        self.forked.wait(1.0)  # the fork itself, at most: the pid is known once it returned
        if self.pid is not None:
            _kill(self.pid)


def _mindspore_fork_hooks() -> Any:
    """MindSpore's own fork callbacks (``mindspore._c_expression.fork_utils``: ``prepare_before_fork``,
    ``parent_at_fork``, ``child_at_fork``), which ``mindspore.multiprocessing.Process`` calls around its fork and
    which are not registered with ``pthread_atfork``: without them a child that runs an op after the parent ran
    one hangs on the runtime's state copied mid-use (an audit: 60 s, the probe's timeout). Only where MindSpore
    is loaded already (never imported here) and its runtime's queue threads are up (``_runtime_threads``): the
    first hook starts them in a program that had none, and they stayed for its life (the threads audit: with
    them Python 3.12 warned at the program's own later forks). ``None`` where not needed, and on releases
    without them (2.0.0 has none; 2.7.2 has them)."""
    if "mindspore" not in sys.modules:
        return None
    hooks = getattr(sys.modules.get("mindspore._c_expression"), "fork_utils", None)
    return hooks if hooks is not None and _runtime_threads() else None


def _runtime_threads() -> bool:
    """MindSpore's runtime queues run in this process (measured names, 2.7.2-2.10: ``frontend_queue`` once an op
    ran; the others once a fork hook ran); where ``/proc`` cannot say, as if they did. ``frontend_queue`` names
    itself a moment after the op that started it returned (under 1 ms idle): a probe forked inside that moment
    goes without the hooks."""
    names = procfs.thread_names()
    return names is None or not names.isdisjoint(("infer_queue", "launch_queue", "resize_queue", "frontend_queue"))


# The signals a program ends by, whose handlers are the program's own: MindSpore's fork hooks must not keep them
_PROGRAM_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_SIGACTION_BYTES = 512  # more than any libc's ``struct sigaction`` (glibc's: 152): kept and put back whole, unread


def _parent_after_fork(hooks: Any, kept: dict) -> None:
    """MindSpore's ``parent_at_fork``, then the program's signal handlers as they were before
    ``prepare_before_fork``. That hook (2.7.2, 2.8.0, 2.9.0, 2.10.0: measured) installs MindSpore's own SIGINT
    handler, process-wide, and no hook puts Python's back: after a ``build_dataset``, Ctrl-C killed the program
    by SIGTERM (rc 143, no ``KeyboardInterrupt``, no ``finally``, no handler of the script's own) where raw
    raised ``KeyboardInterrupt`` (an audit, 2 runs of 2 and 5 of 5). Raw MindSpore calls these hooks only in
    ``mindspore.multiprocessing``, which a ``GeneratorDataset`` does not use. ``signal.signal`` cannot run on
    this thread, hence ``sigaction``; the caller waits for the fork meanwhile, so no handler of its own is
    being set."""
    _call_hook(hooks, "parent_at_fork")
    _reapply_at_mindspores_own_fork(hooks, put_back_signal_actions(kept))


def _reapply_at_mindspores_own_fork(hooks: Any, theirs: dict) -> None:
    """MindSpore installs its handlers at the first ``prepare_before_fork`` only: put back after ms_shm's probe,
    they would never come where raw has them, once ``mindspore.multiprocessing`` starts a DataLoader's workers
    (an audit, 2.8: Ctrl-C raised ``KeyboardInterrupt`` and the program ended 5.4-6.0 s later, waiting for its
    workers, where raw's handler ended it in 0.1 s; MindSpore's test_kill_main_process timed out). So the first
    call of the hook that is not the probe's sets ``theirs`` (``{signal: MindSpore's sigaction bytes}``) again,
    as raw would have them from then on."""
    if not theirs or hooks is None:
        return

    def reapplying(original: Callable) -> Callable:
        def prepare_before_fork() -> Any:
            hooks.prepare_before_fork = original
            libc = _libc()
            for sig, action in theirs.items() if libc is not None else ():
                libc.sigaction(int(sig), ctypes.create_string_buffer(action, _SIGACTION_BYTES), None)
            return original()
        return prepare_before_fork

    wrap_once(hooks, "prepare_before_fork", reapplying)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library this process runs (one handle, which a forked child keeps), or ``None``."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to ask: each caller goes on without it
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated_bytes() -> int | None:
    """Bytes ``malloc`` has handed out and not had back (glibc 2.33+'s ``mallinfo2``: its heaps' and its
    mmapped chunks'; ~0.7 ms with MindSpore loaded), or ``None`` where the C library does not say. Unlike
    resident memory it grows by a new row even where the row reuses pages a freed one left (16 MiB rows in a
    long-lived process: resident memory did not move)."""
    libc = _libc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None
    info.restype = _MallInfo2
    got = info()
    return int(got.uordblks + got.hblkhd)


def signal_actions(signals: Sequence[signal.Signals] = _PROGRAM_SIGNALS) -> dict:
    """``{signal: its struct sigaction's bytes}`` for ``signals`` (empty where they cannot be read): the C
    library's view, which ``signal.getsignal`` does not have of a handler installed in C."""
    libc, kept = _libc(), {}
    for sig in signals if libc is not None else ():
        buffer = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(int(sig), None, buffer) == 0:
            kept[sig] = buffer.raw
    return kept


def put_back_signal_actions(kept: dict, after: str = "MindSpore's fork hooks") -> dict:
    """Each signal of ``kept`` whose action changed since, put back as it was (logged at DEBUG, ``after`` what);
    returns the actions it replaced, ``{signal: bytes}``."""
    if not kept:
        return {}
    libc, now, replaced = _libc(), signal_actions(tuple(kept)), {}
    for sig, before in kept.items():
        if libc is not None and _what_acts(now.get(sig, before)) != _what_acts(before):
            if libc.sigaction(int(sig), ctypes.create_string_buffer(before, _SIGACTION_BYTES), None) == 0:
                replaced[sig] = now[sig]
                log.debug("ms_shm: %s's handler put back after %s", sig.name, after)
    return replaced


def _what_acts(action: bytes) -> bytes:
    """Of a ``struct sigaction``'s bytes (glibc, x86-64 and aarch64), the handler, the first 64 signals of the
    mask (all the kernel keeps), the flags and the restorer: the C library leaves the rest of its 128-byte mask
    as its own stack had it, which differed from one read to the next (every signal read as changed by
    MindSpore's hooks, and was put back, and said so, where only SIGINT's had)."""
    return action[:16] + action[136:152]


def _call_hook(hooks: Any, name: str) -> None:
    if hooks is None:
        return
    try:
        getattr(hooks, name)()
    except Exception as exc:  # a foreign or partial module: the fork goes on as a bare one
        if name != "child_at_fork":
            log.debug("ms_shm probe: mindspore fork_utils.%s raised %s: %s", name, type(exc).__name__, exc)


def _die_with(parent: int) -> None:  # pragma: no cover - child side
    """The child is killed when the parent dies (``PR_SET_PDEATHSIG``), as the parent's timeout no longer can:
    a program stopped by SIGTERM or SIGKILL while it probed left the child reading on, re-parented to init (an
    audit: 19 s for 10 s rows, for ever for a source that hangs). A parent already gone ends it at once."""
    try:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no C library, or not Linux: the parent's own kill on an exception still applies
        pass
    if os.getppid() != parent:
        os._exit(1)


_gate: int | None = None  # in a probe child: the pipe the parent closes once its ``meanwhile`` has returned
GATE_SECONDS = 5.0  # the longest a child waits for it: a parent's read of the host is tens of milliseconds


def _hold_at_gate(gate: tuple) -> None:  # pragma: no cover - child side
    global _gate
    if gate:
        os.close(gate[1])
        _gate = gate[0]


def _run_meanwhile(meanwhile: Callable[[], Any], gate: int) -> Any:
    try:
        return meanwhile()
    except Exception as exc:  # the caller's own read, which it will make again: never the probe's failure
        log.debug("ms_shm probe: %r beside the probe child raised %s: %s", meanwhile, type(exc).__name__, exc)
        return None
    finally:
        os.close(gate)  # the child's wait_for_parent returns


def wait_for_parent() -> None:
    """In a probe child started with ``meanwhile``: wait (at most ``GATE_SECONDS``) until the parent's work is
    done, before timing work that needs every CPU; elsewhere, return at once. Once per child."""
    global _gate
    if _gate is None:
        return
    fd, _gate = _gate, None
    try:
        select.select([fd], [], [], GATE_SECONDS)
    finally:
        os.close(fd)


_BLINDED: list = []  # in a probe child: the parent's pipes and terminals it reads as empty (``fdguard``)


def blinded() -> list:
    """In a probe child: the descriptors the probe reads as empty, described, for a message naming them."""
    return list(_BLINDED)


def _child(probe: Callable[[], Any], fd: int, worker_pages: bool) -> None:  # pragma: no cover - child side
    """Run the probe silently (a source's prints must not appear twice) and leave without cleanup handlers.

    The descriptors the child shares with the parent are guarded (``fdguard``): a file the source reads through
    an attribute, a global or ``sys.stdin`` is rewound after the probe, and a pipe reads as empty, so the
    program's own reads find every byte.

    Garbage collection stays on, as in a forked worker: what the child inherited is frozen at fork, as a
    worker's is (``collector.freeze_in_forked_children``), and its own objects are collected as a worker's are
    (measured before the freeze: with the collector off here, the 450 MB container test's plan admitted a
    pipeline that was OOM-killed, 1 run in 2)."""
    global _HOOKED_FORK
    _HOOKED_FORK = threading.Lock()  # the parent's is held here by the thread that forked, which this child lacks
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        _quiet_python_streams()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        faulthandler.disable()  # a crash of the reads is the parent's to say (pytest's handler writes to a dup of stderr)
        _one_torch_thread()
        _keep_mindspore_iterators()
        threads_at_start = procfs.thread_count()
        try:
            with fdguard.kept(spare=(fd, _gate)) as blinded:  # a file the source reads is the parent's too
                _BLINDED[:] = blinded
                outside.arm()  # a file the reads would write stays unwritten, and the probe unmeasured
                value = probe()
            payload = ("ok", value, _worker_pages() if worker_pages else None, _threads_started(threads_at_start))
        except _HeldAtFork as exc:
            payload = ("unavailable", str(exc), "")
        except BaseException as exc:  # the parent decides what an exception means
            payload = ("error", exc, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        if outside.refused():  # whatever the reads did after it, they did not run as in the program
            payload = ("outside", outside.refused(), "")
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result or exception: send its text
            text = payload[2] if payload[0] == "error" else ""
            data = pickle.dumps(("unpicklable", f"{type(exc).__name__}: {exc}", text))
        with io.FileIO(fd, "wb", closefd=True) as out:
            out.write(data)
    finally:
        os._exit(0)


def _quiet_python_streams() -> None:  # pragma: no cover - child side
    """Point ``sys.stdout``, ``sys.stderr`` and every ``logging`` handler's stream at ``/dev/null`` in the child,
    never writing or flushing the program's own stream objects there: what the program had written and not yet
    flushed would come out twice (a notebook's kernel sends a forked child's output on: a ``print`` made before
    the build showed twice in an audit), and a stream's buffer lock that another thread of the program held at the
    fork is held for good in the child (an audit's thread logging to a file: the probe, logging too, waited its
    60 s). ``logging``'s own handler locks are made anew at a fork by ``logging`` itself."""
    try:
        quiet = open(os.devnull, "w")  # noqa: SIM115 - the child's, for its life
    except OSError:  # no /dev/null to open: the descriptors 1 and 2 point there already, if anywhere
        return
    sys.stdout = sys.stderr = quiet
    for handler in _logging_handlers():
        if isinstance(handler, logging.StreamHandler):
            try:
                handler.stream = quiet  # not setStream: it flushes the program's stream
            except AttributeError:  # a property (logging's last resort writes to sys.stderr, quiet now)
                pass


_KEPT: list = []  # in a probe child: the program's MindSpore iterators, never finalized there


def _keep_mindspore_iterators() -> None:  # pragma: no cover - child side
    """Hold every MindSpore iterator the program had at the fork, so that none is finalized here: one the program
    had left in a reference cycle (a traceback that ``pytest.raises`` holds) was collected in the child, and its
    ``stop()`` waited for ever on the runtime's threads, which a fork does not copy; each later pipeline's probe
    then waited out its 60 s timeout (MindSpore's own ``test_datasets_generator.py`` under ``patch()``). It is
    garbage in the program too, and the program's own collection finalizes it there."""
    iterators = sys.modules.get("mindspore.dataset.engine.iterators")
    for ref in getattr(iterators, "ITERATORS_LIST", None) or ():
        try:
            _KEPT.append(ref())
        except Exception:  # a foreign module, or a list of something else: nothing to hold
            return


def _one_torch_thread() -> None:  # pragma: no cover - child side
    """As a torch worker does first (``torch.set_num_threads(1)``): an intra-op pool the parent started does not
    survive a fork, and a conv in the child hung until the probe's timeout (PyTorch's ``test_conv_after_fork``,
    60 s under ms_shm before). Where torch is loaded only; never imported here."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None:
            torch.set_num_threads(1)
    except Exception:  # a partial or foreign module named torch: nothing to set
        pass


def _threads_started(at_start: int | None) -> int | None:  # pragma: no cover - child side
    """Threads the probe's work left running: a fork keeps only the calling thread, so a BLAS or OpenMP pool
    the rows used is started again here, as in a worker, and stays. A thread the probe joined (the pair's) may
    still be leaving the kernel's list for a moment after ``join``: it is looked at again after a pause."""
    for pause in (0.0, 0.001, 0.003):
        time.sleep(pause)
        now = procfs.thread_count()
        if at_start is None or now is None:
            return None
        if now <= at_start:
            return 0
    return now - at_start


def _worker_pages() -> int | None:  # pragma: no cover - child side
    """What the child holds alone, its freed heap given back first (``malloc_trim``): the probe's rows, freed
    but kept by the allocator, made the reading swing by a row or two from one build to the next (12 MiB rows:
    32-44 MiB), which flipped plans in a container. The row a worker is building is priced by the caller."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # no C library, or not glibc: the reading keeps what the allocator kept
        pass
    return procfs.private_bytes()


def _collect(pid: int, fd: int, timeout: float) -> tuple:
    """``(outcome, reaped)``: what the child sent, and whether its exit status was collected here (a child that
    died or hung), so it is collected once: a pid waited for twice may by then be another child's."""
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                _kill(pid)
                # the program waited that long: said where it is seen, whatever the plan keeps (an explicit
                # num_parallel_workers=1 was built after 60 s with one INFO line)
                log.warning("ms_shm: a probe of this pipeline's rows did not finish within %.0f s and was stopped; "
                            "the pipeline is planned without it (set %s to wait longer)", timeout, TIMEOUT_ENV)
                return Outcome(unavailable=f"the probe did not finish within {timeout:.0f} s (set {TIMEOUT_ENV} "
                                           f"to wait longer); it was stopped"), True
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    if chunks:  # the child closed its end after writing: what is left is its exit, reaped by the probe's thread
        return _decode(b"".join(chunks)), False
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # collected already: a SIGCHLD handler that reaps every child (MindSpore's may)
        return Outcome(unavailable="the probe process died before reporting (its exit status was collected "
                                   "by another handler)"), True
    how = _signal_text(os.WTERMSIG(status)) if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return Outcome(unavailable=f"the probe process died ({how}) before reporting{_oom_hint() if killed else ''}"), True


def _signal_text(number: int) -> str:
    """``"signal 11, SIGSEGV: a crash in native code the reads ran"``: the number alone sent an audit to ms_shm's
    code for a dataset's own segmentation fault, which its loader's workers then met too."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    crash = name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL")
    return f"signal {number}, {name}" + (": a crash in native code the reads ran, which the pipeline's own "
                                         "reads will meet too" if crash else "")


def _oom_hint() -> str:
    """Why a probe child was SIGKILLed, where a memory limit makes the OOM killer the likely cause: reading a
    few rows in a 230 MB container killed it, and the loader built as asked was killed next."""
    try:
        limit, usage = host.read_memory(*host.memory_dirs())
    except Exception:  # no cgroup to read: the cause stays unnamed
        return ""
    if not limit:
        return ""
    return (f": most likely the OOM killer, this process's memory cgroup is limited to {mib(limit)} "
            f"({mib(usage)} in use); reading rows leaves no room, give the container more memory")


def _reap(pid: int) -> None:
    """Collect the child's exit status, so no zombie is left."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # already collected (by a SIGCHLD handler that reaps every child, or stop's _kill)
        pass


def _decode(data: bytes) -> Outcome:
    try:
        payload = pickle.loads(data)
    except Exception as exc:  # e.g. an exception class that cannot be rebuilt here
        return Outcome(unavailable=f"the probe's result could not be read ({type(exc).__name__}: {exc})")
    if payload[0] == "ok":
        return Outcome(value=payload[1], private_bytes=payload[2], threads_started=payload[3])
    if payload[0] == "error":
        return Outcome(error=payload[1], remote_traceback=payload[2])
    if payload[0] == "unavailable":
        return Outcome(unavailable=payload[1])
    if payload[0] == "outside":
        return Outcome(unavailable=f"the probe's reads would {payload[1]}, a change outside this process that a "
                                   f"probe cannot take back: nothing is measured, so only the run makes it")
    return Outcome(unavailable=f"the probe's result could not be sent ({payload[1]})", remote_traceback=payload[2])


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


# --- what the probe changed -------------------------------------------------------------------------------

def rng_state() -> tuple:
    """The global ``random``, ``numpy.random`` (what ``ds.config.set_seed`` seeds) and, where loaded, ``torch``
    generator states, compared whole: hashing them cost a fork ~4-6 ms of OpenSSL's first use."""
    kind, keys, pos, gauss, cached = np.random.get_state()
    torch = sys.modules.get("torch")  # PyTorch's global generator, where torch is in use (never imported here)
    torch_state = None
    if torch is not None and hasattr(torch, "random"):
        try:
            torch_state = bytes(torch.random.get_rng_state().numpy())
        except Exception:  # a partial or foreign module named torch: its state is not ours to read
            pass
    return random.getstate(), keys.tobytes(), kind, pos, gauss, cached, torch_state


def _load_numpy_random() -> None:
    """Import ``numpy.random`` here, before forking: NumPy 2 imports it on first use and the child reads its
    global state, so every probe fork of a program that had not imported it (torch does not) paid 11-22 ms for
    the import (measured: torch 2.13, NumPy 2.4). Paid here once; MindSpore imports it itself."""
    if "numpy.random" not in sys.modules:
        import numpy.random  # noqa: F401


_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset, bytearray, collections.deque)
_SMALL_ARRAY = 4096  # bytes: an array this small (a counter table, a histogram) is compared by its bytes
# bytes: a larger array (a visit count per row of a dataset) is compared by a checksum, up to this size each and
# ``_SUMMED_BYTES`` in one fingerprint of the objects (a dataset's own data, hundreds of MiB, is not read)
_SUMMED_ARRAY = 1 << 20
_SUMMED_BYTES = 8 << 20
_SUMMED_ITEMS = 4096  # a longer list or dict than the walk looks into (``_WALK_ITEMS``) is compared by its items
# up to this many: a count per row (``self.seen[i] += 1``) keeps its length


class _ChecksumBudget:
    """The checksums one ``state_of`` may still take (``_SUMMED_BYTES``): the walk's order is the same on every
    call, so the same arrays are summed each time."""

    def __init__(self) -> None:
        self.left = _SUMMED_BYTES

    def take(self, nbytes: int) -> bool:
        if nbytes > _SUMMED_ARRAY or nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def _cell(value: Any, budget: _ChecksumBudget | None = None) -> tuple:
    """A cheap fingerprint of one value: identity, plus value or length, plus a RNG's state, a cache's counts,
    a counter's value, an array's bytes or checksum. Only the built-in containers are asked their length: a
    user's ``__len__`` may read a file (what they hold is walked instead)."""
    if isinstance(value, _SCALARS):
        return ("v", value if not isinstance(value, (str, bytes)) or len(value) < 256 else hash(value))
    if isinstance(value, np.random.Generator):
        return ("rng", id(value), repr(value.bit_generator.state))
    if isinstance(value, np.random.RandomState):
        return ("rs", id(value), value.get_state()[1].tobytes(), value.get_state()[2])
    if isinstance(value, random.Random):
        return ("r", id(value), hash(value.getstate()))
    if isinstance(value, np.ndarray):
        return ("a", id(value), value.shape, value.__array_interface__["data"][0], _array_content(value, budget))
    if isinstance(value, np.generic):
        return ("g", value.item() if value.dtype != object else id(value))
    if isinstance(value, array.array):  # its length and bytes: a buffer, not a container whose items are walked
        return ("arr", id(value), len(value), _buffer_content(value, len(value) * value.itemsize, budget))
    if isinstance(value, _CONTAINERS):
        return ("o", id(value), objects.stored_length(value), _items_content(value))
    if isinstance(value, itertools.count):
        return ("count", id(value), repr(value))  # its repr is its next value: ``count(7)``
    cache_info = getattr(value, "cache_info", None) if isinstance(value, _LRU_CACHE) else None
    if cache_info is not None:  # an ``lru_cache``'d function: its hits and misses count the calls
        return ("lru", id(value), tuple(cache_info()))
    return ("o", id(value), None)


_LRU_CACHE = type(functools.lru_cache(maxsize=None)(len))


def _array_content(values: np.ndarray, budget: _ChecksumBudget | None) -> Any:
    """An array's bytes (small), a checksum of them (within the fingerprint's budget), or ``None``."""
    if values.dtype == object:
        return None
    return _buffer_content(values if values.flags.c_contiguous else np.ascontiguousarray(values), values.nbytes,
                           budget)


def _buffer_content(buffer: Any, nbytes: int, budget: _ChecksumBudget | None) -> Any:
    """A contiguous buffer's bytes (small), a checksum of them (within the fingerprint's budget), or ``None``."""
    view = memoryview(buffer).cast("B")
    if nbytes <= _SMALL_ARRAY:
        return view.tobytes()
    if budget is None or not budget.take(nbytes):
        return None
    return zlib.crc32(view)


def _items_content(container: Any) -> Any:
    """A hash of a list's, tuple's or dict's plain items (the scalars themselves, others by identity), for one
    longer than the walk looks into (``_WALK_ITEMS``) and at most ``_SUMMED_ITEMS`` long: a list counting reads
    per row keeps its length."""
    if not isinstance(container, (list, tuple, dict)) or \
            not _WALK_ITEMS < objects.stored_length(container) <= _SUMMED_ITEMS:
        return None
    stored = objects.as_stored(container)
    items = stored.values() if isinstance(stored, dict) else stored
    return hash(tuple(v if type(v) in _SCALARS else id(v) for v in items))


def state_of(objects: Sequence[Any]) -> tuple:
    """What each of ``objects`` holds, at any depth (``_reach``: attributes, items of short lists and dicts,
    closure cells, partial arguments, class attributes, the globals its code names), fingerprinted under each
    path: a counter kept in a global, a class attribute, a closure's dict or a nested object is state kept per
    read just as one in the object's own attribute is, and a worker process would change only its copy."""
    return tuple(_state_by_path(obj) for obj in objects)


def _state_by_path(obj: Any) -> tuple:
    budget = _ChecksumBudget()
    return tuple((where, _cell(value, budget)) for where, value in _reach([obj]))


def changed_attributes(before: tuple, after: tuple, objects: Sequence[Any]) -> str | None:
    """Which path the probe changed, named for the log (``Counter.calls``, ``op.<global SEEN>``), or ``None``."""
    for b, a in zip(before, after):
        if a != b:
            old, new = set(b), set(a)
            changed = [where for where, cell in a if (where, cell) not in old] or \
                [where for where, cell in b if (where, cell) not in new]
            return f"{changed[0]} changed while rows were read"
    return None


_WATCHING: list = []  # [objects, their state after the run's first read or None] while ``watch_effects`` runs


def first_read_done() -> None:
    """Said by a probe's run once its first row is read (or its operations' first input is run): where the
    objects change again after it, their state is kept per read, not set up lazily by the first read. A re-read of
    the first row cannot tell: a vocabulary numbering each new word as it meets it changed nothing then, and
    the map (and the source) that built it was planned as 2 worker processes, each numbering the words anew (an
    audit: the rows came out other than raw's)."""
    if _WATCHING and _WATCHING[1] is None:
        _WATCHING[1] = state_of(_WATCHING[0])


def watch_effects(run: Callable[[], Any], objects: Sequence[Any], reread: Callable[[], str | None] | None = None,
                  again: Callable[[], Any] | None = None) -> tuple[Any, Effects]:
    """``run()`` and what it changed, then ``reread()`` (why a row read again differs, or ``None``): meant for
    the child, where the changes are thrown away.

    Where ``run()`` changed the objects' attributes, its later reads (after ``first_read_done``) tell lazy
    set-up (changed once, on the first read) from state kept per read (changed again); else one more read:
    whatever ``reread`` read, or else ``again()``."""
    generators, handles = held_generators(objects), held_handles(objects)
    rng0, state0, own0 = rng_state(), state_of(objects), _states(generators)
    _WATCHING[:] = [objects, None]
    try:
        value = run()
    finally:
        after_first = _WATCHING[1] if _WATCHING else None
        _WATCHING.clear()
    draws = None
    if rng_state() != rng0:
        draws = "rows draw from the global random / numpy.random state"
    elif _states(generators) != own0:
        draws = f"rows draw from a random generator the source or operation holds ({_moved(generators, own0)})"
    elif generators:
        draws = (f"the source or operation holds a random generator ({generators[0][0]}): the rows read here did not "
                 f"draw from it, others may")
    state1 = state_of(objects)
    differs = reread() if reread is not None and draws is None else None
    mutated = changed_attributes(state0, state1, objects)
    per_read = None
    later = changed_attributes(after_first, state1, objects) if mutated and after_first is not None else None
    if later and draws is None and differs is None:
        per_read = f"{later} after the first row, not only on it"
    elif mutated and draws is None and differs is None:
        state2 = state_of(objects)
        if state2 == state1 and again is not None:
            again()
            state2 = state_of(objects)
        changed = changed_attributes(state1, state2, objects)
        per_read = f"{changed} on every read, not only the first" if changed else None
    # a handle open before the reads is the program's, open there, whether or not the probe's reads closed it (a
    # lazy loader reading its file to the end and closing it, on the first read of each of 2 threads at once)
    return value, Effects(draws, differs, mutated, per_read, handles or held_handles(objects))


# attributes of attributes...: a dataset's transform's generator is 2-3 levels down, but composed objects hold
# theirs deeper (an audit: a file at ``src.sub.base.datasets[0].reader.fh``, a seeded generator in
# ``src.cfg.transform.transforms[0].t.rng``, both missed at 4: 2 threads raced on the file's offset, and drew the
# augmentations in another order, where raw's one thread read raw's rows)
_WALK_DEPTH = 7
_WALK_OBJECTS = 400  # objects looked at, at most: the walk costs well under a millisecond
_WALK_VALUES = 4000  # values listed, at most (objects with many attributes)
_WALK_ITEMS = 64  # a longer list or dict is data (file names, labels), not where generators are kept...
_WALK_SPREAD = 8  # ...but for a few of its items, spread over it: one of many alike holds what the others do
_SKIP = (type(None), bool, int, float, complex, str, bytes, bytearray, np.ndarray, np.generic)


def _generator_kinds() -> tuple:
    kinds = [np.random.Generator, np.random.RandomState, random.Random]
    torch = sys.modules.get("torch")  # never imported here
    generator = getattr(torch, "Generator", None) if torch is not None else None
    if isinstance(generator, type):
        kinds.append(generator)
    return tuple(kinds)


def held_generators(objects: Sequence[Any], apart: Sequence[Any] = ()) -> list:
    """``(where, generator)`` for the random generators ``objects`` hold (``_holding``), not looking into
    ``apart``. A generator a worker process copies draws the same numbers in every worker, so these decide as the
    global RNG does."""
    return _holding(objects, _generator_kinds(), apart)


# What a forked child shares with its parent instead of copying (``multiprocessing``'s locks, semaphores,
# barriers, shared values and arrays, manager proxies, queues, pipes, shared memory), by module and class name:
# never imported here, so only the modules the program loaded count.
_SHARED_KINDS = (("multiprocessing.synchronize", ("SemLock", "Condition", "Event", "Barrier")),
                 ("multiprocessing.sharedctypes", ("SynchronizedBase",)),
                 ("multiprocessing.heap", ("BufferWrapper",)),  # RawValue / RawArray
                 ("multiprocessing.managers", ("BaseProxy",)),
                 ("multiprocessing.queues", ("Queue", "SimpleQueue")),
                 ("multiprocessing.connection", ("Connection",)),
                 ("multiprocessing.shared_memory", ("SharedMemory", "ShareableList")))


# Threads a forked child does not have: a source that hands its reads to a pool waits there forever (60 s, the
# probe's timeout, in a run that printed nothing).
_THREAD_KINDS = (("concurrent.futures._base", ("Executor",)), ("threading", ("Thread",)))
# A queue a thread of the program fills: empty when the pipeline is built, a read in the child waits as long (an
# audit's stream over a ``queue.Queue`` filled once the pipeline was built). One holding items is the child's own
# copy to read (an audit's free-list of buffers: refused by kind, its pipeline lost its plan and died of
# ``ShmFullError`` under 64 MB).
_QUEUE_KINDS = (("queue", ("Queue", "SimpleQueue")),)
# What a stream reads its rows off, shared with a forked child: what the child reads there, the program never
# gets (files are rewound and pipes blinded in the child, ``fdguard``; a socket is neither).
_STREAM_KINDS = (("socket", ("socket",)),)
# What a reader holds open, with a position or a thread of its own: streams (files, BytesIO), sockets, a memory
# map read by ``seek`` and ``read`` (an audit: 159-191 rows of 200 wrong where threads shared one; ``np.memmap``,
# read by slices, is an array), and the database and array-file handles datasets keep (by module: never imported
# here; an LMDB transaction and its cursors belong to one thread).
_HANDLE_KINDS = (("io", ("IOBase",)), ("socket", ("socket",)), ("mmap", ("mmap",)),
                 ("sqlite3", ("Connection", "Cursor")), ("h5py", ("File", "Dataset")),
                 ("lmdb", ("Environment", "Transaction", "Cursor")))
# An LMDB environment opened with its lock file (``lmdb.open``'s default ``lock=True``): each thread that reads
# takes a slot of its reader table under the pid that opened it, and a probe process's slots stay taken while
# this process lives (an audit: ``MDB_READERS_FULL`` at the 31st pipeline built, where raw built 40).
_LMDB_KINDS = (("lmdb", ("Environment",)),)


def _kinds(table: tuple) -> tuple:
    return tuple(getattr(sys.modules[module], name) for module, names in table if module in sys.modules
                 for name in names if isinstance(getattr(sys.modules[module], name, None), type))


def _named(where: str, obj: Any) -> str:
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


_PLAIN_SCALARS = (bool, int, float, complex, str, bytes)


def reads_purely(source: Any) -> bool:
    """A ``list``, ``tuple`` or numpy array as it is (no subclass, no ``object`` dtype): reading its rows runs
    none of the program's code, so a probe needs no fork to leave the program as it was (a fork with MindSpore
    loaded costs ~15 ms; an audit ran MindSpore's own tests of 30 small in-memory pipelines 8x slower patched)."""
    if type(source) is np.ndarray:
        return source.dtype != object
    return type(source) in (list, tuple)


def is_plain_row(row: Any) -> bool:
    """A row of plain values (numbers, strings, bytes, numpy arrays other than ``object`` ones), alone or in a
    tuple or list: converting it runs none of the program's code."""
    values = row if type(row) in (list, tuple) else (row,)
    return all(type(v) in _PLAIN_SCALARS or isinstance(v, np.generic) and not isinstance(v, np.object_)
               or type(v) is np.ndarray and v.dtype != object for v in values)


class NotPlainData(BaseException):
    """A row of a ``reads_purely`` source that holds an object of the program's: read it in a fork after all. A
    ``BaseException``: the probe's handling of a row's own errors must not take it for one."""


class PlainRows:
    """A ``reads_purely`` source as the probe reads it in this process: each row checked ``is_plain_row``."""

    def __init__(self, source: Any):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: Any) -> Any:
        row = self.source[index]
        if not is_plain_row(row):
            raise NotPlainData(type(row).__name__)
        return row


def shared_with_processes(objects: Sequence[Any]) -> str | None:
    """Why ``objects`` cannot be read in a probe child, or ``None``: they hold (``_holding``) something the
    child would share with the program rather than copy, or threads it would not have. A read there would change
    it for the program too, or wait on it (PyTorch's ``test_dataloader`` datasets count samples in a
    ``multiprocessing.Value`` and wait on a ``Semaphore`` only the real workers release: the probe added one to
    the count and waited 60 s; a source reading through its ``ThreadPoolExecutor`` waited as long)."""
    found = _holding(objects, _kinds(_SHARED_KINDS))
    if found:
        return (f"{_named(*found[0])}, shared with other processes: a read in a probe process would change it for "
                f"the program too (or wait on it), so nothing is read ahead")
    found = _shared_writable(objects)
    if found:
        return (f"{_named(*found[0])} over writable memory shared with other processes: what a read in a probe "
                f"process writes there, the program would see, so nothing is read ahead")
    found = [(where, env) for where, env in _holding(objects, _kinds(_LMDB_KINDS)) if _locks_readers(env)]
    if found:
        return (f"{_named(*found[0])} opened with its lock file: each reading thread of a probe process would keep "
                f"a slot of its reader table taken while this program runs, so nothing is read ahead (open it "
                f"with lock=False to read it only, or open it in the reader: worker_init_fn, first read)")
    found = _holding(objects, _kinds(_THREAD_KINDS)) + [
        (where, q) for where, q in _holding(objects, _kinds(_QUEUE_KINDS)) if _empty(q)]
    if found:
        return (f"{_named(*found[0])}, whose threads a forked probe process would not have (a read there would wait "
                f"on them): nothing is read ahead")
    return None


def _locks_readers(env: Any) -> bool:
    try:
        return bool(env.flags().get("lock", True))
    except Exception:  # noqa: BLE001 - closed, or an environment that cannot say: as lmdb.open's default
        return not objects.attribute(env, "closed", False)


def _shared_writable(objects_: Sequence[Any]) -> list:
    """``(where, array)`` for the writable arrays (and torch tensors) ``objects_`` hold whose memory is mapped
    shared with other processes (``multiprocessing.Array``, ``SharedMemory.buf``, ``np.memmap`` in ``r+`` mode, a
    writable ``mmap``): what a probe process writes there, the program sees (an audit's count of visits per row,
    the shared-cache idiom: 44 where raw counted 40). An array over numpy's own memory is never asked."""
    candidates = []
    for where, value in _reach(objects_):
        address = _foreign_address(value)
        if address is not None:
            candidates.append((where, value, address))
    if not candidates:
        return []
    shared = procfs.shared_writable_ranges()
    return [(where, value) for where, value, address in candidates
            if any(start <= address < end for start, end in shared)]


def _foreign_address(value: Any) -> int | None:
    """Where a writable array's (or tensor's) memory starts, if it is not numpy's own allocation; else ``None``."""
    if isinstance(value, np.ndarray):
        if not value.flags.writeable or value.nbytes == 0:
            return None
        base = value
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, np.ndarray) and not isinstance(value, np.memmap):
            return None  # numpy's own memory, private to this process
        return value.__array_interface__["data"][0]
    if _is_tensor(value):
        try:
            return value.data_ptr() if value.device.type == "cpu" and value.numel() and value.is_shared() else None
        except Exception:  # noqa: BLE001 - a tensor that cannot say: as a private one
            return None
    if isinstance(value, mmap.mmap):
        try:  # a read-only or closed map refuses a writable view
            view = ctypes.c_char.from_buffer(value)
        except (TypeError, ValueError, BufferError):
            return None
        address = ctypes.addressof(view)
        del view  # the export would keep the map from being closed
        return address
    return None


def _empty(queue_: Any) -> bool:
    try:
        return bool(queue_.empty())
    except Exception:  # noqa: BLE001 - a queue that cannot say: as if a thread were to fill it
        return True


def stream_blocker(objects: Sequence[Any]) -> str | None:
    """Why the head of a stream (an iterable source or dataset) cannot be read in a probe child, or ``None``: it
    holds an open socket, whose bytes a read in the child takes from the program (an audit: a generator over a
    ``socketpair`` gave 17 of 20 rows through ``ms_shm.map``, the 3 the probe read were gone, and nothing was
    said). A map-style dataset's socket stays readable, for a request and reply are whole in the child; one that
    reads a stream off it there loses rows, as does a socket this walk does not reach (README, Known
    limitations)."""
    found = [(where, obj) for where, obj in _holding(objects, _kinds(_STREAM_KINDS))
             if getattr(obj, "fileno", lambda: -1)() != -1]
    if not found:
        return None
    return (f"{_named(*found[0])}, open: a stream's rows read in a probe process would be taken off it for good, "
            f"so nothing is read ahead")


def _logging_streams() -> set:
    """The streams ``logging``'s handlers write to: each write holds the handler's lock, so threads share them
    safely (a dataset holding a logger with a ``FileHandler`` reaches its file)."""
    return {id(getattr(h, "stream", None)) for h in _logging_handlers()}


def _logging_handlers() -> list:
    """Every handler of the root logger and of the loggers made so far."""
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers]


def held_handles(objects: Sequence[Any]) -> str | None:
    """``Effects.holds_handle``: the first open stream or connection ``objects`` hold, named, or ``None``."""
    shared = {id(stream) for stream in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__,
                                        sys.__stderr__)} | _logging_streams()  # shared anyway, or locked
    found = [(where, obj) for where, obj in _holding(objects, _kinds(_HANDLE_KINDS))
             if id(obj) not in shared and not getattr(obj, "closed", False)]
    if not found:
        return None
    return (f"{_named(*found[0])}, open: its position (or its thread) belongs to the reader that uses it, and "
            f"other readers would share or race on it")


def _holding(objects: Sequence[Any], kinds: tuple, apart: Sequence[Any] = ()) -> list:
    """``(where, object)`` for the instances of ``kinds`` ``objects`` hold at any depth (``_reach``), each once."""
    found: dict = {}
    for where, obj in _reach(objects, stop=kinds, apart=apart):
        if isinstance(obj, kinds):
            found.setdefault(id(obj), (where, obj))
    return list(found.values())


def _reach(objects: Sequence[Any], stop: tuple = (), apart: Sequence[Any] = ()) -> list:
    """``(where, value)`` for ``objects`` and what they hold: attributes, items of short lists and dicts (and a
    spread few of longer ones), closure cells, the module globals their code (and their classes' methods) names,
    their classes' own data (a class named by the code too). Values are listed where they are held, each object
    looked into once (never modules, arrays, tensors, instances of ``stop`` or the objects ``apart``). Bounded
    (``_WALK_*``); never raises. Level by level: where the bound is met, what is left unseen is the deepest, never
    a shallow attribute behind a deep branch walked first."""
    out, seen = [], {id(obj) for obj in apart if obj is not None}
    queue = collections.deque((obj, type(obj).__name__, 0) for obj in objects)
    while queue and len(seen) < _WALK_OBJECTS and len(out) < _WALK_VALUES:
        obj, where, depth = queue.popleft()
        looked = id(obj) in seen
        out.append((where, obj))
        if looked or isinstance(obj, _SKIP) or isinstance(obj, types.ModuleType) or _is_tensor(obj):
            continue
        seen.add(id(obj))
        if depth >= _WALK_DEPTH or (stop and isinstance(obj, stop)):
            continue
        try:
            children = _children(obj)
        except Exception:  # an object that cannot be looked into: what it holds stays unseen
            continue
        queue.extend((child, f"{where}{name}" if name.startswith("[") else f"{where}.{name}", depth + 1)
                     for name, child in children)
    return out


def _is_tensor(obj: Any) -> bool:
    """A torch tensor is data, like an array: its state is its bytes, not attributes worth walking."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    return isinstance(tensor, type) and isinstance(obj, tensor)


def _children(obj: Any) -> list:
    if isinstance(obj, (list, tuple, set, frozenset, dict)):
        if objects.stored_length(obj) > _WALK_ITEMS:
            return _spread_items(objects.as_stored(obj))
        obj = objects.as_stored(obj)  # never a subclass's own reads: the program's code
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(sorted(obj, key=repr))]
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, types.MethodType):
        return [("__self__", obj.__self__), ("__func__", obj.__func__)]
    if isinstance(obj, types.FunctionType):
        return _function_children(obj)
    if isinstance(obj, functools.partial):
        return [("func", obj.func), ("args", obj.args), ("keywords", obj.keywords)]
    if isinstance(obj, type):
        return _class_data(obj)
    out = []
    attrs = objects.attribute(obj, "__dict__")
    if isinstance(attrs, dict) and len(attrs) <= 4 * _WALK_ITEMS:
        out += list(attrs.items())
    for name in getattr(type(obj), "__slots__", ()):
        value = objects.attribute(obj, name, _NOTHING)
        if value is not _NOTHING:
            out.append((name, value))
    return out + _class_children(type(obj))


def _spread_items(container: Any) -> list:
    """A few items of a long list or dict, spread from its first to its last: such a container is mostly data
    (file names, labels), but one of many alike (shard readers, each holding its open file, under a
    ``ConcatDataset``: an audit's 100 shards) holds what its neighbours hold."""
    if isinstance(container, (set, frozenset)):
        return []  # no order to spread over without sorting them all
    if isinstance(container, dict):  # its first and its last: a dict has no cheap middle
        half = _WALK_SPREAD // 2
        ends = [*itertools.islice(container.items(), half), *itertools.islice(reversed(container.items()), half)]
        return [(f"[{k!r}]", v) for k, v in dict(ends).items()]
    picks = sorted({round(k * (len(container) - 1) / (_WALK_SPREAD - 1)) for k in range(_WALK_SPREAD)})
    return [(f"[{i}]", container[i]) for i in picks]


_READ_METHODS = ("__getitem__", "__call__", "__iter__", "__next__")


def _class_children(cls: type) -> list:
    """What an instance's class holds that its reads may use: the reading methods (for the globals they name)
    and the class's data."""
    methods = [(name, getattr(cls, name, None)) for name in _READ_METHODS]
    return [(name, f) for name, f in methods if isinstance(f, types.FunctionType)] + _class_data(cls)


def _class_data(cls: type) -> list:
    """A class's own data attributes, and its bases' (``Counter.count += 1`` keeps its state there), for classes
    written in Python: not methods, properties or descriptors. Their current values, under names found once per
    class (a tensor's class alone has hundreds of attributes to sort out)."""
    return [(f"<class {klass.__name__}.{name}>", vars(klass).get(name)) for klass, name in _class_data_names(cls)]


@functools.lru_cache(maxsize=1024)
def _class_data_names(cls: type) -> tuple:
    out = []
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins" or not isinstance(vars(klass), types.MappingProxyType):
            continue
        out += [(klass, name) for name, value in list(vars(klass).items())
                if not name.startswith("__") and not callable(value) and not _descriptor(value)]
    return tuple(out)


def _descriptor(value: Any) -> bool:
    return isinstance(value, (property, staticmethod, classmethod, types.MemberDescriptorType,
                              types.GetSetDescriptorType)) or hasattr(type(value), "__get__")


_NOTHING = object()


def _function_children(function: types.FunctionType) -> list:
    """A function's closure cells, its arguments' default values (``def rows(reader=reader)`` binds as a closure
    does: an audit's stream held its socket so), the module globals its code names (nested code included) and,
    of a module of the program it names, the attributes it names (``_named_in``)."""
    out = [(f"<closure {name}>", cell.cell_contents) for name, cell in
           zip(function.__code__.co_freevars, function.__closure__ or ()) if _filled(cell)]
    defaults = function.__defaults__ or ()
    positional = function.__code__.co_varnames[:function.__code__.co_argcount]
    out += [(f"<default {name}>", value) for name, value in zip(positional[len(positional) - len(defaults):],
                                                                defaults)]
    out += [(f"<default {name}>", value) for name, value in (function.__kwdefaults__ or {}).items()]
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    scope = function.__globals__
    out += [(f"<global {name}>", scope[name]) for name in sorted(names) if name in scope]
    return out + [(f"{where}.{attr}", value) for where, module in out if isinstance(module, types.ModuleType)
                  and objects.of_program(module.__name__) for attr, value in _named_in(module, names)]


def _named_in(module: types.ModuleType, names: set) -> list:
    """The attributes of a module of the program that the code names (``aug.jitter(x)``, ``vocab.VOCAB``), each
    where the code reaches it: a generator or a vocabulary kept in another module of the program is state as one
    in the dataset's own is (an audit: ``myaug._RNG`` drawn for 2 samples of 16, a vocabulary grown in
    ``vocab.VOCAB``; workers drew and numbered apart, and the program's vocabulary stayed empty)."""
    space = objects.attribute(module, "__dict__", {})
    return [(attr, space[attr]) for attr in sorted(names) if attr in space and not attr.startswith("__")]


def _filled(cell: Any) -> bool:
    """A closure cell holds a value (an empty one raises ``ValueError``: its variable is not yet bound)."""
    return objects.has(cell, "cell_contents")


def _states(generators: list) -> tuple:
    return tuple(_generator_state(g) for _, g in generators)


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, (np.random.Generator, np.random.RandomState, random.Random)):
        return _cell(generator)
    try:  # torch.Generator
        return bytes(generator.get_state().numpy())
    except Exception:  # a generator whose state cannot be read: its identity only
        return id(generator)


def _moved(generators: list, before: tuple) -> str:
    return next((where for (where, g), b in zip(generators, before) if _generator_state(g) != b), "?")


__all__ = ["Effects", "Outcome", "run_in_fork", "wait_for_parent", "watch_effects", "blinded", "rng_state",
           "state_of", "held_generators"]
