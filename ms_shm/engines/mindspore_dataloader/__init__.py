"""MindSpore 2.8+'s ``mindspore.dataset.dataloader.DataLoader`` (PyTorch's API and design). Its rules import
without MindSpore; ``compat`` imports it when called.
"""

from __future__ import annotations

from ms_shm.engines.mindspore.leftovers import LeftoverPatterns
from ms_shm.engines.mindspore_dataloader.signatures import SIGNATURES
from ms_shm.engines.torchstyle.engine import LoaderEngine, LoaderProfile
from ms_shm.engines.torchstyle.planning import WorkerCosts

LEFTOVERS = LeftoverPatterns("MindSpore DataLoader")  # its storages are unlinked at once: nothing is left by name

# Measured with MindSpore 2.8.0 and NumPy 1.26 on the 2-core VM (fork): an epoch over 4 samples of 4 floats,
# batch_size 1, took 23 / 29-32 / 45 ms more with num_workers 1 / 2 / 4 than with 0 (median of 5, 2 runs) where the
# program's ``os.fork()`` took 2.2 ms, and 78 / 117 / 213 ms with 1 GB more arrays held (fork 34.6 ms): fitted at
# ``FORKS_PER_WORKER`` 1.5, 23 ms for the pool and ~1 ms per worker beside its forks (within 22 ms of each; the
# constants before, 46 ms, 14 ms and twice the probe's fork-to-ready, priced 2 workers 2-3x over). 8 batches of
# 8 x 2 MiB float32 with samples costing ~nothing, start-up excluded, the consumer summing every batch: 28 ms more
# per 16 MiB batch with a worker than without (1.7 ms/MiB, 5x torch's; 22 ms without the sum), median of 7. Priced
# so, 2 workers lost where they were chosen: bench_dataloader (256 samples of ~4-6 ms numpy work, 2 MiB each,
# batches of 8, a consumer that hashes each batch; 2026-12-07, 5 rounds) ran none in 1.36 / 1.38 s and 2 workers
# at prefetch 2 in 1.54 / 1.63 s (512 MB / ample), which 3.2 / 3.5 ms per MiB price, the consumer's CPU competing
# with the workers' for 2 CPUs; every build of 4 on a slower hour had chosen them at ~1.27 s against none's ~1.50.
# Fitted at 3.3: the framework's default (none) wins more often where batches are large; 2 MiB batches of 10 ms
# samples still go to 2 workers (1.66 s against none's 2.68, measured on the same day).
# Where the probe did not time samples as a loop reads them (``probe.inline_seconds``: slow samples, few of them),
# a loop's read saves 1.9 ms per MiB of sample against the probe child's warm reads (12.5 - 7.3, 13.4 - 9.6,
# 8.5 - 6.4 ms: the fastest of samples 2-4 read in a fork less a W0 epoch's per-sample time, ~8 ms of numpy work
# making 2 MiB arrays; the median 3.8 ms over 2 MiB).
COSTS = WorkerCosts(pool_seconds=0.023, worker_seconds=0.001, transfer_seconds_per_mib=3.3e-3,
                    saved_per_mib=1.9e-3)

ENGINE = LoaderEngine(
    "mindspore-dataloader", "mindspore", "ms_shm.engines.mindspore_dataloader.compat", SIGNATURES, LEFTOVERS,
    LoaderProfile("mindspore-dataloader", None, "file_descriptor", False,
                  "MindSpore 2.8+: batches as /dev/shm files, one fd per storage; needs NumPy 1.x with workers",
                  COSTS, can_pipe=True),
    "Bus error ('DataLoader worker (pid: N) was killed by signal: Bus error.') when /dev/shm fills")

__all__ = ["COSTS", "ENGINE", "LEFTOVERS"]
