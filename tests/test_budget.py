"""``ms_shm.budget``: each rank's share of /dev/shm and fds, and the ledger of live pipelines. Pure."""

from __future__ import annotations

import json
import threading

import pytest

from ms_shm import budget, model

MiB = model.MiB


@pytest.mark.parametrize("free, ranks, reserved, expected", [
    (320 * MiB, 1, 0, 256 * MiB),
    (320 * MiB, 4, 0, 64 * MiB),
    (320 * MiB, 8, 0, 32 * MiB),
    (320 * MiB, 4, 10 * MiB, 54 * MiB),
    (320 * MiB, 4, 100 * MiB, 0),  # reservations beyond the share: nothing left, never negative
    (0, 1, 0, 0),
    (64 * MiB, 0, 0, int(64 * MiB * 0.8)),  # ranks < 1 is read as 1
])
def test_shm_share(free, ranks, reserved, expected):
    b = budget.compute(free, ranks, None, None, reserved_shm=reserved)
    assert b.shm_bytes == expected
    assert b.ranks == max(1, ranks)
    assert f"{max(1, ranks)} local rank(s)" in b.reason
    assert ("reserved by live pipelines" in b.reason) is bool(reserved)


def test_unknown_shm_is_none_and_says_why():
    b = budget.compute(None, 4, 1024, 10)
    assert b.shm_bytes is None
    assert "could not be read" in b.reason
    assert b.fds == 1024 - 10 - model.FD_MARGIN


def test_fraction_and_rank_source_are_reported():
    b = budget.compute(100 * MiB, 2, None, None, fraction=0.5, ranks_source="LOCAL_WORLD_SIZE")
    assert b.shm_bytes == 25 * MiB
    assert "50%" in b.reason and "[LOCAL_WORLD_SIZE]" in b.reason


@pytest.mark.parametrize("nofile, open_fds, reserved, expected", [
    (None, 10, 0, None),  # no limit
    (1024, 10, 0, 1024 - 10 - model.FD_MARGIN),
    (1024, None, 0, 1024 - model.FD_MARGIN),  # open fds unknown: counted as 0
    (40, 10, 0, 22),
    (40, 10, 30, 0),  # never negative
    (1024, 10, 100, 1024 - 10 - model.FD_MARGIN - 100),
])
def test_fds(nofile, open_fds, reserved, expected):
    assert budget.compute(MiB, 1, nofile, open_fds, reserved_fds=reserved).fds == expected


def test_budget_serialises():
    b = budget.compute(64 * MiB, 2, 1024, 10, 1024, 3, ranks_source="RANK_SIZE")
    assert json.loads(json.dumps(b.to_dict()))["shm_bytes"] == b.shm_bytes


def test_ledger_reserve_release_totals():
    ledger = budget.Ledger()
    a = ledger.reserve("train", 10 * MiB, 20)
    b = ledger.reserve("eval", 5 * MiB, 7)
    assert a.key != b.key
    assert ledger.totals() == (15 * MiB, 27, 0)
    assert [r.label for r in ledger.live()] == ["train", "eval"]
    ledger.release(a.key)
    ledger.release(a.key)  # twice is harmless (weakref.finalize and an explicit release)
    assert ledger.totals() == (5 * MiB, 7, 0)
    ledger.clear()
    assert ledger.totals() == (0, 0, 0) and ledger.live() == ()


def test_a_reservation_counts_only_while_its_pipeline_may_hold_dev_shm():
    """A MindSpore pipeline whose iterators have ended holds nothing (the engine's ``in_use``): an eval built
    after a finished train is planned without the train's reservation, which counts again once it runs."""
    ledger, running = budget.Ledger(), [True]
    train = ledger.reserve("train", 40 * MiB, 20, 8 * MiB, in_use=lambda: running[0])
    ledger.reserve("eval", 5 * MiB, 7)
    assert ledger.totals() == (45 * MiB, 27, 8 * MiB)
    running[0] = False
    assert ledger.totals() == (5 * MiB, 7, 0) and [r.label for r in ledger.live()] == ["eval"]
    running[0] = True
    assert ledger.totals() == (45 * MiB, 27, 8 * MiB)
    ledger.release(train.key)
    assert ledger.totals() == (5 * MiB, 7, 0)


def test_a_reservation_that_stops_counting_is_said_once_with_the_fix(caplog):
    ledger = budget.Ledger()
    ledger.reserve("GeneratorDataset(Src)", 40 * MiB, 20, in_use=lambda: False)
    with caplog.at_level("INFO", logger="ms_shm.budget"):
        ledger.totals()
        ledger.totals()
    said = [r.getMessage() for r in caplog.records if "no longer counts" in r.getMessage()]
    assert len(said) == 1, said
    assert "GeneratorDataset(Src)'s reservation (40.0 MiB of /dev/shm)" in said[0]
    assert "create_tuple_iterator(num_epochs=-1)" in said[0]


def test_ledger_feeds_the_next_budget():
    ledger = budget.Ledger()
    ledger.reserve("train", 100 * MiB, 50)
    shm, fds, _ = ledger.totals()
    b = budget.compute(400 * MiB, 1, 1000, 10, shm, fds)
    assert (b.shm_bytes, b.fds) == (220 * MiB, 1000 - 10 - model.FD_MARGIN - 50)
    assert (b.reserved_shm, b.reserved_fds) == (100 * MiB, 50)


def test_ledger_is_thread_safe():
    ledger = budget.Ledger()
    threads_n, per_thread = 8, 300
    keys: list = []
    lock = threading.Lock()
    start = threading.Barrier(threads_n)

    def work() -> None:
        start.wait()
        mine = [ledger.reserve("t", 3, 1).key for _ in range(per_thread)]
        for key in mine[::2]:
            ledger.release(key)
        ledger.totals()
        with lock:
            keys.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == threads_n * per_thread  # no key handed out twice
    left = threads_n * per_thread // 2
    assert ledger.totals()[:2] == (3 * left, left)
    assert len(ledger.live()) == left


def test_memory_the_program_took_since_the_first_pipeline_is_not_planned_on():
    """A budget taken at ``tune()`` planned 670 MiB that a 450 MiB model loaded afterwards had taken: OOM.
    Memory is read again for each pipeline (facts read from this machine only), and the lesser is planned on."""
    from dataclasses import replace

    from ms_shm import host
    from ms_shm.state import Session

    real = host.probe()
    assert real.live and real.mem_available
    earlier = replace(real, mem_available=real.mem_available + (8 << 30), cgroup_mem_limit=None, cgroup_mem_usage=None)
    now = Session().budget(earlier, reserved=(0, 0, 0))
    assert "read now" in now.memory_reason and now.memory_bytes < earlier.mem_available * 0.8, now
    assert "read now" not in Session().budget(replace(earlier, live=False), reserved=(0, 0, 0)).memory_reason


def test_a_budget_held_now_counts_running_pipelines_at_what_the_memory_left_now_shows():
    """Reservations are each live pipeline's worst case, every queue full: where nothing fits beside them, a plan
    may overcommit on the memory left now (``api._overcommitted``), in which a running pipeline's present pages
    already show. One built and not iterated yet (``follows_prefetch``) holds nothing now: it keeps its
    reservation there, and the memory left now is not raised by it either (an audit: a map planned on memory
    that was not there was OOM-killed at 650 MB where raw ran)."""
    from dataclasses import replace

    from ms_shm import host
    from ms_shm.state import Session

    s = Session()
    s.ledger.reserve("GeneratorDataset(train)", 0, 0, 600 * MiB)
    s.ledger.reserve("GeneratorDataset(eval)", 0, 0, 100 * MiB, by_prefetch=((0, 0, 100 * MiB),),
                     follows_prefetch=lambda: True)
    real = host.probe()
    facts = replace(real, mem_available=real.mem_available + (8 << 30), cgroup_mem_limit=None,
                    cgroup_mem_usage=None)  # as if the program took 8 GiB since: the reading now binds
    reserved, now = s.budget(facts), s.budget(facts, held_now=True)
    left_now = host.memory_now(facts).memory_left[0]
    assert reserved.reserved_memory == 700 * MiB and now.reserved_memory == 100 * MiB
    assert "running pipelines at what they hold now" in now.memory_reason
    assert abs(now.memory_bytes - (left_now * 0.8 - 100 * MiB)) < 64 * MiB
    assert abs(reserved.memory_bytes - ((left_now + 600 * MiB) * 0.8 - 700 * MiB)) < 64 * MiB


def test_a_kind_planned_apart_does_not_count_against_its_own_kind():
    """Two DataLoaders (train, val) built up front iterate one after the other: each is planned apart from the
    other (the audit's two.py: val refused in 64 MB while train, idle, held 40 MiB); a MindSpore pipeline, whose
    iterator lives across epochs, counts against every one."""
    ledger = budget.Ledger()
    ledger.reserve("dataloader", 40 * MiB, 24, 100 * MiB, kind="dataloader")
    ms = ledger.reserve("GeneratorDataset(x)", 5 * MiB, 3)
    assert ledger.totals() == (45 * MiB, 27, 100 * MiB)
    assert ledger.totals(apart="dataloader") == (5 * MiB, 3, 0)
    assert [r.key for r in ledger.live(apart="dataloader")] == [ms.key]
    assert ledger.live()[0].to_dict()["kind"] == "dataloader"


def test_the_session_budget_of_a_loader_keeps_only_persistent_workers_memory_of_other_loaders(monkeypatch):
    """Loaders iterate one after the other: an idle one holds no batches, and no workers unless persistent. A
    val loader was refused in a 450 MB container after a train loader with no workers, where raw torch ran both."""
    from ms_shm import host
    from ms_shm.state import Session

    s = Session()
    s.ledger.reserve("dataloader", 40 * MiB, 24, 100 * MiB, kind="dataloader")
    s.ledger.reserve("dataloader", 8 * MiB, 4, 30 * MiB, kind="dataloader", held_apart=30 * MiB)
    facts = host.probe()
    b = s.budget(facts, apart="dataloader")
    assert b.reserved_shm == 0 and b.reserved_fds == 0 and b.reserved_pipelines == 0
    assert b.reserved_memory == 30 * MiB  # persistent workers keep their pages between epochs; the other nothing
    b = s.budget(facts)
    assert b.reserved_shm == 48 * MiB and b.reserved_memory == 130 * MiB and b.reserved_pipelines == 2


@pytest.mark.parametrize("reserved, pipelines, ranks, expected, text", [
    (0, 0, 1, int(24 * MiB / 0.8) + 1, ""),
    (40 * MiB, 1, 1, int(64 * MiB / 0.8) + 1, ", counting 40.0 MiB reserved by 1 other live pipeline of this process"),
    (40 * MiB, 2, 2, int(2 * 64 * MiB / 0.8) + 1, ", counting 40.0 MiB reserved by 2 other live pipelines of this "
                                                  "process"),
])
def test_the_shm_to_give_adds_what_live_pipelines_reserved(reserved, pipelines, ranks, expected, text):
    b = budget.compute(64 * MiB, ranks, None, None, reserved_shm=reserved, reserved_pipelines=pipelines)
    assert budget.shm_to_give(b, 24 * MiB) == expected
    assert budget.reserved_text(b) == text


def test_mindsporess_budget_error_sizes_dev_shm_past_what_live_pipelines_reserved():
    """build_dataset's ShmBudgetError, same rule: 64 MB with 40 MiB reserved by a live pipeline was told to
    give /dev/shm what fits this pipeline alone."""
    from ms_shm._results import mib
    from ms_shm.engines.mindspore import planning
    from ms_shm.plan import Request, ShmBudgetError
    from ms_shm.rows import RowStats

    row = RowStats(True, 100, 8, (), (), 256 << 10, 256 << 10, 0.02, 1.0, 0.0)
    reserved = int(64 * MiB * 0.8) - (50 << 10)  # 50 KiB left: 2 workers' semaphores alone need 76 KiB
    b = budget.compute(64 * MiB, 1, 65536, 10, reserved_shm=reserved, reserved_pipelines=1)
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_generator(row, Request(workers=2, multiprocessing=True, cpu_count=2, usable_cpus=2), b,
                                model.profile_for("2.10.0"))
    text = str(err.value)
    least = int(float(text.split("the smallest needs ")[1].split(" KiB")[0]) * 1024)
    size = budget.shm_to_give(b, least)
    assert size > 64 * MiB and f"give /dev/shm at least {mib(size)}" in text, text
    assert f"{mib(reserved)} reserved by 1 other live pipeline of this process" in text, text


def test_a_read_only_dev_shm_is_a_budget_of_nothing_and_its_fix_is_a_writable_mount():
    b = budget.compute(1 << 30, 1, None, None, shm_readonly=True)
    assert b.shm_bytes == 0 and b.shm_readonly and "read-only" in b.reason
    assert "remount,rw" in budget.shm_fix(b, 1 << 20) and "at least" not in budget.shm_fix(b, 1 << 20)
    assert budget.shm_fix(budget.compute(1 << 30, 1, None, None), 1 << 20).startswith("give /dev/shm at least")
    assert budget.compute(None, 1, None, None, shm_readonly=True).shm_bytes is None  # unread: unknown, as before


def test_stages_whose_iterator_is_not_made_yet_give_memory_back_at_a_lower_global_prefetch():
    """MindSpore reads its global prefetch as an iterator is made: where a stage planned later lowers it, the
    stages planned before it that no live iterator holds run at the lower prefetch too (an audit's per_batch_map
    batch was refused in a 700 MB container with its source and map counted at prefetch 16). A stage an iterator
    already runs keeps what it reserved."""
    ledger, iterating = budget.Ledger(), [False]
    at = tuple((p * MiB, p, 10 * p * MiB) for p in range(1, 5))  # (shm, fds, memory) at prefetch 1..4
    idle = ledger.reserve("source", *at[-1], by_prefetch=at, follows_prefetch=lambda: True)
    running = ledger.reserve("other", *at[-1], by_prefetch=at, follows_prefetch=lambda: not iterating[0])
    ledger.reserve("loader", 1 * MiB, 1, 5 * MiB)  # no prefetch of MindSpore's: never gives back
    returned = budget.returned_at(ledger.following(ledger.live()))
    assert returned == ((6 * MiB, 6, 60 * MiB), (4 * MiB, 4, 40 * MiB), (2 * MiB, 2, 20 * MiB))
    b = budget.compute(256 * MiB, 1, 1000, 10, *ledger.totals()[:2], memory_left=500 * MiB,
                       reserved_memory=ledger.totals()[2], returned=returned)
    assert b.at_prefetch(2).memory_bytes == b.memory_bytes + 40 * MiB
    assert b.at_prefetch(2).shm_bytes == b.shm_bytes + 4 * MiB and b.at_prefetch(2).fds == b.fds + 4
    assert "given back at prefetch 2" in b.at_prefetch(2).memory_reason
    assert b.at_prefetch(4) is b and b.at_prefetch(9) is b  # the prefetch they were planned at, or above

    iterating[0] = True
    assert budget.returned_at(ledger.following(ledger.live())) == \
        ((3 * MiB, 3, 30 * MiB), (2 * MiB, 2, 20 * MiB), (1 * MiB, 1, 10 * MiB))
    changed = ledger.lower_prefetch(2)
    assert [(before.key, after.memory) for before, after in changed] == [(idle.key, 20 * MiB)]
    kept = {r.key: r for r in ledger.live()}
    assert kept[running.key].memory == 40 * MiB and kept[idle.key].by_prefetch == at[:2]
    assert ledger.totals() == (2 * MiB + 4 * MiB + 1 * MiB, 2 + 4 + 1, 20 * MiB + 40 * MiB + 5 * MiB)


@pytest.mark.parametrize("reserved_mib, back_mib, expected_mib", [(500, 40, 0), (410, 40, 30), (300, 40, 140)])
def test_memory_given_back_at_a_lower_prefetch_first_pays_off_what_the_budget_is_short(reserved_mib, back_mib,
                                                                                     expected_mib):
    """A budget clamped at 0 is short by what the reservations exceed it: an audit's eval source was admitted
    with 128 MiB "given back" on top of a budget 273 MiB short."""
    b = budget.compute(1 << 30, 1, None, None, memory_left=500 * MiB, reserved_memory=reserved_mib * MiB,
                       fraction=0.8, returned=((0, 0, back_mib * MiB),))
    assert b.at_prefetch(1).memory_bytes == expected_mib * MiB


def test_stages_whose_iterator_is_not_made_yet_switch_to_their_leanest_settings_most_giving_first():
    """A stage built later that finds no room asks the stages before it whose iterator is not made yet to switch
    to their leanest settings (train and eval built up front in a 1000 MB container: the eval was refused beside
    the train's fastest plan, where raw ran both). A stage an iterator runs, or one whose switch fails, keeps
    its reservation."""
    ledger, iterating, switched = budget.Ledger(), [False], []
    at = tuple((0, 0, 100 * p * MiB) for p in range(1, 5))
    lean = tuple((0, 0, 10 * p * MiB) for p in range(1, 5))

    def switch(name, ok=True):
        return lambda before, after: switched.append((name, before.memory, after.memory)) or ok

    small = ledger.reserve("small", 0, 0, 200 * MiB, by_prefetch=at[:2], follows_prefetch=lambda: True,
                           lean=lean[:2], go_lean=switch("small"))
    big = ledger.reserve("big", *at[-1], by_prefetch=at, follows_prefetch=lambda: not iterating[0], lean=lean,
                         go_lean=switch("big"))
    ledger.reserve("no lean", *at[-1], by_prefetch=at, follows_prefetch=lambda: True)
    failing = ledger.reserve("failing", 0, 0, 50 * MiB, by_prefetch=at[:1], follows_prefetch=lambda: True,
                             lean=lean[:1], go_lean=switch("failing", ok=False))
    assert [r.label for r in ledger.leanable()] == ["big", "small", "failing"]
    assert big.lean_gain == 360 * MiB and big.leaned().by_prefetch == lean

    iterating[0] = True
    assert [r.label for r in ledger.leanable()] == ["small", "failing"]
    changed = ledger.go_lean(ledger.leanable())
    assert [(before.key, after.memory) for before, after in changed] == [(small.key, 20 * MiB)]
    assert switched == [("small", 200 * MiB, 20 * MiB), ("failing", 50 * MiB, 10 * MiB)]
    kept = {r.key: r for r in ledger.live()}
    assert kept[small.key].memory == 20 * MiB and kept[failing.key].memory == 50 * MiB
    assert ledger.leanable() == []  # switched, or failed to: not asked again
    assert ledger.go_lean([small, failing]) == [] and len(switched) == 2


def test_many_pipelines_built_up_front_refuse_no_build_while_one_fits_beside_the_largest(caplog):
    """Each pipeline built and not iterated yet keeps its worst-case reservation (train and eval built up front
    may run at once). A search built 80 up front and ran them one after another: from the 47th on, raw built and
    ran them where ms_shm refused ("17.6 GiB reserved by live pipelines", 21.9 GiB available). Where nothing fits
    beside all of them, the plan goes beside the largest, said once at WARNING; with one idle, it is refused."""
    import logging

    from ms_shm import api, model, plan
    from ms_shm.engines.mindspore import planning
    from ms_shm.rows import RowStats
    from ms_shm.state import SESSION
    from tests.fakes import host_facts

    def plan_with(b):
        if b.memory_bytes is not None and b.memory_bytes < 1 << 30:
            raise plan.ShmBudgetError("needs 1 GiB of memory. Fix: give the container more memory")
        return planning.plan_generator(RowStats(True, 16, 8, (), (), MiB, MiB, 0.001, 1.0, 0.0),
                                       plan.Request(cpu_count=2, usable_cpus=2), b, model.profile_for("2.10.0"))

    facts = host_facts(mem_available=4 << 30)  # 3.2 GiB to plan on
    api.reset()
    try:
        for i in range(5):
            SESSION.ledger.reserve(f"GeneratorDataset(fold {i})", 0, 0, 1 << 30, follows_prefetch=lambda: True)
        with caplog.at_level(logging.INFO, logger="ms_shm"):
            p = [api._with_room(plan_with, facts) for _ in range(2)][0]  # a loop: one line builds them all
        said = [r for r in caplog.records if "built and not iterated yet" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], said
        assert "5 pipelines built and not iterated yet reserve 5.0 GiB" in said[0].getMessage()
        assert any(d.setting == "memory_overcommitted" for d in p.decisions)
        api.reset()
        for stage in ("GeneratorDataset(train)", "map", "batch"):  # one pipeline's stages: counted together
            SESSION.ledger.reserve(stage, 0, 0, 1 << 30, follows_prefetch=lambda: True, group=(1,))
        with pytest.raises(plan.ShmBudgetError):
            api._with_room(plan_with, facts)
    finally:
        api.reset()


def test_a_fix_for_both_limits_asks_for_both_with_the_open_files_limit_named():
    """An audit (64 MB /dev/shm, ``ulimit -n 256``) was told "give /dev/shm at least 66.4 MiB ...; or raise
    `ulimit -n`": either alone was refused again, and the limit had no number."""
    b = budget.compute(64 << 20, 1, 256, 40)
    both = budget.limits_fix(b, 60 << 20, 400)
    assert " and raise `ulimit -n` to at least " in both and both.startswith("give /dev/shm at least ")
    assert both.endswith(f"to at least {256 + 400 - b.fds}")
    assert budget.limits_fix(b, 1 << 20, 400) == f"raise `ulimit -n` to at least {256 + 400 - b.fds}"
    assert budget.limits_fix(b, 1 << 20, 10) == ""


def test_the_dev_shm_size_asked_for_counts_what_other_processes_held():
    """Another job held 40 MiB of a 64 MB /dev/shm: the fix named 64m, the size it already had (3 runs of 3)."""
    alone = budget.compute(24 << 20, 1, None, None)
    beside = budget.compute(24 << 20, 1, None, None, shm_others=40 << 20)
    need = 30 << 20
    assert budget.shm_to_give(beside, need) == budget.shm_to_give(alone, need) + (40 << 20)
    assert "counting 40.0 MiB other processes held in /dev/shm" in budget.shm_fix(beside, need)
    assert "--shm-size=128m" in budget.shm_fix(beside, need)


def test_more_memory_is_asked_with_a_margin():
    """Given exactly the memory asked for, a container was refused again by 0.1-0.4 MiB (2 runs of 13): memory
    left moves with the page cache between the build's reading and the next run's."""
    from ms_shm import plan

    b = budget.compute(1 << 30, 1, None, None, memory_left=500 << 20)
    short = ((700 << 20) - b.memory_bytes) / b.fraction
    text = plan.memory_fix(700 << 20, b)
    asked = float(text.split("at least ")[1].split(" MiB")[0]) * (1 << 20)
    assert short * 1.1 <= asked < short * 1.1 + (16 << 20)
    assert plan.memory_fix(100 << 20, b) == ""


def test_the_memory_fix_is_for_the_pipeline_built_so_far():
    """An audit: a map refused at 600 MB was told "32 MiB more"; at 700 MB its batch(2) of 24 MiB rows then needed
    ~500 MiB more. The size says what it counts; a DataLoader's has no later stages to speak of."""
    from ms_shm import plan

    b = budget.compute(1 << 30, 1, None, None, memory_left=500 << 20)
    assert "for the pipeline built so far, and stages added after it" in plan.memory_fix(700 << 20, b)
    assert "built so far" not in plan.memory_fix(700 << 20, b, staged=False)
