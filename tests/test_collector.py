"""``ms_shm.collector``: the modules ms_shm loads never tip the program's collector into a full collection, and
the collector is left as the program had it. No framework: a subprocess builds a heap near the threshold."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_shm import collector

ROOT = Path(__file__).resolve().parent.parent

NEAR_A_FULL_COLLECTION = """
import gc, sys
from ms_shm import collector
gc.set_threshold(100, 2, 2)  # the oldest generation is weighed at every other young collection
heap = [[i] for i in range(100_000)]  # a framework's heap, as after import mindspore.dataset
gc.collect()
kept = [[i] for i in range(18_000)]  # long-lived since: under a quarter of the heap
fulls = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and fulls.append(1))
if sys.argv[1] == "quiet":
    with collector.quiet():
        made = [[i] for i in range(10_000)]  # ms_shm's modules, classes and session
else:
    made = [[i] for i in range(10_000)]
for i in range(5_000):  # what the program goes on keeping
    kept.append([i])
print(len(fulls))
"""


@pytest.mark.parametrize("mode, fulls", [("plain", 1), ("quiet", 0)])
def test_objects_made_quietly_do_not_tip_the_program_into_a_full_collection(mode, fulls):
    """Measured with MindSpore 2.10: ``import ms_shm`` ran a full collection of MindSpore's heap (~50-80 ms of
    CPU) that a raw run never made. ``plain`` shows the heap is near the threshold: the same objects made
    without ``quiet()`` start one."""
    proc = subprocess.run([sys.executable, "-c", NEAR_A_FULL_COLLECTION, mode], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.split() == [str(fulls)], proc.stdout + proc.stderr


CYCLE_DROPPED_BEFORE = """
import gc, weakref
from ms_shm import collector
gone = []

class Big:
    pass

big = Big()
big.me = big
weakref.finalize(big, gone.append, "freed")
gc.collect(0)  # it lived through a young collection: the middle generation holds it
del big  # garbage now, for the program's next middle collection
with collector.quiet():
    made = [[i] for i in range(1000)]  # a module's objects
kept = [[i] for i in range(20_000)]  # the program goes on: its young collections run
print(gone)
"""


def test_the_programs_young_garbage_is_collected_not_moved_to_the_oldest_generation():
    """An audit: a 400 MB cycle dropped just before ``import ms_shm`` was moved to the oldest generation with
    what the import made, and held until a full collection that did not come (raw: freed 151 steps later)."""
    proc = subprocess.run([sys.executable, "-c", CYCLE_DROPPED_BEFORE], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.split() == ["['freed']"], proc.stdout + proc.stderr


def test_the_collector_is_left_as_the_program_had_it():
    assert gc.isenabled()
    with collector.quiet():
        assert not gc.isenabled()
        with collector.quiet():  # nested: the outer one settles
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with collector.quiet():
            pass
        assert not gc.isenabled()  # the program's choice, kept
    finally:
        gc.enable()


def test_objects_the_program_froze_stay_frozen_and_an_error_still_restores_the_collector():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector.quiet():
            assert gc.isenabled()  # nothing changed where the program froze objects itself
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError), collector.quiet():
        raise ValueError("x")
    assert gc.isenabled()


def test_cycles_made_quietly_are_still_collected():
    class Node:
        pass

    import weakref

    with collector.quiet():
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
    assert alive() is None  # the young collection at the end freed the cycle


AFTER_MINDSPORE = """
import gc, sys
import numpy as np
import mindspore.dataset
fulls = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and fulls.append(1))
import ms_shm
ms_shm.tune()
dataset = ms_shm.build_dataset([(np.full(8, i, np.int64),) for i in range(32)], ["x"], shuffle=False)
dataset = ms_shm.map(dataset, lambda x: x + 1, input_columns=["x"])
rows = sum(1 for _ in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True))
print(rows, len(fulls), gc.isenabled(), gc.get_freeze_count())
"""


def test_a_program_that_imported_mindspore_makes_no_full_collection_for_ms_shm(real_mindspore):
    """``import ms_shm``, ``tune()``, a build and a map after ``import mindspore.dataset``: before, one full
    collection of MindSpore's heap (~160,000 objects) ran inside ``import ms_shm``; a raw run made none."""
    proc = subprocess.run([sys.executable, "-c", AFTER_MINDSPORE], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-4:] == ["32", "0", "True", "0"], proc.stdout


def test_a_module_already_loaded_is_returned_without_settling(monkeypatch):
    """A patched call asks for the planner's modules at every call: settling there would promote the program's
    young objects at every build (an audit: 50 MB of cycles held per epoch)."""
    import ms_shm.rows  # noqa: F401

    settled = []
    monkeypatch.setattr(collector, "settle", lambda: settled.append(1))
    assert collector.load("ms_shm.rows") is sys.modules["ms_shm.rows"] and settled == []


BUILDS_DO_NOT_SETTLE = """
import gc, weakref
import numpy as np
import ms_shm
ms_shm.tune()
gone = []

class State:
    pass

for epoch in range(3):
    state = State()
    state.me = state  # a cycle of the program's, alive while the pipeline is built
    weakref.finalize(state, gone.append, epoch)
    dataset = ms_shm.build_dataset([(np.full(8, i, np.int64),) for i in range(8)], ["x"], shuffle=False)
    del state
    kept = [[i] for i in range(20_000)]  # the program goes on: its young collections run
print(gone)
"""


def test_a_build_leaves_the_programs_young_cycles_to_its_young_collections(real_mindspore):
    """An audit: with every build settling, a cycle alive at the build moved to the oldest generation and was
    not freed in any epoch (raw: each freed in the next young collections)."""
    proc = subprocess.run([sys.executable, "-c", BUILDS_DO_NOT_SETTLE], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[0, 1, 2]", proc.stdout


WORKER_AFTER_AN_OWED_COLLECTION = """
import gc, os, sys
from ms_shm import collector
heap = [[i] for i in range(300_000)]  # a program's long-lived heap (a framework, a model)
if sys.argv[1] == "frozen":
    collector.freeze_in_forked_children()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    frozen = gc.get_freeze_count()
    walked = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and walked.append(1))
    gc.collect()  # the full collection a worker comes to owe
    os.write(write, f"{frozen} {len(walked)}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 100).decode(), gc.get_freeze_count())
"""


@pytest.mark.parametrize("mode", ["plain", "frozen"])
def test_a_forked_child_leaves_what_it_inherited_to_the_parents_collector(mode):
    """A worker's full collection writes the GC header of every object it walks, so each page of the inherited
    heap is copied into it (an audit: 98 MiB of its own against 9.5 MiB). Once ms_shm planned a pipeline, a child
    forked from the process freezes what it inherited, and its collections walk only its own objects; the parent's
    collector is untouched."""
    done = subprocess.run([sys.executable, "-c", WORKER_AFTER_AN_OWED_COLLECTION, mode], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    frozen_in_child, _, frozen_in_parent = done.stdout.split()
    assert (int(frozen_in_child) > 300_000) == (mode == "frozen") and frozen_in_parent == "0", done.stdout


def test_a_module_another_thread_is_still_loading_is_waited_for(monkeypatch):
    """Two threads building their first pipelines at once: the second took ``ms_shm.api`` from ``sys.modules``
    half made and met ``AttributeError: partially initialized module`` (1 run of 5). Such a module goes through
    ``importlib``, which waits for the thread loading it; a loaded one is taken as it is."""
    import importlib
    import types

    half = types.ModuleType("ms_shm_half_made")
    half.__spec__ = types.SimpleNamespace(_initializing=True)
    whole = types.ModuleType("ms_shm_whole")
    whole.__spec__ = types.SimpleNamespace(_initializing=False)
    monkeypatch.setitem(sys.modules, half.__name__, half)
    monkeypatch.setitem(sys.modules, whole.__name__, whole)
    asked = []
    monkeypatch.setattr(importlib, "import_module", lambda name: asked.append(name) or sys.modules[name])
    assert collector.load(whole.__name__) is whole and asked == []
    assert collector.load(half.__name__) is half and asked == [half.__name__]

