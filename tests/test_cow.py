"""The copy-on-read inspector: what it flags, what it does not, its estimates, its warning and its swaps."""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

import numpy as np
import pytest

from ms_shm import shared_list
from ms_shm.cow import CowFinding, inspect_source, log_findings, share_lists
from ms_shm.sandbox import Effects
from ms_shm.shared_list import ReadOnlyError, SharedDict, SharedList


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


class DecodingList(list):
    """Decodes an item as it is read: the program's own code, which the estimate must not run in the program."""

    reads = 0

    def __getitem__(self, i):
        DecodingList.reads += 1
        return list.__getitem__(self, i).upper()

    def __iter__(self):
        DecodingList.reads += 1
        return (item.upper() for item in list.__iter__(self))

    def __len__(self):
        DecodingList.reads += 1
        return list.__len__(self)


def test_a_container_subclass_is_sampled_as_stored_without_running_its_reads():
    """The handles audit: a lazily decoding list of 200,000 items had 1,000 decoded by the estimate, at build."""
    DecodingList.reads = 0
    held = Plain(annotations=DecodingList(names(200_000)), nested=Meta(inner=DecodingList(names(50))))
    finding = only(inspect_source(held, workers=2))
    assert finding.attribute == "annotations" and finding.items == 200_000, finding
    assert DecodingList.reads == 0


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


def test_copies_too_small_to_act_on_are_said_at_info(caplog):
    """10,000 strings copied by 2 workers come to ~1.2 MiB: said (INFO), not a WARNING no one can act on."""
    findings = inspect_source(Plain(captions=names(10_000)), workers=2)
    assert only(findings).total_bytes < 16 * 2**20
    with caplog.at_level(logging.INFO, logger="ms_shm.cow"):
        log_findings(findings)
    records = [r for r in caplog.records if r.name == "ms_shm.cow"]
    assert [r.levelno for r in records] == [logging.INFO] and "'captions'" in records[0].getMessage()


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
    (np.array(names(30_000), dtype=object), "ndarray[object]", 30_000, "SharedList(self.data.tolist())"),
    ([{"id": i, "box": [i, i, i + 5, i + 5]} for i in range(5_000)], "list", 5_000, "SharedList(self.data)"),
])
def test_flagged_kinds(value, kind, items, fix):
    finding = only(inspect_source(Plain(data=value), workers=2))
    assert (finding.kind, finding.items) == (kind, items)
    assert fix in finding.fix
    assert finding.objects >= 10_000


def test_dict_of_50k_is_flagged_and_counts_the_values_a_lookup_hands_out():
    """Under fork a lookup compares a key and writes only the value's reference count: the values are copied, not
    the keys (an audit: 2M ``{path: class id}`` was counted at 152.6 MiB per worker, refused in 500 MB where raw
    ran, and workers copied ~0). Under spawn both are unpickled."""
    index = {f"k{i}": f"v{i}" for i in range(50_000)}
    finding = only(inspect_source(Plain(index=index), workers=2))
    assert finding.kind == "dict" and finding.items == 50_000 and finding.objects == 50_000
    assert only(inspect_source(Plain(index=index), workers=2, start_method="spawn")).objects == 100_000
    assert inspect_source(Plain(classes={name: i % 10 for i, name in enumerate(names(50_000))}), workers=2) == ()


@pytest.mark.parametrize("kind", [set, frozenset])
def test_a_set_is_read_by_membership_and_copies_nothing_under_fork(kind):
    members = kind(names(30_000))
    assert inspect_source(Plain(data=members), workers=2) == ()
    finding = only(inspect_source(Plain(data=members), workers=2, start_method="spawn"))
    assert (finding.kind, finding.items) == (kind.__name__, 30_000) and "SharedDict.fromkeys(self.data" in finding.fix


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
    # a list whose own len() and iteration raise is still read as stored, as a worker copies it; not swapped
    assert sorted(f.attribute for f in findings) == ["broken", "files"]
    assert not next(f for f in findings if f.attribute == "broken").swappable
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
    # the fix: under spawn the stand-in's buffer travels through shared memory, or each worker unpickles it
    assert fork.fix == "self.annotations = ms_shm.SharedList(self.annotations)"
    assert spawn.fix == "self.annotations = ms_shm.SharedList(self.annotations, shared_memory=True)"


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
    assert any("left pair[0] (list) as is" in m for m in messages)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ms_shm.cow" and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # what was left, though the caller asked for it, named in one line
    assert all(f"source.{a}" in warnings[0] for a in ("counts", "frozen_meta.captions", "pair[0]"))
    assert "members" not in " ".join(messages)  # a set read by membership: nothing copied under fork
    assert "every worker still copies them" in warnings[0]
    summary = only([m for m in messages if "share_lists=True put read-only shared stand-ins" in m])
    assert all(f"source.{a}" in summary for a in ("annotations", "index", "meta.captions", "splits[0]"))
    left = {f.attribute for f in inspect_source(source, workers=2)}
    assert left == {"counts", "frozen_meta.captions", "pair[0]"}


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


# ------------------------------------------------------------------------------------------ audit fixes
def test_a_periodic_list_is_sampled_at_random_positions_not_a_stride():
    """Every 1000th item of ``[i % 1000 ...]`` is 0, a shared small int: a stride would see no objects at all."""
    finding = only(inspect_source(Plain(labels=[i % 1000 for i in range(1_000_000)]), workers=2))
    assert 600_000 < finding.objects < 900_000  # 743,000 ints above 256, each its own object
    again = only(inspect_source(Plain(labels=[i % 1000 for i in range(1_000_000)]), workers=2))
    assert again.objects == finding.objects  # a fixed seed: the same estimate every time


def test_every_name_of_an_aliased_list_is_swapped():
    """``self.train_paths = self.paths``: swapping one name only would keep the plain list alive."""
    paths = names(20_000)
    source = Plain(paths=paths, train_paths=paths, split={"train": paths, "n": 3})
    finding = only(inspect_source(source, workers=2))
    assert finding.attribute == "paths" and {_path(a) for a in finding.aliases} == {"train_paths", "split['train']"}
    assert set(share_lists(source, [finding])) == {"paths", "train_paths", "split['train']"}
    assert source.paths is source.train_paths is source.split["train"] and isinstance(source.paths, SharedList)
    assert type(source.split) is dict  # the small wrapper of an alias is not swapped whole around it


def _path(path: tuple) -> str:
    from ms_shm.cow import _format_path
    return _format_path(path)


def test_a_small_container_deeper_down_is_looked_into_not_swapped_whole():
    """pycocotools keeps ``self.coco.dataset = {"images": [...], "annotations": [...]}``: swapping that 2-key
    dict whole would unpickle a whole list on every ``dataset["images"]``."""
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in range(20_000)]
    source = Plain(coco=Meta(dataset={"images": images, "annotations": names(20_000), "info": {"v": 1}}))
    found = {f.attribute for f in inspect_source(source, workers=2)}
    assert found == {"coco.dataset['images']", "coco.dataset['annotations']"}
    share_lists(source, inspect_source(source, workers=2))
    assert type(source.coco.dataset) is dict and isinstance(source.coco.dataset["images"], SharedList)
    assert source.coco.dataset["images"] == images


def test_nothing_outside_the_source_is_changed(caplog):
    """A ``meta`` dict held by a train and a val dataset: replacing inside it would change the val one too."""
    meta = {"train": names(20_000), "val": names(20_000)}
    train, val = Plain(meta=meta, split="train"), Plain(meta=meta, split="val")
    with caplog.at_level(logging.INFO, logger="ms_shm.cow"):
        assert share_lists(train, inspect_source(train, workers=2)) == ()
    assert type(meta["train"]) is list and type(val.meta["val"]) is list
    messages = [r.getMessage() for r in caplog.records]
    assert any("left meta['train'] as is: meta is also held outside the source" in m for m in messages)
    assert any(r.levelno == logging.WARNING and "left source.meta['train']" in r.getMessage()
               for r in caplog.records)
    del val  # now the source is the dict's only holder
    assert set(share_lists(train, inspect_source(train, workers=2))) == {"meta['train']", "meta['val']"}


def test_an_object_shared_with_another_source_is_not_written_into():
    shared = Meta(captions=names(20_000))
    one, other = Plain(meta=shared), Plain(meta=shared)
    assert share_lists(one, inspect_source(one, workers=2)) == ()
    assert type(other.meta.captions) is list
    own = Plain(meta=Meta(captions=names(20_000)))
    assert share_lists(own, inspect_source(own, workers=2)) == ("meta.captions",)


@pytest.mark.parametrize("value", [tuple(names(20_000)), deque(names(20_000), maxlen=30_000)])
def test_tuples_and_deques_are_left_as_they_are(value):
    """A stand-in is neither hashable nor equal to a tuple, and has no ``maxlen``: fix by hand only."""
    source = Plain(data=value)
    finding = only(inspect_source(source, workers=2))
    assert not finding.swappable and "ms_shm.SharedList(self.data)" in finding.fix
    assert share_lists(source, [finding]) == () and source.data is value


def test_a_swapped_list_names_its_attribute_when_changed():
    source = Plain(paths=names(20_000), index={f"{i}.jpg": i for i in range(20_000)})
    share_lists(source, inspect_source(source, workers=2))
    with pytest.raises(TypeError, match="source attribute 'paths' is ms_shm's read-only shared stand-in") as raised:
        source.paths.append("new.jpg")
    assert "share_lists=True" in str(raised.value) and "do not modify self.paths after building" in str(raised.value)
    with pytest.raises(ReadOnlyError, match="source attribute 'index'"):
        source.index["new.jpg"] = 1
    with pytest.raises(ReadOnlyError, match="source attribute 'paths'"):
        random.shuffle(source.paths)


@pytest.mark.parametrize("effects, swapped", [
    (Effects(rereads_differ="source[0] read twice differs"), ()),
    (Effects(mutates_state="Source.calls changed while rows were read",
             state_per_read="Source.calls changed while rows were read on every read, not only the first"), ()),
    (Effects(mutates_state="Source.anns changed while rows were read"), ()),  # lazy set-up of a flagged list
    (Effects(mutates_state="Source.handle changed while rows were read"), ("anns",)),  # lazy open of a file
    (Effects(), ("anns",)),
    (None, ("anns",)),
])
def test_no_swap_when_the_probe_saw_reading_keep_state(caplog, effects, swapped):
    """``ann["hits"] += 1`` on an item works on a list; on a stand-in each read is a new copy and the count
    would be lost. The probe sees it (a re-read differs), and then nothing is swapped, with a WARNING."""
    source = Plain(anns=[{"file": f"{i}.jpg", "bbox": [1.0, 2.0]} for i in range(20_000)])
    with caplog.at_level(logging.WARNING, logger="ms_shm.cow"):
        assert share_lists(source, inspect_source(source, workers=2), effects=effects) == swapped
    assert isinstance(source.anns, SharedList) == bool(swapped)
    if not swapped:
        text = only([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING])
        assert "left anns as they are" in text and "share_lists=False" in text


# ------------------------------------------------------------------------------- real MindSpore, side by side
SIDE_BY_SIDE = '''
import logging, sys
import numpy as np
import mindspore.dataset as ds
import ms_shm


class CacheInElement:
    """A per-worker cache written into each element: rows count how often the worker saw the element."""

    def __init__(self):
        self.anns = [{"file_name": f"{i}.jpg", "bbox": [1.0, 2.0]} for i in range(30_000)]

    def __len__(self):
        return 64

    def __getitem__(self, i):
        a = self.anns[i]
        a["hits"] = a.get("hits", 0) + 1
        return np.array([a["hits"], len(a["file_name"])], np.int64)


class IdMap:
    """MindSpore hands workers numpy.int64 indices; the int-keyed dict must find them."""

    def __init__(self):
        self.id2len = {i: i * 3 for i in range(30_000)}

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.array([self.id2len.get(i, -1)], np.int64)


def rows(make, share):
    kw = dict(num_parallel_workers=2, python_multiprocessing=True, shuffle=False)
    source = make()
    d = ms_shm.build_dataset(source, ["x"], share_lists=True, **kw) if share else ds.GeneratorDataset(source, ["x"], **kw)
    it = d.create_tuple_iterator(num_epochs=2, output_numpy=True)
    out = [[r[0].tolist() for r in it] for _ in range(2)]
    return out, {k: type(v).__name__ for k, v in vars(source).items()}


logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
for make in (CacheInElement, IdMap):
    raw, _ = rows(make, False)
    mine, kinds = rows(make, True)
    assert raw == mine, (make.__name__, raw[0][:5], mine[0][:5])
    print("SAME", make.__name__, kinds, flush=True)
'''


@pytest.mark.mindspore
@pytest.mark.privileged
def test_share_lists_rows_equal_raw_mindspore(real_mindspore, tmp_path):
    (tmp_path / "side_by_side.py").write_text(SIDE_BY_SIDE)
    result = real_mindspore.run_shell(f"{sys.executable} {tmp_path / 'side_by_side.py'}", shm="256m", timeout=600,
                                      env={"PYTHONPATH": str(real_mindspore.REPO)})
    assert result.returncode == 0, real_mindspore.describe(result)
    assert "SAME CacheInElement {'anns': 'list'}" in result.stdout, real_mindspore.describe(result)  # kept: state
    assert "SAME IdMap {'id2len': 'SharedDict'}" in result.stdout, real_mindspore.describe(result)
    assert "left anns as they are" in result.stdout + result.stderr, real_mindspore.describe(result)


def test_the_warning_offers_share_lists_only_where_it_would_swap(caplog):
    """A source whose rows read back differently keeps its lists under share_lists=True (a cache in an item
    would be lost): its copy-on-read warning must not offer that fix."""
    class Src:
        def __init__(self):
            self.names = [f"{i}.jpg" for i in range(200_000)]

    findings = inspect_source(Src(), workers=2)
    with caplog.at_level("WARNING", logger="ms_shm"):
        log_findings(findings)
        log_findings(findings, Effects(rereads_differ="source[0] read twice differs"))
    first, second = [r.getMessage() for r in caplog.records]
    assert "share_lists=True" in first and "share_lists=True" not in second and "SharedList" in second


def test_inspecting_a_source_leaves_shared_list_unimported():
    """``build_dataset`` inspects every source: the stand-ins' module (and ``cleanup`` with it) loads only where a
    stand-in is made, not in every build."""
    import subprocess

    code = ("import sys; from ms_shm import cow\n"
            "class Source:\n    def __init__(self):\n        self.paths = [str(i) for i in range(200_000)]\n"
            "assert cow.inspect_source(Source(), workers=2)\n"
            "print(sorted(m for m in ('ms_shm.shared_list', 'ms_shm.cleanup') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_maps_holders_are_its_operations_of_the_programs_own_not_mindspores():
    """A map's operations are walked as the source is (copy-on-read in each map worker), but only the program's:
    an object, a function (for the globals it reads), a bound method, a partial's function; MindSpore's own
    transforms and builtins hold no program data."""
    import functools

    from ms_shm.api import _operation_holders

    class Lookup:
        def __call__(self, x):
            return x

        def find(self, x):
            return x

    def decode(x):
        return x

    own = Lookup()
    native = type("Decode", (), {"__module__": "mindspore.dataset.vision.transforms", "__call__": lambda s, x: x})()
    assert _operation_holders([own, len, None, native]) == [("map operation Lookup", own)]
    assert _operation_holders(own) == [("map operation Lookup", own)]
    assert _operation_holders(functools.partial(decode, 1)) == [(f"map operation {decode.__qualname__}", decode)]
    method = own.find  # walked as far as its code names its object's attributes
    assert _operation_holders(method) == [(f"map operation {method.__qualname__}", method)]


def _module(source: str, **globals_) -> dict:
    """A module's namespace: ``source`` run with ``globals_`` as its globals (what a user's module holds)."""
    namespace = dict(globals_)
    exec(compile(source, "<user module>", "exec"), namespace)
    return namespace


def test_a_module_global_the_sources_getitem_reads_is_flagged_with_a_fix_at_module_level():
    """``return load(PATHS[i])`` reads a module-level list in every forked worker as an attribute is read."""
    module = _module("class Source:\n    def __getitem__(self, i):\n        return PATHS[i]\n"
                     "    def __len__(self):\n        return len(SIZES)\n", PATHS=names(30_000), SIZES=names(30_000))
    finding = only(inspect_source(module["Source"](), workers=2))
    assert (finding.attribute, finding.fix, finding.swappable) == ("PATHS", "PATHS = ms_shm.SharedList(PATHS)", False)
    assert "module global 'PATHS' read by the source" in finding.message
    assert inspect_source(module["Source"](), workers=2, start_method="spawn") == ()  # rebuilt by each import


def test_what_a_map_function_reads_through_helpers_comprehensions_and_closures_is_flagged():
    from ms_shm.cow import findings_in

    module = _module(
        "def label(x):\n    return LABELS[x]\n"
        "def op(x):\n    return [label(x)] + [w for w in WORDS if w]\n"
        "def make():\n    table = {i: str(i) for i in range(30000)}\n"
        "    def closed(x):\n        return table[x]\n    return closed\n",
        LABELS={i: [i] for i in range(30_000)}, WORDS=names(30_000))
    found = findings_in([("map operation op", module["op"]), ("map operation closed", module["make"]())], workers=2)
    assert sorted((f.attribute, f.holder) for f in found) == [
        ("LABELS", "map operation op"), ("WORDS", "map operation op"), ("table", "map operation closed")]
    closed = next(f for f in found if f.attribute == "table")
    assert "variable 'table' closed over by the map operation closed" in closed.message
    assert closed.fix == "table = ms_shm.SharedDict(table)"


def test_a_container_two_holders_read_is_said_and_counted_once():
    from ms_shm.cow import findings_in, for_workers

    module = _module("def a(x):\n    return WORDS[x]\ndef b(x):\n    return WORDS[-x]\n", WORDS=names(30_000))
    found = findings_in([("map operation a", module["a"]), ("map operation b", module["b"])], workers=1)
    assert [f.holder for f in found] == ["map operation a"]
    four = only(for_workers(found, 4))
    assert (four.workers, four.total_bytes) == (4, 4 * found[0].bytes_per_worker)


def test_an_attribute_of_a_programs_module_the_code_reads_is_flagged_and_a_librarys_is_not():
    """``import config`` then ``config.PATHS[i]`` in ``__getitem__``: the program's module is read as far as the
    code names its attributes; a module installed with the interpreter is a library, never the dataset's data."""
    import sysconfig
    import types

    def module_at(path: str) -> types.ModuleType:
        made = types.ModuleType("config")
        made.__file__, made.PATHS, made.UNREAD = path, names(30_000), names(30_000)
        return made

    code = "class Source:\n    def __getitem__(self, i):\n        return config.PATHS[i]\n"
    ours = _module(code, config=module_at("/srv/project/config.py"))
    finding = only(inspect_source(ours["Source"](), workers=2))
    assert (finding.attribute, finding.swappable) == ("config.PATHS", False)
    assert finding.fix == "config.PATHS = ms_shm.SharedList(config.PATHS)"
    assert "attribute 'PATHS' of module global 'config' read by the source" in finding.message
    library = _module(code, config=module_at(os.path.join(sysconfig.get_path("purelib"), "config.py")))
    assert inspect_source(library["Source"](), workers=2) == ()


def test_a_dataframes_columns_of_python_objects_are_flagged_and_its_numbers_are_not():
    """``self.df.iloc[i]["path"]``: pandas keeps strings (without pyarrow) and ``object`` columns as numpy arrays
    of Python objects, four levels below the frame (``_mgr.blocks[k].values``), which the attribute walk never
    reached: an audit measured 62 MiB per worker against an estimate of 0. A Series held apart from its frame
    is the same array, said once."""
    pd = pytest.importorskip("pandas", reason="pandas is not installed (make install adds it)")
    frame = pd.DataFrame({"path": names(30_000), "label": np.arange(30_000), "meta": [{"w": i} for i in range(30_000)]})
    found = inspect_source(Plain(df=frame, paths=frame["path"]), workers=2)
    by_attribute = {f.attribute: f for f in found}
    assert sorted(by_attribute) == ["df['meta']", "df['path']"], found
    path, meta = by_attribute["df['path']"], by_attribute["df['meta']"]
    assert path.kind == "pandas column of Python objects" and not path.swappable and path.objects >= 30_000
    assert path.fix == """self.df['path'] = self.df['path'].astype("string[pyarrow]")  # pip install pyarrow"""
    assert meta.fix.startswith("rows = ms_shm.SharedList(self.df['meta'].tolist())") and meta.objects >= 50_000
    assert """source attribute "df['path']" is a pandas column of Python objects of 30,000 items""" in path.message
    assert only(inspect_source(Plain(paths=pd.Series(names(30_000), dtype=object)), workers=2)).attribute == "paths"
    table = type("Table", (pd.DataFrame,), {"_constructor": property(lambda self: type(self))})  # the program's
    assert only(inspect_source(Plain(df=table({"p": names(30_000)})), workers=2)).attribute == "df['p']"
    labels = only(inspect_source(Plain(df=pd.DataFrame({"c": pd.Categorical(names(30_000))})), workers=2))
    assert (labels.attribute, labels.items) == ("df['c']", 30_000)  # a categorical's strings: its categories
    module = _module("class Source:\n    def __getitem__(self, i):\n        return DF.iloc[i]\n", DF=frame)
    assert sorted(f.attribute for f in inspect_source(module["Source"](), workers=2)) == ["DF['meta']", "DF['path']"]
    holder = Plain(df=frame)
    assert share_lists(holder, found) == () and holder.df is frame  # by hand only: pandas makes a list objects again


def test_the_pandas_walk_reads_only_what_pandas_exposes_and_never_imports_it():
    """The frame is recognised by its class's module and read through ``dtypes``, ``iloc`` and ``.array``: a
    stand-in of that shape is walked without pandas, and an object of another library with the same names is
    not."""

    class Column:
        def __init__(self, values):
            self.array = type("Backing", (), {})()
            self.array._ndarray = values

    class ByPosition:
        def __init__(self, columns):
            self.columns = columns

        def __getitem__(self, at):
            return self.columns[at[1]]

    def made(module):
        frame = type("DataFrame", (), {"__module__": module, "columns": ("a", "b")})()
        values = (np.array(names(30_000), dtype=object), np.array(names(30_000)))  # objects; fixed-width text
        frame.dtypes, frame.iloc = [v.dtype for v in values], ByPosition([Column(v) for v in values])
        return frame

    (finding,) = inspect_source(Plain(df=made("pandas.core.frame")), workers=2)
    assert finding.attribute == "df['a']" and finding.kind == "pandas column of Python objects"
    assert inspect_source(Plain(df=made("polars.dataframe")), workers=2) == ()


def test_names_read_as_attributes_modules_and_classes_are_not_globals_read():
    """``self.table`` names ``table`` in the code too; only a global load counts. Modules and classes are not
    walked."""
    module = _module("import collections\nclass Source:\n    def __getitem__(self, i):\n"
                     "        return self.table[i], collections.OrderedDict, Source\n", table=names(30_000))
    assert inspect_source(module["Source"](), workers=2) == ()


def test_share_lists_leaves_a_module_global_and_says_the_fix(caplog):
    module = _module("class Source:\n    def __getitem__(self, i):\n        return PATHS[i]\n", PATHS=names(30_000))
    source, before = module["Source"](), module["PATHS"]
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        assert share_lists(source, inspect_source(source, workers=2)) == ()
    assert module["PATHS"] is before
    assert "PATHS = ms_shm.SharedList(PATHS)" in caplog.text


def test_globals_read_through_a_helper_method_or_a_decorated_getitem_are_found():
    """``self._load(i)`` is the common shape: the helpers of the source's class its reading methods call are read
    too, as is the function under a ``functools.wraps`` decorator (``torch.no_grad()``)."""
    module = _module(
        "import functools\n"
        "def quiet(f):\n    @functools.wraps(f)\n    def wrapper(*a):\n        return f(*a)\n    return wrapper\n"
        "class Helper:\n    def __getitem__(self, i):\n        return self._load(i)\n"
        "    def _load(self, i):\n        return PATHS[i]\n"
        "class Decorated:\n    @quiet\n    def __getitem__(self, i):\n        return PATHS[i]\n", PATHS=names(30_000))
    for source in (module["Helper"](), module["Decorated"]()):
        assert only(inspect_source(source, workers=2)).attribute == "PATHS"


def test_an_object_the_code_reaches_is_walked_only_as_far_as_the_code_names_its_attributes():
    """A map function reading ``SRC.scale`` copies nothing of ``SRC.paths`` (an audit: the source's paths said a
    second time, as a map operation's); one reading ``SRC.paths`` is told so; a bound method likewise reads only
    the attributes of its object its code names."""
    from ms_shm.cow import findings_in

    module = _module(
        "class Source:\n    def __init__(self):\n        self.paths, self.scale = PATHS, 2.0\n"
        "    def normalize(self, x):\n        return x * self.scale\n"
        "    def name(self, i):\n        return self.paths[i]\n"
        "SRC = Source()\n"
        "def scaled(x):\n    return x * SRC.scale\n"
        "def named(i):\n    return SRC.paths[i]\n", PATHS=names(30_000))
    src = module["SRC"]
    assert findings_in([("map operation scaled", module["scaled"]), ("map operation normalize", src.normalize)],
                       workers=2) == []
    (global_read,) = findings_in([("map operation named", module["named"])], workers=2)
    assert global_read.attribute == "SRC.paths" and global_read.fix == "SRC.paths = ms_shm.SharedList(SRC.paths)"
    assert "attribute 'paths' of module global 'SRC' read by the map operation named" in global_read.message
    (method_read,) = findings_in([("map operation Source.name", src.name)], workers=2)
    assert method_read.attribute == "paths" and "map operation Source.name attribute 'paths'" in method_read.message


def test_share_lists_never_reaches_an_alias_through_the_code_and_says_both_names(caplog):
    """``self.paths = PATHS`` with ``__getitem__`` reading ``PATHS``: swapping ``self.paths`` alone saves nothing,
    and reaching the global as ``source["PATHS"]`` called the program's ``__getitem__`` with a string."""
    module = _module("class Source:\n    def __init__(self):\n        self.paths = PATHS\n        self.asked = []\n"
                     "    def __getitem__(self, i):\n        self.asked.append(i)\n        return PATHS[i]\n",
                     PATHS=names(30_000))
    source = module["Source"]()
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        assert share_lists(source, inspect_source(source, workers=2)) == ()
    assert source.asked == [] and type(source.paths) is list
    assert "PATHS holds it too" in caplog.text and "PATHS = ms_shm.SharedList(PATHS)" in caplog.text


def test_a_global_whose_class_lies_is_not_asked_and_the_others_are_still_found():
    module = _module("class Lazy:\n    @property\n    def __class__(self):\n        raise RuntimeError('settings')\n"
                     "LAZY = Lazy()\n"
                     "class Source:\n    def __getitem__(self, i):\n        return LAZY, PATHS[i]\n",
                     PATHS=names(30_000))
    assert only(inspect_source(module["Source"](), workers=2)).attribute == "PATHS"


def test_a_collate_fn_partial_or_object_is_a_holder_as_a_map_operation_is():
    import functools

    from ms_shm.cow import code_holders

    module = _module("def collate(batch, vocab):\n    return [VOCAB[t] for t in batch]\n"
                     "class Collate:\n    def __call__(self, batch):\n        return batch\n",
                     VOCAB={str(i): i for i in range(30_000)})
    partial, obj = functools.partial(module["collate"], vocab=None), module["Collate"]()
    assert code_holders([partial, obj, len], "collate_fn") == [("collate_fn collate", module["collate"]),
                                                             ("collate_fn Collate", obj)]


def test_a_class_attribute_the_reading_methods_name_through_self_is_found():
    module = _module("class Source:\n    TABLE = TABLE_\n    def __getitem__(self, i):\n        return self.TABLE[i]\n",
                     TABLE_=names(30_000))
    finding = only(inspect_source(module["Source"](), workers=2))
    assert finding.attribute == "TABLE" and finding.fix == "self.TABLE = ms_shm.SharedList(self.TABLE)"
