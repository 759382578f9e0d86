"""How much of a row's work runs in parallel under threads, measured rather than inferred from CPU time.

Whether MindSpore's threads help depends on whether the row's work holds the GIL: pure-Python loops do, while
Pillow's and OpenCV's decoders, numpy's random generators and many numpy kernels release it. A thread's CPU share
cannot tell these apart (both are 100% CPU), so the probe reads two rows at once, on two threads, and compares the
CPU seconds they burned with the wall time they took: two GIL-bound rows take as long as their CPU time added up
(one runs while the other waits), two GIL-releasing rows take as long as the longer one.

For two rows of CPU work ``t`` each, of which a fraction ``f`` runs outside the GIL, the pair takes
``T = (2 - f) t`` on two cores, and burns ``2 t`` of CPU: ``S = 2t / T`` and so ``f = 2 - 2 / S``. Time spent
waiting (I/O, sleep) overlaps under threads whatever the GIL does and is priced by the CPU share, so ``S`` is taken
per CPU second of the row's own work (``cpu_share``). The rules are pure (numbers in, a fraction or a yes/no
out); ``run_pair`` and ``timed_call`` are the only timing, and every probe read goes through one of them.

Overlap alone mistakes other contention for the GIL: two rows read in a fresh fork fault in their pages at once
and queue on the kernel's memory locks (Pillow JPEG decodes in bench_core's probe children: 12 ms of CPU each,
20 ms for the pair, read as 0-35% outside the GIL in 3 builds of 8, which then chose processes over threads,
0.8x the fastest). So a third thread watches the GIL itself while the pair runs (``GilWatch``): it naps and times
each nap, and a nap ends late only while another thread holds the GIL (a pure-Python holder gives it up after
``sys.getswitchinterval()``, 1 ms while a pair runs). The late time is the GIL's busy time, and
``1 - busy / CPU`` the fraction, whatever the kernel did. Measured in forked probe children with MindSpore 2.10
loaded (6 forks each, two pairs): pure-Python rows 0-3%, numpy Generator rows 89-98%, JPEG decodes 63-90% on the
first, cold, pair. Where the watch saw too few naps (rows of a few ms), the overlap decides as before.

A row may be parallel already: its library's own thread pool (OpenBLAS, MKL, OpenCV) works beside the reading
thread, which the thread's CPU time does not show and the GIL watch reads as free. The process's CPU time over a
read made alone does show it (``Timing.process_cpu``, ``pooled``): such rows gain nothing from a second thread.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import sandbox
from ms_shm._results import record

MIN_SECONDS = 2e-3  # rows cheaper than this: starting threads costs as much as the row, the figure is noise
MIN_CPU_SHARE = 0.5  # below it the row mostly waits: threads overlap the waiting, the CPU share decides
# A first pair read in a fresh fork runs cold: both threads fault in new pages at once (~4,400 faults for two
# 1024x768 JPEG decodes, ~10 on the next pair) and queue on the kernel's locks, which reads as the GIL. Measured
# in probe children (MindSpore 2.10 loaded, 5 forks each, 4 pairs in a row): Pillow decode 0.00-0.85 on the first
# pair, mostly 0.7-0.9 after; numpy Generator rows 0.47-0.91, then 0.63-0.97; pure-Python rows 0.00-0.30 on every
# pair. A first pair that came back low although it took less than 1.5x a row read alone did overlap, so it is
# read once more (about one more row's time, as its rows overlap) and the larger fraction kept; rows that held
# the GIL took 1.8-3.2x one row for their first pair and are not read again. (A source whose first read was slow for
# its own reasons, a lazy open, also gets a second pair: it costs two rows there, and the fraction stays low.)
WARM_ABOVE, OVERLAPPED_BELOW = 0.8, 1.5
INFLATED_FROM = 1.15
# Rows (or map rows) whose first read took this long outside the kernel are read in a pair at once (beside a new
# row: the GIL's share, and the re-read overlapped with it). Cheaper ones are read alone first and paired only if
# their warm reads still take ``MIN_SECONDS`` of mostly CPU work: a first read in a fresh process also pays for new
# pages (kernel time) and lazy set-up that a pipeline pays once per worker. Measured in probe children (MindSpore
# 2.10): 8 MiB ``np.full`` rows read 2.3-3.9 ms on the first two reads, up to 33 ms where this VM's first touch of
# a page is slow, and 0.2-0.7 ms once freed pages are reused; with the first reads setting the time per row, 2 of
# 6 builds sent them to worker processes or threads, ~6x slower than the main process (after: 14 of 14 inline).
# Below 8 ms the late pair costs under 2% of a 100-row epoch of such rows.
PAIR_AT_ONCE_FROM = 8e-3
# Rows larger than this are never read two at once: a pair holds two new rows beside the first, kept for the
# re-read, so the probe would hold three where a worker holds one (MindSpore's UT
# ``test_map_and_generatordataset_with_multiprocessing``, a map making 0.95 GB rows: the probe child peaked at
# 2890 MiB against the whole raw process's 1306, and its pair took 9.9-13.7 s against 0.9 s alone, as this VM's
# first touch of fresh pages stalls; 128 MiB to 1 GiB rows made beside a kept one took 0.05-9.4 s for the pair
# against 0.06-0.3 s alone, 5 runs of 10). Their GIL share is then unmeasured, taken as none, and said so.
PAIR_ROWS_UP_TO = 64 << 20
# A row whose library runs its own thread pool (OpenBLAS's ``matmul``, OpenCV, MKL) keeps more CPUs busy than the
# thread that reads it: 600x600 float64 ``a @ b`` in a probe child, 5 ms of wall and thread CPU, 7-13 ms of process
# CPU. Such rows are parallel already: MindSpore's threads calling one pool at once queue on it (two threads: 0.74 s
# an epoch of 100, one: 0.50 s, where ms_shm chose threads from the pair's 74% outside the GIL), and worker
# processes have only the cores the pool leaves. Beyond a quarter of a CPU it is a pool, not timer noise.
POOLED_FROM = 0.25


def pooled(cpu_share: float | None, cores_busy: float | None) -> bool:
    """Whether rows read alone kept ``POOLED_FROM`` of a CPU busy beyond their own thread's share: their library
    runs a thread pool of its own (see ``POOLED_FROM``)."""
    return cpu_share is not None and cores_busy is not None and cores_busy - cpu_share >= POOLED_FROM


def parallel_fraction(cpu_seconds: Sequence[float], wall_together: float, cpu_share: float | None,
                      cpus: int, gil_busy: float | None = None) -> float | None:
    """The fraction of a row's CPU work that ran outside the GIL, from two rows read at once on two threads.

    Args:
        cpu_seconds: each thread's CPU time (``time.thread_time``) for its row.
        wall_together: wall time from starting both threads to both rows done.
        cpu_share: the rows' CPU time over wall time when read alone (``None``: unknown).
        cpus: CPUs this process may run on; with one, nothing can run in parallel.
        gil_busy: seconds the GIL was held while the pair ran (``GilWatch``); where known, it decides, and the
            overlap (``wall_together``) is the fallback.

    Returns:
        ``f`` in [0, 1], or ``None`` when the measurement cannot say (rows took no time, or mostly wait and the
        GIL was not watched: their overlap is the waiting's, which the CPU share prices).
    """
    if cpus < 2:
        return 0.0
    if watch_decides(cpu_seconds, gil_busy):
        return min(1.0, max(0.0, 1.0 - gil_busy / sum(cpu_seconds)))
    if cpu_share is None or cpu_share < MIN_CPU_SHARE or wall_together <= 0 or len(cpu_seconds) < 2:
        return None
    speedup = sum(cpu_seconds) / wall_together / min(1.0, cpu_share)
    if speedup <= 0:
        return None
    return min(1.0, max(0.0, 2.0 - 2.0 / speedup))


def watch_decides(cpu_seconds: Sequence[float], gil_busy: float | None) -> bool:
    """Whether the GIL's watched busy time, not the pair's overlap, gives the fraction: the watch saw enough naps
    and the rows burned ``MIN_SECONDS`` of CPU between them (less, and a nap's jitter is most of the figure)."""
    return gil_busy is not None and sum(cpu_seconds) >= MIN_SECONDS


def may_have_run_cold(fraction: float | None, together: float, alone: float,
                      cpu_inflation: float | None = None) -> bool:
    """Whether a first pair is worth a second (see ``WARM_ABOVE``): it read low but overlapped, or its rows burned
    ``INFLATED_FROM`` times the CPU of a row read alone (``cpu_inflation``): a thread waiting for the GIL burns
    none, one faulting in fresh pages beside another burns more (measured in bench_core's JPEG probe children: cold
    pairs 1.22-1.37x a warm row's CPU, taking 2.1-2.5x its time, then a second pair 0.8-1.0x, overlapped; pure-Python
    pairs 0.88-0.98x, 1.20x once on a loaded machine, where a second pair costs time, never the choice)."""
    if fraction is None or fraction >= WARM_ABOVE:
        return False
    return together < OVERLAPPED_BELOW * alone or (cpu_inflation is not None and cpu_inflation >= INFLATED_FROM)


def pair_at_once(first_wall: float, first_kernel: float) -> bool:
    """Whether a first read is dear enough, less its kernel time, to be paired at once (``PAIR_AT_ONCE_FROM``)."""
    return first_wall - first_kernel >= PAIR_AT_ONCE_FROM


def pair_now(walls: Sequence[float], first_kernel: float, share: float | None, row_bytes: int = 0) -> bool:
    """Whether the next reads, after ``walls`` read alone, are made two at once: after one, where it was dear
    enough (``pair_at_once``); after two, where the warm second still is (``worth_a_late_pair``); never for rows
    of more than ``PAIR_ROWS_UP_TO`` (``row_bytes``: the largest read so far). A pair always reads a new row (a
    late one beside the first again, which is also the fidelity check's second read), so no read is made only for
    the pair: a late pair after every read alone re-read rows already read (JPEG rows of ~8 ms: six reads, now
    four)."""
    if row_bytes > PAIR_ROWS_UP_TO:
        return False
    if len(walls) == 1:
        return pair_at_once(walls[0], first_kernel)
    return len(walls) == 2 and worth_a_late_pair(walls[1:], share)


def worth_a_late_pair(walls: Sequence[float], cpu_share: float | None) -> bool:
    """Whether reads timed alone, warm, still take ``MIN_SECONDS`` of mostly CPU work: what a pair can tell threads
    about (rows that mostly wait overlap under threads whatever the GIL does)."""
    return bool(walls) and float(np.median(walls)) >= MIN_SECONDS and cpu_share is not None and \
        cpu_share >= MIN_CPU_SHARE


def time_alone(wall: float, cpu: float, cpu_share: float | None) -> float:
    """A row read in a pair, at the time it would take alone: its CPU time over the CPU share of rows read alone
    (a row that held the GIL waited for its partner; that wait is not its cost), never more than its wall time."""
    return min(wall, cpu / cpu_share) if cpu_share else wall


@record
class Timing:
    """What one call took, in seconds: its wall time, its thread's CPU time, the kernel's (system) share of that
    (0.0 where unknown), and the whole process's CPU time, which exceeds the thread's where the call's library
    ran a thread pool of its own (a BLAS ``matmul``: 5 ms of wall and thread CPU, 7-13 ms of process CPU)."""

    wall: float
    cpu: float
    kernel: float = 0.0
    process_cpu: float = 0.0


def timed_call(work: Callable[..., Any], *args: Any) -> tuple:
    """``(work(*args), Timing)``."""
    k0 = kernel_seconds()
    w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    result = work(*args)
    wall, cpu, process = time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0
    k1 = kernel_seconds()
    return result, Timing(wall, cpu, (k1 - k0) if k0 is not None and k1 is not None else 0.0, max(cpu, process))


def kernel_seconds() -> float | None:
    """System CPU seconds of this thread so far (Linux; of the process where threads are not told apart)."""
    try:
        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_stime
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class GilWatch:
    """A thread that naps (``NAP_SECONDS``) and times each nap: what a nap took beyond the shortest one is time
    another thread held the GIL (see the module's docstring). Meant for a probe child, around a pair."""

    def __init__(self) -> None:
        self.naps: list = []  # (start, end) of each nap, perf_counter seconds
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, daemon=True, name="ms_shm-gil-watch")

    def _watch(self) -> None:
        while not self._stopped:
            begin = time.perf_counter()
            time.sleep(NAP_SECONDS)
            self.naps.append((begin, time.perf_counter()))

    def start(self) -> "GilWatch":
        """Start, and return once a few naps were taken while nothing else ran: their shortest is the baseline."""
        self._thread.start()
        deadline = time.perf_counter() + 0.05
        while len(self.naps) < BASELINE_NAPS and time.perf_counter() < deadline:
            time.sleep(NAP_SECONDS)
        return self

    def stop(self) -> None:
        self._stopped = True
        self._thread.join()

    def busy(self, begin: float, end: float) -> float | None:
        """Seconds the GIL was held by others between ``begin`` and ``end``; ``None`` from too few naps there."""
        return gil_busy(self.naps, begin, end)


NAP_SECONDS = 2e-4
BASELINE_NAPS = 2
# While a pair runs, a thread holding the GIL is asked to give it up after 1 ms instead of Python's 5 ms: behind two
# GIL-bound threads the watcher waited 10-20 ms a nap, two or three naps for a 40 ms pair, too few to count.
SWITCH_SECONDS = 1e-3
MIN_WATCHED_NAPS = 3  # fewer naps in the pair's span (one long hold, or a span shorter than a nap): not enough


def gil_busy(naps: Sequence[tuple], begin: float, end: float) -> float | None:
    """What the naps took within ``[begin, end]`` beyond the shortest nap of all: the GIL's busy time there. A nap
    that straddles either end counts for its part inside (one still waiting when the pair ended is most of a busy
    span's tail: a GIL-bound pair of 50 ms held the watcher 10-20 ms a nap, behind two threads). ``None`` where
    fewer than ``MIN_WATCHED_NAPS`` naps fall in the span."""
    if not naps:
        return None
    shortest = min(e - s for s, e in naps)
    inside = [(max(s, begin), min(e, end)) for s, e in naps if e > begin and s < end]
    if len(inside) < MIN_WATCHED_NAPS:
        return None
    return sum(max(0.0, e - s - shortest) for s, e in inside)


def run_pair(work: Callable[[Any], Any], items: Sequence[Any]) -> tuple:
    """``work(item)`` for two items at once, on two threads: ``(results, walls, cpus, wall_together, gil_busy)``,
    ``gil_busy`` from a ``GilWatch`` over the pair's span (``None`` where it saw too little).

    ``wall_together`` spans the two calls only, from the first one's start to the last one's end: starting and
    joining two threads in a fresh fork took ~2.5 ms (measured, MindSpore 2.10 loaded), which counted as the
    rows' own time read 6 ms JPEG decodes that overlapped fully (6.2 and 6.0 ms on two threads, 6.2 and 6.0 ms
    of CPU) as 41% outside the GIL, and sent 4-6 builds in 10 to processes.

    Meant for a probe child. The first exception a call raised is raised here, after both threads ended, so a
    source's own error reaches the caller as it would from a serial read.
    """
    results: list = [None, None]
    walls, cpus, spans = [0.0, 0.0], [0.0, 0.0], [(0.0, 0.0), (0.0, 0.0)]
    errors: list = []
    start = threading.Barrier(2)

    def one(k: int) -> None:
        try:
            start.wait()
            w0, c0 = time.perf_counter(), time.thread_time()
            results[k] = work(items[k])
            w1 = time.perf_counter()
            walls[k], cpus[k], spans[k] = w1 - w0, time.thread_time() - c0, (w0, w1)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in (0, 1)]
    sandbox.wait_for_parent()  # two threads timed at once need both CPUs: the parent's own read must be done
    watch = GilWatch().start()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_SECONDS)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        watch.stop()
    if errors:
        raise errors[0]
    begin, end = min(b for b, _ in spans), max(e for _, e in spans)
    return results, walls, cpus, end - begin, watch.busy(begin, end)


__all__ = ["parallel_fraction", "may_have_run_cold", "pair_at_once", "worth_a_late_pair", "time_alone", "timed_call", "Timing",
           "run_pair", "pair_now", "usable_cpus", "GilWatch", "gil_busy", "watch_decides", "MIN_SECONDS", "WARM_ABOVE", "OVERLAPPED_BELOW", "INFLATED_FROM", "PAIR_AT_ONCE_FROM", "PAIR_ROWS_UP_TO", "pooled", "POOLED_FROM"]
