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

# Measured with torch 2.13.0 on the 2-core VM (fork): an epoch over 4 samples of 4 floats, batch_size 1, took 83 /
# 138 / 211 ms more with num_workers 1 / 2 / 4 than with 0 (median of 5), with the probe's fork-to-ready 12 ms:
# 42 ms per worker (2 forks of 12 ms and 18 ms of torch's own), 41 ms for the pool. 64 batches of 8 x 2 MiB
# float32 with samples costing ~nothing, the consumer summing every batch: 5.6 ms more per 16 MiB batch with a
# worker (0.35 ms/MiB; without the sum, none: the worker's transfer overlaps the main process's own collate).
# Where the probe did not time samples as the main process reads them (``probe.inline_seconds``: slow samples,
# few of them), a sample in the main process: 0.55 of the probe child's warm time (8.7 / 15.9, 6.4 / 13.5, 8.7 /
# 14.4 ms: a W0 epoch's per-sample time over the fastest of samples 2-4 read in a fork, ~8 ms of numpy work on
# 2 MiB arrays).
COSTS = WorkerCosts(pool_seconds=0.041, worker_seconds=0.018, transfer_seconds_per_mib=0.35e-3,
                    inline_fraction=0.55)

ENGINE = LoaderEngine(
    "torch", "torch", "ms_shm.engines.torch.compat", SIGNATURES, LEFTOVERS,
    LoaderProfile("torch", None, "file_descriptor", True,
                  "batches as /dev/shm files; file_descriptor passes an fd per storage, file_system names them",
                  COSTS, can_pipe=True, collate_in_shm=True),
    "Bus error, or 'unable to allocate shared memory(shm) ... No space left on device', when /dev/shm fills")

__all__ = ["COSTS", "ENGINE", "LEFTOVERS"]
