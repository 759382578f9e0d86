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


def _is_size(name: str) -> bool:
    """Fields that hold bytes, by the names the results use."""
    return (name.endswith("bytes") or name.startswith(("shm_total", "shm_free", "mem_", "cgroup_mem_"))
            or name in ("predicted_shm", "shmmax"))


def _show(name: str, value: Any, indent: str) -> str:
    if isinstance(value, Result) and dataclasses.is_dataclass(value):
        return "\n" + "\n".join(indent + "  " + line for line in str(value).splitlines())
    if isinstance(value, (list, tuple)) and value and not all(isinstance(v, (int, float)) for v in value):
        return "".join(f"\n{indent}  - " + _show(name, v, indent + "    ").lstrip("\n") for v in value)
    if isinstance(value, int) and not isinstance(value, bool) and _is_size(name):
        return f"{mib(value)} ({value})" if value >= 1024 else mib(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value) if not isinstance(value, tuple) else str(list(value))


class Result:
    """Mixin for frozen dataclasses: ``to_dict()``, ``to_json()``, and ``str()`` as one field per line."""

    def __str__(self) -> str:
        lines = [type(self).__name__]
        for f in dataclasses.fields(self):
            if f.repr:
                shown = _show(f.name, getattr(self, f.name), "  ")
                lines.append(f"  {f.name}:{'' if shown.startswith(chr(10)) else ' '}{shown}")
        return "\n".join(lines)

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
