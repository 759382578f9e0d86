"""MindSpore's dataset engine: ``GeneratorDataset``, ``map`` and ``batch``. Every MindSpore fact lives in this
package: release profiles (``profiles``), shared-memory and fd arithmetic (``arithmetic``), candidate
transports and their prices (``planning``), the runtime guard (``guard``), and ``compat``, the only module that
imports MindSpore.
"""

from __future__ import annotations

from typing import Any, Sequence

from ms_shm.engines.mindspore import arithmetic, leftovers, profiles


class MindSporeEngine:
    """``ms_shm.engines.base.Engine`` for MindSpore."""

    name = "mindspore"
    arithmetic = arithmetic
    profiles = profiles

    def available(self) -> bool:
        from ms_shm.engines.mindspore import compat

        return compat.available()

    def installed_version(self) -> str | None:
        from ms_shm import host  # the package metadata reader doctor uses (mindspore, -ascend, -gpu, -cpu)

        return host.mindspore_version()

    def profile(self, version: str | None = None) -> profiles.EngineProfile:
        return profiles.profile_for(version if version is not None else self.installed_version())

    def read_config(self) -> Any:
        from ms_shm.engines.mindspore import compat

        return compat.read_config()

    def undo(self, changes: Sequence[Any]) -> None:
        from ms_shm.engines.mindspore import compat

        compat.undo(changes)

    @property
    def compat(self):
        """The adapter that touches MindSpore (imported on first use; MindSpore itself only when called)."""
        from ms_shm.engines.mindspore import compat

        return compat

    @property
    def planning(self):
        from ms_shm.engines.mindspore import planning

        return planning

    @property
    def guard(self):
        from ms_shm.engines.mindspore import guard

        return guard

    def apply_setting(self, setting: str, value: Any, reason: str) -> Any:
        """Apply one global decision (``prefetch_size``, ``shared_mem``); the ``Change`` made, or ``None``."""
        from ms_shm.engines.mindspore import compat

        if setting == "prefetch_size":
            return compat.set_prefetch_size(value, reason)
        if setting == "shared_mem":
            return compat.set_shared_mem(value, reason)
        if setting == "enable_watchdog":
            return compat.set_watchdog(value, reason)
        return None

    def typical_peak(self, row_bytes: int, workers: int, prefetch: int, version: str | None = None) -> int:
        static = self.profile(version).generator_default_max_rowsize_mb
        return arithmetic.generator_peak(row_bytes, workers, prefetch, None, static)

    def pipeline_fds(self, workers: int, prefetch: int) -> int:
        return arithmetic.generator_fds(workers, prefetch)

    def signatures(self, version: str | None = None) -> tuple:
        """MindSpore's failure signatures for ``explain``, worded for ``version`` (``None``: the newest)."""
        from ms_shm.engines.mindspore import signatures

        return signatures.signatures(version)

    def outcome(self, row_bytes: int, workers: int, prefetch: int, ranks: int = 1, shm_free: int | None = None,
                version: str | None = None, rows: int | None = None) -> Any:
        """``outcomes.outcome``: what ``version`` does with this pipeline at ``shm_free`` bytes of /dev/shm."""
        from ms_shm.engines.mindspore import outcomes

        return outcomes.outcome(row_bytes, workers, prefetch, ranks, shm_free, version, rows)

    def what_if_report(self, facts: Any, row_bytes: int, workers: int, prefetch: int = arithmetic.DEFAULT_PREFETCH,
                       ranks: int | None = None, version: str | None = None, shm: int | None = None,
                       rows: int | None = None, memory: int | None = None) -> Any:
        """``ms-shm plan``'s answer (``outcomes.what_if``): each release's outcome and the plan ms_shm would pick."""
        from ms_shm.engines.mindspore import outcomes

        return outcomes.what_if(facts, row_bytes, workers, prefetch, ranks, version, shm, rows, memory)

    def leftover_patterns(self) -> leftovers.LeftoverPatterns:
        return leftovers.leftover_patterns()


ENGINE = MindSporeEngine()

__all__ = ["ENGINE", "MindSporeEngine", "arithmetic", "profiles"]
