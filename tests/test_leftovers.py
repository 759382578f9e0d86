"""MindSpore's leftover patterns live in its engine, and ``clean`` asks every engine for them: a second engine's
names and key shape are cleaned the same way, with no change to ``cleanup.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ms_shm import cleanup, engines
from ms_shm.cleanup import KIND_DEV_SHM, KIND_IPC_FILE, KIND_MSG, KIND_SHM, clean, ftok
from ms_shm.engines.base import Engine
from ms_shm.engines.mindspore import ENGINE, leftovers
from ms_shm.engines.mindspore.leftovers import LeftoverPatterns
from tests import test_cleanup
from tests.test_cleanup import DEAD, LIVE

TOY_PROJ = 0x42
TOY = LeftoverPatterns(
    label="Toy",
    dev_shm=(("toy", re.compile(r"^toy_(\d+)_")),),
    ipc_files=(re.compile(r"^toyipc_(\d+)$"),),
    ipc_file_text="/tmp/toyipc file",
    ftok_proj=TOY_PROJ,
    sysv_pair=True,
)


#: the fake root and the IPC_RMID recorder of ``test_cleanup``
host = test_cleanup.host
rmid = test_cleanup.rmid


class ToyEngine:
    name = "toy"

    def leftover_patterns(self) -> LeftoverPatterns:
        return TOY


@pytest.fixture
def with_toy(monkeypatch):
    monkeypatch.setattr(engines, "all_engines", lambda: [engines.get("mindspore"), ToyEngine()])


def test_mindspore_names_and_key_shape():
    p = ENGINE.leftover_patterns()
    assert p is leftovers.PATTERNS and p.label == "MindSpore"
    assert p.ipc_file_pid("dataset_ipc_4770_140594783198080_0") == 4770
    assert p.ipc_file_pid("dataset_ipc_4770_x_0") is None and p.ipc_file_pid("other") is None
    assert p.dev_shm_owner("mindspore_123_8812_3") == ("mindspore", 123)
    assert p.dev_shm_owner(f"pym-{DEAD}-x") is None and p.dev_shm_owner("torch_1_2") is None
    assert p.has_key_shape(0x00290003) and p.has_key_shape(0x0000C0AB)  # proj_id 0 in the top byte
    assert not p.has_key_shape(0x5100C0AD)
    assert p.sysv_pair and p.ftok_proj == cleanup.MINDSPORE_FTOK_PROJ == 0


def test_the_engine_implements_the_protocol_and_the_patterns_are_frozen():
    assert isinstance(ENGINE, Engine)
    with pytest.raises(AttributeError):
        ENGINE.leftover_patterns().label = "other"  # frozen dataclass
    assert [p.label for p in cleanup.engine_patterns()] == [e.leftover_patterns().label
                                                             for e in engines.all_engines()]


def test_patterns_and_clean_import_without_mindspore(tmp_path):
    code = ("import sys\n"
            "from ms_shm.engines.mindspore import leftovers\n"
            "from ms_shm.cleanup import clean, engine_patterns\n"
            "engine_patterns()\n"
            f"clean(root={str(tmp_path)!r})\n"
            "assert 'mindspore' not in sys.modules, sorted(m for m in sys.modules if 'mindspore' in m)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_second_engine_is_cleaned_through_its_own_patterns(host, rmid, with_toy):
    dead_file = host.dev_shm(f"toy_{DEAD}_1")
    live_file = host.dev_shm(f"toy_{LIVE}_1")
    key_file = host.root / "tmp" / f"toyipc_{DEAD}"
    key_file.write_bytes(b"")
    key = ftok(os.stat(key_file), TOY_PROJ)
    host.segment(key, 21)
    host.queue(key, 21)
    host.crashed_pipeline(workers=1, first_id=30)  # MindSpore's, beside it
    report = clean(dry_run=False, root=host.root, uid=0)
    names = {(item.kind, Path(item.name).name if "/" in item.name else item.name) for item in report.leftovers}
    assert (KIND_DEV_SHM, dead_file.name) in names and (KIND_IPC_FILE, key_file.name) in names
    assert sorted(rmid) == [(KIND_MSG, 21), (KIND_MSG, 30), (KIND_SHM, 21), (KIND_SHM, 30)]
    assert live_file.exists() and not dead_file.exists() and not key_file.exists()
    toy_reasons = [item.reason for item in report.leftovers if item.kind == KIND_IPC_FILE and "toyipc" in item.name]
    assert toy_reasons and "Toy never deletes" in toy_reasons[0]


def test_orphans_of_a_second_engine_carry_its_name(host, rmid, with_toy):
    key = (TOY_PROJ << 24) | 0xC0AB
    host.segment(key, 7)
    host.queue(key, 7)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == () and rmid == []
    assert any("look like Toy's" in note and "proj_id 66" in note and "/tmp/toyipc file" in note
               for note in report.notes)
    forced = clean(dry_run=False, root=host.root, uid=0, orphan_keys=True)
    assert sorted(rmid) == [(KIND_MSG, 7), (KIND_SHM, 7)]
    assert all("Toy's shape" in item.reason for item in forced.leftovers)


def test_without_the_engine_its_files_are_no_one_s(host, rmid, monkeypatch):
    """A name no engine (and no generic rule) claims is never touched: cleanup itself knows no framework's."""
    monkeypatch.setattr(engines, "all_engines", lambda: [])
    mindspore_file = host.dev_shm(f"mindspore_{DEAD}_1_0")
    host.crashed_pipeline(workers=1)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == () and rmid == [] and mindspore_file.exists()
