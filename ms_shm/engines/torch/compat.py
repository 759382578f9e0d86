"""The only module that imports torch: PyTorch's DataLoader, its collate functions, its tensors' storages, its
sharing strategy. Imported on first use; ``torch`` itself only when a function is called.
"""

from __future__ import annotations

import logging
from typing import Any

from ms_shm.changes import Change

log = logging.getLogger(__name__)
SHARING_STRATEGY = "sharing_strategy"


def available() -> bool:
    try:
        import torch.utils.data  # noqa: F401
    except Exception:
        return False
    return True


def loader_class() -> Any:
    from torch.utils.data import DataLoader

    return DataLoader


def owns(dataset: Any) -> bool:
    """Whether ``dataset`` is a PyTorch dataset (without importing torch when it is not loaded)."""
    import sys

    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(dataset, (data.Dataset, data.IterableDataset))


def is_iterable(dataset: Any) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def default_collate(batched: bool) -> Any:
    from torch.utils.data import default_collate as collate
    from torch.utils.data import default_convert

    return collate if batched else default_convert


def weigh(batch: Any) -> tuple:
    """``(bytes, storages)`` of every tensor in ``batch`` (nested lists, tuples, dicts), each storage once."""
    import torch

    seen: dict = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(batch)
    return sum(seen.values()), len(seen)


def worker_info() -> Any:
    from torch.utils.data import get_worker_info

    return get_worker_info()


def sharing_strategy() -> str:
    import torch.multiprocessing as mp

    return mp.get_sharing_strategy()


def set_sharing_strategy(value: str, reason: str) -> Change | None:
    old = sharing_strategy()
    if old == value:
        return None
    import torch.multiprocessing as mp

    mp.set_sharing_strategy(value)
    return Change(SHARING_STRATEGY, old, value, reason)


def undo(changes: Any) -> None:
    for change in reversed(list(changes)):
        if change.setting == SHARING_STRATEGY:
            import torch.multiprocessing as mp

            mp.set_sharing_strategy(change.old)


def numpy_problem() -> str | None:
    return None  # torch 2.13's wheels run under NumPy 1 and 2
