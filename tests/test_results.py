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


# --- ``record``: dataclass's behaviour, without compiling methods per class -----------------------------------

from dataclasses import FrozenInstanceError, field, fields, replace  # noqa: E402

import pytest  # noqa: E402

from ms_shm._results import record  # noqa: E402


def _pair(frozen: bool):
    """The same class made by ``dataclass`` and by ``record``, with every kind of field the results use."""
    made = []
    for decorate in (dataclass(frozen=frozen), record(frozen=frozen)):
        class Base(Result):
            name: str
            size: int = 0

        @decorate
        class Sub(decorate(Base)):
            notes: tuple = field(default_factory=tuple)
            hidden: int = field(default=7, repr=False, compare=False)

        made.append(Sub)
    return made


@pytest.mark.parametrize("frozen", [True, False])
def test_record_behaves_as_dataclass(frozen):
    expected, ours = _pair(frozen)
    for cls in (expected, ours):
        a, b = cls("x", 3, ("n",)), cls(name="x", size=3, notes=("n",), hidden=9)
        assert a == b and not a != b and cls("x") != cls("y") and cls("x") != ("x",)
        assert [f.name for f in fields(cls)] == ["name", "size", "notes", "hidden"]
        assert replace(a, size=4).size == 4 and replace(a, size=4).name == "x"
        assert cls("x").notes == ()
    assert repr(ours("x", 3)).split("(", 1)[1] == repr(expected("x", 3)).split("(", 1)[1]
    assert str(ours("x", 3)).splitlines()[1:] == str(expected("x", 3)).splitlines()[1:]
    assert ours("x", 3).to_dict() == expected("x", 3).to_dict()
    if frozen:
        assert hash(ours("x", 3)) == hash(ours("x", 3, (), 8))
        for obj in (ours("x"), expected("x")):
            with pytest.raises(FrozenInstanceError):
                obj.size = 1
            with pytest.raises(FrozenInstanceError):
                del obj.size
    else:
        obj = ours("x")
        obj.size = 5
        assert obj.size == 5
        with pytest.raises(TypeError):
            hash(obj)


@pytest.mark.parametrize("call", [
    lambda cls: cls(),  # missing a required argument
    lambda cls: cls("x", 1, (), 2, 3),  # too many positional arguments
    lambda cls: cls("x", name="y"),  # one argument twice
    lambda cls: cls("x", colour=1),  # an unknown keyword
])
def test_record_refuses_what_dataclass_refuses(call):
    for cls in _pair(True):
        with pytest.raises(TypeError):
            call(cls)


@record
class Checked(Result):
    value: int

    def __post_init__(self):
        if self.value < 0:
            raise ValueError("negative")


def test_record_runs_post_init_and_pickles():
    import copy
    import pickle

    with pytest.raises(ValueError):
        Checked(-1)
    assert pickle.loads(pickle.dumps(Checked(2))) == Checked(2) == copy.deepcopy(Checked(2))


def test_a_decision_on_explicit_arguments_names_what_was_asked_not_a_default():
    """An audit's log read ``num_workers=0 (default num_workers=2)`` for a ``num_workers=2`` the user passed."""
    from ms_shm.plan import EXPLICIT, Decision

    assert "(asked num_workers=2)" in str(Decision(EXPLICIT, "num_workers=0", "num_workers=2", "no room"))
    assert "(default 16)" in str(Decision("prefetch_size", 4, 16, "no room"))
