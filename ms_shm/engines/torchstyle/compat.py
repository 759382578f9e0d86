"""What a PyTorch-style DataLoader's adapter does the same way for every framework that has one: torch and
MindSpore 2.8+ each name ``DataLoader``, ``Dataset``, ``IterableDataset``, ``default_collate``,
``default_convert`` and ``get_worker_info`` in one module (``torch.utils.data``, ``mindspore.dataset.dataloader``).
One adapter, given that module's path, so the two engines' ``compat`` modules keep only what differs (how a batch
is weighed, the sharing strategy, NumPy). The framework is imported only when a method is called.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class DataModule:
    """The framework's data module, reached by its path (never imported before a method needs it)."""

    def __init__(self, path: str) -> None:
        self.path = path

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


__all__ = ["DataModule"]
