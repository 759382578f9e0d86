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
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import sandbox

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


def parallel_fraction(cpu_seconds: Sequence[float], wall_together: float, cpu_share: float | None,
                      cpus: int) -> float | None:
    """The fraction of a row's CPU work that ran outside the GIL, from two rows read at once on two threads.

    Args:
        cpu_seconds: each thread's CPU time (``time.thread_time``) for its row.
        wall_together: wall time from starting both threads to both rows done.
        cpu_share: the rows' CPU time over wall time when read alone (``None``: unknown).
        cpus: CPUs this process may run on; with one, nothing can run in parallel.

    Returns:
        ``f`` in [0, 1], or ``None`` when the measurement cannot say (rows mostly wait, or took no time).
    """
    if cpus < 2:
        return 0.0
    if cpu_share is None or cpu_share < MIN_CPU_SHARE or wall_together <= 0 or len(cpu_seconds) < 2:
        return None
    speedup = sum(cpu_seconds) / wall_together / min(1.0, cpu_share)
    if speedup <= 0:
        return None
    return min(1.0, max(0.0, 2.0 - 2.0 / speedup))


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


def pair_now(walls: Sequence[float], first_kernel: float, share: float | None) -> bool:
    """Whether the next reads, after ``walls`` read alone, are made two at once: after one, where it was dear
    enough (``pair_at_once``); after two, where the warm second still is (``worth_a_late_pair``). A pair always
    reads a new row (a late one beside the first again, which is also the fidelity check's second read), so no
    read is made only for the pair: a late pair after every read alone re-read rows already read (JPEG rows of
    ~8 ms: six reads, now four)."""
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


def timed_call(work: Callable[..., Any], *args: Any) -> tuple:
    """``work(*args)`` and what it took: ``(result, wall, CPU, kernel)`` seconds (kernel: its system CPU time,
    0.0 where unknown)."""
    k0 = kernel_seconds()
    w0, c0 = time.perf_counter(), time.thread_time()
    result = work(*args)
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    k1 = kernel_seconds()
    return result, wall, cpu, (k1 - k0) if k0 is not None and k1 is not None else 0.0


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


def run_pair(work: Callable[[Any], Any], items: Sequence[Any]) -> tuple:
    """``work(item)`` for two items at once, on two threads: ``(results, walls, cpus, wall_together)``.

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
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, walls, cpus, max(end for _, end in spans) - min(begin for begin, _ in spans)


__all__ = ["parallel_fraction", "may_have_run_cold", "pair_at_once", "worth_a_late_pair", "time_alone", "timed_call",
           "run_pair", "pair_now", "usable_cpus", "MIN_SECONDS", "WARM_ABOVE", "OVERLAPPED_BELOW", "INFLATED_FROM", "PAIR_AT_ONCE_FROM"]
