"""Native threads per worker process: W MindSpore workers each start one BLAS/OpenMP/OpenCV thread per core, so
on C usable CPUs ``W x T`` threads compete for C cores and the kernel spends its time switching between them
(MindSpore's FAQ blames high ``sy`` time on this). ms_shm caps each worker's pools to ``C // W`` threads.

Probe, decide and apply are separate, as in threadpoolctl itself:

* ``probe()`` reads the pools loaded in this process (a ``threadpoolctl.ThreadpoolController``, and OpenCV's
  count only when ``cv2`` is already imported: nothing heavy is imported here) into a frozen ``ThreadPools``.
* ``decide()`` is pure: workers, pool threads and usable CPUs in, a ``ThreadCap`` (a threads-per-worker or no cap,
  and the reason) out.
* ``CappedSource`` / ``CappedCall`` carry the cap into the workers: on the first row a worker process reads (its
  pid differs from the pid that built the plan) they limit its pools to ``n`` there, once: through the
  controller the plan read where the worker was forked from it, else ``threadpoolctl.threadpool_limits(n)``. The
  main process's pools, environment and globals are never changed; a row read in the main process (threads,
  ``dataset[i]``) goes straight through.

``MS_SHM_THREAD_CAP=0`` turns the cap off. ``threadpool_limits`` acts at run time on loaded libraries, so fork
workers (pools initialised in the parent) and spawn workers (pools loaded while unpickling the source) are capped
alike at their first row. Libraries a worker loads after that (an ``import`` inside ``__getitem__``) keep their own
default: ``OMP_NUM_THREADS`` and friends are not set, since spawn workers take their environment from the main
process, and setting it there would change the main process too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import replace
from typing import Any, Mapping

from ms_shm import objects
from ms_shm._results import Result, record
from ms_shm.plan import PIPES, PROCESSES, Decision, Plan

log = logging.getLogger(__name__)

OPT_OUT = "MS_SHM_THREAD_CAP"  # "0": never cap
SETTING = "num_threads"
_APIS = {"blas": "BLAS/OpenMP", "openmp": "BLAS/OpenMP", "opencv": "OpenCV"}


@record
class ThreadPool(Result):
    """One native thread pool loaded in this process.

    Attributes:
        user_api: ``"blas"``, ``"openmp"`` or ``"opencv"``.
        internal_api: the implementation (``"openblas"``, ``"mkl"``, ``"openmp"``, ``"opencv"``).
        num_threads: threads the pool runs a parallel call with now.
    """

    user_api: str
    internal_api: str
    num_threads: int


@record
class ThreadPools(Result):
    """The pools ``probe()`` found; ``known`` is False when the probe failed (``notes`` say why)."""

    pools: tuple = ()
    known: bool = True
    notes: tuple = ()

    def largest(self) -> ThreadPool | None:
        """The pool with the most threads: it alone decides how far a worker oversubscribes."""
        return max(self.pools, key=lambda pool: pool.num_threads, default=None)


@record
class ThreadCap(Result):
    """What ``decide()`` chose: ``threads_per_worker`` is ``None`` for no cap, and ``reason`` says why.

    Attributes:
        threads_per_worker: the limit each worker applies, or ``None``.
        workers: worker processes of the pipeline (0: none, rows are made in this process).
        pool_threads: the largest pool's threads, ``None`` when unknown or no pool is loaded.
        usable_cpus: CPUs this process may use (affinity and cgroup quota).
        reason: one line, as logged and recorded in the plan.
    """

    threads_per_worker: int | None
    workers: int
    pool_threads: int | None
    usable_cpus: int
    reason: str

    def decision(self) -> Decision:
        """The plan's record: the per-worker limit against the pools' own thread count."""
        value = self.threads_per_worker if self.threads_per_worker is not None else self.pool_threads
        return Decision(SETTING, value, self.pool_threads, self.reason)


_probed: dict = {}  # (pid, modules imported) -> ThreadPools


def probe() -> ThreadPools:
    """The native pools loaded in this process now, read once per state of the process: the reading
    walks every loaded library (~20 ms with MindSpore loaded), and a pipeline's stages ask in a row. A native
    library arrives with an import (numpy, cv2, torch...), so the number of imported modules stands for the
    libraries loaded (ms_shm's own modules, imported lazily between the probe and the plan, load none). A pool
    resized between two stages (``threadpool_limits``) keeps its first reading: the cap then set is at most one
    the pools already meet. A failing probe is an unknown, never an error."""
    key = (os.getpid(), sum(1 for name in list(sys.modules) if name.partition(".")[0] != "ms_shm"))
    if key not in _probed:
        _probed.clear()
        _probed[key] = _read_pools()
    return _probed[key]


_controller: tuple = ()  # (shared objects loaded, threadpoolctl.ThreadpoolController) of the last reading
_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _shared_objects() -> int | None:
    """How many shared objects this process has loaded (``dl_iterate_phdr``, ~0.2 ms for MindSpore's 170), or
    ``None`` where it cannot be counted: a pool arrives with one, and MindSpore imports Python modules between the
    plan and its workers' start that load none, so modules are no measure here."""
    count = [0]

    def seen(info: Any, size: int, data: Any) -> int:
        count[0] += 1
        return 0

    try:
        ctypes.CDLL(None).dl_iterate_phdr(_PHDR_CALLBACK(seen), None)
    except (OSError, AttributeError):  # not glibc / not Linux
        return None
    return count[0]


def _read_pools() -> ThreadPools:
    global _controller
    pools, notes = [], []
    try:
        import threadpoolctl

        controller = threadpoolctl.ThreadpoolController()
        info = controller.info()
    except Exception as exc:  # a native library's probe must not stop a pipeline: unknown, no cap
        log.info("ms_shm threads: threadpoolctl's reading of the loaded libraries failed (%s: %s); threads are "
                 "not capped", type(exc).__name__, exc)
        return ThreadPools((), False, (f"threadpoolctl.ThreadpoolController(): {type(exc).__name__}: {exc}",))
    _controller = (_shared_objects(), controller)
    for lib in info:
        if lib.get("user_api") in ("blas", "openmp") and isinstance(lib.get("num_threads"), int):
            pools.append(ThreadPool(lib["user_api"], str(lib.get("internal_api")), lib["num_threads"]))
    cv2 = sys.modules.get("cv2")  # only when the program imported it: importing OpenCV here would cost seconds
    if cv2 is not None:
        try:
            pools.append(ThreadPool("opencv", "opencv", int(cv2.getNumThreads())))
        except Exception as exc:  # a partial or stub cv2: OpenCV's count is unknown, the others still count
            notes.append(f"cv2.getNumThreads(): {type(exc).__name__}: {exc}")
    return ThreadPools(tuple(pools), True, tuple(notes))


def decide(workers: int, pools: ThreadPools | None, usable_cpus: int, enabled: bool = True,
           threads_started: int | None = None) -> ThreadCap:
    """Pure: cap each worker to ``max(1, C // W)`` threads when ``W x T > C`` and the stage's work starts a
    pool, else leave the pools alone.

    Args:
        workers: worker processes that run the user's code at once (0 when rows are made in this process).
        pools: the pools loaded now; the largest one's threads are ``T``. ``None``: not read, which only a
            stage whose rows started no native thread may skip (there is nothing to cap).
        usable_cpus: ``C``, the CPUs this process may use (affinity, cgroup quota).
        enabled: False when the caller opted out (``MS_SHM_THREAD_CAP=0``).
        threads_started: native threads the stage's probe rows left running in the probe child (``None``:
            not measured). 0 means the work runs on the calling thread: there is nothing to oversubscribe,
            while a limit itself starts OpenBLAS's pool again in each forked worker (measured: 1 to 2 threads,
            ~50 ms more of a 0.6 s epoch of a source and a map in 2 workers each), so none is set.

    Returns:
        ThreadCap: the limit, or ``None`` with the reason nothing is capped.
    """
    cpus = max(1, usable_cpus)
    largest = pools.largest() if pools is not None else None
    threads = largest.num_threads if largest else None
    if workers < 1:
        return ThreadCap(None, workers, threads, cpus, "not capped: no worker processes, rows are made in this "
                                                       "process, whose pools ms_shm never changes")
    if threads_started == 0:
        return ThreadCap(None, workers, threads, cpus, "not capped: the probe rows' work started no native thread "
                                                       "(it runs on the worker's own thread), so the pools stay "
                                                       "idle in the workers")
    if pools is None or not pools.known:
        why = "; ".join(pools.notes) if pools is not None else "not read"
        return ThreadCap(None, workers, None, cpus, f"not capped: native thread pools unknown ({why})")
    if largest is None:
        return ThreadCap(None, workers, None, cpus, "not capped: no BLAS, OpenMP or OpenCV thread pool is loaded")
    over = f"{workers} workers × {threads} {_APIS[largest.user_api]} threads"
    if workers * threads <= cpus:
        return ThreadCap(None, workers, threads, cpus, f"not capped: {over} <= {cpus} CPUs")
    if not enabled:
        return ThreadCap(None, workers, threads, cpus, f"not capped ({OPT_OUT}=0): {over} > {cpus} CPUs")
    n = max(1, cpus // workers)
    return ThreadCap(n, workers, threads, cpus, f"capped to {n} per worker: {over} > {cpus} CPUs")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """The opt-out: ``MS_SHM_THREAD_CAP=0`` (or ``false``, ``no``, ``off``) leaves every pool alone."""
    return environ.get(OPT_OUT, "1").strip().lower() not in ("0", "false", "no", "off")


def worker_processes(p: Plan) -> int:
    """How many processes run the user's code for this plan: its workers in process modes, else none."""
    return p.workers if p.python_multiprocessing and p.mode in (PROCESSES, PIPES) else 0


def plan_cap(p: Plan, usable_cpus: int, threads_started: int | None = None,
             environ: Mapping[str, str] = os.environ) -> tuple:
    """Compose probe and decide for one planned stage: the plan with its ``num_threads`` decision (only where
    worker processes run: elsewhere nothing is recorded), and the per-worker limit or ``None``. Logged once,
    here, at plan time."""
    workers = worker_processes(p)
    if workers < 1:
        return p, None
    pools = probe() if threads_started != 0 else None  # rows that start no thread leave nothing to cap
    cap = decide(workers, pools, usable_cpus, enabled(environ), threads_started)
    level = logging.INFO if cap.threads_per_worker is not None else logging.DEBUG
    log.log(level, "%s: %s", SETTING, cap.reason)
    return replace(p, decisions=p.decisions + (cap.decision(),)), cap.threads_per_worker


def cap_source(p: Plan, feed: Any, usable_cpus: int, threads_started: int | None = None) -> tuple:
    """``(plan, feed)``: the source MindSpore reads, wrapped in ``CappedSource`` only where a cap is decided."""
    p, n = plan_cap(p, usable_cpus, threads_started)
    return p, (feed if n is None else CappedSource(feed, n))


def cap_operations(p: Plan, operations: Any, usable_cpus: int, threads_started: int | None = None) -> tuple:
    """``(plan, operations)``: the first plain Python callable among a map's operations (or a batch's
    ``per_batch_map``) wrapped in ``CappedCall`` where a cap is decided. MindSpore's own transforms are never
    wrapped (MindSpore treats them apart); one wrapped callable is enough, as a worker runs every operation."""
    p, n = plan_cap(p, usable_cpus, threads_started)
    if n is None:
        return p, operations
    ops = list(operations) if isinstance(operations, (list, tuple)) else [operations]
    at = next((i for i, op in enumerate(ops) if _plain_callable(op)), None)
    if at is None:
        log.info("%s: no plain Python operation to carry the cap into the workers; not applied", SETTING)
        return p, operations
    ops[at] = CappedCall(ops[at], n)
    return p, (ops if isinstance(operations, (list, tuple)) else ops[0])


def _plain_callable(op: Any) -> bool:
    """A user's function or callable object: MindSpore wraps it in its ``FuncWrapper`` and runs it in the
    workers as any function. A MindSpore transform (it has ``implementation``) or a class is left as it is."""
    return (callable(op) and not isinstance(op, type) and not objects.has(op, "implementation")
            and not type(op).__module__.startswith("mindspore"))


def limit_this_process(n: int) -> None:
    """Apply: every BLAS/OpenMP pool loaded here, and OpenCV's if imported, to ``n`` threads. Runs inside a
    worker only; a failure is logged and the worker goes on with its pools as they were."""
    try:
        controller = _inherited_controller()
        if controller is not None:
            controller.limit(limits=n)
        else:
            import threadpoolctl

            threadpoolctl.threadpool_limits(limits=n)
    except Exception as exc:  # the rows matter more than the cap
        log.warning("ms_shm threads: threadpool_limits(%d) failed in worker %d (%s: %s); pools left as they are",
                    n, os.getpid(), type(exc).__name__, exc)
    cv2 = sys.modules.get("cv2")
    if cv2 is not None and hasattr(cv2, "setNumThreads"):
        try:
            cv2.setNumThreads(n)
        except Exception as exc:  # a stub cv2: the BLAS/OpenMP cap still holds
            log.warning("ms_shm threads: cv2.setNumThreads(%d) failed (%s: %s)", n, type(exc).__name__, exc)


def _inherited_controller() -> Any:
    """The plan's reading of the pools, where this worker was forked with the same shared objects loaded: its
    handles to the libraries are valid here, and a limit through them costs ~1 ms, where ``threadpool_limits``
    walks every loaded library again (9-16 ms per worker with MindSpore loaded, paid at each stage's worker
    start). A spawn worker, or a fork after a library was loaded, walks the libraries anew, so that library is
    capped too."""
    if _controller and _controller[0] is not None and _controller[0] == _shared_objects():
        return _controller[1]
    return None


class _Capped(objects.Transparent):
    """Shared by both wrappers: the cap and the pid that built the plan, kept under ``_ms_shm_`` names; every
    other attribute is the wrapped object's (``objects.Transparent``), so ``dataset.source.x`` and MindSpore's
    own ``getattr`` checks see the user's object."""

    def __init__(self, wrapped: Any, threads: int):
        self._ms_shm_wrapped = wrapped
        self._ms_shm_threads = threads
        self._ms_shm_plan_pid = os.getpid()
        self._ms_shm_pending = True  # cleared in a worker only: a forked or unpickled copy starts pending again

    def _ms_shm_enter(self) -> None:
        if os.getpid() != self._ms_shm_plan_pid:  # in a worker process: once, before its first row
            self._ms_shm_pending = False
            limit_this_process(self._ms_shm_threads)


class CappedSource(_Capped):
    """A random-access source (or ms_shm's ``GuardedSource``) whose reads cap the worker's threads first.

    Returns exactly what ``source[index]`` returns, passes the index and the source's exceptions through
    unchanged, forwards attributes and ``len``; copies nothing.
    """

    def __len__(self) -> int:
        return len(self._ms_shm_wrapped)

    def __getitem__(self, index: Any) -> Any:
        if self._ms_shm_pending:
            self._ms_shm_enter()
        return self._ms_shm_wrapped[index]


class CappedCall(_Capped):
    """A map operation or ``per_batch_map`` whose calls cap the worker's threads first. Returns exactly what the
    operation returns; ``__wrapped__`` lets ``inspect.signature`` (MindSpore checks ``per_batch_map``'s) see the
    operation's own signature."""

    @property
    def __wrapped__(self) -> Any:
        return self._ms_shm_wrapped

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._ms_shm_pending:
            self._ms_shm_enter()
        return self._ms_shm_wrapped(*args, **kwargs)


__all__ = ["ThreadPool", "ThreadPools", "ThreadCap", "probe", "decide", "enabled", "plan_cap", "cap_source",
           "cap_operations", "CappedSource", "CappedCall", "limit_this_process", "OPT_OUT"]
