"""The only module that imports torch: PyTorch's DataLoader, its collate functions, its tensors' storages, its
sharing strategy (what the two DataLoaders share is ``torchstyle.compat.DataModule``, given torch's path). Imported
on first use; ``torch`` itself only when a function is called.
"""

from __future__ import annotations

import logging
from typing import Any

from ms_shm.changes import Change
from ms_shm.engines.torchstyle.compat import DataModule
from ms_shm.engines.torchstyle.storages import tensors

log = logging.getLogger(__name__)
SHARING_STRATEGY = "sharing_strategy"

_DATA = DataModule("torch.utils.data", batched_reads=True)  # DataLoader, datasets, collates, worker info: shared
available, loader_class, owns = _DATA.available, _DATA.loader_class, _DATA.owns
is_iterable, default_collate, worker_info = _DATA.is_iterable, _DATA.default_collate, _DATA.worker_info
warn_as_asked, sample_reader = _DATA.warn_as_asked, _DATA.sample_reader

# torch draws its iterators' base seed from the global generator (or the loader's ``generator``) in every
# iterator, with workers or without (2.13: ``_BaseDataLoaderIter.__init__``); a loader with persistent workers
# makes one iterator for all its epochs. MindSpore 2.8 draws it with workers only (``WORKERS_DRAW_FROM_GENERATOR``).
EVERY_ITERATOR_DRAWS_SEED = True


def weigh(batch: Any) -> tuple:
    """``(bytes, storages)`` of every tensor in ``batch`` (nested lists, tuples, dicts, and the attributes of the
    objects a ``collate_fn`` returns: a worker pickles those whole, each tensor through shared memory), each
    storage once."""
    seen = _storages(batch)
    return sum(s.nbytes() for s in seen.values()), len(seen)


def unshared_bytes(batch: Any) -> int:
    """Bytes of ``batch``'s storages a worker has yet to write to shared memory when it sends the batch: torch's
    default collate builds its batch there already (``_new_shared``), a ``collate_fn`` that keeps the samples'
    tensors (``list``) does not."""
    return sum(s.nbytes() for s in _storages(batch).values() if not s.is_shared())


def share(batch: Any) -> None:
    """Moves ``batch``'s storages into shared memory, in a worker, as torch's queue does when it sends the batch
    (``reduce_storage``: the same copy, the same strategy), but in the worker's own loop: a ``/dev/shm`` that
    filled up meanwhile raises there, and reaches the program, instead of in the queue's feeder thread, where
    the batch is lost and the loader waits for it forever."""
    for storage in _storages(batch).values():
        if not storage.is_shared():
            storage.share_memory_()


def _storages(batch: Any) -> dict:
    """Every tensor storage in ``batch``, once each, by address (``storages.tensors``' walk)."""
    seen: dict = {}
    for tensor in tensors(batch):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage
    return seen


def twin(sample: Any) -> Any:
    """A second sample as a batch would carry it, made from ``sample`` without reading one: each tensor that owns
    its storage copied (a second sample has storages of its own), each view into a larger storage kept (a
    ``TensorDataset``'s samples share the dataset's storage, sent once; copying it would copy the dataset)."""
    import torch

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            owns = value.untyped_storage().nbytes() <= value.numel() * value.element_size()
            return value.clone() if owns else value
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(copy(v) for v in value))
        if isinstance(value, (list, tuple)):
            return [copy(v) for v in value] if isinstance(value, list) else tuple(copy(v) for v in value)
        return value

    return copy(sample)


def tensor_bytes(value: Any) -> tuple | None:
    """``(dtype, shape, bytes as a uint8 array)`` of a tensor (what the probe compares two reads of a sample by),
    else ``None``: any dtype, bfloat16 included, viewed (not copied, where contiguous on the CPU) as bytes."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    flat = value.detach().cpu().contiguous().reshape(-1)
    return str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy()


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
