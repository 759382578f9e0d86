"""The copy-on-read inspector: what it flags, what it does not, its estimates, its warning and its swaps."""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

import numpy as np
import pytest

from ms_shm import shared_list
from ms_shm.cow import CowFinding, inspect_source, log_findings, share_lists
from ms_shm.shared_list import SharedDict, SharedList


def names(n: int) -> list:
    return [f"images/train/{i:08d}.jpg" for i in range(n)]


class Plain:
    """A source whose attributes are given as keywords."""

    def __init__(self, **attributes):
        vars(self).update(attributes)


class Meta:
    def __init__(self, **attributes):
        vars(self).update(attributes)


def only(findings) -> CowFinding:
    assert len(findings) == 1, findings
    return findings[0]


# ---------------------------------------------------------------------------------------------- flagging
def test_200k_item_list_is_flagged_with_its_count():
    finding = only(inspect_source(Plain(annotations=names(200_000)), workers=2))
    assert finding.attribute == "annotations" and finding.kind == "list"
    assert finding.items == 200_000 and finding.objects == 200_000  # one str per item
    assert finding.workers == 2 and finding.ranks == 1
    assert finding.total_bytes == finding.bytes_per_worker * 2
    assert finding.fix == "self.annotations = ms_shm.SharedList(self.annotations)" and finding.swappable


def test_warning_is_logged_once_per_finding(caplog):
    source = Plain(annotations=names(200_000), captions=[f"a photo of {i}" for i in range(20_000)])
    findings = inspect_source(source, workers=4, ranks=8)
    with caplog.at_level(logging.WARNING, logger="ms_shm.cow"):
        log_findings(findings)
    records = [r for r in caplog.records if r.name == "ms_shm.cow"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    text = records[0].getMessage()
    assert "'annotations'" in text and "200,000 items" in text and "4 worker(s) x 8 rank(s)" in text
    assert "fork: copy-on-read page faults" in text
    assert "self.annotations = ms_shm.SharedList(self.annotations)" in text and "share_lists=True" in text
    assert "'captions'" in records[1].getMessage()


@pytest.mark.parametrize("value", [
    np.zeros((2000, 2000), np.float32),
    np.arange(1_000_000),
    np.array(names(100), dtype="U32"),
    b"x" * 10_000_000,
    "y" * 10_000_000,
    SharedList(names(50_000)),
    SharedDict(dict.fromkeys(names(50_000))),
    range(10_000_000),
    [None] * 200_000,          # one shared object, touched 200,000 times: a single page
    list(range(200)) * 1000,    # small ints are shared singletons too
    names(9_000),               # below min_objects
])
def test_not_flagged(value):
    assert inspect_source(Plain(data=value, other=np.ones(10)), workers=2) == ()


def test_numpy_source_is_not_flagged():
    class ArraySource:
        def __init__(self):
            self.images = np.zeros((1000, 32, 32, 3), np.uint8)
            self.labels = np.arange(1000)
            self.mean = np.array([0.5, 0.5, 0.5])

    assert inspect_source(ArraySource(), workers=8, ranks=8) == ()
    assert inspect_source(ArraySource(), workers=8, start_method="spawn") == ()


@pytest.mark.parametrize("value, kind, items, fix", [
    ({name: i for i, name in enumerate(names(50_000))}, "dict", 50_000, "ms_shm.SharedDict(self.data)"),
    (OrderedDict((i, str(i)) for i in range(50_000)), "OrderedDict", 50_000, "ms_shm.SharedDict(self.data)"),
    (tuple(names(30_000)), "tuple", 30_000, "ms_shm.SharedList(self.data)"),
    (deque(names(30_000)), "deque", 30_000, "ms_shm.SharedList(self.data)"),
    (set(names(30_000)), "set", 30_000, "SharedDict.fromkeys(self.data)"),
    (frozenset(names(30_000)), "frozenset", 30_000, "SharedDict.fromkeys(self.data)"),
    (np.array(names(30_000), dtype=object), "ndarray[object]", 30_000, "SharedList(self.data.tolist())"),
    ([{"id": i, "box": [i, i, i + 5, i + 5]} for i in range(5_000)], "list", 5_000, "SharedList(self.data)"),
])
def test_flagged_kinds(value, kind, items, fix):
    finding = only(inspect_source(Plain(data=value), workers=2))
    assert (finding.kind, finding.items) == (kind, items)
    assert fix in finding.fix
    assert finding.objects >= 10_000


def test_dict_of_50k_is_flagged_and_counts_keys_and_values():
    finding = only(inspect_source(Plain(index={f"k{i}": f"v{i}" for i in range(50_000)}), workers=2))
    assert finding.kind == "dict" and finding.items == 50_000 and finding.objects == 100_000


def test_nested_one_level():
    source = Plain(
        meta=Meta(captions=names(20_000), small=[1, 2, 3]),
        cfg={"annotations": names(30_000), "size": 224},
        splits=[names(15_000), names(5)],
        frozen=(names(12_000), "val"),
        deeper=Meta(inner=Meta(hidden=names(50_000))),  # two levels down: not looked at
    )
    found = {f.attribute: f for f in inspect_source(source, workers=2)}
    assert set(found) == {"meta.captions", "cfg['annotations']", "splits[0]", "frozen[0]"}
    assert found["meta.captions"].fix == "self.meta.captions = ms_shm.SharedList(self.meta.captions)"
    assert found["cfg['annotations']"].fix == (
        "self.cfg['annotations'] = ms_shm.SharedList(self.cfg['annotations'])")
    assert found["splits[0]"].swappable and not found["frozen[0]"].swappable  # a tuple cannot be assigned into


def test_small_wrapper_of_medium_containers_is_flagged_as_a_whole():
    source = Plain(shards=[[f"{j}-{i}" for i in range(2_000)] for j in range(20)])  # 40,000 strings in 20 lists
    finding = only(inspect_source(source, workers=2))
    assert finding.attribute == "shards" and finding.items == 20 and finding.objects >= 40_000


def test_same_list_under_two_names_is_reported_once():
    shared = names(20_000)
    source = Plain(a=shared, b=shared, meta=Meta(c=shared))
    assert [f.attribute for f in inspect_source(source, workers=2)] == ["a"]


def test_slots_are_inspected():
    class Slotted:
        __slots__ = ("files", "unset")

        def __init__(self):
            self.files = names(20_000)

    assert only(inspect_source(Slotted(), workers=2)).attribute == "files"


def test_the_source_itself_can_be_the_container():
    finding = only(inspect_source(names(20_000), workers=2))
    assert finding.attribute == "<source>" and finding.path == ()
    assert finding.fix == "source = ms_shm.SharedList(source)" and not finding.swappable
    assert "the source itself" in finding.message


def test_sorted_largest_first():
    source = Plain(small=names(11_000), big=names(100_000), middle=names(40_000))
    assert [f.attribute for f in inspect_source(source, workers=2)] == ["big", "middle", "small"]


def test_no_workers_no_copies():
    assert inspect_source(Plain(a=names(200_000)), workers=0) == ()


def test_min_objects_is_the_threshold():
    source = Plain(a=names(5_000))
    assert inspect_source(source, workers=2) == ()
    assert only(inspect_source(source, workers=2, min_objects=5_000)).items == 5_000


# ------------------------------------------------------------------------------------------- weird sources
class Weird:
    __slots__ = ("__dict__", "never_set")

    def __init__(self):
        self.files = names(20_000)
        self.broken = BrokenList(names(20_000))
        self.angry = Angry()

    @property
    def explodes(self):
        raise RuntimeError("a property must never be evaluated")

    def __getattr__(self, name):
        raise RuntimeError(f"__getattr__({name}) must never be needed")


class BrokenList(list):
    def __len__(self):
        raise RuntimeError("no len")

    def __iter__(self):
        raise RuntimeError("no iter")


class Angry:
    @property
    def __dict__(self):
        raise RuntimeError("no vars")


def test_weird_sources_never_raise(caplog):
    with caplog.at_level(logging.DEBUG, logger="ms_shm.cow"):
        findings = inspect_source(Weird(), workers=2)
    assert [f.attribute for f in findings] == ["files"]
    assert any("skipped" in r.getMessage() or "failed" in r.getMessage() for r in caplog.records)


def test_objects_that_are_not_walked():
    source = Plain(module=sys, klass=dict, func=names, method=[].append, gen=(i for i in range(3)))
    assert inspect_source(source, workers=2) == ()


class Counted:
    """An element that counts how often the inspector sizes it (``sys.getsizeof`` calls ``__sizeof__``)."""

    __slots__ = ()
    reads = 0

    def __sizeof__(self):
        Counted.reads += 1
        return 64


def test_inspecting_reads_a_bounded_sample_whatever_the_size():
    """The cost is bounded by what is read, not by the list's length: counted, not timed. A list 50 times
    longer is sized from the same 1000 sampled elements, and still flagged with its full count."""
    reads, findings = {}, {}
    for n in (20_000, 1_000_000):
        Counted.reads = 0
        findings[n] = only(inspect_source(Plain(a=[Counted() for _ in range(n)]), workers=2))
        reads[n] = Counted.reads
    assert reads[20_000] == reads[1_000_000] == 1000, reads
    assert findings[1_000_000].items == 1_000_000 and findings[1_000_000].objects == 1_000_000


# ---------------------------------------------------------------------------------------- start methods
def test_fork_and_spawn_say_which_mechanism_applies():
    source = Plain(annotations=[{"id": i, "file": f"{i:08d}.jpg"} for i in range(50_000)])
    fork = only(inspect_source(source, workers=2, start_method="fork"))
    spawn = only(inspect_source(source, workers=2, start_method="spawn"))
    assert fork.mechanism == "fork: copy-on-read page faults"
    assert spawn.mechanism == "spawn: pickled into each worker"
    assert "copies the pages it reads as reference counts are touched" in fork.message
    assert "spawn: pickled into each worker" in spawn.message and "unpickles its own full copy" in spawn.message
    assert spawn.bytes_per_worker > fork.bytes_per_worker  # spawn rebuilds dict tables too
    assert only(inspect_source(source, workers=2, start_method="forkserver")).mechanism == (
        "forkserver: pickled into each worker")


def test_estimates_track_object_sizes():
    strings = names(100_000)
    per_item = sys.getsizeof(strings[0])
    fork = only(inspect_source(Plain(a=strings), workers=3, ranks=2))
    assert 0.95 * 100_000 * per_item <= fork.bytes_per_worker <= 1.1 * 100_000 * per_item
    assert fork.total_bytes == fork.bytes_per_worker * 6
    spawn = only(inspect_source(Plain(a=strings), workers=3, start_method="spawn"))
    assert spawn.bytes_per_worker >= 100_000 * (per_item + 8)  # plus the list's pointer table


def test_big_leaves_cost_a_page_under_fork_and_everything_under_spawn():
    data = np.zeros(100_000, np.uint8)
    blobs = [data[:] for _ in range(10_000)]  # 10,000 array headers over 100 kB each (views: no real 1 GB)
    fork = only(inspect_source(Plain(a=blobs), workers=2))
    assert fork.bytes_per_worker < 10_000 * 4096
    spawn = only(inspect_source(Plain(a=blobs), workers=2, start_method="spawn"))
    assert spawn.bytes_per_worker > 10_000 * 100_000


def test_to_dict_is_json_and_leaves_out_internals():
    finding = only(inspect_source(Plain(annotations=names(20_000)), workers=2))
    data = finding.to_dict()
    assert "path" not in data and "container_id" not in data
    assert json.loads(finding.to_json())["attribute"] == "annotations"
    with pytest.raises(AttributeError):
        finding.items = 3  # frozen


# ---------------------------------------------------------------------------------------------- swapping
@dataclass(frozen=True)
class FrozenMeta:
    captions: list


def test_share_lists_swaps_what_it_can_and_says_why_not(caplog):
    annotations = [{"id": i, "file": f"{i}.jpg"} for i in range(20_000)]
    index = {f"{i}.jpg": i for i in range(20_000)}
    source = Plain(
        annotations=annotations, index=index, members=set(names(20_000)),
        counts=defaultdict(int, {f"{i}": i for i in range(20_000)}),
        meta=Meta(captions=names(20_000)), frozen_meta=FrozenMeta(names(20_000)),
        pair=(names(20_000), 1), splits=[names(20_000)],
    )
    findings = inspect_source(source, workers=2)
    with caplog.at_level(logging.INFO, logger="ms_shm.cow"):
        swapped = share_lists(source, findings)
    assert set(swapped) == {"annotations", "index", "meta.captions", "splits[0]"}
    assert isinstance(source.annotations, SharedList) and source.annotations == annotations
    assert isinstance(source.index, SharedDict) and source.index == index
    assert isinstance(source.meta.captions, SharedList) and isinstance(source.splits[0], SharedList)
    assert type(source.members) is set and type(source.counts) is defaultdict
    assert type(source.frozen_meta.captions) is list and type(source.pair[0]) is list
    messages = [r.getMessage() for r in caplog.records if r.name == "ms_shm.cow"]
    assert sum("replaced source." in m for m in messages) == 4
    assert any("frozen_meta.captions as is: cannot assign it" in m for m in messages)
    assert any("left members (set) as is" in m for m in messages)
    assert any("left pair[0] (list) as is" in m for m in messages)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "ms_shm.cow")
    left = {f.attribute for f in inspect_source(source, workers=2)}
    assert left == {"members", "counts", "frozen_meta.captions", "pair[0]"}


def test_share_lists_uses_shared_memory_under_spawn(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_list, "_SHM_DIR", str(tmp_path))
    fork_source, spawn_source = Plain(a=names(20_000)), Plain(a=names(20_000))
    share_lists(fork_source, inspect_source(fork_source, workers=2))
    share_lists(spawn_source, inspect_source(spawn_source, workers=2, start_method="spawn"))
    assert fork_source.a.shared_memory_name is None
    assert spawn_source.a.shared_memory_name is not None and (tmp_path / spawn_source.a.shared_memory_name).exists()
    forced = Plain(a=names(20_000))
    share_lists(forced, inspect_source(forced, workers=2), shared_memory=True)
    assert forced.a.shared_memory_name is not None


def test_share_lists_falls_back_when_shm_is_full(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shared_list, "_SHM_DIR", str(tmp_path))

    def no_space(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_list.os, "posix_fallocate", no_space)
    source = Plain(a=names(20_000))
    with caplog.at_level(logging.INFO, logger="ms_shm.cow"):
        assert share_lists(source, inspect_source(source, workers=2), shared_memory=True) == ("a",)
    assert source.a.shared_memory_name is None and source.a == names(20_000)
    assert any("no room in shared memory" in r.getMessage() for r in caplog.records)


def test_share_lists_skips_what_changed_since_inspection():
    source = Plain(a=names(20_000))
    findings = inspect_source(source, workers=2)
    source.a = names(20_000)  # a different object now
    assert share_lists(source, findings) == ()
    del source.a
    assert share_lists(source, findings) == ()


def test_share_lists_leaves_the_source_itself():
    source = names(20_000)
    assert share_lists(source, inspect_source(source, workers=2)) == ()


def test_share_lists_leaves_unpicklable_items():
    source = Plain(a=[lambda i=i: i for i in range(20_000)])
    assert share_lists(source, inspect_source(source, workers=2)) == ()
    assert type(source.a) is list
