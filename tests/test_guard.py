"""``GuardedSource`` without MindSpore: slot accounting, growth detection, normalisation and error texts.

The guard is only useful if its slot accounting is exactly MindSpore's: it predicts, row by row, what
``_SharedQueue.put`` (MindSpore 2.10, ``dataset/engine/queue.py``) is about to allocate. ``MindSporeSlots``
below transcribes that algorithm so the two can be compared on arbitrary row sequences.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
from dataclasses import replace

import numpy as np
import pytest

from ms_shm import budget as budget_mod
from ms_shm.budget import Budget
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import guard
from ms_shm.engines.mindspore.guard import (
    GuardedSource,
    GuardSpec,
    RowTooLargeError,
    ShmFullError,
    row_nbytes,
)
from ms_shm.rows import RowError

PAGE = model.PAGE
MiB = model.MiB


class MindSporeSlots:
    """MindSpore 2.10 ``_SharedQueue.put`` in dynamic mode, reduced to the slot sizes it allocates.

    ``check_and_create_shm(total)`` runs when the row's ndarray bytes are > 0: it appends a slot when
    ``seg_pos`` equals the number of slots, or re-creates slot ``seg_pos`` when it is smaller than the row.
    ``seg_pos`` advances only when some column went to shared memory (``start_bytes > 0``).
    """

    def __init__(self, num_seg: int):
        self.num_seg = num_seg
        self.sizes: list = []
        self.seg_pos = 0
        self.created = 0  # slots created or re-created: each is a new file in /dev/shm

    def put(self, row: tuple) -> None:
        total = sum(c.nbytes for c in row if isinstance(c, np.ndarray))
        if total > 0:
            if len(self.sizes) == self.seg_pos:
                self.sizes.append(total)
                self.created += 1
            elif self.sizes[self.seg_pos] < total:
                self.sizes[self.seg_pos] = total
                self.created += 1
        start_bytes = sum(c.nbytes for c in row if isinstance(c, np.ndarray) and c.nbytes > 0)
        if start_bytes > 0:
            self.seg_pos = (self.seg_pos + 1) % self.num_seg


class ListSource:
    def __init__(self, rows: list):
        self.rows = rows

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self):
        return len(self.rows)


def spec(slots: int = 4, worker_bytes: int = 1 << 40, planned: int = PAGE, workers: int = 1,
         budget: Budget | None = None) -> GuardSpec:
    return GuardSpec(slots, worker_bytes, planned, "lower num_parallel_workers", workers, "/dev/shm", budget)


@pytest.fixture
def free_space(monkeypatch):
    """Replace the statvfs of /dev/shm with a settable number, and count the calls."""

    class Free:
        value = 1 << 40
        calls = 0

        def __call__(self, path):
            Free.calls += 1
            if isinstance(self.value, Exception):
                raise self.value
            return self.value

    free = Free()
    monkeypatch.setattr(guard, "_free_bytes", free)
    return free


def row_of(nbytes: int, label: int = 0) -> tuple:
    return (np.zeros(nbytes, np.uint8), np.array(label, np.int64))


# ------------------------------------------------------------------------------------- slot accounting


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slots", [1, 4, 18])
def test_slot_accounting_matches_mindspores_round_robin(seed, slots, free_space):
    """Random rows, some without bytes (which do not advance ``seg_pos``): same slots, same growth events."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 0, 1, 4095, 4096, 5000, 9000, 3 * MiB]) for _ in range(300)]
    rows = [(np.zeros(n, np.uint8),) if rng.random() < 0.5 else (np.zeros(n, np.uint8), np.zeros(0, np.int32))
            for n in sizes]
    ms = MindSporeSlots(slots)
    g = GuardedSource(ListSource(rows), spec(slots=slots))
    for i, row in enumerate(rows):
        g[i]
        ms.put(row)
        assert g._ms_shm_guard._slots == ms.sizes, f"after row {i}"
        assert g._ms_shm_guard._next_slot % slots == ms.seg_pos
    assert g._ms_shm_guard._total == sum(model.pages(s) for s in ms.sizes)
    assert free_space.calls == ms.created  # statvfs exactly when MindSpore creates a file, never otherwise
    assert g._ms_shm_guard.rows_checked == len(rows)


def test_rows_without_bytes_do_not_take_a_slot(free_space):
    empty = (np.zeros((0, 3), np.float32), np.zeros(0))
    g = GuardedSource(ListSource([empty, row_of(10), empty, row_of(10)]), spec(slots=4))
    for i in range(4):
        g[i]
    guard = g._ms_shm_guard
    assert guard._slots == [18, 18] and guard._next_slot == 2 and guard.rows_checked == 4


def test_a_dict_row_is_pickled_not_shared(free_space):
    """MindSpore's dict column goes through the pipe: no slot, so the guard must not count one."""
    g = GuardedSource(ListSource([{"a": np.arange(1000)}]), spec())
    out = g[0]
    assert isinstance(out, dict) and list(out) == ["a"]
    assert g._ms_shm_guard._slots == [] and free_space.calls == 0


def test_growth_is_checked_once_then_steady_rows_are_free(free_space):
    g = GuardedSource(ListSource([row_of(MiB)] * 40), spec(slots=4))
    for i in range(40):
        g[i]
    assert free_space.calls == 4  # one per slot created, none for the 36 rows that reuse them
    g.rows.append(row_of(2 * MiB))  # the source's own attribute, through the wrapper
    g[40]
    assert free_space.calls == 5  # a bigger row re-creates its slot


def test_a_fresh_worker_starts_with_no_slots(free_space):
    """Fork copies the main process's guard; the worker's own slots start empty (MindSpore's do too)."""
    g = GuardedSource(ListSource([row_of(MiB)] * 4), spec(slots=4, worker_bytes=5 * MiB))
    for i in range(4):
        g[i]
    assert g._ms_shm_guard._total > 4 * MiB
    g._ms_shm_guard._pid = -1  # as seen from a forked child
    g[0]
    assert g._ms_shm_guard._slots == [MiB + 8] and g._ms_shm_guard._pid == os.getpid()


def test_the_guard_survives_pickling_for_spawn(free_space):
    """With spawn, MindSpore pickles the source (dill): the copy must work and account from scratch."""
    g = GuardedSource(ListSource([row_of(100)] * 3), spec())
    g[0]
    copy = pickle.loads(pickle.dumps(g))
    copy._ms_shm_guard._pid = -1
    copy[1]
    assert copy._ms_shm_guard._slots == [108]


# ------------------------------------------------------------------------------------------ budget


def test_a_row_over_the_workers_share_is_refused_naming_row_size_plan_and_fix(free_space):
    free_space.value = 20 * MiB  # no room for both workers to grow a 12 MiB slot
    rows = [row_of(12 * MiB - 8) for _ in range(3)]
    g = GuardedSource(ListSource(rows),
                      spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2,
                           budget=budget_mod.compute(64 * MiB, 1, None, None)))
    g[0], g[1]
    with pytest.raises(RowTooLargeError) as err:
        g[2]
    need = int((2 * 18 * 12 * MiB + model.semaphore_bytes(2)) / 0.8)
    assert str(err.value) == (
        "row 2 is 12.0 MiB, ms_shm planned rows of 1.0 MiB: this worker's 18 shared-memory slots would grow "
        "to 36.0 MiB, over its 25.6 MiB share of /dev/shm, which would end in a bus error. Fix: give /dev/shm "
        f"at least {need / MiB:.1f} MiB for rows of 12.0 MiB (docker run --shm-size=1g, or a "
        "Kubernetes emptyDir with medium: Memory and that sizeLimit), or lower num_parallel_workers")
    assert g._ms_shm_guard._slots == [12 * MiB, 12 * MiB]  # the refused row took nothing: MindSpore never saw it
    assert g._ms_shm_guard._next_slot == 2


def test_a_rare_row_over_the_share_goes_on_where_dev_shm_has_room_for_every_worker(free_space, caplog):
    """Rows the probe did not read (a few full-size images among small ones): raw MindSpore runs them where
    /dev/shm has room, so the guard does too, and says so once."""
    free_space.value = 100 * MiB  # room for 2 workers x 12 MiB at once, beyond a 25.6 MiB share
    rows = [row_of(12 * MiB - 8) for _ in range(4)]
    g = GuardedSource(ListSource(rows), spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2))
    with caplog.at_level(logging.WARNING, logger="ms_shm"):
        for i in range(4):
            assert g[i] is rows[i]
    assert caplog.text.count("going on") == 1, caplog.text
    assert "at row 2 this worker's slots grow to 36.0 MiB (rows up to 12.0 MiB; planned 1.0 MiB)" in caplog.text
    assert g._ms_shm_guard._total == 4 * 12 * MiB


def test_a_rare_row_goes_on_only_where_every_local_rank_could_grow_alike(free_space):
    """Four ranks on one /dev/shm: the first to meet a rare large row took the room the other three then
    lacked (audit: 3 of 4 ranks stopped). Room for ranks x workers such slots, or the clear error."""
    free_space.value = 90 * MiB  # 2 workers x 12 MiB fit; 4 ranks x 2 workers x 12 MiB do not
    rows = [row_of(12 * MiB - 8) for _ in range(4)]
    g = GuardedSource(ListSource(rows), replace(spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB,
                                                     workers=2), ranks=4))
    with pytest.raises(RowTooLargeError):
        for i in range(4):
            g[i]


def test_a_row_larger_than_every_planned_slot_goes_on_where_the_others_keep_their_planned_slots(free_space):
    """One 34 MiB row among 1 MiB ones, 2 workers of 4 slots (the program's prefetch 2) in 64 MB: raw ran it.
    Keeping as much again for the other worker (68 MiB) stopped it; the other worker holds at most its 4
    planned slots (4 MiB) unless it too meets a row larger than its whole plan."""
    free_space.value = 56 * MiB
    rows = [row_of(MiB - 8), row_of(34 * MiB - 8), row_of(MiB - 8)]
    g = GuardedSource(ListSource(rows), spec(slots=4, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2))
    for i in range(3):
        assert g[i] is rows[i]
    free_space.value = 36 * MiB  # 34 MiB + the other worker's 3 slots yet to make (1 MiB each) do not fit
    g = GuardedSource(ListSource(rows), spec(slots=4, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2))
    g[0]
    with pytest.raises(RowTooLargeError):
        g[1]


def test_late_in_an_epoch_the_slots_the_others_made_already_are_not_kept_room_for_again(free_space):
    """A 20 MiB row 60 of 80 among 1 MiB ones, 2 workers of 18 slots, 64 MB: raw ran it (~55 MiB). Room kept for
    the other worker's 18 planned slots, which it had made and /dev/shm counted as used, stopped it; the same
    row at index 3 went on. Rows are dealt round-robin: the others have made about as many slots as this one."""
    free_space.value = 28 * MiB
    rows = [row_of(MiB - 8)] * 30 + [row_of(20 * MiB - 8)]
    g = GuardedSource(ListSource(rows), spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2))
    for i in range(31):
        assert g[i] is rows[i]
    assert g._ms_shm_guard._total == 17 * MiB + 20 * MiB


def _in_a_forked_worker(g: GuardedSource, monkeypatch, settings) -> GuardedSource:
    """``g`` as a worker forked from its program sees it: another pid than the one that made it, the module
    imported by that program, and MindSpore's settings as ``settings`` says (``(shared memory, prefetch)``)."""
    home = os.getpid() + 1_000_000
    g._ms_shm_guard.spec = replace(g._ms_shm_guard.spec, home_pid=home)
    g._ms_shm_guard._pid = -1
    monkeypatch.setattr(guard, "_IMPORTED_BY", home)
    monkeypatch.setattr(guard.settings, "slot_settings", lambda: settings)
    return g


def test_a_worker_started_with_shared_memory_off_counts_no_slots(free_space, monkeypatch):
    """The program turned shared memory off after the dataset was built: MindSpore's workers send rows
    through pipes, and a row over the planned share is no reason to stop (an audit: raw ran it)."""
    rows = [row_of(34 * MiB - 8)] * 3
    g = _in_a_forked_worker(GuardedSource(ListSource(rows), spec(slots=18, worker_bytes=int(25.6 * MiB),
                                                                 planned=MiB, workers=2)), monkeypatch, (False, 16))
    for i in range(3):
        assert g[i] is rows[i]
    assert g._ms_shm_guard._total == 0 and g._ms_shm_guard.rows_checked == 3


def test_a_worker_counts_the_slots_of_the_prefetch_it_was_started_with(free_space, monkeypatch):
    """The prefetch lowered to 2 after the dataset was built: 4 slots a worker (2 workers), not the planned 18;
    the error counts those."""
    free_space.value = 30 * MiB
    rows = [row_of(12 * MiB - 8)] * 6
    g = _in_a_forked_worker(GuardedSource(ListSource(rows), spec(slots=18, worker_bytes=int(25.6 * MiB),
                                                                 planned=MiB, workers=2)), monkeypatch, (True, 2))
    g[0], g[1], g[2], g[3], g[4]  # the 5th reuses slot 0: 4 x 12 MiB at most
    assert g._ms_shm_guard._slot_count == 4 and g._ms_shm_guard._total == 4 * 12 * MiB
    g = _in_a_forked_worker(GuardedSource(ListSource([row_of(10 * MiB - 8)] * 2 + [row_of(40 * MiB - 8)]),
                                          spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2)),
                            monkeypatch, (True, 2))
    g[0], g[1]
    with pytest.raises(RowTooLargeError, match="this worker's 4 shared-memory slots would grow to 60.0 MiB"):
        g[2]


def test_a_spawned_worker_takes_the_settings_the_program_started_it_with(free_space, monkeypatch):
    """A spawned worker's own MindSpore holds its defaults: the settings go along in the pickle MindSpore
    makes as it starts the worker."""
    monkeypatch.setattr(guard.settings, "slot_settings", lambda: (False, 2))
    g = GuardedSource(ListSource([row_of(34 * MiB - 8)]),
                      replace(spec(slots=18, worker_bytes=MiB, planned=MiB, workers=2), home_pid=os.getpid()))
    spawned = pickle.loads(pickle.dumps(g))
    monkeypatch.setattr(guard.settings, "slot_settings", lambda: (True, 16))  # the fresh interpreter's defaults
    spawned._ms_shm_guard.spec = replace(spawned._ms_shm_guard.spec, home_pid=os.getpid() + 1_000_000)
    spawned._ms_shm_guard._pid = -1
    assert spawned[0] is not None and spawned._ms_shm_guard._total == 0


def test_a_budget_exactly_full_is_allowed(free_space):
    g = GuardedSource(ListSource([row_of(PAGE - 8)] * 5), spec(slots=4, worker_bytes=4 * PAGE))
    for i in range(5):
        g[i]  # the 5th reuses slot 0
    assert g._ms_shm_guard._total == 4 * PAGE


# ------------------------------------------------------------------------------------ free space


def test_a_full_dev_shm_is_refused_naming_row_need_free_and_fix(free_space):
    free_space.value = 3 * MiB
    rows = [row_of(2 * MiB - 8)] * 2
    g = GuardedSource(ListSource(rows), spec(slots=4, planned=2 * MiB, workers=2))
    with pytest.raises(ShmFullError) as err:
        g[0]
    need = 2 * 4 * 2 * MiB + model.semaphore_bytes(2)
    assert str(err.value) == (
        "row 0 needs a new 2.0 MiB shared-memory slot plus 2.0 MiB for the other 1 worker(s)' next slot, but "
        "/dev/shm has only 3.0 MiB free: another worker of this pipeline grew its slots past its share for rows "
        "larger than the probe saw, or something else filled it after ms_shm planned this pipeline, and "
        "writing the row would end in a bus error (ms_shm planned for 1 rank(s) using this host's /dev/shm; where "
        "more ranks run here, tell each how many: export LOCAL_WORLD_SIZE (or MS_SHM_LOCAL_RANKS), or "
        f"ms_shm.tune(ranks=N)). Fix: make room, this pipeline needs {need / MiB:.1f} MiB of "
        "/dev/shm for its slots (find what else uses it: `df -h /dev/shm`; `ms-shm clean` removes what crashed "
        "runs left), or lower num_parallel_workers")
    assert g._ms_shm_guard._slots == []


def test_a_slot_not_committed_is_named_as_the_guard_that_let_its_row_through(free_space):
    """The guard lets a new slot through (room at its check); MindSpore then finds no pages for it
    (``compat._commit_new_slots``): the error names that row, and says when the room was missing."""
    free_space.value = 64 * MiB
    g = GuardedSource(ListSource([row_of(2 * MiB - 8)] * 2), spec(slots=4, planned=2 * MiB, workers=2))
    g[1]
    free_space.value = 1 * MiB
    text = str(guard.slot_not_committed(2 * MiB - 8))
    assert text.startswith("row 1 needs a new 2.0 MiB shared-memory slot, but /dev/shm had no room for it when "
                           "the worker created it (1.0 MiB free when read after that)"), text
    assert "Fix: make room" in text
    other = str(guard.slot_not_committed(8 * MiB))  # not the row the guard saw: what is known
    assert other.startswith("a row of 8.0 MiB needs a new shared-memory slot"), other


@pytest.mark.parametrize("workers, planned, free, ok", [
    (1, MiB, MiB, True),  # one worker: no margin, exactly enough
    (1, MiB, MiB - 1, False),
    (2, MiB, 2 * MiB, True),  # one planned row for the other worker
    (2, MiB, 2 * MiB - 1, False),
    (3, MiB // 2, 2 * MiB, True),  # margin uses the planned row when it is smaller than this one
    (3, MiB // 2, 2 * MiB - 1, False),
])
def test_free_space_margin(free_space, workers, planned, free, ok):
    free_space.value = free
    g = GuardedSource(ListSource([row_of(MiB - 8)]), spec(planned=planned, workers=workers))
    if ok:
        g[0]
    else:
        with pytest.raises(ShmFullError):
            g[0]


def test_a_shortfall_smaller_than_the_shown_precision_is_shown_in_bytes(free_space):
    """CI printed "needs a new 1.0 MiB slot plus 1.0 MiB ... has only 2.0 MiB free": 1.96 MiB rounds up."""
    free_space.value = 2 * MiB - 40_960
    g = GuardedSource(ListSource([row_of(MiB - 8)]), spec(planned=MiB, workers=2))
    with pytest.raises(ShmFullError, match=r"has only 2,056,192 B free: "):
        g[0]


def test_unreadable_dev_shm_warns_once_and_falls_back_to_the_budget(free_space, caplog):
    free_space.value = PermissionError(13, "Permission denied")
    g = GuardedSource(ListSource([row_of(MiB * (i + 1)) for i in range(3)]), spec(slots=4))
    with caplog.at_level(logging.WARNING, logger="ms_shm.guard"):
        for i in range(3):
            g[i]
    warnings = [r for r in caplog.records if "statvfs(/dev/shm) failed" in r.getMessage()]
    assert len(warnings) == 1 and "PermissionError" in warnings[0].getMessage()
    assert free_space.calls == 1 and len(g._ms_shm_guard._slots) == 3


def test_the_real_statvfs_is_read():
    assert guard._free_bytes("/") > 0
    with pytest.raises(OSError):
        guard._free_bytes("/nonexistent/ms_shm")


# ------------------------------------------------------------------------------------ pass-through


class Recording:
    """Keeps the index objects it was given and returns rows of any form, as a user's source may."""

    def __init__(self, rows):
        self.rows, self.seen, self.label = rows, [], "mine"

    def __getitem__(self, index):
        self.seen.append(index)
        return self.rows[int(index)]

    def __len__(self):
        return len(self.rows)


@pytest.mark.parametrize("row", [
    (np.arange(6, dtype=np.float32), np.array(3)),
    [np.arange(3), 7],  # a list with a Python int: MindSpore converts it, not the guard
    np.arange(24).reshape(4, 6).T,  # a bare, non-contiguous array
    {"a": np.arange(3, dtype=">i4")},
    (np.arange(3, dtype=">f8"),),
])
def test_rows_reach_mindspore_exactly_as_the_source_returned_them(row, free_space):
    g = GuardedSource(Recording([row]), spec())
    assert g[np.int64(0)] is row


def test_the_index_reaches_the_source_as_mindspore_passed_it(free_space):
    src = Recording([row_of(8)] * 2)
    g = GuardedSource(src, spec())
    g[np.int64(1)]
    g[0]
    assert [type(i) for i in src.seen] == [np.int64, int]


def test_the_sources_exceptions_pass_unchanged(free_space):
    class Broken:
        def __len__(self):
            return 3

        def __getitem__(self, index):
            raise ValueError(f"bad jpeg {index}")

    with pytest.raises(ValueError, match="bad jpeg 2") as err:
        GuardedSource(Broken(), spec())[2]
    assert err.type is ValueError


def test_attributes_are_the_sources(free_space):
    src = Recording([row_of(8)])
    g = GuardedSource(src, spec())
    assert g.label == "mine" and len(g) == 1
    with pytest.raises(AttributeError):
        _ = g.no_such_attribute


@pytest.mark.parametrize("row, expected", [
    ((np.zeros(10, np.uint8), np.zeros(3, np.int32)), 22),
    ([np.zeros(4, np.float64), 5], 40),  # a Python int becomes an 8-byte array in MindSpore
    (np.zeros((2, 3), np.float32), 24),
    ({"a": np.zeros(100)}, 0),  # a dict column is pickled, not put in a slot
    ((np.float32(1), True), 12),
])
def test_row_bytes_are_counted_as_mindspore_counts_its_slot(row, expected):
    assert row_nbytes(row) == expected


@pytest.mark.parametrize("exc", [
    RowTooLargeError("row 3 is 12.0 MiB"), ShmFullError("row 0 needs"), RowError("row 4 is None"),
])
def test_each_error_can_be_rebuilt_from_its_text_alone(exc):
    """MindSpore re-raises a worker's exception as ``except_type(traceback_text)``, after pickling the type."""
    cls = pickle.loads(pickle.dumps(type(exc)))
    rebuilt = cls("Traceback ...\n" + str(exc))
    assert isinstance(rebuilt, type(exc)) and str(exc) in str(rebuilt)


def test_a_loader_batch_over_its_plan_that_dev_shm_cannot_take_is_named_as_the_cause(monkeypatch):
    """An audit's three 24 MiB samples among 2 MiB ones (MindSpore's DataLoader, 2 workers, 64 MB): the batch
    was within the loader's budget when checked, then /dev/shm had too little free to send it, and the error
    said "something else filled it after ms_shm planned this loader" while this loader's own batches had. A batch
    over its plan is ``RowTooLargeError``, as where its write fails (pure logic: a collate of byte strings)."""
    import types

    from ms_shm.engines.torchstyle import guard as loader_guard

    MiB = 1 << 20
    free = iter([30 * MiB, 10 * MiB, 1 * MiB])  # before the collate; after it, as the other worker wrote; later
    monkeypatch.setattr(loader_guard.procfs, "statvfs",
                        lambda path: types.SimpleNamespace(total=64 * MiB, free=(f := next(free)), used=64 * MiB - f))
    worker = types.SimpleNamespace(id=0)
    g = loader_guard.GuardedCollate(lambda samples: samples, lambda batch: (sum(map(len, batch)), len(batch)),
                                    lambda: worker, 2 * MiB, 5, 1 << 30, "num_workers=1")
    with pytest.raises(RowTooLargeError, match=r"is 24.0 MiB \(planned 2.0 MiB\)"):
        g([b"x" * (24 * MiB)])
    with pytest.raises(ShmFullError, match="something else filled it"):  # within its plan: another's doing
        g([b"x" * (2 * MiB)])


def test_rows_read_in_the_programs_own_process_use_no_slot_and_are_not_counted(free_space):
    """``dataset[i]``, or an iterator reading in MindSpore's own thread, reads through the guard in the program's
    process, where no row goes through a slot: counted there, rows over the share were refused as if a worker
    had made them."""
    free_space.value = 2 * MiB
    rows = [row_of(12 * MiB - 8) for _ in range(3)]
    made = spec(slots=18, worker_bytes=int(25.6 * MiB), planned=MiB, workers=2)
    home = GuardedSource(ListSource(rows), replace(made, home_pid=os.getpid()))
    assert [home[i] for i in range(3)] == rows and home._ms_shm_guard.rows_checked == 0
    worker = GuardedSource(ListSource(rows), replace(made, home_pid=os.getpid() + 1))
    with pytest.raises(guard.ShmFullError):
        [worker[i] for i in range(3)]
