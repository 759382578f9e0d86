"""Shared-memory and file-descriptor arithmetic of MindSpore's dataset engine. Pure.

Every number here was measured (see ``shared/MINDSPORE_SHM_FACTS.md``): the GeneratorDataset formula is exact
to the byte on 2.10 in 200 of 200 runs. How releases differ is in ``profiles``; what the installed release
supports is detected in ``compat``.
"""

from __future__ import annotations

import math

from ms_shm._results import Result, record
from ms_shm.engines.mindspore.profiles import EngineProfile
from ms_shm.sizes import FD_MARGIN, PAGE, MiB  # noqa: F401  (re-exported: model's arithmetic is in pages)

DEFAULT_PREFETCH = 16
SEM_PAGES_PER_POOL = 17  # a map/batch process pool's semaphores, measured (68 KiB)
FD_BASE = 5  # main-process fds of one GeneratorDataset process pool ...
FD_PER_WORKER = 6  # ... plus these per worker (queues, pipes, sentinels), measured for W = 2, 4, 8
STATIC_MIN_ELEMENTS = 10000  # a static slot carries a column only with more elements than this


def queue_size(prefetch: int, workers: int) -> int:
    """Per-worker result queue length: ``max(2, min(P, 4P // W))``."""
    return max(2, min(prefetch, 4 * prefetch // max(1, workers)))


def slots(prefetch: int, workers: int) -> int:
    """Shared-memory slots per worker: the queue plus one being filled and one being read."""
    return queue_size(prefetch, workers) + 2


def slots_made(prefetch: int, workers: int, rows: int | None = None, static: bool = False) -> int:
    """Slots a worker makes: with static slots all of them, up front; with dynamic ones no more than the rows
    it delivers over ``rows`` (one epoch's)."""
    s = slots(prefetch, workers)
    return s if rows is None or static else max(1, min(s, math.ceil(rows / workers)))


def pages(nbytes: int) -> int:
    return -(-int(nbytes) // PAGE) * PAGE


def semaphore_bytes(workers: int) -> int:
    """/dev/shm pages a GeneratorDataset process pool takes before any row: ``(6W + 7)`` pages."""
    return (6 * workers + 7) * PAGE


def generator_peak(row_bytes: int, workers: int, prefetch: int, rows: int | None = None,
                   max_rowsize_mb: int | None = None, shared_mem: bool = True) -> int:
    """Peak /dev/shm bytes of one GeneratorDataset process pool (random-access source, W > 1).

    Args:
        row_bytes: largest row, as the sum of ``nbytes`` of its ndarray columns (slots only grow).
        workers: worker processes (W > 1; W == 1 runs in-process and uses none).
        prefetch: ``ds.config.get_prefetch_size()`` when the iterator is created.
        rows: rows per epoch; a worker that delivers fewer rows than it has slots creates fewer slots.
        max_rowsize_mb: a static ``max_rowsize``: all slots are committed up front.
        shared_mem: ``False`` when rows go through pipes; only the semaphore pages remain.
    """
    if workers <= 1:
        return 0
    sem = semaphore_bytes(workers)
    if not shared_mem:
        return sem
    s = slots(prefetch, workers)
    if max_rowsize_mb is not None and max_rowsize_mb > 0:
        return workers * s * (max_rowsize_mb * MiB + PAGE) + sem
    if row_bytes <= 0:
        return sem
    return workers * slots_made(prefetch, workers, rows) * pages(row_bytes) + sem


def fitting_prefetch(row_bytes: int, workers: int, budget: int, current: int = DEFAULT_PREFETCH,
                     max_rowsize_mb: int | None = None) -> int | None:
    """The largest prefetch (<= ``current``) whose slots fit ``budget`` bytes (static slots of
    ``max_rowsize_mb`` where the release uses them), or ``None`` when even prefetch 1 does not."""
    for p in range(current, 0, -1):
        if generator_peak(row_bytes, workers, p, None, max_rowsize_mb) <= budget:
            return p
    return None


def static_precheck_fails(workers: int, prefetch: int, max_rowsize_mb: int, shm_free: int,
                          device_num: int = 1) -> bool:
    """MindSpore's own launch check for a static max_rowsize: it raises at >= 80% of free /dev/shm."""
    need = device_num * workers * slots(prefetch, workers) * max_rowsize_mb * MiB
    return need >= 0.8 * shm_free


def static_row_fits(row_bytes: int, max_rowsize_mb: int) -> bool:
    """A static slot carries a row only when it is strictly smaller; otherwise MindSpore pickles, slowly."""
    return row_bytes < max_rowsize_mb * MiB


def max_rowsize_mb(value) -> int | None:
    """The static slot size (MiB) a ``max_rowsize`` argument asks for, or ``None`` for dynamic slots.

    MindSpore takes an int, ``None`` or -1 (dynamic), and for ``map`` also ``[in, out]``: the larger of the two
    is what a slot must hold.
    """
    if isinstance(value, (list, tuple)):
        sizes = [v for v in value if isinstance(v, int) and v > 0]
        return max(sizes) if sizes else None
    return value if isinstance(value, int) and value > 0 else None


def static_rowsize_for(row_bytes: int) -> int:
    """The smallest static max_rowsize (MiB) that still carries the row: strictly larger than it."""
    return int(row_bytes // MiB) + 1


@record
class MapCost(Result):
    """What a map/batch process pool needs, by where it lives."""

    dev_shm: int  # bytes of /dev/shm
    sysv: int  # bytes of SysV shared memory (counts against cgroup memory, shmmax, shmall)
    sysv_segment: int  # the largest single segment, to compare with shmmax


def map_pool_cost(profile: EngineProfile, workers: int, in_bytes: int, out_bytes: int,
                  max_rowsize_mb: int | None = None, slot_rows: int = 1, shared_mem: bool = True) -> MapCost:
    """Shared memory of ``.map(python_multiprocessing=True)`` (or ``batch(per_batch_map=...)``). ``slot_rows``:
    a batch's pool slots are ``max_rowsize x batch_size`` MiB (``BatchDataset`` multiplies them, 2.0 to 2.10: an
    audit's 2.0 batch of 4 asked MindSpore's pre-check for 768 MiB where ms_shm priced 192 MiB). ``shared_mem``:
    MindSpore's global switch; a ``/dev/shm`` pool (2.0-2.6) sends rows through pipes where it is off, and checks
    nothing (an audit: 2.0 refused where raw ran with it off); SysV segments (2.7+) ignore it."""
    if workers <= 0:
        return MapCost(0, 0, 0)
    sem = SEM_PAGES_PER_POOL * PAGE
    row = max(in_bytes, out_bytes)
    if profile.map_transport == "sysv":
        segment = pages(row + 512)
        return MapCost(sem, workers * segment, segment)
    if not shared_mem:
        return MapCost(sem, 0, 0)
    rowsize = max_rowsize_mb if max_rowsize_mb and max_rowsize_mb > 0 else profile.map_default_max_rowsize_mb
    per_slot = rowsize * slot_rows * MiB if rowsize else pages(row)
    return MapCost(workers * 6 * per_slot + sem, 0, 0)


def map_precheck_bytes(profile: EngineProfile, workers: int, max_rowsize_mb: int | None,
                       shared_mem: bool = True) -> int:
    """/dev/shm a map/batch pool's own pre-check asks for: ``W x 3 x (in + out)`` MiB with a static
    ``max_rowsize`` on releases that check (2.7: "Required: 201326592" for 2 workers at 16 MiB), else 0; a
    ``/dev/shm`` pool checks only with shared memory on (``map_pool_cost``)."""
    if not profile.map_checks_dev_shm or not max_rowsize_mb or (not shared_mem and profile.map_transport != "sysv"):
        return 0
    return workers * 3 * 2 * max_rowsize_mb * MiB


def generator_fds(workers: int, prefetch: int, rows: int | None = None, shared_mem: bool = True) -> int:
    """File descriptors the main process adds for a GeneratorDataset pool: one per live shm slot, plus pipes."""
    if workers <= 1:
        return 0
    per_worker = slots(prefetch, workers) if shared_mem else 0
    if rows is not None and shared_mem:
        per_worker = max(1, min(per_worker, math.ceil(rows / workers)))
    return FD_BASE + workers * (FD_PER_WORKER + per_worker)


def map_fds(workers: int) -> int:
    """Main-process fds of a map pool (pipes and sentinels; SysV ids are not fds)."""
    return FD_BASE + FD_PER_WORKER * workers if workers > 0 else 0


__all__ = ["DEFAULT_PREFETCH", "SEM_PAGES_PER_POOL", "FD_BASE", "FD_PER_WORKER", "STATIC_MIN_ELEMENTS", "FD_MARGIN",
           "PAGE", "MiB", "queue_size", "slots", "pages", "semaphore_bytes", "generator_peak",
           "fitting_prefetch", "static_precheck_fails", "static_row_fits", "max_rowsize_mb", "static_rowsize_for", "MapCost",
           "map_pool_cost", "map_precheck_bytes", "generator_fds", "map_fds"]


# --- host memory (the memory cgroup) ------------------------------------------------------------------------
# Rows of a stage's output the process tree holds at once beyond /dev/shm slots (connector queues, rows being
# copied out of a slot or pickled into a pipe). Measured on MindSpore 2.10 with 2 workers and 8 MiB rows read by
# a consumer slower than the workers (a sha256 per row, so every queue fills), as the cgroup's rss + shmem
# sampled every 2 ms over the process before the pipeline, 5-6 runs each: threads 27-39 rows at prefetch 2,
# 27-36 at 4, 31-39 at 16 (each worker thread's result queue holds 16 rows whatever the prefetch:
# ``queue.Queue(16)`` in ``_GeneratorWorkerMt``, 2.0 to 2.10); processes 18-19 rows at prefetch 2, 27-28 at 5,
# 48-60 at 16, slots and worker pages included; inline 5-7 at prefetch 2, 14-19 at 16. Pipes were measured
# before, as the smallest cgroup limit passed (bisected): 46 rows at prefetch 16; the rule counts 54 there (its
# base moved with processes' and was not re-measured). A map's peak varies
# more from run to run (the race between its workers and the reader): 25-31 rows in threads, 33-37 in
# processes (slots and worker pages included).
# A reader slower still (80-150 ms per row: a training step) lets every queue fill, which the rules below take:
# measured again as the main process's RSS sampled every 5 ms, 8 MiB rows, 120 of them, a reader sleeping 80 ms
# per row: threads 41 rows at prefetch 4 and 54 at 16 with 2 workers (each worker's
# result queue of 16, the row it makes, the op's connector of ``prefetch``, 4 more), where the older rule said 40
# and a 1000 MiB container was OOM-killed; a map 17, 38 and 54 rows at prefetch 4, 11 and 16 with 2 workers, 36
# at 16 with one (``prefetch`` per worker's output connector and one more for the next stage), threads and
# processes alike (31.5 and 54.5 rows in processes at 8 and 16).
PIPELINE_BYTES = 16 * MiB  # the same pipeline with empty rows, over the process before it was built
THREAD_RESULT_QUEUE = 16  # rows each of MindSpore's worker threads may hold done (its res_queue)
WORKER_BYTES_UNMEASURED = 32 * MiB  # a forked worker's own pages when the probe could not say (measured 12-25)


def rows_in_flight(mode: str, workers: int, prefetch: int) -> int:
    """Rows held in memory at once, by transport (see the table above)."""
    if mode == "inline":
        return prefetch + 4
    if mode == "threads":
        return prefetch + (THREAD_RESULT_QUEUE + 1) * workers + 4
    held = prefetch + 6
    if mode == "pipes":
        held += workers * queue_size(prefetch, workers)
    return held


def generator_memory(mode: str, row_bytes: int, workers: int, prefetch: int, shm_bytes: int,
                     worker_bytes: int | None, rows: int | None = None, by_reference: float = 0.0,
                     dict_bytes: int = 0) -> int:
    """Host memory one GeneratorDataset adds to this process's memory cgroup: its /dev/shm pages (tmpfs pages
    are charged to the writer), the rows in flight, and each forked worker's own pages plus the row it is
    reading (``worker_bytes`` is measured with the probe's freed rows given back). ``by_reference``: the share
    of each row that MindSpore's own process carries without a copy (arrays the source holds,
    ``RowStats.held_fraction``, where the release does: ``EngineProfile.rows_by_reference``); a worker
    process's rows are copies whatever the source holds. ``dict_bytes``: what a row's dict columns hold, which
    no slot carries (``row_bytes`` counts them 0) and every reader copies."""
    def held(transport: str) -> int:
        return rows_in_flight(transport, workers, prefetch) if rows is None else \
            min(rows_in_flight(transport, workers, prefetch), max(1, rows))

    if mode in ("inline", "threads"):
        row_bytes, dict_bytes = int(row_bytes * (1.0 - by_reference)), int(dict_bytes * (1.0 - by_reference))
    # a dict column goes through a worker's queue pickled, as every row does over pipes: 48 rows of 8 MiB images
    # in a dict, 2 worker processes, grew the process tree 549 MiB (an audit), where slot rows grew it 248 MiB
    memory = PIPELINE_BYTES + shm_bytes + held(mode) * max(0, row_bytes) + \
        held("pipes" if mode == "processes" else mode) * dict_bytes
    if mode in ("processes", "pipes") and workers > 1:
        own = worker_bytes + max(0, row_bytes) if worker_bytes is not None else WORKER_BYTES_UNMEASURED
        memory += workers * own
    return memory


def map_rows_in_flight(workers: int, prefetch: int) -> int:
    """A map's (or batch's) output rows held at once: each worker's output connector of ``prefetch`` rows, the
    next stage's, and the rows being made (see the table above); threads and processes alike."""
    return (workers + 1) * prefetch + workers + 6


# A plain ``batch`` (no ``per_batch_map``) holds whole batches in its queues and the iterator's, and the allocator
# keeps what it freed in the threads' arenas, which the memory cgroup charges as well. Measured on 2.10 (peak RSS
# over the process's baseline; one GeneratorDataset thread reading 1, 8 or 16 MiB rows; batch_size 1-16; a loop
# slower than the pipeline; 64-512 rows): 9.5 + 1.5 x prefetch batches in all, within ~10% (prefetch 1: 10.5;
# 2: 12-13; 4: 14.5-15.5; 8: 19.5; 16: 33.5), the source's own prefetch + 4 rows among them. ms_shm planned an
# audit's source and map to 424 of a 428 MiB budget, and its batch(4) of 16 MiB rows was OOM-killed, 3 of 3.
BATCH_HELD = (9.5, 1.5)


def batch_memory(row_bytes: int, batch_size: int, prefetch: int, batches_per_epoch: int | None = None) -> int:
    """Host memory a plain batch stage adds to the rows its input stage was planned to hold; an epoch of fewer
    batches holds at most those and two more (32 rows of 8 MiB in batches of 4 at prefetch 2: 9.4 batches)."""
    batches = BATCH_HELD[0] + BATCH_HELD[1] * max(1, prefetch)
    if batches_per_epoch is not None:
        batches = min(batches, batches_per_epoch + 2)
    return int(max(0.0, batches * batch_size - (prefetch + 4)) * max(0, row_bytes))


def map_memory(processes: bool, out_bytes: int, workers: int, prefetch: int, cost: MapCost,
               worker_bytes: int | None) -> int:
    """Host memory a map/batch stage adds: its output rows in flight (its own queue and the next stage's),
    its SysV segments and /dev/shm slots, and each worker process's own pages."""
    memory = PIPELINE_BYTES + map_rows_in_flight(workers, prefetch) * max(0, out_bytes)
    if processes:
        memory += cost.dev_shm + cost.sysv
        memory += workers * (worker_bytes if worker_bytes is not None else WORKER_BYTES_UNMEASURED)
    return memory
