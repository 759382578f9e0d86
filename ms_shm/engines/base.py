"""The seam: what every engine provides, so the generic parts (host facts, measurement, budget, ranking,
advice text, sizes) stay framework-free. A ``Protocol``: engines implement it without inheriting from it.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    """One framework's data-pipeline engine.

    Attributes:
        name: the key in ``ms_shm.engines.ENGINES``.
    """

    name: str

    def available(self) -> bool:
        """Whether the framework can be imported here (imports it)."""

    def installed_version(self) -> str | None:
        """The installed release, read without importing the framework where possible."""

    def profile(self, version: str | None = None) -> Any:
        """How ``version`` (default: the installed one) behaves: transports, pre-checks, failure wording."""

    def read_config(self) -> Any:
        """The framework's global pipeline settings now, or ``None`` when it is not importable."""

    def undo(self, changes: Sequence[Any]) -> None:
        """Put back every global setting in ``changes`` (``Change`` records), newest first."""

    def typical_peak(self, row_bytes: int, workers: int, prefetch: int, version: str | None = None) -> int:
        """Peak shared memory of one typical pipeline of this engine (what ``doctor`` sizes /dev/shm for)."""

    def pipeline_fds(self, workers: int, prefetch: int) -> int:
        """File descriptors the main process holds for one typical pipeline."""

    def leftover_patterns(self) -> Any:
        """How ``clean`` recognises what a crashed pipeline of this engine left: ``/dev/shm`` and ``/tmp`` names,
        SysV key shape (a frozen ``LeftoverPatterns``, as in ``engines/mindspore/leftovers.py``)."""


__all__ = ["Engine"]
