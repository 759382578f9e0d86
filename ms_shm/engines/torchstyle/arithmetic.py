"""Shared memory and file descriptors of a PyTorch-style DataLoader's batches in flight. Pure.

PyTorch's ``torch.utils.data.DataLoader`` and MindSpore 2.8+'s ``mindspore.dataset.dataloader.DataLoader`` (a
port of it) move every batch from a worker to the main process as shared memory: each tensor storage of the
batch is a ``/dev/shm`` file, and under PyTorch's default ``file_descriptor`` sharing strategy each one travels
as a file descriptor. Measured with torch 2.13.0 (2 workers, prefetch 2 and 4, 8 MiB batches, a private
tmpfs sampled every 2 ms): the peak of ``/dev/shm`` is ``(W x prefetch_factor + 1)`` batches (5.0 and 9.0
batches measured) in the first epoch, one more from the second on where each epoch forks new workers
(``held_at_start``), and the main process's fds grow with the storages in flight (one per storage, plus a few per
worker for its queues); ``file_system`` keeps the files by name instead and holds almost no fds.
"""

from __future__ import annotations

from ms_shm.sizes import PAGE

FD_BASE = 8  # the main process's fds for a loader's queues and pipes before any batch (measured: 6-9)
FD_PER_WORKER = 3  # per worker: its index queue, its process sentinel, its result pipe end
WORKER_FD_BASE = 24  # a worker's own fds before it sends a batch (inherited ones, its queues)
DEFAULT_PREFETCH_FACTOR = 2
FILE_DESCRIPTOR, FILE_SYSTEM = "file_descriptor", "file_system"


def pages(nbytes: int) -> int:
    return -(-int(nbytes) // PAGE) * PAGE


def held_at_start(workers: int, start_method: str, persistent_workers: bool) -> int:
    """Batches the program still holds when an iterator forks its workers, which stay in ``/dev/shm`` for the
    workers' life: ``fork`` maps every shared-memory batch the program holds into each new worker (the previous
    epoch's last batch, still bound to the loop's name), and its pages are freed only when those workers exit, at
    the epoch's end. Measured (torch 2.13, 2 workers, prefetch 1, 16 MiB batches, 3 epochs): 48, 64 and 64 MiB;
    48 in each epoch with ``persistent_workers=True`` (forked once) or with the batch deleted before the next
    epoch. A plan of 3 batches under Docker's 64 MB ran its first epoch and failed in its second, where raw with
    room to spare ran on. ``spawn`` and ``forkserver`` workers inherit no mapping."""
    return 1 if workers > 0 and start_method == "fork" and not persistent_workers else 0


def batches_in_flight(workers: int, prefetch_factor: int, held: int = 0) -> int:
    """Batches alive in shared memory at once: each worker's prefetched ones, plus the one being consumed, plus
    ``held`` (``held_at_start``)."""
    return workers * prefetch_factor + 1 + held if workers > 0 else 0


def shm_peak(batch_bytes: int, storages: int, workers: int, prefetch_factor: int, shared_bytes: int = 0,
             held: int = 0) -> int:
    """Peak ``/dev/shm`` bytes: every storage of every batch in flight, each in whole pages, and ``shared_bytes``
    once per worker: storages the dataset holds that batches send views of (torch moves such a storage to shared
    memory on its first send and sends it again by reference: a 20 MiB preloaded tensor, 2 workers, a collate
    keeping samples apart, peaked at 40 MiB, measured, where pricing it per batch in flight said 60-100 MiB)."""
    if workers <= 0:
        return 0
    per_batch = pages(batch_bytes) + max(0, storages - 1) * PAGE  # each storage rounds up to a page
    return batches_in_flight(workers, prefetch_factor, held) * per_batch + workers * pages(shared_bytes)


def main_fds(storages: int, workers: int, prefetch_factor: int, strategy: str) -> int:
    """File descriptors the main process adds for the loader."""
    if workers <= 0:
        return 0
    carried = storages * batches_in_flight(workers, prefetch_factor) if strategy == FILE_DESCRIPTOR else 0
    return FD_BASE + FD_PER_WORKER * workers + carried


def worker_fds(storages: int, prefetch_factor: int, strategy: str) -> int:
    """File descriptors one worker holds at most: its own, plus the storages of the batches it sent and the main
    process has not yet received (its share of the prefetch)."""
    carried = storages * (prefetch_factor + 1) if strategy == FILE_DESCRIPTOR else 0
    return WORKER_FD_BASE + carried


def memory(batch_bytes: int, storages: int, workers: int, prefetch_factor: int, worker_bytes: int,
           pin_memory: bool, shared_bytes: int = 0, held: int = 0) -> int:
    """Host memory the loader adds to the memory cgroup: its ``/dev/shm`` pages, each worker's own pages, the
    batches alive in the main process without workers, and a pinned copy of one batch with ``pin_memory``.

    Without workers three batches are alive at once: the next batch's samples, their collated batch, and the
    batch the training loop still holds while the next is made (``for batch in loader``: the name is rebound only
    after). Measured (torch 2.13, 96 MiB batches of 3 MiB samples, default collate): the main process grew
    ~210 MB; priced at two batches (192 MiB) it was admitted under a 241 MiB budget and OOM-killed, 3 of 3. A
    worker holds the samples of the batch it is collating (its batch itself is in ``/dev/shm``) and what its
    allocator kept of the last batch's: two batches over what the probe child held. Measured (torch 2.13, a
    cgroup-v1 group, batches of 8 samples computed from a held array): 4 workers at prefetch 1 with 32 MiB
    batches added 389 MiB beside their 160 MiB of ``/dev/shm``, ~92 MiB a worker over a 14 MiB probe reading
    (2.4 batches); 3 workers with 64 MiB batches ~130 MiB a worker (1.8 batches). Priced at one batch, a plan of
    344 MiB was admitted under a 344 MiB budget and OOM-killed, 3 of 3."""
    shm = shm_peak(batch_bytes, storages, workers, prefetch_factor, shared_bytes, held)
    own = workers * (worker_bytes + 2 * batch_bytes) if workers > 0 else 3 * batch_bytes
    return shm + own + (batch_bytes if pin_memory else 0)


__all__ = ["held_at_start", "batches_in_flight", "shm_peak", "main_fds", "worker_fds", "memory", "DEFAULT_PREFETCH_FACTOR",
           "FILE_DESCRIPTOR", "FILE_SYSTEM"]
