"""Every public result type, produced on this real host, is a frozen dataclass that prints and serialises to
JSON; every exported exception sits under ``ms_shm.Error``; the public names exist. No root, no MindSpore
needed (where MindSpore is missing, the results say so instead of raising)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

import ms_shm
from ms_shm import sandbox
from ms_shm._results import Result
from ms_shm.engines.mindspore import planning


def public_results() -> list:
    with ms_shm.watch(interval=0.05) as w:
        pass
    return [
        ms_shm.probe(),
        ms_shm.tune(dry_run=True),
        planning.what_if(8 << 20, 2, shm_free=64 << 20),
        ms_shm.clean(dry_run=True),
        w.summary,
        ms_shm.RowStats.synthetic(1 << 20),
        sandbox.Effects("draws"),
    ]


@pytest.mark.parametrize("result", public_results(), ids=lambda r: type(r).__name__)
def test_results_are_frozen_printable_and_json(result):
    assert isinstance(result, Result) and dataclasses.is_dataclass(result)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(result, dataclasses.fields(result)[0].name, None)
    assert str(result).strip()
    assert json.loads(json.dumps(result.to_dict())) == json.loads(result.to_json())


def test_every_exported_exception_is_an_ms_shm_error():
    exported = [getattr(ms_shm, n) for n in ms_shm.__all__]
    errors = [e for e in exported if inspect.isclass(e) and issubclass(e, BaseException)]
    assert {e.__name__ for e in errors} >= {"Error", "RowError", "ShmBudgetError", "RowTooLargeError",
                                            "ShmFullError", "UsageError"}
    assert all(issubclass(e, ms_shm.Error) for e in errors)


def test_every_name_in_all_exists():
    assert all(hasattr(ms_shm, name) for name in ms_shm.__all__)
