"""MindSpore 2.8+'s ``mindspore.dataset.dataloader.DataLoader`` (PyTorch's API and design). Its rules import
without MindSpore; ``compat`` imports it when called.
"""

from __future__ import annotations

from ms_shm.engines.mindspore.leftovers import LeftoverPatterns
from ms_shm.engines.mindspore_dataloader.signatures import SIGNATURES
from ms_shm.engines.torchstyle.engine import LoaderEngine, LoaderProfile

LEFTOVERS = LeftoverPatterns("MindSpore DataLoader")  # its storages are unlinked at once: nothing is left by name

ENGINE = LoaderEngine(
    "mindspore-dataloader", "mindspore", "ms_shm.engines.mindspore_dataloader.compat", SIGNATURES, LEFTOVERS,
    LoaderProfile("mindspore-dataloader", None, "file_descriptor", False,
                  "MindSpore 2.8+: batches as /dev/shm files, one fd per storage; needs NumPy 1.x with workers"),
    "Bus error ('DataLoader worker (pid: N) was killed by signal: Bus error.') when /dev/shm fills")

__all__ = ["ENGINE", "LEFTOVERS"]
