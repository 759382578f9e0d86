"""``ms_shm.plan``: fake facts in, decisions out. Pure: no MindSpore, no /dev/shm, no clock."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

from ms_shm import budget, model, plan
from ms_shm.engines.mindspore import planning, polling
from ms_shm.plan import INLINE, PIPES, PROCESSES, THREADS, Request, ShmBudgetError
from ms_shm.rows import RowStats

MiB = model.MiB
KiB = 1 << 10
GiB = 1 << 30
V210 = model.profile_for("2.10.0")


def rows(row_bytes: int, seconds: float | None = 0.02, cpu: float | None = 1.0, length: int | None = 100,
         random_access: bool = True, smallest: int | None = None) -> RowStats:
    """Probe stats as ``rows.measure_random_access`` would report them."""
    return RowStats(random_access, length, 8, (), (), row_bytes, row_bytes if smallest is None else smallest,
                    seconds, cpu, 0.0)


def room(shm_free: int | None = 4 * GiB, ranks: int = 1, nofile: int | None = 65536, open_fds: int = 10,
         reserved_shm: int = 0, reserved_fds: int = 0, memory: int | None = None) -> budget.Budget:
    return budget.compute(shm_free, ranks, nofile, open_fds, reserved_shm, reserved_fds, memory_left=memory,
                          memory_source="cgroup v1 limit 450.0 MiB" if memory else "")


def ask(**kw) -> Request:
    kw.setdefault("cpu_count", 2)
    kw.setdefault("usable_cpus", kw["cpu_count"])
    return Request(**kw)


def mode_decision(p: plan.Plan) -> plan.Decision:
    found = [d for d in p.decisions if d.setting == "mode"]
    assert len(found) == 1, p.decisions
    return found[0]


CPU_HEAVY = dict(row_bytes=256 * KiB, seconds=0.02, cpu=1.0)  # pure-Python work, 20 ms a row
TRIVIAL_BIG = dict(row_bytes=8 * MiB, seconds=0.05e-3, cpu=1.0)  # np.full of 8 MiB
IO_BOUND = dict(row_bytes=256 * KiB, seconds=0.02, cpu=0.1)  # mostly waiting

# name: (row stats, request, budget, expected mode, expected workers)
GENERATOR_CASES = {
    # processes do not fit 51.2 MiB (4 slots x 8 MiB x 2 workers is already 64 MiB); threads (~0.39 s) beat pipes
    # (~2.54 s: 2.3 ms per MiB through a pipe)
    "64m shm, 8 MiB rows, W=2 explicit": (
        rows(**TRIVIAL_BIG), ask(workers=2), room(64 * MiB), THREADS, 2),
    # 20 ms of CPU per row: threads ~2.39 s, pipes ~2.54 s (pickling 8 MiB rows costs more than the GIL does)
    "64m shm, 8 MiB CPU-heavy rows, W=2 explicit": (
        rows(8 * MiB, 0.02, 1.0), ask(workers=2), room(64 * MiB), THREADS, 2),
    "ample shm, CPU-heavy slow rows": (rows(**CPU_HEAVY), ask(), room(), PROCESSES, 2),
    "ample shm, trivial fast 8 MiB rows": (rows(**TRIVIAL_BIG), ask(), room(), INLINE, 1),
    "I/O-bound rows, multiprocessing=False": (
        rows(**IO_BOUND), ask(multiprocessing=False, cpu_count=4), room(), THREADS, 4),
    # no shared memory considered; CPU-bound rows gain nothing from threads (~2.11 s) over inline (~2.01 s)
    "unknown /dev/shm, CPU-heavy rows": (rows(**CPU_HEAVY), ask(), room(None), INLINE, 1),
    # 22 fds left: slots need 25 at least, pipes 17 (5 + 2 workers x 6); pipes ~1.22 s beat inline ~2.01 s
    "fd-starved (40), CPU-heavy rows": (
        rows(**CPU_HEAVY), ask(), room(nofile=40, open_fds=10), PIPES, 2),
    "fd-short (50), CPU-heavy rows": (rows(**CPU_HEAVY), ask(), room(nofile=50, open_fds=10), PROCESSES, 2),
    "W=8 explicit on 2 CPUs": (rows(**CPU_HEAVY), ask(workers=8), room(), PROCESSES, 2),
    "W=1, multiprocessing=False explicit": (
        rows(**CPU_HEAVY), ask(workers=1, multiprocessing=False), room(), INLINE, 1),
    "W=1, multiprocessing=True explicit (MindSpore runs W=1 in its own thread)": (
        rows(**CPU_HEAVY), ask(workers=1, multiprocessing=True), room(), INLINE, 1),
    # MindSpore's UT test_generator_19: python_multiprocessing=True, workers left out (MindSpore's default, 1: its
    # own thread), 10 rows of 0.02 ms; two worker processes made it 25-30x slower
    "multiprocessing=True, workers left out, tiny cheap rows": (
        rows(64 * KiB, 0.02e-3, 1.0, length=10), ask(multiprocessing=True), room(), INLINE, 1),
    "multiprocessing=True, workers left out, CPU-heavy rows": (
        rows(**CPU_HEAVY), ask(multiprocessing=True), room(), PROCESSES, 2),
    "multiprocessing=False, trivial 8 MiB rows": (
        rows(**TRIVIAL_BIG), ask(multiprocessing=False), room(), INLINE, 1),
    # 4 workers asked on 2 CPUs: MindSpore would refuse 4 (ValueError), so they are capped at 2 as for any source
    "iterable source": (rows(8 * MiB, random_access=False, length=None), ask(workers=4), room(), INLINE, 2),
    "untimed rows (what-if)": (RowStats.synthetic(MiB), ask(workers=2), room(), PROCESSES, 2),
    # a 450 MB container, 2 GB /dev/shm, 288 MiB left (x 80% = 230 MiB): at prefetch 16 the slots alone are
    # 288 MiB; at prefetch 3, 5 slots per worker (80 MiB) + 7 rows in flight + 2 workers' pages fit
    "450 MB container, 8 MiB CPU-heavy rows, W=2 explicit": (
        rows(8 * MiB, 0.02, 1.0), ask(workers=2), room(2 * GiB, memory=288 * MiB), PROCESSES, 2),
    # 100 MiB left: only one row at a time in this process fits (16 MiB + (1 + 4) rows)
    "100 MiB of memory left, 8 MiB rows": (
        rows(**TRIVIAL_BIG), ask(), room(2 * GiB, memory=100 * MiB), INLINE, 1),
}


def _plan(name: str) -> plan.Plan:
    stats, req, b, _, _ = GENERATOR_CASES[name]
    return planning.plan_generator(stats, req, b, V210)


@pytest.mark.parametrize("name", list(GENERATOR_CASES))
def test_generator_mode(name):
    _, _, b, mode, workers = GENERATOR_CASES[name]
    p = _plan(name)
    assert (p.mode, p.workers) == (mode, workers), p.summary()
    assert p.fits
    if b.shm_bytes is not None:
        assert p.predicted_shm <= b.shm_bytes
    if b.fds is not None:
        assert p.predicted_fds <= b.fds
    if b.memory_bytes is not None:
        assert p.predicted_shm < p.predicted_memory <= b.memory_bytes or p.mode == INLINE


def test_memory_lowers_the_prefetch_and_says_why():
    p = _plan("450 MB container, 8 MiB CPU-heavy rows, W=2 explicit")
    d = next(d for d in p.decisions if d.setting == "prefetch_size")
    assert d.value == p.prefetch < 16 and "of memory" in d.reason


def test_unknown_memory_plans_on_dev_shm_alone():
    b = room(2 * GiB)
    assert b.memory_bytes is None and "unknown" in b.memory_reason
    p = planning.plan_generator(rows(**CPU_HEAVY), ask(), b, V210)
    assert p.fits and p.predicted_memory > 0


def test_no_memory_for_any_transport_names_the_container_limit():
    b = room(2 * GiB, memory=20 * MiB)
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_generator(rows(**TRIVIAL_BIG), ask(), b, V210)
    text = str(err.value)
    assert "of memory" in text and "cgroup v1 limit 450.0 MiB" in text and "docker run --memory" in text


def test_where_memory_binds_the_source_leaves_a_map_after_it_room():
    """The source is planned first: the fastest plan up to the whole memory budget left the map after it nothing
    (an audit's generator + map of 8 MiB rows in a 600 MB container, refused 6 runs of 6). It now keeps the least
    a map of its rows holds, and says so; the map then fits in what is left."""
    b = room(4 * GiB, memory=int(350 * MiB / 0.8))
    source = planning.plan_generator(rows(8 * MiB, seconds=0.002), ask(workers=2), b, V210)
    kept = next(d for d in source.decisions if d.setting == "memory_kept_for_next_stage")
    assert kept.value == planning.next_stage_memory(8 * MiB) and "left for a stage after this one" in kept.reason
    left = replace(b, memory_bytes=b.memory_bytes - source.predicted_memory)
    after = planning.plan_map(8 * MiB, 8 * MiB, 0.002, 1.0, 100, ask(), left, V210)
    assert source.predicted_memory + after.predicted_memory <= b.memory_bytes
    roomy = planning.plan_generator(rows(8 * MiB, seconds=0.002), ask(workers=2), room(4 * GiB), V210)
    assert all(d.setting != "memory_kept_for_next_stage" for d in roomy.decisions)  # nothing binds: no change


def test_unchanged_codes_explicit_workers_give_way_where_they_leave_the_next_stage_no_memory():
    """An audit's script under ``ms-shm run`` in a 600 MB container: its source's explicit 2 workers fitted only by
    taking the memory a map after it needs (the reserve cannot be kept for them), and the map was refused 3 runs of
    3; without the explicit workers the same script fitted. As preferences they now give way to the plan that
    keeps the room; as orders, or where rows depend on the worker (``locked``), they stay."""
    from ms_shm import api
    from ms_shm.plan import unasked

    b, stats = room(4 * GiB, memory=int(400 * MiB / 0.8)), rows(16 * MiB, seconds=0.002)
    plan_for = functools.partial(planning.plan_generator, stats, budget=b, profile=V210)
    preference = ask(workers=2, explicit="preference")
    kept = plan_for(preference)
    assert (kept.mode, kept.workers) == (PROCESSES, 2) and api._left_no_room(kept), kept.decisions
    assert not api._left_no_room(plan_for(unasked(preference)))
    adapted = api._fit(plan_for, preference, locked=False)
    assert (adapted.mode, adapted.workers) == (INLINE, 1) and api._adapted(adapted), adapted
    assert "kept for a stage after this one" in adapted.decisions[0].reason
    assert api._fit(plan_for, preference, locked=True) == kept
    assert api._fit(plan_for, ask(workers=2), locked=False) == kept  # an order: build_dataset's own call


def test_a_map_of_cpp_transforms_alone_starts_no_pool_so_processes_cost_what_threads_cost():
    """MindSpore starts a Python pool only for an operation still callable once its C++ transforms are parsed:
    2.0 priced RandomCrop + RandomHorizontalFlip with python_multiprocessing=True at 6 x 16 MiB slots per worker,
    and refused them under 64 MB, where raw ran (an audit)."""
    v20, b = model.profile_for("2.0.0"), room(64 * MiB)
    asked = ask(workers=2, multiprocessing=True)
    pooled = planning.plan_map(3 * MiB, 3 * MiB, 0.002, 1.0, 40, asked, b, v20)  # slots below the rows: pipes
    assert pooled.max_rowsize < 3 and pooled.predicted_shm > 0
    p = planning.plan_map(3 * MiB, 3 * MiB, 0.002, 1.0, 40, asked, b, v20, python_pool=False)
    assert (p.mode, p.workers, p.python_multiprocessing, p.predicted_shm) == (PROCESSES, 2, True, 0)


def test_a_map_of_cpp_transforms_gets_threads_the_probes_eager_calls_cannot_show():
    """The probe's eager calls of C++ transforms hold the GIL (0% outside it on a pair); MindSpore's map threads
    run them without it (an audit's Decode + Resize + Normalize + HWC2CHW got 1 thread, 2x slower than
    MindSpore's default 2)."""
    python = planning.plan_map(600 * KiB, 600 * KiB, 0.003, 1.0, 384, ask(), room(), V210, parallel_fraction=0.0)
    assert python.workers == 1  # a Python map that holds the GIL: a second thread would only wait
    native = planning.plan_map(600 * KiB, 600 * KiB, 0.003, 1.0, 384, ask(), room(), V210, parallel_fraction=0.0,
                               python_pool=False)
    assert (native.mode, native.workers) == (THREADS, 2)
    assert "C++ transforms, which its map threads run outside the GIL" in mode_decision(native).reason
    assert native.estimated_seconds < 0.6 * python.estimated_seconds


def _source_seconds(mode: str, workers: int, per_row: float, prefetch: int, rows_: int = 600,
                    row_bytes: int = 16 * KiB) -> float:
    stats = replace(rows(row_bytes, per_row, length=rows_), parallel_fraction=0.0)
    return planning._epoch_seconds(mode, workers, stats, rows_, planning.Costs(), prefetch=prefetch)


@pytest.mark.parametrize("mode", [THREADS, PROCESSES])
def test_a_sources_workers_are_priced_no_faster_than_mindspores_polling_lets_rows_through(mode):
    """MindSpore's GeneratorDataset main process sleeps 0.1 s where the worker it takes the next row from has none
    ready: 2 workers of 0.5-2 ms rows delivered one every 2.2-3.2 ms (measured, 2.10), slower than inline."""
    floor = 600 * polling.POLL_SECONDS / (2 * (16 + 1))
    for per_row in (0.5e-3, 1e-3, 2e-3):
        assert _source_seconds(mode, 2, per_row, 16) >= floor
        assert _source_seconds(mode, 2, per_row, 16) > _source_seconds(INLINE, 1, per_row, 16)
    # rows slower than the polling lets through are priced by their work as before
    assert _source_seconds(PROCESSES, 2, 20e-3, 16) < _source_seconds(INLINE, 1, 20e-3, 16) * 0.6
    # rows made faster than the main process takes them never wait on the polling
    assert _source_seconds(mode, 2, 1e-5, 16) < 0.5 * floor
    # a map's or a batch's pool is not polled so
    stats = replace(rows(16 * KiB, 0.5e-3, length=600), parallel_fraction=0.0)
    assert planning._epoch_seconds(mode, 2, stats, 600, planning.Costs()) < floor


def test_a_lower_prefetch_makes_worker_processes_slower_not_only_smaller():
    """Each worker process holds ``max(2, min(P, 4P // W))`` indices: bench_core's 8 ms JPEG rows in 2 processes
    took 16-18 ms each at prefetch 2 and 10-11 ms at 4, against 5 ms at 16 (2.10)."""
    at = {p: _source_seconds(PROCESSES, 2, 8e-3, p, rows_=100, row_bytes=2 * MiB) / 100 for p in (2, 4, 16)}
    assert at[2] > at[4] > at[16]
    assert 0.012 < at[2] < 0.03 and 0.007 < at[4] < 0.015 and at[16] < 0.007
    assert _source_seconds(THREADS, 2, 8e-3, 2, rows_=100) == _source_seconds(THREADS, 2, 8e-3, 16, rows_=100)


def test_with_ms_shms_shorter_poll_workers_are_priced_at_their_work():
    """With the poll at 2 ms (``polling``), the audit's 2000 rows of ~0.6 ms in 2 processes took 1.2 s (5.0 raw):
    workers are worth it again, and an iterator's first row no longer waits 0.1 s."""
    shorter = planning.Costs(poll_seconds=polling.SHORTER_POLL)
    p = planning.plan_generator(rows(16 * KiB, 0.6e-3, length=2000), ask(workers=2), room(), V210, shorter)
    assert p.estimated_seconds < 1.5
    stats = replace(rows(16 * KiB, 1e-3, length=20), parallel_fraction=0.0)
    for mode in (THREADS, PROCESSES):
        raw = planning._epoch_seconds(mode, 2, stats, 20, planning.Costs(), prefetch=16)
        assert planning._epoch_seconds(mode, 2, stats, 20, shorter, prefetch=16) < raw - 0.07


def test_a_polled_epoch_pays_its_first_poll_once():
    """64 ragged rows of ~0.9 ms, up to 830 KiB, 2 explicit worker processes under 64 MB: 0.23 s in processes,
    0.33-0.43 s through pipes (measured, 2.10); the start-up figure already holds the first 0.1 s poll."""
    stats = replace(rows(830 * KiB, 0.93e-3, length=64), parallel_fraction=0.0)
    shm = planning._epoch_seconds(PROCESSES, 2, stats, 64, planning.Costs(), prefetch=16)
    pipes = planning._epoch_seconds(PIPES, 2, stats, 64, planning.Costs(), prefetch=16)
    assert shm < pipes and shm < 0.32


def test_small_cheap_rows_stay_in_mindspores_own_thread_where_it_polls_every_tenth_of_a_second():
    """An audit's 2000 rows of 16 KiB and ~0.6 ms of numpy, MindSpore's own poll: 2 worker processes 5.0-5.3 s,
    threads 5.9, inline 1.3 s; ms_shm priced the processes at 1.28 s (with ms_shm's 2 ms poll they took 1.2 s)."""
    p = planning.plan_generator(rows(16 * KiB, 0.6e-3, length=2000), ask(), room(), V210)
    assert (p.mode, p.workers) == (INLINE, 1)
    kept = planning.plan_generator(rows(16 * KiB, 0.6e-3, length=2000), ask(workers=2), room(), V210)
    assert kept.workers == 2 and kept.estimated_seconds >= 2000 * polling.POLL_SECONDS / 34


def test_a_batch_pools_slots_are_max_rowsize_times_the_batch_size():
    """MindSpore sizes a per_batch_map pool's slots at max_rowsize x batch_size: an audit's 2.0 batch of 4 with 2
    workers asked its pre-check for 768 MiB, where ms_shm priced 192 MiB and neither adapted nor refused."""
    v20, asked = model.profile_for("2.0.0"), ask(workers=2, multiprocessing=True)
    p = planning.plan_map(4 * MiB, 4 * MiB, 0.01, 1.0, 10, asked, room(4 * GiB), v20, slot_rows=4)
    assert p.predicted_shm >= 2 * 6 * 16 * 4 * MiB
    with pytest.raises(ShmBudgetError):  # 640 MB x 80%: the map's 192 MiB would fit, the batch's 768 MiB does not
        planning.plan_map(4 * MiB, 4 * MiB, 0.01, 1.0, 10, replace(asked, max_rowsize=16), room(640 * MiB), v20,
                          slot_rows=4)


@pytest.mark.parametrize("version, max_rowsize, slot_rows, expected", [
    ("2.0.0", None, 1, 1),  # 264 KiB rows x 1.5: 1 MiB slots, 2 x 6 of them
    ("2.0.0", None, 4, None),  # a batch of 4 such rows: slots of 1 MiB x 4, 48 MiB, leave no room for the next
    # iterator's pool (``_pool_held_meanwhile``)
    ("2.0.0", 16, 1, None),  # the caller's own max_rowsize: kept, and refused
    ("2.10.0", None, 1, "sysv"),  # a SysV segment per worker, sized to the row: nothing to lower
])
def test_a_dev_shm_pools_slots_are_lowered_to_the_rows_where_the_default_does_not_fit(version, max_rowsize,
                                                                                       slot_rows, expected):
    """2.0-2.6 map pools keep 6 static slots a worker in /dev/shm, 16 MiB each by default: a model zoo's map of
    ~264 KiB rows (SSD, explicit worker processes) was refused under 64 MB. A row outgrowing a smaller slot goes
    through the pool's pipe on those releases, the same row."""
    row = 264 * KiB * slot_rows
    asked = ask(workers=2, multiprocessing=True, max_rowsize=max_rowsize)
    if expected is None:
        with pytest.raises(ShmBudgetError):
            planning.plan_map(row, row, 0.016, 0.3, 32, asked, room(64 * MiB), model.profile_for(version),
                              slot_rows=slot_rows)
        return
    p = planning.plan_map(row, row, 0.016, 0.3, 32, asked, room(64 * MiB), model.profile_for(version),
                          slot_rows=slot_rows)
    assert (p.mode, p.workers) == (PROCESSES, 2)
    lowered = [d for d in p.decisions if d.setting == "max_rowsize"]
    if expected == "sysv":
        assert p.max_rowsize is None and not lowered
        return
    assert p.max_rowsize == expected and [d.value for d in lowered] == [expected], p.decisions
    assert p.predicted_shm < 2 * 6 * (expected * slot_rows + 1) * MiB


def test_dropping_explicit_settings_is_offered_only_where_it_would_fit():
    """An audit dropped num_parallel_workers=2 as the error said, and the map was refused again."""
    for memory, offered in ((60 * MiB, False), (95 * MiB, True)):  # threads x1 at prefetch 1 holds 88 MiB
        with pytest.raises(ShmBudgetError) as err:
            planning.plan_map(8 * MiB, 8 * MiB, 0.002, 1.0, 100, ask(workers=2),
                              room(4 * GiB, memory=int(memory / 0.8)), V210)
        assert ("drop the explicit num_parallel_workers=2" in str(err.value)) is offered, err.value


def test_measured_worker_pages_count_for_each_worker():
    light = replace(rows(**CPU_HEAVY), worker_bytes=MiB)
    heavy = replace(light, worker_bytes=200 * MiB)
    b = room(2 * GiB, memory=500 * MiB)
    assert planning.plan_generator(light, ask(workers=2), b, V210).mode == PROCESSES
    p = planning.plan_generator(heavy, ask(workers=2), b, V210)  # 2 x 200 MiB of worker pages > 400 MiB
    assert p.mode in (THREADS, INLINE) and p.predicted_memory <= b.memory_bytes


@pytest.mark.parametrize("name", list(GENERATOR_CASES))
def test_every_plan_explains_its_mode_and_serialises(name):
    p = _plan(name)
    d = mode_decision(p)
    assert d.value == p.mode
    assert d.reason.strip()
    text = json.dumps(p.to_dict())
    assert json.loads(text)["mode"] == p.mode
    assert p.summary().startswith("generator: mode=" + p.mode)


def test_processes_flags_match_mode():
    p = _plan("ample shm, CPU-heavy slow rows")
    assert (p.python_multiprocessing, p.shared_mem, p.max_rowsize, p.prefetch) == (True, True, None, 16)
    # facts sheet §3: Q = max(2, min(16, 64 // 2)) = 16, S = 18 slots per worker, 50 rows each > 18, so
    # 2 workers x 18 slots x 256 KiB (page-aligned) + (6*2 + 7) = 19 semaphore pages
    assert p.predicted_shm == 2 * 18 * 256 * KiB + 19 * 4096 == 9_515_008
    # the runtime guard gets this worker's share of the budget and the slots it may create:
    # int(4 GiB x 0.8) = 3,435,973,836 minus the 19 semaphore pages, halved
    assert p.guard_slots == 18
    assert p.guard_worker_bytes == (3_435_973_836 - 19 * 4096) // 2 == 1_717_948_006
    assert not any(d.setting == "prefetch_size" for d in p.decisions)


def test_pipes_never_win_a_tie_with_shared_memory():
    # Estimates 1.21 vs 1.22 s: the same bucket. Pipes would flip a deprecated global for nothing.
    p = _plan("ample shm, CPU-heavy slow rows")
    assert p.mode == PROCESSES
    assert any(c.mode == PIPES and c.fits for c in p.alternatives)


def test_a_tie_goes_to_fewer_workers():
    # Probe rows slowed by a busy machine (5.66 ms, 25% CPU) put inline (0.67 s) and processes (0.66 s) in the
    # same 0.05 s bucket: the extra processes and 288 MiB of /dev/shm would buy nothing.
    p = planning.plan_generator(rows(8 * MiB, 5.66e-3, 0.25), ask(), room(), V210)
    estimates = {c.mode: c.seconds for c in p.alternatives}
    assert abs(estimates[PROCESSES] - p.estimated_seconds) < 0.05
    assert p.mode == INLINE


def test_small_shm_big_rows_explicit_workers_keeps_workers_and_raises_nothing():
    p = _plan("64m shm, 8 MiB CPU-heavy rows, W=2 explicit")
    assert p.workers == 2
    processes = [c for c in p.alternatives if c.mode == PROCESSES]
    assert processes and not processes[0].fits and "budget" in processes[0].why_not


def test_pipes_plan_says_why_slots_were_refused():
    p = _plan("fd-starved (40), CPU-heavy rows")
    assert p.mode == PIPES, p.summary()
    d = next(d for d in p.decisions if d.setting == "shared_mem")
    assert d.value is False and "fds" in d.reason


def test_trivial_rows_stay_in_process():
    p = _plan("ample shm, trivial fast 8 MiB rows")
    assert (p.workers, p.python_multiprocessing, p.predicted_shm) == (1, False, 0)


def test_io_bound_threads_use_every_cpu():
    p = _plan("I/O-bound rows, multiprocessing=False")
    assert not p.python_multiprocessing and p.predicted_shm == 0
    assert {c.mode for c in p.alternatives} <= {THREADS, INLINE}  # never processes: the caller said no


def test_unknown_shm_is_the_safe_choice_and_says_so():
    p = _plan("unknown /dev/shm, CPU-heavy rows")
    assert p.predicted_shm == 0 and not p.python_multiprocessing
    assert "unknown" in mode_decision(p).reason
    assert p.budget.shm_bytes is None and "could not be read" in p.budget.reason


# Main-process fds of a 2-worker pool (measured, model.FD_BASE/FD_PER_WORKER): 5 + 2 x (6 + slots per worker);
# pipes carry no slots: 5 + 2 x 6 = 17. Budget: nofile - open fds - 8 of margin.
@pytest.mark.parametrize("nofile, open_fds, mode, prefetch, fds", [
    (40, 10, PIPES, 16, 17),  # 22 fds left: even 4 slots per worker (prefetch 2) need 5 + 2 x 10 = 25
    (50, 10, PROCESSES, 5, 31),  # 32 left: prefetch 5 (7 slots) needs 5 + 2 x 13 = 31, prefetch 6 needs 33
    (65536, 10, PROCESSES, 16, 53),  # prefetch 16: 18 slots, 5 + 2 x 24 = 53
])
def test_fd_starved_processes_only_where_fds_fit(nofile, open_fds, mode, prefetch, fds):
    b = room(nofile=nofile, open_fds=open_fds)
    p = planning.plan_generator(rows(**CPU_HEAVY), ask(), b, V210)
    assert (p.mode, p.prefetch, p.predicted_fds) == (mode, prefetch, fds), p.summary()
    assert p.predicted_fds <= b.fds == nofile - open_fds - 8
    lowered = [d.value for d in p.decisions if d.setting == "prefetch_size"]
    assert lowered == ([prefetch] if mode == PROCESSES and prefetch < 16 else [])


def test_fd_short_lowers_prefetch():
    p = _plan("fd-short (50), CPU-heavy rows")
    assert p.prefetch == 5


def test_workers_over_cpu_count_are_capped_with_the_reason():
    p = _plan("W=8 explicit on 2 CPUs")
    capped = [d for d in p.decisions if d.setting == "num_parallel_workers"]
    assert capped[0].value == 2 and capped[0].default == 8
    assert "refuses" in capped[0].reason and "cpu_count" in capped[0].reason


def test_iterable_source_runs_inline_without_shm():
    p = _plan("iterable source")
    assert p.predicted_shm == 0 and p.predicted_fds == 0 and p.guard_slots == 0
    assert "__getitem__" in mode_decision(p).reason


def test_untimed_rows_fall_back_to_mindspore_default_transport():
    p = _plan("untimed rows (what-if)")
    assert p.estimated_seconds is None
    assert "not timed" in mode_decision(p).reason


def test_ragged_rows_are_planned_at_one_and_a_half_times_the_largest():
    stats = rows(4 * MiB, smallest=MiB)
    assert stats.ragged
    p = planning.plan_generator(stats, ask(), room(), V210)
    assert p.row_bytes == 6 * MiB
    d = next(d for d in p.decisions if d.setting == "row_bytes")
    assert (d.value, d.default) == (6 * MiB, 4 * MiB)
    assert (p.mode, p.workers, p.prefetch) == (PROCESSES, 2, 16), p.summary()
    # predicted at 6 MiB: 2 workers x 18 slots x 6 MiB + 19 semaphore pages (facts sheet §3)
    assert p.predicted_shm == 2 * 18 * 6 * MiB + 19 * 4096 == 226_570_240


def test_uniform_rows_are_planned_as_measured():
    p = planning.plan_generator(rows(4 * MiB), ask(), room(), V210)
    assert p.row_bytes == 4 * MiB
    assert not any(d.setting == "row_bytes" for d in p.decisions)


def test_no_room_for_semaphores_with_explicit_processes_raises_with_numbers_and_fix():
    b = room(64 * KiB)  # 51.2 KiB budget; 2 workers' semaphores alone are 19 pages = 76 KiB
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_generator(rows(**CPU_HEAVY), ask(workers=2, multiprocessing=True), b, V210)
    msg = str(err.value)
    assert "python_multiprocessing=True" in msg
    assert "76.0 KiB" in msg and "51.2 KiB" in msg
    assert "Fix:" in msg and "--shm-size=" in msg


def test_explicit_processes_with_unknown_shm_raise():
    with pytest.raises(ShmBudgetError, match="unknown"):
        planning.plan_generator(rows(**CPU_HEAVY), ask(workers=2, multiprocessing=True), room(None), V210)


def test_four_ranks_share_the_host():
    b = room(320 * MiB, ranks=4)
    assert b.shm_bytes == 64 * MiB
    p = planning.plan_generator(rows(2 * MiB, 0.02, 1.0), ask(), b, V210)
    # 2 MiB rows at prefetch 16 need 72.2 MiB; 13 is the largest prefetch under 64 MiB
    assert (p.mode, p.prefetch) == (PROCESSES, 13)
    assert 4 * p.predicted_shm <= 320 * MiB * 0.8


def test_ledger_reservations_shrink_the_next_plan():
    ledger = budget.Ledger()
    ledger.reserve("train", 300 * MiB, 60)
    shm, fds, _ = ledger.totals()
    b = room(512 * MiB, reserved_shm=shm, reserved_fds=fds)
    assert b.shm_bytes == int(512 * MiB * 0.8) - 300 * MiB
    p = planning.plan_generator(rows(8 * MiB, 0.02, 1.0), ask(), b, V210)
    free_p = planning.plan_generator(rows(8 * MiB, 0.02, 1.0), ask(), room(512 * MiB), V210)
    assert (free_p.mode, free_p.prefetch) == (PROCESSES, 16)
    assert (p.mode, p.prefetch) == (PROCESSES, 4)  # 96.1 MiB of the 109.6 MiB left
    assert p.predicted_shm <= b.shm_bytes


def test_old_mindspore_gets_a_static_rowsize_larger_than_the_row():
    p = planning.plan_generator(rows(MiB, 0.02, 1.0), ask(), room(), model.profile_for("2.3.1"))
    assert p.mode == PROCESSES
    assert p.max_rowsize == 6  # 2.3's default, already larger than a 1 MiB row
    assert p.guard_worker_bytes == 0  # static slots are committed up front: nothing for the guard to track
    p = planning.plan_generator(rows(8 * MiB, 0.02, 1.0), ask(), room(), model.profile_for("2.3.1"))
    assert p.max_rowsize == 9


@pytest.mark.parametrize("version, as_asked", [
    ("2.3", 8 * 10 * (6 * MiB + 4096) + 55 * 4096),  # static 6 MiB slots, committed at launch
    ("2.10", 8 * 10 * 8 * MiB + 55 * 4096),  # dynamic slots sized to the row
])
def test_what_if_eight_ranks_eight_workers(version, as_asked):
    p = planning.what_if(8 * MiB, 8, 16, ranks=8, version=version, shm_free=64 * MiB)
    assert p.fits is False
    assert p.budget.shm_bytes == int(64 * MiB * 0.8 / 8)
    asked = [c for c in p.alternatives if c.why_not == "as asked"]
    assert len(asked) == 1 and asked[0].shm == as_asked and not asked[0].fits
    d = next(d for d in p.decisions if d.setting == "as_asked")
    assert "does NOT fit" in d.reason
    assert mode_decision(p).reason
    json.dumps(p.to_dict())


def test_what_if_that_fits():
    p = planning.what_if(MiB, 2, 16, shm_free=4 * GiB)
    assert p.fits is True and p.mode == PROCESSES


def test_what_if_weighs_the_memory_left():
    """An audit: 64 MiB rows on 2 workers were said to fit in a 500 MB container that OOM-killed them, where
    ``build_dataset`` refused the same pipeline; the what-if plans against the memory left too."""
    roomy = planning.what_if(8 * MiB, 2, 16, shm_free=4 * GiB, memory_left=16 * GiB)
    tight = planning.what_if(8 * MiB, 2, 16, shm_free=4 * GiB, memory_left=300 * MiB, memory_source="test")
    assert roomy.fits is True and tight.fits is False
    asked = next(d for d in tight.decisions if d.setting == "as_asked")
    assert "of memory vs 240.0 MiB left: does NOT fit" in asked.reason
    assert tight.predicted_memory <= tight.budget.memory_bytes  # what ms_shm would build instead fits it


def test_what_if_with_a_full_dev_shm_answers_instead_of_raising():
    p = planning.what_if(8 * MiB, 2, 16, shm_free=0)
    assert p.fits is False
    assert p.mode == THREADS and p.predicted_shm == 0  # what ms_shm would build instead
    json.dumps(p.to_dict())


# map: (in, out, seconds, cpu, rows, request, budget, shmmax, memory left, expected mode)
MAP_CASES = {
    "fast ops": (MiB, MiB, 0.1e-3, 1.0, 1000, ask(), room(), None, None, THREADS),
    "slow CPU-bound ops, many rows": (MiB, MiB, 0.02, 1.0, 1000, ask(), room(), None, None, PROCESSES),
    "slow ops, segment > shmmax": (MiB, 8 * MiB, 0.02, 1.0, 1000, ask(), room(), 4 * MiB, None, THREADS),
    # at prefetch 16 processes need 16 MiB + (16 + 4 x 2 + 4) rows of 8 MiB + 2 segments + 2 workers' 32 MiB:
    # 320 MiB > 240 MiB left; at prefetch 5 they fit, and are faster than threads
    "slow ops, little memory": (MiB, 8 * MiB, 0.02, 1.0, 1000, ask(), room(), None, 300 * MiB, PROCESSES),
    "slow ops, no memory for workers": (MiB, 8 * MiB, 0.02, 1.0, 1000, ask(multiprocessing=False), room(), None,
                                        300 * MiB, THREADS),
    # not timed: no estimate to compare, so the plan takes processes (first in the planner's untimed order): they fit
    "untimed ops": (MiB, MiB, None, None, None, ask(), room(), None, None, PROCESSES),
    "slow ops, unknown /dev/shm": (MiB, MiB, 0.02, 1.0, 1000, ask(), room(None), None, None, THREADS),
}


def _map_plan(name: str) -> plan.Plan:
    i, o, t, cpu, n, req, b, shmmax, mem, _ = MAP_CASES[name]
    b = b if mem is None else replace(b, memory_bytes=int(mem * b.fraction))
    return planning.plan_map(i, o, t, cpu, n, req, b, V210, shmmax=shmmax)


@pytest.mark.parametrize("name", list(MAP_CASES))
def test_map_mode(name):
    p = _map_plan(name)
    assert p.kind == "map"
    assert p.mode == MAP_CASES[name][-1], p.summary()
    d = mode_decision(p)
    assert d.value == p.mode and d.reason.strip()
    json.dumps(p.to_dict())


def test_map_lowers_prefetch_where_memory_is_short():
    p = _map_plan("slow ops, little memory")
    assert p.prefetch < 16 and p.predicted_memory <= p.budget.memory_bytes
    d = next(d for d in p.decisions if d.setting == "prefetch_size")
    assert d.value == p.prefetch and "of memory" in d.reason


def test_map_memory_nothing_fits_names_both_numbers_and_the_fix():
    i, o, t, cpu, n, _, b, *_ = MAP_CASES["slow ops, little memory"]
    b = replace(b, memory_bytes=64 * MiB, memory_reason="cgroup v1 limit 450.0 MiB")
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_map(i, o, t, cpu, n, ask(), b, V210)
    text = str(err.value)
    assert "of memory against 64.0 MiB left" in text and "--memory" in text
    assert "resources.limits.memory" in text


def test_map_processes_predict_sysv_not_dev_shm():
    p = _map_plan("slow CPU-bound ops, many rows")
    assert p.workers == 2 and p.python_multiprocessing
    # facts sheet §2: one SysV segment per worker, the largest row plus up to 270 B, in whole pages
    assert p.predicted_sysv == 2 * (MiB + 4096) == 2_105_344
    assert p.predicted_shm == 17 * 4096  # a map pool's semaphores: 68 KiB measured (§3)


def test_map_shmmax_is_named():
    p = _map_plan("slow ops, segment > shmmax")
    refused = [c for c in p.alternatives if c.mode == PROCESSES]
    assert refused and all("shmmax" in c.why_not for c in refused)


def test_map_unknown_shm_says_so():
    assert "unknown" in mode_decision(_map_plan("slow ops, unknown /dev/shm")).reason


def test_map_explicit_processes_that_cannot_fit_raise():
    with pytest.raises(ShmBudgetError, match="shmmax"):
        planning.plan_map(MiB, 8 * MiB, 0.02, 1.0, 1000, ask(multiprocessing=True), room(), V210, shmmax=MiB)


def test_costs_are_positive_and_pipes_cost_more_per_mib():
    c = planning.Costs()
    for mode in plan.MODES:
        assert c.row(mode, MiB) > 0 and c.start(mode) >= 0
    assert c.row(PIPES, 8 * MiB) > c.row(PROCESSES, 8 * MiB)


def test_worker_cap_is_one_decision():
    """W=8 on 2 CPUs: one decision says why (MindSpore's cap), not a second "capped" line for the same change."""
    p = _plan("W=8 explicit on 2 CPUs")
    found = [d for d in p.decisions if d.setting == "num_parallel_workers"]
    assert len(found) == 1 and found[0].value == 2 and found[0].default == 8 and "cpu_count" in found[0].reason


# The measured share of a row's CPU work that runs outside the GIL (two probe rows read at once) decides
# between threads and processes: (row bytes, parallel fraction, CPU share, expected mode) for rows of 40 ms.
PARALLEL_CASES = {
    "GIL-bound (pure Python)": (8 * MiB, 0.0, 1.0, PROCESSES),
    "GIL-releasing (numpy RNG, Pillow decode)": (8 * MiB, 1.0, 1.0, THREADS),
    # waiting overlaps in threads and processes alike; threads need no /dev/shm and start faster
    "I/O-bound (waiting)": (256 * KiB, None, 0.05, THREADS),
}


@pytest.mark.parametrize("name", list(PARALLEL_CASES))
def test_measured_parallel_fraction_flips_threads_and_processes(name):
    size, free, cpu, expected = PARALLEL_CASES[name]
    stats = replace(rows(size, 0.04, cpu), parallel_fraction=free)
    p = planning.plan_generator(stats, ask(), room(), V210)
    assert p.mode == expected, p.summary()
    reason = mode_decision(p).reason
    assert ("outside the GIL" in reason) and (("not measured" in reason) == (free is None))


def test_unmeasured_parallel_fraction_takes_threads_as_serial():
    measured = planning.plan_generator(replace(rows(8 * MiB, 0.04, 1.0), parallel_fraction=1.0), ask(), room(), V210)
    unknown = planning.plan_generator(rows(8 * MiB, 0.04, 1.0), ask(), room(), V210)
    assert measured.mode == THREADS and unknown.mode == PROCESSES


@pytest.mark.parametrize("busy, expected", [(None, THREADS), (1.0, THREADS), (1.8, INLINE)])
def test_rows_whose_library_keeps_its_own_pool_busy_stay_in_one_thread(busy, expected):
    """OpenBLAS's ``matmul`` rows: 8.6 ms each, 100% CPU and 60-74% outside the GIL, but 1.8 CPUs busy while read
    alone. Measured, 100 rows: one MindSpore thread 0.50 s an epoch, two 0.74 s (both calls queue on one pool),
    which ms_shm chose before it read the process's CPU."""
    stats = replace(rows(int(1.4 * MiB), 0.0086, 1.0), parallel_fraction=0.6, cores_busy=busy)
    p = planning.plan_generator(stats, ask(), room(), V210)
    assert p.mode == expected, p.summary()
    assert ("own thread pool" in mode_decision(p).reason) is (expected == INLINE)


def test_a_pooled_row_s_wait_for_its_pool_does_not_overlap_under_threads():
    """On a busy machine the reading thread waited for its pool (69% CPU, 1.0 CPUs busy: a map's ``matmul``): that
    wait is the pool's work, not I/O, and a second thread did not make it overlap (chosen, it ran 1.75 s against
    one thread's 1.13-1.74 s)."""
    stats = replace(rows(int(1.4 * MiB), 0.0086, 0.69), parallel_fraction=0.8, cores_busy=1.0)
    one, two = (planning._epoch_seconds(THREADS, w, stats, 100, planning.Costs(), cpus=2) for w in (1, 2))
    assert two >= one


@pytest.mark.parametrize("rows_per_epoch, expected", [(50, THREADS), (None, PROCESSES), (1000, PROCESSES),
                                                     (0, THREADS)])
def test_a_map_over_rows_of_unknown_count_is_priced_as_a_long_epoch_and_says_so(rows_per_epoch, expected):
    """A 20 ms GIL-bound map: threads win a 50-row epoch (the pool's ~1.2 s fixed cost is most of it), processes a
    long one. A stream's rows cannot be counted: priced at 100, 1 build in 3 chose threads for 200 rows (5.4 s
    against 4.4-4.9 s); a wrong pool costs its fixed cost once, a wrong transport every row of every epoch. None
    is not zero: a ``per_batch_map`` over 12 rows in batches of 99 with ``drop_remainder`` has no batch, and
    priced as unknown it got two worker processes (0.01 s raw, 1.2-1.3 s under ``patch()``)."""
    p = planning.plan_map(64 * KiB, 64 * KiB, 0.02, 1.0, rows_per_epoch, ask(), room(), V210, parallel_fraction=0.05)
    assert p.mode == expected, p.summary()
    assert ("rows per epoch are unknown" in mode_decision(p).reason) is (rows_per_epoch is None)


def test_map_operations_whose_library_keeps_its_own_pool_busy_run_on_one_thread():
    p = planning.plan_map(MiB, MiB, 0.0086, 1.0, 100, ask(), room(), V210, parallel_fraction=0.6, cores_busy=1.8)
    assert (p.mode, p.workers) == (THREADS, 1), p.summary()


def test_close_estimates_keep_mindsporeS_own_choice_and_say_so():
    # explicit 2 workers: MindSpore's own choice is processes; threads measured a little faster
    stats = replace(rows(MiB, 0.02, 1.0), parallel_fraction=0.45)
    p = planning.plan_generator(stats, ask(workers=2), room(), V210)
    assert p.mode == PROCESSES, p.summary()
    assert "within the estimate's error" in mode_decision(p).reason


@pytest.mark.parametrize("free, expected", [(0.0, PROCESSES), (1.0, THREADS)])
def test_map_operations_parallel_fraction(free, expected):
    p = planning.plan_map(MiB, 8 * MiB, 0.04, 1.0, 1000, ask(), room(), V210, parallel_fraction=free)
    assert p.mode == expected, p.summary()


@pytest.mark.parametrize("build", [
    lambda req: planning.plan_iterable(req, room(), V210),
    lambda req: planning.plan_unmeasured(req, room(), V210, "the source holds an open file"),
    lambda req: planning.plan_generator(rows(**CPU_HEAVY), req, room(), V210),
])
def test_more_workers_than_cpus_are_capped_by_every_planner_with_one_decision(build):
    """MindSpore refuses ``num_parallel_workers`` above ``os.cpu_count()``: every planner caps it there and says
    so once, whether the source is measured, unmeasured or an iterable (the iterable one kept 4 and MindSpore
    raised ValueError under ``patch()``)."""
    p = build(ask(workers=4, cpu_count=2))
    capped = [d for d in p.decisions if d.setting == "num_parallel_workers" and "os.cpu_count()" in d.reason]
    assert p.workers <= 2 and len(capped) == 1 and (capped[0].value, capped[0].default) == (2, 4)
    assert not any(d.setting == "num_parallel_workers" for d in build(ask(workers=2, cpu_count=2)).decisions
                   if "os.cpu_count()" in d.reason)


def test_an_iterable_source_is_read_inline_by_mindspore_itself_not_adapted():
    """The inline mode of an iterable source is MindSpore's own (not a change ms_shm makes): its decision's value
    and default agree, so ``patch()`` logs no "adapted" warning for it."""
    for req in (ask(), ask(workers=2, multiprocessing=True)):
        decision = mode_decision(planning.plan_iterable(req, room(), V210))
        assert decision.value == decision.default == INLINE


def test_the_global_shared_mem_change_gives_the_plans_own_reason():
    # A pipes plan chosen because slots are not faster must not log that they "would not fit".
    from types import SimpleNamespace

    from ms_shm import api
    from ms_shm.changes import Change

    p = _plan("fd-starved (40), CPU-heavy rows")
    made = []

    class Engine:
        def apply_setting(self, setting, value, reason):
            made.append(Change(setting, True, value, reason))
            return made[-1]

        def undo(self, changes):
            pass

    config = SimpleNamespace(prefetch_size=0, shared_mem=True)
    try:
        api._apply_globals(p, config, Engine(), quiet=True)
    finally:
        api.SESSION.restore(made)  # Engine.undo: nothing to put back
    reason = next(d.reason for d in p.decisions if d.setting == "shared_mem")
    assert [c.setting for c in made] == ["shared_mem"]
    assert made[0].reason.startswith(reason) and "later in this process" in made[0].reason


@pytest.mark.parametrize("length, kwargs, rows", [
    (60, {"num_shards": 2, "num_samples": 24}, 24),  # the shard (30 rows) first, then num_samples
    (60, {"num_shards": 2, "num_samples": 40}, 30),
    (61, {"num_shards": 2}, 31),
    (61, {"num_shards": 4, "num_samples": 10}, 10),
    (7, {"num_shards": 4}, 2),
    (60, {"num_samples": 24}, 24),
    (60, {}, 60),
])
def test_rows_per_epoch_shards_before_num_samples_as_mindspore_does(length, kwargs, rows):
    """MindSpore 2.10's get_dataset_size() for these GeneratorDataset arguments (measured): planning for fewer
    rows than a worker reads under-counts its shared-memory slots, and the guard then stops a run that fits."""
    from ms_shm import api

    assert api._rows_per_epoch(kwargs, length) == rows


def test_shared_memory_the_program_switched_off_is_planned_as_pipes_without_a_change():
    """``ds.config.set_enable_shared_mem(False)`` in the program: MindSpore's worker processes use pipes, so
    /dev/shm bounds nothing and neither the transport nor the prefetch is changed for it."""
    p = planning.plan_generator(rows(8 * MiB, 0.02, 1.0), ask(workers=2, multiprocessing=True, shared_mem=False),
                                room(shm_free=64 * MiB), V210)
    assert p.mode == PIPES and p.prefetch == 16 and p.predicted_shm < MiB, p.summary()  # semaphores only
    assert not [d for d in p.decisions if d.setting in ("shared_mem", "prefetch_size")], p.decisions
    assert mode_decision(p).value == mode_decision(p).default == PIPES


@pytest.mark.parametrize("memory_mib, batches, expected", [
    (8192, None, 16),   # room: MindSpore's prefetch kept (33.5 batches of 4 x 8 MiB less the source's 20 rows)
    (450, None, 4),     # 15.5 batches at prefetch 4: 432 MiB
    (100, None, None),  # not even prefetch 1 (39 rows): the warning's case
    (300, 12, 16),      # a 12-batch epoch holds at most 14 batches at any prefetch: 288 MiB at 16
])
def test_a_plain_batch_lowers_prefetch_to_the_largest_that_fits(memory_mib, batches, expected):
    assert planning.plain_batch_prefetch(8 * MiB, 4, 16, batches, replace(room(), memory_bytes=memory_mib * MiB)) \
        == expected


def test_a_stage_that_lowers_the_global_prefetch_counts_what_the_stages_below_it_give_back_there():
    """The stages below a ``per_batch_map`` batch, planned at prefetch 16 and not yet iterated, run at the
    prefetch the batch lowers it to: the batch fits where they give memory back (an audit: refused in a 700 MB
    container, 3 runs of 3, where the pipeline runs). Each plan also says what it holds at every lower prefetch."""
    row = 12 * MiB
    tight = replace(room(memory=300 * MiB), memory_bytes=8 * MiB)
    with pytest.raises(ShmBudgetError):
        planning.plan_map(row, row, 0.02, 1.0, 10, ask(workers=2, multiprocessing=True), tight, V210)
    given_back = tuple((0, 0, max(0, 16 - p) * 30 * MiB) for p in range(1, 16))
    p = planning.plan_map(row, row, 0.02, 1.0, 10, ask(workers=2, multiprocessing=True),
                          replace(tight, returned=given_back), V210)
    assert p.prefetch < 16 and p.predicted_memory <= p.budget.memory_bytes, p.summary()
    assert "given back at prefetch" in p.budget.memory_reason
    assert len(p.by_prefetch) == p.prefetch and p.by_prefetch[-1][2] == p.predicted_memory
    assert [m for _, _, m in p.by_prefetch] == sorted(m for _, _, m in p.by_prefetch)

    source = planning.plan_generator(rows(3 * MiB, 0.003, 1.0), ask(workers=2, multiprocessing=True),
                                     room(memory=2000 * MiB), V210)
    assert len(source.by_prefetch) == source.prefetch == 16
    assert source.by_prefetch[-1] == (source.predicted_shm, source.predicted_fds, source.predicted_memory)
    assert source.by_prefetch[0][2] < source.predicted_memory


def test_a_source_in_worker_threads_or_processes_can_lean_back_to_mindspores_own_thread():
    """Its leanest settings (``Plan.lean``): what a stage built later may ask of it before its iterator is made.
    A source's fastest plan in 2 threads holds their queues (34 rows of 8 MiB at any prefetch); in MindSpore's own
    thread it holds the prefetch's rows. None where the call fixed its workers, or the plan already is the
    leanest."""
    stats = rows(8 * MiB, seconds=0.03, cpu=1.0)
    fast = planning.plan_generator(replace(stats, parallel_fraction=1.0), ask(multiprocessing=False), room(), V210)
    assert (fast.mode, fast.workers) == (THREADS, 2)
    lean = fast.lean
    assert (lean.mode, lean.workers) == (INLINE, 1) and len(lean.by_prefetch) == fast.prefetch
    assert lean.by_prefetch[-1][2] < fast.predicted_memory and lean.by_prefetch[-1][:2] == (0, 0)
    assert lean.seconds > fast.estimated_seconds
    fixed = planning.plan_generator(replace(stats, parallel_fraction=1.0), ask(workers=2, multiprocessing=False),
                                    room(), V210)
    assert (fixed.mode, fixed.workers, fixed.lean) == (THREADS, 2, None)
    inline = planning.plan_generator(rows(**TRIVIAL_BIG), ask(), room(2 * GiB, memory=100 * MiB), V210)
    assert inline.mode == INLINE and inline.lean is None


def test_a_map_in_threads_can_lean_back_to_one_thread_where_its_workers_were_left_to_ms_shm():
    p = planning.plan_map(8 * MiB, 8 * MiB, 0.03, 0.2, 100, ask(), room(), V210)
    assert (p.mode, p.workers) == (THREADS, 2)
    assert (p.lean.mode, p.lean.workers) == (THREADS, 1) and p.lean.by_prefetch[-1][2] < p.predicted_memory
    assert planning.plan_map(8 * MiB, 8 * MiB, 0.03, 0.2, 100, ask(workers=2), room(), V210).lean is None


def test_rows_that_are_not_tuples_are_not_sent_through_worker_processes_unless_asked():
    """MindSpore's worker-process queue carries a row that is not a tuple (a list of columns) as one column:
    where the call leaves the transport to ms_shm, such rows are read in this process, and the plan says why."""
    stats = replace(rows(**CPU_HEAVY), rows_one_column="list")
    p = planning.plan_generator(stats, ask(), room(), V210)
    assert p.mode in (INLINE, THREADS)
    assert "rows are lists, which MindSpore's worker processes carry as one column" in mode_decision(p).reason
    assert planning.plan_generator(rows(**CPU_HEAVY), ask(), room(), V210).mode == PROCESSES
    asked = planning.plan_generator(stats, ask(workers=2, multiprocessing=True), room(), V210)
    assert asked.mode == PROCESSES  # as asked: raw MindSpore fails the same way


def test_rows_the_source_holds_cost_no_memory_in_mindspores_own_process_where_the_release_carries_them_so():
    """A list of two 300 MiB arrays in a 1300 MB container: raw MindSpore 2.10 ran at a 770 MiB peak, and ms_shm
    refused it, pricing the rows in flight as copies. 2.0.0 copies them (+900 MiB for three rows, measured)."""
    held = replace(rows(300 * MiB, seconds=0.001), length=2, held_fraction=1.0)
    tight = room(4 * GiB, memory=int(424 * MiB / 0.8))
    p = planning.plan_generator(held, ask(), tight, V210)
    assert p.fits and p.mode == INLINE and p.predicted_memory < 100 * MiB, p.summary()
    with pytest.raises(ShmBudgetError):
        planning.plan_generator(replace(held, held_fraction=0.0), ask(), tight, V210)
    with pytest.raises(ShmBudgetError):
        planning.plan_generator(held, ask(), tight, model.profile_for("2.0.0"))
    copies = [planning.model.generator_memory(mode, 300 * MiB, 2, 16, 0, None, 2, by_reference=share)
              for mode in (PROCESSES, PIPES) for share in (0.0, 1.0)]
    assert copies[0] == copies[1] and copies[2] == copies[3]  # a worker process's rows are copies


def test_dict_columns_are_priced_in_memory_as_rows_through_a_queue():
    """A dict column is pickled through each worker's queue, as rows over pipes are: 48 rows of 8 MiB images in
    a dict, 2 worker processes, grew the process tree 471-549 MiB where the plan said 80 (an audit); priced now
    at 464."""
    in_dicts = replace(rows(0, seconds=0.02), length=48, dict_bytes_max=8 * MiB)
    p = planning.plan_generator(in_dicts, ask(workers=2, multiprocessing=True), room(4 * GiB), V210)
    assert p.mode == PROCESSES and p.predicted_shm < 1 * MiB, p.summary()
    pipes_rows = planning.model.rows_in_flight(PIPES, 2, p.prefetch)
    assert p.predicted_memory >= pipes_rows * 8 * MiB, p.summary()


@pytest.mark.parametrize("start_method, kept", [("fork", False), ("spawn", True), ("forkserver", True)])
def test_mindspores_own_spawn_start_method_starts_no_process_raw_would_not(monkeypatch, start_method, kept):
    """``ds.config.set_multiprocessing_start_method("spawn")``: each worker imports the program anew (an audit:
    ``NameError`` in every worker ms_shm started for a source and a map of the script's own, where raw read them
    in its threads). Where raw starts processes itself, or the call says threads, nothing changes."""
    import multiprocessing

    from ms_shm import api

    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    req = Request(start_method=start_method, cpu_count=2, usable_cpus=2)
    new, decision = api._program_start_method_kept(req, False, True)
    assert (new.multiprocessing is False) == kept and (decision is not None) == kept, (new, decision)
    assert not kept or "set_multiprocessing_start_method" in decision.reason, decision
    assert api._program_start_method_kept(req, True, True) == (req, None)
    assert api._program_start_method_kept(replace(req, multiprocessing=False), False, True)[1] is None


def test_a_dev_shm_map_pool_leaves_room_for_the_next_iterators_pre_check():
    """2.0.0 under 64 MB, 2 MiB rows in 2 explicit worker processes: the plan filled 48.1 of 51.2 MiB, the first
    epoch ran, and the next iterator (or ``output_shapes()``) failed MindSpore's pre-check while the first pool
    held its slots (an audit, 3 runs of 3). A SysV pool (2.7+) holds no /dev/shm: nothing to leave."""
    asked, v20 = ask(workers=2, multiprocessing=True), model.profile_for("2.0.0")
    p = planning.plan_map(2 * MiB, 2 * MiB, 0.01, 1.0, 60, asked, room(64 * MiB), v20)
    assert (p.mode, p.max_rowsize) == (PROCESSES, 2) and "through the pool's pipe" in str(p.decisions), p.decisions
    with pytest.raises(ShmBudgetError, match="and again for the next iterator"):  # a batch's slots: 4 rows each
        planning.plan_map(2 * MiB, 2 * MiB, 0.01, 1.0, 60, asked, room(64 * MiB), v20, slot_rows=4)
    p = planning.plan_map(2 * MiB, 2 * MiB, 0.01, 1.0, 60, asked, room(64 * MiB), model.profile_for("2.10.0"))
    assert (p.mode, p.workers) == (PROCESSES, 2)
