"""What a batch of PyTorch tensors puts in ``/dev/shm``, by storage: a tensor is a view of a storage, and what
travels is not always the storage.

Three rules, measured with torch 2.13 (2 workers, a private 64 MB ``/dev/shm``):

* A collate that copies (``default_collate`` stacks into a new tensor, in shared memory in a worker) writes the
  views' own bytes: a ``TensorDataset`` sample is a 32 KiB view of one 96 MiB tensor, and its batches of 32 are
  1 MiB. Weighing each sample's whole storage read 96 MiB and stopped raw torch's run with ``RowTooLargeError``.
* A collate that keeps the samples' tensors (``batch_size=None``, ``zip(*batch)``, ``list``) sends their storages:
  torch moves a storage to shared memory once (``share_memory_`` in place) and sends it again by reference, so a
  storage the dataset holds (a dataset preloaded into one tensor) is in ``/dev/shm`` once per worker, however many
  batches carry views of it: 20 MiB preloaded, 2 workers, peak 40 MiB measured, where it was priced per batch in
  flight (60-100 MiB) and refused at build.
* A storage already in shared memory before a batch is collated costs that batch nothing.

Tensors are found by duck typing (``untyped_storage``): torch is never imported here, and a batch of another
framework's tensors (MindSpore's DataLoader) has none, so every function says ``None`` (unknown) and the caller
keeps its engine's own ``weigh``. The walk is ``engines.torch.compat.weigh``'s (containers, and the attributes of a
``collate_fn``'s own batch class).
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable, Iterator

# A dataset's tensors are looked for among this many objects at most (its attributes, their containers...): a
# dataset holding a list of a million paths is not walked to its end; what is not found is priced per batch.
DATASET_WALK_LIMIT = 10_000

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType)


def _is_tensor(value: Any) -> bool:
    return callable(getattr(value, "untyped_storage", None)) and hasattr(value, "element_size")


def tensors(value: Any, limit: int | None = None, is_tensor: Callable[[Any], bool] = _is_tensor) -> Iterator:
    """Every tensor in ``value`` (each occurrence), through dicts, sequences and objects' attributes; with
    ``limit``, among that many objects at most. ``is_tensor``: torch's by default (duck typed)."""
    visited: set = set()
    stack, seen = [value], 0
    while stack and (limit is None or seen < limit):
        item = stack.pop()
        seen += 1
        if is_tensor(item):
            yield item
        elif id(item) in visited or isinstance(item, _LEAVES):
            continue
        elif isinstance(item, dict):
            visited.add(id(item))
            stack.extend(_first(item.values(), limit, seen))
        elif isinstance(item, (list, tuple, set, frozenset)):
            visited.add(id(item))
            stack.extend(_first(item, limit, seen))
        else:
            visited.add(id(item))
            stack.extend(attributes(item))


def _first(items: Any, limit: int | None, seen: int) -> Any:
    """``items``, or as many of them as a walk limited to ``limit`` objects may still visit."""
    return items if limit is None else itertools.islice(items, max(0, limit - seen))


def attributes(value: Any) -> list:
    """The attribute values of an object a batch holds (``__dict__`` and slots)."""
    attrs = getattr(value, "__dict__", None)
    out = list(attrs.values()) if isinstance(attrs, dict) else []
    for klass in type(value).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if hasattr(value, name):
                out.append(getattr(value, name))
    return out


def _by_storage(value: Any) -> dict:
    """``{key: [storage, bytes of its views]}`` of every tensor in ``value`` (the key: the storage's address)."""
    out: dict = {}
    for tensor in tensors(value):
        storage = tensor.untyped_storage()
        entry = out.setdefault(storage.data_ptr() or id(storage), [storage, 0])
        entry[1] += tensor.numel() * tensor.element_size()
    return out


def samples_view(samples: Any) -> tuple | None:
    """``(bytes a collate writes at least, keys of the storages already in shared memory)`` of a worker's samples,
    or ``None`` where they hold no tensor. Per storage, the smaller of its views' bytes (what a copying collate
    writes) and the storage (what a collate keeping the samples sends, once); already shared, nothing."""
    found = _by_storage(samples)
    if not found:
        return None
    shared = {key for key, (storage, _) in found.items() if storage.is_shared()}
    written = sum(min(storage.nbytes(), views) for key, (storage, views) in found.items() if key not in shared)
    return written, shared


def batch_view(batch: Any, shared_before: set) -> tuple | None:
    """``(new bytes, of them written already)`` of a collated batch: its storages but those that were in shared
    memory before the collate (``samples_view``'s keys: sent before, they cost this batch nothing), and of the rest
    those in shared memory now (torch's collate wrote them there in the worker). ``None``: no tensor."""
    found = _by_storage(batch)
    if not found:
        return None
    new = {key: storage for key, (storage, _) in found.items() if key not in shared_before}
    return (sum(s.nbytes() for s in new.values()),
            sum(s.nbytes() for s in new.values() if s.is_shared()))


def dataset_storages(dataset: Any, limit: int = DATASET_WALK_LIMIT) -> set:
    """Keys of the storages of the tensors ``dataset`` holds (``TensorDataset.tensors``, a preloaded ``self.x``),
    among ``limit`` objects: those a worker keeps, and so shares once, whatever number of batches send them."""
    keys = set()
    for tensor in tensors(dataset, limit):
        storage = tensor.untyped_storage()
        if storage.data_ptr():
            keys.add(storage.data_ptr())
    return keys


def _once(batch: Any, held: set) -> dict:
    """``{key: storage}`` of the storages ``batch`` carries that a worker shares once: held by the dataset
    (``dataset_storages``) and larger than the batch's views of them (a storage many samples share; a dataset of
    one tensor per sample sends each sample's storage with its batch)."""
    return {key: storage for key, (storage, views) in _by_storage(batch).items()
            if key in held and views < storage.nbytes()}


def once_per_worker(batch: Any, held: set) -> int:
    """Bytes of ``batch``'s storages each worker puts in ``/dev/shm`` once (``_once``); one already in shared
    memory, none (it was there before the loader, in the free space its plan read)."""
    return sum(s.nbytes() for s in _once(batch, held).values() if not s.is_shared()) if held else 0


def per_batch_weigh(weigh: Callable[[Any], tuple], held: set) -> Callable[[Any], tuple]:
    """``weigh`` without the storages a worker shares once (``_once``): the bytes each batch in flight brings,
    every storage still counted (each travels as one fd with every batch)."""
    if not held:
        return weigh

    def weighed(batch: Any) -> tuple:
        nbytes, count = weigh(batch)
        return max(0, nbytes - sum(s.nbytes() for s in _once(batch, held).values())), count

    return weighed


__all__ = ["samples_view", "batch_view", "dataset_storages", "once_per_worker", "per_batch_weigh",
           "DATASET_WALK_LIMIT"]
