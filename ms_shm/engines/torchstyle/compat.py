"""What a PyTorch-style DataLoader's adapter does the same way for every framework that has one: torch and
MindSpore 2.8+ each name ``DataLoader``, ``Dataset``, ``IterableDataset``, ``default_collate``,
``default_convert`` and ``get_worker_info`` in one module (``torch.utils.data``, ``mindspore.dataset.dataloader``).
One adapter, given that module's path, so the two engines' ``compat`` modules keep only what differs (how a batch
is weighed, the sharing strategy, NumPy). The framework is imported only when a method is called.
"""

from __future__ import annotations

import collections
import importlib
import operator
import pickle
import sys
import types
from typing import Any, Callable


class UnreadableSamples(Exception):
    """A map-style dataset whose samples cannot be read one at a time as its loader reads them."""


class DataModule:
    """The framework's data module, reached by its path (never imported before a method needs it).

    ``batched_reads``: the loader's fetcher reads a batch's samples with ``dataset.__getitems__(indices)`` where
    the dataset has one (torch since 2.0); MindSpore 2.8's reads ``dataset[i]`` only."""

    def __init__(self, path: str, batched_reads: bool = False) -> None:
        self.path = path
        self.batched_reads = batched_reads

    def __repr__(self) -> str:
        return f"DataModule({self.path!r})"

    def _data(self) -> Any:
        return importlib.import_module(self.path)

    def available(self) -> bool:
        try:
            self._data()
        except Exception:  # not installed, or broken (a wheel for another NumPy): the engine is unavailable
            return False
        return True

    def loader_class(self) -> Any:
        return self._data().DataLoader

    def loaded(self) -> bool:
        """Whether the program imported this framework's data module (never imported here)."""
        return self.path in sys.modules

    def owns(self, dataset: Any) -> bool:
        """Whether ``dataset`` is this framework's dataset (without importing the framework when it is not
        loaded: a dataset of a framework nobody imported cannot be one)."""
        data = sys.modules.get(self.path)
        return data is not None and isinstance(dataset, (data.Dataset, data.IterableDataset))

    def is_iterable(self, dataset: Any) -> bool:
        return isinstance(dataset, self._data().IterableDataset)

    def default_collate(self, batched: bool) -> Any:
        data = self._data()
        return data.default_collate if batched else data.default_convert

    def sample_reader(self, batched: bool) -> Callable[[Any, Any], Any]:
        """``read(dataset, index)``: one sample of a map-style dataset, read as the loader's fetcher reads it. A
        dataset that reads in batches (Hugging Face's, a ``__getitems__`` over a database) may refuse
        ``__getitem__``: the probe read it there and warned of an error the loader never meets, then planned
        nothing (the audit's 16 MiB samples under 64 MB died of ENOSPC as without ms_shm)."""
        return _one_of_a_batch if self.batched_reads and batched else operator.getitem

    def worker_info(self) -> Any:
        return self._data().get_worker_info()

    def warn_as_asked(self, num_workers: int) -> None:
        """The framework's own warning about the ``num_workers`` a call asked for, where ms_shm passes others:
        torch's ``check_worker_number_rationality`` warns about more workers than CPUs at construction, and
        code (PyTorch's own ``test_excessive_thread_creation_warning``) waits for it. Reads ``num_workers``
        only; MindSpore's DataLoader has no such check."""
        check = getattr(self.loader_class(), "check_worker_number_rationality", None)
        if callable(check):
            check(types.SimpleNamespace(num_workers=num_workers))


def _one_of_a_batch(dataset: Any, index: Any) -> Any:
    """``dataset.__getitems__([index])``'s one sample where the dataset has ``__getitems__`` (torch's fetcher
    reads ``dataset.__getitems__(indices)`` then, and collates what it returns), else ``dataset[index]``.

    Raises:
        UnreadableSamples: ``__getitems__`` returned something else than a list of one sample (its batches are
            the collate's to unpack, so a sample cannot be weighed alone).
    """
    getitems = getattr(dataset, "__getitems__", None)
    if not getitems:
        return dataset[index]
    samples = getitems([index])
    if isinstance(samples, (list, tuple)) and len(samples) == 1:
        return samples[0]
    what = f"a list of {len(samples)}" if isinstance(samples, (list, tuple)) else type(samples).__name__
    raise UnreadableSamples(f"{type(dataset).__name__}.__getitems__([{index!r}]) returned {what}, not a list of "
                            f"one sample, so its samples cannot be weighed one by one")


def rebuilt(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything but its containers: lists, tuples, namedtuples and dicts
    rebuilt as their own type (what a default collate makes of samples), anything else handed to ``leaf``, which
    returns it as it is where it has nothing to change (a batch class, a string). How both engines' pipe transports
    (``compat.piped``) walk a batch."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(rebuilt(v, leaf) for v in value)
    if isinstance(value, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make"):
        return kind._make(rebuilt(v, leaf) for v in value)
    if kind is dict or kind is collections.OrderedDict:
        return kind((k, rebuilt(v, leaf)) for k, v in value.items())
    return leaf(value)


_PLAIN = (str, bytes, bytearray, int, float, complex, bool, type(None))


def by_value(value: Any, is_tensor: Callable[[Any], bool]) -> Any:
    """``value`` (a leaf ``rebuilt`` does not open: a batch class, a dataclass, a tensor subclass) sent as plain
    ``pickle`` sends it, where a tensor is reachable inside it: the worker's queue pickles with the framework's
    reductions, which put each tensor in ``/dev/shm`` (one file per storage); plain ``pickle`` writes its bytes
    into the pipe. An audit's ``collate_fn`` returning its own batch class, 16 MiB batches, workers that had to
    stay, 64 MB: the plan said "no /dev/shm", the workers could not allocate, and the loop waited (3 runs of 3).
    A value that plain ``pickle`` refuses is left to the queue's, as before."""
    if isinstance(value, _PLAIN) or type(value).__module__ == "numpy" or not _reaches(value, is_tensor):
        return value
    return _ByValue(value)


class _Found(Exception):
    pass


class _Finder(pickle.Pickler):
    """Walks what ``pickle`` would write of an object, stopping at its first tensor; arrays are not copied."""

    def __init__(self, is_tensor: Callable[[Any], bool]) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.is_tensor = is_tensor

    def persistent_id(self, obj: Any) -> Any:
        if self.is_tensor(obj):
            raise _Found
        return "array" if type(obj).__module__ == "numpy" and hasattr(obj, "shape") else None


class _Discard:
    @staticmethod
    def write(data: Any) -> int:
        return len(data)


def _reaches(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(value):
        return True
    try:
        _Finder(is_tensor).dump(value)
    except _Found:
        return True
    except Exception:  # noqa: BLE001  (plain pickle refuses it: the queue's own pickling sends it, as before)
        return False
    return False


class _ByValue:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return pickle.loads, (pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL),)


__all__ = ["DataModule", "UnreadableSamples", "by_value", "rebuilt"]
