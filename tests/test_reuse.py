"""Probe rows served once to the pipeline (``ms_shm.reuse``): pure checks, then real MindSpore pipelines."""

from __future__ import annotations

import copy
import os
import pickle
import sys

import numpy as np
import pytest

from ms_shm import reuse


def _rows(n: int, size: int = 16) -> list:
    return [(np.full(size, i, np.uint8), np.array(i)) for i in range(n)]


def test_each_probe_row_is_served_once():
    rows = _rows(3)
    cache = reuse.cache_for([0, 9, 5], rows)
    assert len(cache) == 3
    assert cache.take(9) is rows[1] and cache.take(9) is None
    assert cache.take(1) is None  # not probed: the source is called
    assert cache.take(0) is rows[0] and cache.take(5) is rows[2]
    assert len(cache) == 0 and cache.served == 3


_BUFFER = np.zeros(8)  # a source that refills one buffer per call returns the same array every time


@pytest.mark.parametrize("why, rows", [
    ("not a tuple of numpy arrays", [({"a": np.zeros(2)},), (np.zeros(2),)]),
    ("not a tuple of numpy arrays", [[np.zeros(2)]]),
    ("share memory", [(_BUFFER,), (_BUFFER,)]),
    ("share memory", [(_BUFFER[:4],), (_BUFFER[2:],)]),
])
def test_rows_that_could_change_the_data_are_not_kept(why, rows):
    assert why in reuse.reusable(rows)
    assert reuse.cache_for(range(len(rows)), rows) is None


@pytest.mark.parametrize("seconds, nbytes, keep", [
    (0.0017, 8 << 20, False),  # np.full of 8 MiB on fresh pages: cheaper to read again than to hold
    (0.020, 256 << 10, True),  # 20 ms of Python work for 256 KiB
    (0.002, 150 << 10, True),  # a decoded 224x224 RGB image
    (1e-6, 16, True),  # tiny rows cost nothing to hold
])
def test_only_rows_that_cost_more_than_their_memory_are_kept(seconds, nbytes, keep):
    assert reuse.worth_keeping(seconds, nbytes) is keep


def test_views_of_one_array_are_kept_and_large_rows_are_not():
    data = np.arange(100, dtype=np.float32).reshape(10, 10)
    assert reuse.reusable([(data[0],), (data[9],), (data[5],)]) is None  # disjoint slices
    assert "over the 1 MiB" in reuse.reusable(_rows(3, 1 << 20), limit=1 << 20)


def test_copies_serve_nothing():
    """A pickled (spawned worker) or deep-copied cache serves nothing: no row twice, no big pickle."""
    cache = reuse.cache_for([0, 1], _rows(2, 1 << 20))
    blob = pickle.dumps(cache)
    assert len(blob) < 4096
    for clone in (pickle.loads(blob), copy.deepcopy(cache)):
        assert clone.take(0) is None and len(clone) == 0
    assert cache.take(0) is not None


def test_forked_children_share_the_taken_flags():
    """Workers fork from the parent: whichever takes row i first, no other process gets it again."""
    cache = reuse.cache_for([0, 1], _rows(2))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, b"1" if cache.take(1) is not None else b"0")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert cache.take(1) is None and cache.take(0) is not None


SOURCE_MODULE = r'''
import os
import time
import numpy as np

class Counted:
    """Logs every call with its index; rows are random (a fresh draw per call)."""
    def __init__(self, log):
        self.log = log
    def __len__(self):
        return 12
    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {int(i)}\n")
        time.sleep(0.005)  # worth keeping: producing the row costs more than touching 1 MiB of fresh memory
        rng = np.random.default_rng()
        return rng.integers(0, 255, 1 << 20, dtype=np.uint8), np.array(int(i))
'''

DRIVER = r'''
import json, sys
import mindspore.dataset as ds
import ms_shm
from counted_source import Counted

def main():
    mode, log, start = sys.argv[1:4]
    kwargs = {"inline": dict(num_parallel_workers=1),
              "threads": dict(num_parallel_workers=2, python_multiprocessing=False),
              "processes": dict(num_parallel_workers=2, python_multiprocessing=True)}[mode]
    ds.config.set_multiprocessing_start_method(start)
    ms_shm.tune()
    d = ms_shm.build_dataset(Counted(log), ["data", "label"], shuffle=False, **kwargs)
    epochs = [[int(r["label"]) for r in d.create_dict_iterator(num_epochs=1, output_numpy=True)] for _ in range(2)]
    print("RESULT " + json.dumps({"epochs": epochs, "mode": ms_shm.plan_of(d).mode}))


if __name__ == "__main__":  # spawned workers import this file again
    main()
'''


@pytest.mark.mindspore
@pytest.mark.parametrize("mode, start", [("inline", "fork"), ("threads", "fork"), ("processes", "fork"),
                                         ("processes", "spawn")])
def test_pipeline_calls_the_source_once_per_row_and_epoch(real_mindspore, tmp_path, mode, start):
    """Over two epochs every index reaches the pipeline twice; with the probe's 3 calls the source is called
    exactly 2N times when rows are reused, and 2N + 3 when they cannot be (spawned workers get a pickled
    source, and the probe rows are dropped from the pickle)."""
    log = tmp_path / "calls.log"
    (tmp_path / "counted_source.py").write_text(SOURCE_MODULE)  # importable by spawned workers
    (tmp_path / "driver.py").write_text(DRIVER)
    result = real_mindspore.run_shell(f"{sys.executable} {tmp_path / 'driver.py'} {mode} {log} {start}",
                                      shm="256m", timeout=300,
                                      env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{real_mindspore.REPO}"})
    assert result.returncode == 0, real_mindspore.describe(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    out = __import__("json").loads(line[len("RESULT "):])
    assert out["epochs"] == [list(range(12))] * 2 and out["mode"] == mode
    calls = [int(x.split()[1]) for x in log.read_text().split("\n") if x]
    reused = not (mode == "processes" and start == "spawn")
    assert len(calls) == 2 * 12 + (0 if reused else 3), calls
    assert sorted(calls) == sorted(list(range(12)) * 2 + ([] if reused else calls[:3]))
