"""What a PyTorch-style DataLoader engine is, once: ``engines/torch`` and ``engines/mindspore_dataloader`` are
this class with their framework's adapter (``compat``), signatures and leftovers.
"""

from __future__ import annotations

from typing import Any, Sequence

from ms_shm import host
from ms_shm._results import Result, record
from ms_shm.engines.torchstyle import arithmetic
from ms_shm.engines.torchstyle.planning import DEFAULT_COSTS, WorkerCosts


@record
class LoaderProfile(Result):
    """How one framework's DataLoader moves batches."""

    framework: str
    version: str | None
    default_strategy: str = arithmetic.FILE_DESCRIPTOR
    can_switch_strategy: bool = False  # torch.multiprocessing.set_sharing_strategy
    note: str = ""
    costs: WorkerCosts = DEFAULT_COSTS  # what its workers cost beyond the samples' work, measured per framework
    can_pipe: bool = False  # its workers can send batches through their pipes (``compat.piped``)
    # its default collate, called by a ``collate_fn`` of the caller's in a worker, stacks into /dev/shm (torch's
    # ``_new_shared``); MindSpore's stacks in the worker's own memory
    collate_in_shm: bool = False


@record
class LoaderOutcome(Result):
    """A typical loader at some free /dev/shm: its peak and whether it fits (what ``doctor`` sizes)."""

    peak: int
    fits: bool | None
    failure: str


class LoaderEngine:
    """``ms_shm.engines.base.Engine`` for a PyTorch-style DataLoader."""

    def __init__(self, name: str, distribution: str, compat_module: str, signatures: tuple, leftovers: Any,
                 profile: LoaderProfile, failure: str) -> None:
        self.name, self._distribution, self._compat_module = name, distribution, compat_module
        self._signatures, self._leftovers, self._profile, self._failure = signatures, leftovers, profile, failure
        self.arithmetic = arithmetic
        self._version: str | None = None

    @property
    def compat(self) -> Any:
        import importlib

        return importlib.import_module(self._compat_module)

    @property
    def planning(self) -> Any:
        from ms_shm.engines.torchstyle import planning

        return planning

    def available(self) -> bool:
        return self.compat.available()

    def installed_version(self) -> str | None:
        """The framework's version (``host.installed_version``), read once: every plan asks."""
        if self._version is None:
            self._version = host.installed_version(self._distribution)
        return self._version

    def profile(self, version: str | None = None) -> LoaderProfile:
        from dataclasses import replace

        return replace(self._profile, version=version if version is not None else self.installed_version())

    def read_config(self) -> Any:
        return {"sharing_strategy": self.compat.sharing_strategy()} if self.available() else None

    def undo(self, changes: Sequence[Any]) -> None:
        self.compat.undo(changes)

    def apply_setting(self, setting: str, value: Any, reason: str) -> Any:
        if setting == "sharing_strategy":
            return self.compat.set_sharing_strategy(value, reason)
        return None

    def typical_peak(self, row_bytes: int, workers: int, prefetch: int, version: str | None = None) -> int:
        return arithmetic.shm_peak(row_bytes, 1, workers, prefetch, held=self._held_by_default(workers))

    @staticmethod
    def _held_by_default(workers: int) -> int:
        """A loader with the defaults (workers forked anew each epoch) over more than one epoch."""
        return arithmetic.held_at_start(workers, "fork", persistent_workers=False)

    def pipeline_fds(self, workers: int, prefetch: int) -> int:
        return arithmetic.main_fds(1, workers, prefetch, self._profile.default_strategy)

    def leftover_patterns(self) -> Any:
        return self._leftovers

    def signatures(self, version: str | None = None) -> tuple:
        return self._signatures

    def outcome(self, row_bytes: int, workers: int, prefetch: int, ranks: int = 1, shm_free: int | None = None,
                version: str | None = None, rows: int | None = None) -> LoaderOutcome:
        peak = ranks * arithmetic.shm_peak(row_bytes, 1, workers, prefetch, held=self._held_by_default(workers))
        return LoaderOutcome(peak, None if shm_free is None else peak <= shm_free, self._failure)


__all__ = ["LoaderEngine", "LoaderProfile", "LoaderOutcome"]
