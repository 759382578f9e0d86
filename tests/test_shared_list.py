"""SharedList / SharedDict: exact round trips, pickling, shared memory lifetime, and real GeneratorDataset runs."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import pickle
import random
import re
import shlex
import subprocess
import sys
import textwrap
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import ms_shm
from ms_shm import shared_list
from ms_shm.shared_list import SHM_PREFIX, ReadOnlyError, SharedDict, SharedList


@dataclasses.dataclass
class Box:
    """A user class inside items: must come back equal, by value."""

    label: str
    xyxy: tuple


MIXED = [
    0, -1, 2**100, -(2**70), 3.5, -0.0, float("inf"), 1 + 2j, True, False, None,
    "", "plain", "ünïcødé ✓ 漢字 🙂", "\ud800 lone surrogate", "a\x00b",
    b"", b"\x00\xff bytes", bytearray(b"mutable"),
    [], (), {}, set(), frozenset({1, 2}),
    {"file": "img/0001.jpg", "boxes": [Box("cat", (1, 2, 3, 4))], "meta": {"h": 480, "w": 640}},
    [1, [2, [3, [4, ("deep", b"x", None)]]]],
    Box("dog", (0.5, 0.25, 1.0, 1.0)),
    range(3), slice(1, 2),
]


def test_round_trip_every_item_exactly():
    lst = SharedList(MIXED)
    assert len(lst) == len(MIXED)
    for i, expected in enumerate(MIXED):
        got = lst[i]
        assert type(got) is type(expected)
        assert got == expected
    assert list(lst) == MIXED
    assert math.copysign(1.0, lst[5]) == -1.0  # MIXED[5] is -0.0: the sign of zero survives


def test_nan_and_numpy_items_round_trip():
    lst = SharedList([float("nan"), np.arange(6, dtype=np.float32).reshape(2, 3), np.int64(7)])
    assert math.isnan(lst[0])
    np.testing.assert_array_equal(lst[1], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert lst[1].dtype == np.float32 and lst[2] == 7 and type(lst[2]) is np.int64


def test_items_are_copies():
    lst = SharedList([{"a": [1]}])
    item = lst[0]
    item["a"].append(2)
    assert lst[0] == {"a": [1]}


@pytest.mark.parametrize("items", [[], (), iter([]), (x for x in [])])
def test_empty(items):
    lst = SharedList(items)
    assert len(lst) == 0 and not lst
    assert list(lst) == [] and lst == [] and lst != ()  # a list stand-in: never equal to a tuple
    assert lst[:] == [] and lst[::-1] == []
    with pytest.raises(IndexError):
        lst[0]
    with pytest.raises(IndexError):
        lst[-1]


def test_from_generator_and_from_another_shared_list():
    lst = SharedList(f"name_{i}" for i in range(100_003))  # crosses a build chunk boundary
    assert len(lst) == 100_003 and lst[65_536] == "name_65536" and lst[-1] == "name_100002"
    again = SharedList(lst)
    assert again == lst and again._buf is lst._buf  # no re-pickling


@pytest.mark.parametrize("index", [0, 1, 5, -1, -6, np.int64(3), np.int32(-2)])
def test_indexing_like_a_list(index):
    items = list("abcdef")
    assert SharedList(items)[index] == items[index]


@pytest.mark.parametrize("index", [6, 100, -7, -100])
def test_index_out_of_range(index):
    with pytest.raises(IndexError):
        SharedList(list("abcdef"))[index]


@pytest.mark.parametrize("index", ["1", 1.0, None])
def test_bad_index_type(index):
    with pytest.raises(TypeError):
        SharedList([1, 2])[index]


@pytest.mark.parametrize("sl", [
    slice(None), slice(2, 5), slice(-3, None), slice(None, -3), slice(5, 2), slice(100, 200),
    slice(None, None, 2), slice(1, None, 3), slice(None, None, -1), slice(-2, 1, -2), slice(0, 0),
    slice(-100, 100), slice(None, None, 7),
])
def test_slices_match_list_slices(sl):
    lst = SharedList(MIXED)
    part = lst[sl]
    assert type(part) is list  # as a list's slice: json.dumps and + work on it
    assert part == MIXED[sl]


def test_iteration_reversed_contains_index_count():
    items = ["x", "y", "x", None]
    lst = SharedList(items)
    assert list(reversed(lst)) == items[::-1]
    assert "y" in lst and "z" not in lst
    assert lst.index("x", 1) == 2 and lst.count("x") == 2
    assert lst.tolist() == items and type(lst.tolist()) is list


def test_equality():
    lst = SharedList([1, "a", (2,)])
    assert lst == [1, "a", (2,)] and [1, "a", (2,)] == lst
    assert lst != (1, "a", (2,)) and (1, "a", (2,)) != lst  # as [1] != (1,)
    assert lst == SharedList([1, "a", (2,)])
    assert lst != [1, "a"] and lst != [1, "a", (3,)] and lst != SharedList([1, "a", (3,)])
    assert SharedList([{"a": 1, "b": 2}]) == SharedList([{"b": 2, "a": 1}])  # different pickles, equal items
    assert SharedList("ab") != "ab"  # strings are not compared item by item
    assert lst != 5
    with pytest.raises(TypeError):
        hash(lst)


def test_unpicklable_item_is_named():
    with pytest.raises(TypeError, match="item 2 cannot be pickled"):
        SharedList([1, 2, lambda: 3])


def test_nbytes_and_repr():
    lst = SharedList(range(1000))
    assert lst.nbytes == lst._buf.nbytes + 8 * 1001
    text = repr(lst)
    assert text.startswith("SharedList([0, 1, 2, ...], 1,000 items,") and "\n" not in text
    assert repr(SharedList([])) == "SharedList([], 0 items, 8 B)"


def test_read_only():
    lst = SharedList([1])
    with pytest.raises(TypeError):
        lst[0] = 2
    with pytest.raises(ValueError):
        lst._buf[0] = 1
    with pytest.raises(TypeError, match="cannot append"):
        lst.append(2)


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickles(protocol):
    lst = SharedList(MIXED)
    back = pickle.loads(pickle.dumps(lst, protocol))
    assert isinstance(back, SharedList) and back == MIXED and back.shared_memory_name is None
    assert pickle.loads(pickle.dumps(lst[3:9], protocol)) == MIXED[3:9]


def test_copy_is_the_same_immutable_object():
    lst = SharedList([[1]])
    assert copy.copy(lst) is lst and copy.deepcopy(lst) is lst
    holder = copy.deepcopy({"x": lst})
    assert holder["x"] is lst


def test_a_million_items_build_and_read_back():
    """Functional only: how long the build takes is a benchmark's question, not a test's."""
    items = [{"id": i, "file": f"{i:08d}.jpg"} for i in range(1_000_000)]
    lst = SharedList(items)
    assert len(lst) == 1_000_000
    assert [lst[i] for i in (0, 1, 499_999, 999_999, -1)] == [items[i] for i in (0, 1, 499_999, 999_999, -1)]
    assert lst[::99_991] == items[::99_991]


# ----------------------------------------------------------------------------------------- shared memory
@pytest.fixture
def fake_shm(tmp_path, monkeypatch):
    """Blocks go to tmp_path, a stand-in for /dev/shm, so no test touches the host's real /dev/shm."""
    monkeypatch.setattr(shared_list, "_SHM_DIR", str(tmp_path))
    return tmp_path


def blocks(directory) -> list:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(SHM_PREFIX))


def test_shared_memory_pickles_only_the_name(fake_shm):
    owner = SharedList(MIXED, shared_memory=True)
    name = owner.shared_memory_name
    assert blocks(fake_shm) == [name] and name.startswith(f"{SHM_PREFIX}{os.getpid()}_")
    assert (fake_shm / name).stat().st_size == owner.nbytes
    data = pickle.dumps(owner)
    assert len(data) < 200  # the name, not the bytes
    attached = pickle.loads(data)
    assert attached == MIXED and attached.shared_memory_name == name
    assert pickle.loads(pickle.dumps(attached)) == MIXED  # re-pickling from an attached copy works too
    with pytest.raises(ValueError):
        attached._buf[0] = 0  # mapped read-only
    assert SharedList(attached) == MIXED and SharedList(attached).shared_memory_name is None


def test_owner_unlinks_and_attached_copies_keep_working(fake_shm):
    owner = SharedList(["a", "b"], shared_memory=True)
    attached = pickle.loads(pickle.dumps(owner))
    del owner
    gc.collect()
    assert blocks(fake_shm) == []  # unlinked when the owner went away
    assert attached == ["a", "b"]  # an existing mapping outlives the unlink
    with pytest.raises(FileNotFoundError, match="only valid while its owner is alive"):
        pickle.loads(pickle.dumps(attached))


def test_copies_never_unlink(fake_shm):
    owner = SharedList([1], shared_memory=True)
    attached = pickle.loads(pickle.dumps(owner))
    del attached
    gc.collect()
    shared_list._release_block(owner.shared_memory_name, owner_pid=os.getpid() + 1)  # a forked child
    assert blocks(fake_shm) == [owner.shared_memory_name]


def test_empty_shared_memory_list(fake_shm):
    owner = SharedList([], shared_memory=True)
    assert pickle.loads(pickle.dumps(owner)) == []


def test_full_shm_raises_oserror_and_leaves_nothing(fake_shm, monkeypatch):
    def no_space(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match="cannot reserve"):
        SharedList(range(10), shared_memory=True)
    assert blocks(fake_shm) == []


# ---------------------------------------------------------------------------------------------- SharedDict
def test_shared_dict_reads_like_a_dict():
    data = {"a.jpg": "a cat", b"raw": [1, 2], 7: None, -3: {"x": 1}, "": 0, "🙂": "smile"}
    d = SharedDict(data)
    assert len(d) == len(data) and list(d) == list(data) and d == data
    for key, value in data.items():
        assert d[key] == value and key in d
    assert d.get("missing", 5) == 5 and "missing" not in d and 8 not in d
    assert dict(d.items()) == data and list(d.values()) == list(data.values())
    assert d[7.0] is None  # equal keys find each other, as in a dict
    with pytest.raises(KeyError):
        d["missing"]
    with pytest.raises(KeyError):
        d[(1, 2)]


def test_shared_dict_bool_and_int_keys_are_one_key_like_dict():
    d = SharedDict({1: "one", 2: "two"})
    assert d[True] == "one" and d[1.0] == "one"
    assert SharedDict({True: "t"})[1] == "t"


@pytest.mark.parametrize("key", [1.5, (1, 2), None, frozenset()])
def test_shared_dict_rejects_other_key_types(key):
    with pytest.raises(TypeError, match="keys must be str, bytes or int"):
        SharedDict({key: 1})


def test_shared_dict_survives_hash_collisions(monkeypatch):
    monkeypatch.setattr(shared_list, "_stable_hash", lambda key: 42)
    data = {f"k{i}": i for i in range(50)}
    d = SharedDict(data)
    assert all(d[k] == v for k, v in data.items()) and "k50" not in d


def test_shared_dict_pickles_and_from_pairs_and_fromkeys(fake_shm):
    d = SharedDict([("a", 1), ("b", 2), ("a", 3)])
    assert d == {"a": 3, "b": 2}
    assert pickle.loads(pickle.dumps(d)) == {"a": 3, "b": 2}
    members = SharedDict.fromkeys(["x", "y"], shared_memory=True)
    assert "x" in members and "z" not in members and len(blocks(fake_shm)) == 2
    back = pickle.loads(pickle.dumps(members))
    assert back == {"x": None, "y": None}
    assert repr(d).startswith("SharedDict({'a': 3, 'b': 2}, 2 items")


def test_stable_hash_is_the_same_in_another_interpreter():
    """Spawned workers get a different PYTHONHASHSEED; SharedDict's index must not depend on it."""
    keys = ["a.jpg", "ünïcødé", b"raw", 12345, -1, 2**80]
    code = ("import json, sys; from ms_shm.shared_list import _stable_hash as h; "
            f"print(json.dumps([h(k) for k in {keys!r}]))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(Path(shared_list.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str([shared_list._stable_hash(k) for k in keys])


# ------------------------------------------------------------------------------- real MindSpore, real /dev/shm
SOURCE_MODULE = '''
import os, pickle
import numpy as np


class Source:
    """Each row is the pickle of item i as read in the worker, its pid, and whether the data was mapped."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        mapped = getattr(self.items, "shared_memory_name", None) is not None
        return (np.frombuffer(pickle.dumps(self.items[i], 5), np.uint8).copy(),
                np.array([os.getpid(), int(mapped)], np.int64))
'''

DRIVER = '''
import os, pickle, sys
import mindspore.dataset as ds
from ms_shm.shared_list import SharedList
from cow_source import Source


def main():  # spawned workers re-import this file as __mp_main__: nothing may run at import
    start = sys.argv[1]
    if start != "fork":
        ds.config.set_multiprocessing_start_method(start)
    items = [{"id": i, "name": f"ünïcødé_{i}", "raw": bytes([i % 256]) * (i % 7), "nested": [i, (None, -i)]}
             for i in range(600)] + [None, "", b"", 2**90, -0.0, ("t", ["u"]), {"k": {"v": [1.5]}}]
    for shared_memory in (False, True):
        lst = SharedList(items, shared_memory=shared_memory)
        dataset = ds.GeneratorDataset(Source(lst), ["x", "meta"], num_parallel_workers=2,
                                      python_multiprocessing=True, shuffle=False)
        pids = set()
        n = 0
        for i, (x, meta) in enumerate(dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)):
            got = pickle.loads(x.tobytes())
            assert got == items[i] and type(got) is type(items[i]), (i, got, items[i])
            assert int(meta[1]) == int(shared_memory), (i, meta)
            pids.add(int(meta[0]))
            n += 1
        assert n == len(items), n
        assert len(pids) == 2 and os.getpid() not in pids, pids
        print("OK", start, "shared_memory" if shared_memory else "pickled", n, "rows from", len(pids), "workers")
        del dataset, lst


if __name__ == "__main__":
    main()
'''


@pytest.mark.mindspore
@pytest.mark.privileged
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_generator_dataset_reads_every_item_exactly(real_mindspore, tmp_path, start):
    (tmp_path / "cow_source.py").write_text(SOURCE_MODULE)  # importable by spawned workers, unlike __main__
    (tmp_path / "driver.py").write_text(DRIVER)
    result = real_mindspore.run_shell(
        f"{sys.executable} {tmp_path / 'driver.py'} {start}; rc=$?; echo LEFT: $(ls -A /dev/shm); exit $rc",
        shm="256m", timeout=600, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{real_mindspore.REPO}"})
    assert result.returncode == 0, real_mindspore.describe(result)
    assert f"OK {start} pickled 607 rows from 2 workers" in result.stdout, real_mindspore.describe(result)
    assert f"OK {start} shared_memory 607 rows from 2 workers" in result.stdout, real_mindspore.describe(result)
    left = result.stdout.split("LEFT:", 1)[1]
    assert SHM_PREFIX not in left, real_mindspore.describe(result)


@pytest.mark.privileged
def test_killed_owner_leaves_no_block(private_shm):
    """SIGKILL gives no finalizer a chance: multiprocessing's resource tracker must unlink the block."""
    code = textwrap.dedent('''
        import os, signal
        from ms_shm.shared_list import SharedList
        lst = SharedList(range(100_000), shared_memory=True)
        print("CREATED", lst.shared_memory_name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    ''')
    script = (f"{sys.executable} -c {shlex.quote(code)}; "
              "for i in $(seq 50); do ls -A /dev/shm | grep -q ms_shm_list_ || break; sleep 0.1; done; "
              "echo LEFT: $(ls -A /dev/shm)")
    result = private_shm.run_shell(script, shm="64m", timeout=120)
    assert "CREATED ms_shm_list_" in result.stdout, private_shm.describe(result)
    assert SHM_PREFIX not in result.stdout.split("LEFT:", 1)[1], private_shm.describe(result)


# ------------------------------------------------------------------------------------ audit: dict semantics
INT_KEYED = {i: f"name_{i}" for i in range(100)}


@pytest.mark.parametrize("key", [
    np.int64(5), np.int32(5), np.uint8(5), np.int64(-0), np.float64(5.0), np.float32(5.0), 5.0, -0.0,
    np.bool_(True), True, Decimal(5), Fraction(10, 2),  # equal to a stored int, with its hash: the same key
    5.5, np.float64(5.5), float("nan"), float("inf"), "5", b"5", np.str_("5"), (5,), None, 10**30,  # no match
])
def test_shared_dict_finds_every_key_a_dict_finds(key):
    """MindSpore hands workers numpy.int64 indices: ``self.id2file[idx]`` must find the int key, as a dict does,
    and a key a dict does not find must be missing here too (never the wrong value)."""
    d = SharedDict(INT_KEYED)
    assert d.get(key, "MISSING") == INT_KEYED.get(key, "MISSING")
    assert (key in d) == (key in INT_KEYED)
    if key in INT_KEYED:
        assert d[key] == INT_KEYED[key]
    else:
        with pytest.raises(KeyError):
            d[key]


def test_shared_dict_str_keys_and_unhashable_keys_like_dict():
    d = SharedDict({"a.jpg": 1, b"raw": 2})
    assert d[np.str_("a.jpg")] == 1 and d[np.bytes_(b"raw")] == 2 and d.get(b"a.jpg") is None
    for unhashable in ([5], {"a": 1}, np.array([5])):
        with pytest.raises(TypeError):
            {}.get(unhashable)  # what a dict does ...
        with pytest.raises(TypeError):
            d.get(unhashable)  # ... and so does the stand-in


def test_shared_dict_with_numpy_int_keys_is_stored_as_ints():
    d = SharedDict({np.int64(3): "three"})
    assert d[3] == "three" and d[np.int32(3)] == "three" and 4 not in d


# ------------------------------------------------------------------------------------ audit: read-only
LIST_CHANGES = [
    ("assign an item", lambda x: x.__setitem__(0, "a")),
    ("assign an item", lambda x: random.Random(0).shuffle(x)),
    ("delete an item", lambda x: x.__delitem__(0)),
    ("append", lambda x: x.append(1)),
    ("extend", lambda x: x.extend([1])),
    ("insert", lambda x: x.insert(0, 1)),
    ("pop", lambda x: x.pop()),
    ("remove an item", lambda x: x.remove("a")),
    ("clear", lambda x: x.clear()),
    ("sort in place", lambda x: x.sort()),
    ("reverse in place", lambda x: x.reverse()),
    ("extend it with +=", lambda x: x.__iadd__([1])),
    ("repeat it with *=", lambda x: x.__imul__(2)),
]
DICT_CHANGES = [
    ("assign a key", lambda d: d.__setitem__("k", 1)),
    ("delete a key", lambda d: d.__delitem__("a")),
    ("setdefault", lambda d: d.setdefault("k", 1)),
    ("update", lambda d: d.update(k=1)),
    ("pop", lambda d: d.pop("a")),
    ("popitem", lambda d: d.popitem()),
    ("clear", lambda d: d.clear()),
    ("update it with |=", lambda d: d.__ior__({})),
]


@pytest.mark.parametrize("operation, change", LIST_CHANGES + DICT_CHANGES)
def test_every_change_raises_a_type_error_that_says_why_and_the_fix(operation, change):
    stand_in = SharedList(["a", "b"]) if (operation, change) in LIST_CHANGES else SharedDict({"a": 1})
    with pytest.raises(TypeError, match=f"cannot {re.escape(operation)}.*: a Shared(List|Dict) is read-only") as raised:
        change(stand_in)
    assert isinstance(raised.value, ms_shm.Error) and raised.value.fix
    named = stand_in._named("meta['paths']")  # what share_lists records when it swaps
    for copy_ in (named, pickle.loads(pickle.dumps(named))):  # a spawned worker gets the name too
        with pytest.raises(ReadOnlyError) as raised:
            change(copy_)
        text = str(raised.value)
        assert "source attribute \"meta['paths']\"" in text and "share_lists=True" in text
        assert "do not modify self.meta['paths'] after building" in text


def test_the_origin_travels_with_a_shared_memory_pickle(fake_shm):
    lst = SharedList([1], shared_memory=True)._named("paths")
    with pytest.raises(ReadOnlyError, match="source attribute 'paths'"):
        pickle.loads(pickle.dumps(lst)).append(2)


# ------------------------------------------------------------------------------------ audit: list semantics
def test_list_operations_give_plain_lists_as_a_list_does():
    items = [f"img_{i}.jpg" for i in range(10)]
    lst = SharedList(items)
    assert json.dumps(lst[:2]) == json.dumps(items[:2])
    assert lst[:2] + ["a"] == items[:2] + ["a"] and type(lst + ["a"]) is list and lst + lst == items + items
    assert ["a"] + lst == ["a"] + items and type(["a"] + lst) is list
    assert lst * 2 == items * 2 and 2 * lst == items * 2 and type(lst * 2) is list
    assert type(lst.copy()) is list and lst.copy() == items
    assert lst[::-1][0] == items[-1]
    with pytest.raises(TypeError):
        lst + ("a",)  # as list + tuple
    with pytest.raises(TypeError, match="list indices must be integers or slices, not float"):
        lst[1.0]
    with pytest.raises(IndexError, match="list index out of range"):
        lst[10]
    assert (lst < ["z"]) == (items < ["z"]) and (lst >= items) and not (lst > items)


def test_index_raises_like_list_index():
    lst = SharedList(["x", "y", "x"])
    assert lst.index("x") == 0 and lst.index("x", 1) == 2 and lst.index("y", -2) == 1
    for args in (("nope",), ("y", 2), ("x", 1, 2)):
        with pytest.raises(ValueError) as mine:
            lst.index(*args)
        with pytest.raises(ValueError) as theirs:
            ["x", "y", "x"].index(*args)
        assert str(mine.value) == str(theirs.value)


def test_nan_is_found_only_where_equality_finds_it():
    """Documented difference: a list also matches the very same NaN object; a stand-in's items are copies."""
    nan = float("nan")
    assert nan in [nan] and nan not in SharedList([nan])


def test_shared_dict_copy_and_union_are_plain_dicts():
    data = {"a": 1, "b": 2}
    d = SharedDict(data)
    assert type(d.copy()) is dict and d.copy() == data
    assert d | {"c": 3} == data | {"c": 3} and type(d | {"c": 3}) is dict
    assert {"a": 0, "z": 9} | d == {"a": 0, "z": 9} | data and type({"z": 9} | d) is dict
