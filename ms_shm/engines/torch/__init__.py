"""PyTorch's ``torch.utils.data.DataLoader``: an optional engine (``pip install ms_shm[torch]``). Its rules import
without torch; ``compat`` imports torch when called.
"""

from __future__ import annotations

import re

from ms_shm.engines.mindspore.leftovers import LeftoverPatterns
from ms_shm.engines.torch.signatures import SIGNATURES
from ms_shm.engines.torchstyle.engine import LoaderEngine, LoaderProfile
from ms_shm.engines.torchstyle.planning import WorkerCosts

# NewProcessWideShmHandle / the file_system strategy name each storage /dev/shm/torch_<pid>_<random>[_<n>], pid
# the process that created it; the files outlive a process killed before the receiver unlinked them.
LEFTOVERS = LeftoverPatterns("PyTorch", dev_shm=(("pytorch", re.compile(r"^torch_(\d+)_\d")),))

# Measured with torch 2.13.0 on the 2-core VM (fork): an epoch over 4 samples of 4 floats, batch_size 1, took 28-31 /
# 32-34 / 56-60 ms more with num_workers 1 / 2 / 4 than with 0 (median of 5, 3 runs) where the program's
# ``os.fork()`` took 1.8-2 ms, and 89 / 143 / 216 ms with 1 GB more arrays held (fork 28.5 ms): fitted at
# ``FORKS_PER_WORKER`` 1.5, 29 ms for the pool and 4 ms per worker beside its forks (within 21 ms of each). The
# constants before (41 ms, 18 ms, and twice the probe's fork-to-ready, ~12 ms more than the fork) priced 2 workers
# at 128-135 ms where they cost 30-50: an ImageFolder of 200 Pillow decodes kept none, 0.34 s an epoch, where 2 ran
# 0.28-0.30. 64 batches of 8 x 2 MiB float32 with samples costing ~nothing, the consumer summing every batch:
# 5.6 ms more per 16 MiB batch with a worker (0.35 ms/MiB; without the sum, none: the worker's transfer overlaps
# the main process's own collate).
# Where the probe did not time samples as a loop reads them (``probe.inline_seconds``: slow samples, few of them),
# a loop's read saves 3.55 ms per MiB of sample against the probe child's warm reads (15.9 - 8.7, 13.5 - 6.4,
# 14.4 - 8.7 ms: the fastest of samples 2-4 read in a fork less a W0 epoch's per-sample time, ~8 ms of numpy work
# making 2 MiB arrays; the median 7.1 ms over 2 MiB). A worker's loop reads as the main process's (4.0 ms each,
# measured in both, 2 MiB samples).
COSTS = WorkerCosts(pool_seconds=0.029, worker_seconds=0.004, transfer_seconds_per_mib=0.35e-3,
                    saved_per_mib=3.55e-3)

ENGINE = LoaderEngine(
    "torch", "torch", "ms_shm.engines.torch.compat", SIGNATURES, LEFTOVERS,
    LoaderProfile("torch", None, "file_descriptor", True,
                  "batches as /dev/shm files; file_descriptor passes an fd per storage, file_system names them",
                  COSTS, can_pipe=True, collate_in_shm=True),
    "Bus error, or 'unable to allocate shared memory(shm) ... No space left on device', when /dev/shm fills")

__all__ = ["COSTS", "ENGINE", "LEFTOVERS"]
