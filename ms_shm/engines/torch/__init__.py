"""PyTorch's ``torch.utils.data.DataLoader``: an optional engine (``pip install ms_shm[torch]``). Its rules import
without torch; ``compat`` imports torch when called.
"""

from __future__ import annotations

import re

from ms_shm.engines.mindspore.leftovers import LeftoverPatterns
from ms_shm.engines.torch.signatures import SIGNATURES
from ms_shm.engines.torchstyle.engine import LoaderEngine, LoaderProfile

# NewProcessWideShmHandle / the file_system strategy name each storage /dev/shm/torch_<pid>_<random>[_<n>], pid
# the process that created it; the files outlive a process killed before the receiver unlinked them.
LEFTOVERS = LeftoverPatterns("PyTorch", dev_shm=(("pytorch", re.compile(r"^torch_(\d+)_\d")),))

ENGINE = LoaderEngine(
    "torch", "torch", "ms_shm.engines.torch.compat", SIGNATURES, LEFTOVERS,
    LoaderProfile("torch", None, "file_descriptor", True,
                  "batches as /dev/shm files; file_descriptor passes an fd per storage, file_system names them"),
    "Bus error, or 'unable to allocate shared memory(shm) ... No space left on device', when /dev/shm fills")

__all__ = ["ENGINE", "LEFTOVERS"]
