"""MindSpore's global dataset settings that its worker pools read as they start, read as they are now.

Apart from ``compat`` so that the runtime guard, which a worker process unpickles, reads them without the
hooks ``compat`` puts on MindSpore as it loads it.
"""

from __future__ import annotations

import sys


def shared_mem(config) -> bool | None:
    """``config``'s shared-memory switch, ``None`` in releases without one. The private getter first: the public
    one logs 2.8+'s deprecation warning on every read."""
    getter = getattr(config, "_get_enable_shared_mem", None) or getattr(config, "get_enable_shared_mem", None)
    if getter is None:
        return None
    return bool(getter())


def slot_settings() -> tuple | None:
    """``(shared memory on, prefetch size)`` as MindSpore's config holds them now: what a ``GeneratorDataset``
    pool reads as it starts its workers. ``None`` where unreadable. Reads ``core.config`` only, so a worker
    process that asks sets nothing of ``_dataset_module``'s up, and a process that has not imported MindSpore
    does not import it for this."""
    if "mindspore.dataset" not in sys.modules:
        return None
    try:
        from mindspore.dataset.core import config as core_config

        return shared_mem(core_config), int(core_config.get_prefetch_size())
    except Exception:  # noqa: BLE001 - MindSpore not importable, or a release without these getters
        return None
