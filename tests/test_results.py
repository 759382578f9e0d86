"""Every result prints as one field per line, sizes readable, and round-trips to JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ms_shm._results import Result


@dataclass(frozen=True)
class Inner(Result):
    source: str


@dataclass(frozen=True)
class Outer(Result):
    shm_free: int | None
    peak_bytes: int
    fraction: float
    inner: Inner
    warnings: tuple
    growth_bytes: tuple


def test_str_is_readable_and_json_is_plain():
    r = Outer(64 << 20, 512, 0.847106, Inner("env"), ("first", "second"), (0, 1))
    assert str(r).splitlines() == [
        "Outer",
        "  shm_free: 64.0 MiB (67108864)",
        "  peak_bytes: 512 B",
        "  fraction: 0.8471",
        "  inner:",
        "    Inner",
        "      source: env",
        "  warnings:",
        "    - first",
        "    - second",
        "  growth_bytes: [0, 1]",
    ]
    assert json.loads(r.to_json()) == {"shm_free": 64 << 20, "peak_bytes": 512, "fraction": 0.847106,
                                       "inner": {"source": "env"}, "warnings": ["first", "second"],
                                       "growth_bytes": [0, 1]}
    assert "None" in str(Outer(None, 0, 0.0, Inner(""), (), ()))
