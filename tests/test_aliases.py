"""``engines.torchstyle.aliases``: what of a batch is the dataset's or the collate_fn's own. Pure: numpy only."""

from __future__ import annotations

import numpy as np

from ms_shm.engines.torchstyle import aliases


class Records:
    def __init__(self, n=10):
        self.paths = [f"img_{i}.jpg" for i in range(50_000)]  # a long list first: it must not take the walk
        self.records = [{"id": i} for i in range(n)]
        self.rows = np.arange(n * 4, dtype=np.float64).reshape(n, 4)


def test_the_datasets_records_and_its_arrays_memory_are_found():
    ds = Records()
    kept = aliases.held(ds)
    assert aliases.own_in([ds.records[3]], kept) == "a dict the dataset or collate_fn keeps"
    assert aliases.own_in(ds.rows[2], kept) == "a numpy array over memory the dataset or collate_fn keeps"
    assert aliases.own_in(ds.rows[::-1][1:3], kept) is not None  # a reversed view: its lowest byte comes first
    assert aliases.own_in({"x": ds.rows[2].copy(), "id": 3, "path": ds.paths[3]}, kept) is None
    assert aliases.own_in([{"id": 3}], kept) is None


def test_a_record_past_the_walk_is_found_at_the_index_it_was_read_at():
    ds = Records(n=5_000)
    assert aliases.own_in([ds.records[4_321]], aliases.held(ds)) is None  # past the 256 items looked at
    assert aliases.own_in([ds.records[4_321]], aliases.held(ds, at=(4_321,))) is not None


def test_a_buffer_a_collate_object_fills_is_found():
    class Fill:
        def __init__(self):
            self.buffer = np.zeros((4, 3))

        def __call__(self, samples):
            self.buffer[:len(samples)] = samples
            return self.buffer[:len(samples)]

    collate = Fill()
    assert aliases.own_in(collate([np.ones(3)]), aliases.held(Records(), collate)) is not None
    assert aliases.own_in(collate.__call__([np.ones(3)]), aliases.held(Records(), collate.__call__)) is not None


def test_memory_spans_of_arrays_and_of_nothing():
    a = np.zeros((3, 4), dtype=np.float32)
    start = a.__array_interface__["data"][0]
    assert aliases.memory_span(a) == (start, start + 48)
    assert aliases.memory_span(a[:, 1]) == (start + 4, start + 4 + 2 * 16 + 4)
    assert aliases.memory_span(np.zeros((0, 4))) is None and aliases.memory_span([1, 2]) is None


def test_a_read_only_array_the_dataset_holds_is_changed_by_no_loop(tmp_path):
    """An ``"r"`` memmap (``batch_size=None`` rows of it): the loop cannot change it in place, and no batch
    overwrites another; workers are not kept away for it."""
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(40.0).reshape(10, 4))
    rows = np.load(path, mmap_mode="r")
    holder = type("Rows", (), {})()
    holder.rows = rows
    assert aliases.own_in(rows[3], aliases.held(holder)) is None
    holder.rows = np.load(path, mmap_mode="r+")
    assert aliases.own_in(holder.rows[3], aliases.held(holder)) is not None


def test_records_in_a_long_dict_are_found_at_the_position_they_were_read_at():
    """An audit's 1,000 records keyed by name (``self.records[self.keys[i]]``), first read at 700: past the 256
    items looked at, found as the dict's 700th value."""
    holder = type("Records", (), {})()
    holder.records = {f"id{i:05d}": {"seen": 0} for i in range(1_000)}
    assert aliases.own_in(holder.records["id00700"], aliases.held(holder, at=(700,))) is not None


def test_values_no_loop_changes_in_place_are_not_the_datasets_own():
    """A collate handing on the dataset's own ``pathlib.Path``s (or numpy scalars) kept 0 workers, where they
    arrive the same from one (an audit, torch and MindSpore's DataLoader)."""
    import pathlib

    holder = type("Paths", (), {})()
    holder.paths, holder.labels = [pathlib.Path(f"img_{i}.jpg") for i in range(4)], list(np.arange(4))
    kept = aliases.held(holder)
    assert aliases.own_in([holder.paths[1], holder.labels[2]], kept) is None
