"""ms_shm keeps MindSpore data pipelines alive and fast on real machines.

It reads the host (``/dev/shm``, fds, CPUs, ranks), measures a few rows, predicts the shared memory a pipeline
will need with MindSpore's measured model, and builds the fastest configuration that fits; every decision is
logged with its reason and the exact fix. Nothing runs at import.

Examples:
    >>> import ms_shm
    >>> report = ms_shm.tune()  # doctest: +SKIP
    >>> ds = ms_shm.build_dataset(source, ["image", "label"], shuffle=True)  # doctest: +SKIP
"""

import logging

from ms_shm.api import TuneReport, batch, build_dataset, map, plan_of, probe, reset, session, tune
from ms_shm.budget import Budget
from ms_shm.cleanup import CleanReport, Leftover, clean
from ms_shm.cow import CowFinding
from ms_shm.errors import (
    Error,
    ProcessesUnavailableError,
    RowError,
    RowTooLargeError,
    ShmBudgetError,
    ShmFullError,
    UsageError,
)
from ms_shm.host import HostFacts
from ms_shm.loaders import build_dataloader
from ms_shm.patch import patch, patched, unpatch
from ms_shm.plan import Decision, Plan
from ms_shm.rows import RowStats
from ms_shm.shared_list import SharedDict, SharedList
from ms_shm.state import Session
from ms_shm.watch import Watcher, WatchSummary, watch

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "tune", "build_dataset", "map", "batch", "build_dataloader", "plan_of", "patch", "unpatch", "patched", "probe", "reset", "session", "Session",
    "TuneReport", "Plan", "Decision", "Budget", "HostFacts", "RowStats",
    "Error", "ShmBudgetError", "RowError", "ProcessesUnavailableError", "UsageError", "RowTooLargeError", "ShmFullError",
    "clean", "CleanReport", "Leftover", "watch", "Watcher", "WatchSummary",
    "SharedList", "SharedDict", "CowFinding",
]
