"""The engines: one per framework whose data pipelines ms_shm plans. Generic code asks an engine for its part
(a release profile, candidate transports and their arithmetic, config to read and restore, failure signatures
for ``explain``, leftovers for ``clean``) and never asks which framework it is talking to.

A contributor adding an engine adds a package here with an ``ENGINE`` object implementing ``base.Engine`` and
names it in ``ENGINES``; its rules must import without the framework installed.
"""

from __future__ import annotations

import importlib

from ms_shm.engines.base import Engine

ENGINES = {"mindspore": "ms_shm.engines.mindspore", "torch": "ms_shm.engines.torch",
           "mindspore-dataloader": "ms_shm.engines.mindspore_dataloader"}


def get(name: str = "mindspore") -> Engine:
    """The engine called ``name`` (its module is imported on first use; the framework itself is not)."""
    return importlib.import_module(ENGINES[name]).ENGINE


def all_engines() -> list:
    return [get(name) for name in ENGINES]


__all__ = ["Engine", "ENGINES", "get", "all_engines"]
