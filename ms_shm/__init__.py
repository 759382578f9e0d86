"""ms_shm keeps MindSpore data pipelines alive and fast on real machines.

It reads the host (``/dev/shm``, fds, CPUs, ranks), measures a few rows, predicts the shared memory a pipeline
will need with MindSpore's measured model, and builds the fastest configuration that fits; every decision is
logged with its reason and the exact fix. Nothing runs at import (but a young garbage collection:
``ms_shm.collector``).

Examples:
    >>> import ms_shm
    >>> report = ms_shm.tune()  # doctest: +SKIP
    >>> ds = ms_shm.build_dataset(source, ["image", "label"], shuffle=True)  # doctest: +SKIP
"""

from ms_shm.collector import load as _load
from ms_shm.collector import quiet as _quiet

# The collector is kept quiet while ms_shm's modules load: their objects would tip a program that has just
# imported MindSpore into a full collection of its heap (``ms_shm.collector``).
with _quiet():
    from ms_shm.errors import (
        Error,
        ProcessesUnavailableError,
        ReadOnlyError,
        RowError,
        RowTooLargeError,
        RowTypeError,
        ShmBudgetError,
        ShmFullError,
        SourceError,
        UsageError,
    )

    # ``patch`` and ``watch`` are also module names: importing a submodule binds it on the package, which would
    # hide a lazily bound function of the same name, so these two are bound here (both modules import no
    # framework and little else: ``ms-shm run`` needs ``patch`` before the script starts anyway).
    from ms_shm.patch import patch, patched, unpatch
    from ms_shm.watch import Watcher, WatchSummary, watch

# The rest is bound on first use (PEP 562): ``ms-shm run`` and ``import ms_shm`` then cost what they use
# (measured with MindSpore loaded: the package 8 ms, every module 35 ms; ~0.15 s before result classes stopped
# compiling methods per class, ``_results.record``).
_LAZY = {
    "ms_shm.api": ("TuneReport", "batch", "build_dataset", "map", "plan_of", "probe", "reset", "session", "tune"),
    "ms_shm.budget": ("Budget",),
    "ms_shm.cleanup": ("CleanReport", "Leftover", "clean"),
    "ms_shm.cow": ("CowFinding",),
    "ms_shm.host": ("HostFacts",),
    "ms_shm.loaders": ("build_dataloader",),
    "ms_shm.plan": ("Decision", "Plan"),
    "ms_shm.rows": ("RowStats",),
    "ms_shm.shared_list": ("SharedDict", "SharedList"),
    "ms_shm.state": ("Session",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_shm' has no attribute {name!r}")
    value = getattr(_load(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))


# No NullHandler: in a program that configures no logging, Python's last-resort handler prints ms_shm's warnings
# (explicit arguments adapted under patch(), a probe that timed out, NumPy 2 under MindSpore's DataLoader) to
# stderr, as MindSpore prints its own; INFO and DEBUG stay silent until the program asks for them (an audit found
# each of those warnings lost in a program that had not called logging.basicConfig).

__version__ = "0.1.0"

__all__ = [
    "tune", "build_dataset", "map", "batch", "build_dataloader", "plan_of", "patch", "unpatch", "patched", "probe", "reset", "session", "Session",
    "TuneReport", "Plan", "Decision", "Budget", "HostFacts", "RowStats",
    "Error", "ShmBudgetError", "RowError", "RowTypeError", "ProcessesUnavailableError", "UsageError", "RowTooLargeError", "ShmFullError",
    "SourceError", "ReadOnlyError", "clean", "CleanReport", "Leftover", "watch", "Watcher", "WatchSummary",
    "SharedList", "SharedDict", "CowFinding",
]
