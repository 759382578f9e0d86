"""One base for every result ms_shm returns, so each prints well and turns into JSON the same way."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import PurePath
from typing import Any


def plain(value: Any) -> Any:
    """JSON-ready copy of a result: dataclasses become dicts, tuples lists, paths strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


class Result:
    """Mixin for frozen dataclasses: ``to_dict()`` and ``to_json()``."""

    def to_dict(self) -> dict:
        return plain(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)


def mib(nbytes: float | None) -> str:
    """Human size used in every log line and CLI table."""
    if nbytes is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"
