"""PyTorch-style DataLoader planning (``engines/torchstyle``): fake facts in, decisions out. Pure."""

from __future__ import annotations

import collections
import types
from dataclasses import replace

import numpy as np
import pytest

from ms_shm import budget
from ms_shm.changes import NOFILE
from ms_shm.engines.mindspore_dataloader import COSTS as MS_COSTS
from ms_shm.engines.torch import COSTS as TORCH_COSTS
from ms_shm.engines.torchstyle import arithmetic as model
from ms_shm.engines.torchstyle import planning, probe
from ms_shm.engines.torchstyle.engine import LoaderProfile
from ms_shm.engines.torchstyle.planning import BatchStats, LoaderRequest, plan_loader
from ms_shm.errors import ShmBudgetError
from ms_shm.plan import Plan
from ms_shm.sandbox import Effects

MiB, GiB = 1 << 20, 1 << 30


def stats(batch_mb: float = 32, storages: int = 2, per_sample: float | None = 0.02, samples: int = 64,
          batch_size: int = 4) -> BatchStats:
    return BatchStats(int(batch_mb * MiB), storages, per_sample, samples, batch_size, 16 * MiB)


def room(shm: int | None = 4 * GiB, nofile: int | None = 65536, open_fds: int = 10) -> budget.Budget:
    return budget.compute(shm, 1, nofile, open_fds)


def ask(**kw) -> LoaderRequest:
    kw.setdefault("usable_cpus", 2)
    return LoaderRequest("torch", **kw)


def test_batches_in_flight_match_the_measured_peaks():
    # torch 2.13, 8 MiB batches: 5.0 batches at W=2 P=2, 9.0 at W=2 P=4, 3.0 at W=1 P=2 (sampled /dev/shm)
    assert [model.batches_in_flight(w, p) for w, p in ((2, 2), (2, 4), (1, 2), (0, 2))] == [5, 9, 3, 0]
    assert model.shm_peak(8 * MiB, 1, 2, 2) == 5 * 8 * MiB


@pytest.mark.parametrize("workers, start_method, persistent, held", [
    (2, "fork", False, 1),  # each epoch forks new workers while the loop holds the last epoch's last batch
    (2, "fork", True, 0),  # forked once, before any batch
    (2, "spawn", False, 0), (2, "forkserver", False, 0),  # no mapping inherited
    (0, "fork", False, 0),  # no workers, nothing in /dev/shm
])
def test_a_batch_held_while_workers_fork_is_priced_one_batch_more(workers, start_method, persistent, held):
    assert model.held_at_start(workers, start_method, persistent) == held
    # measured (torch 2.13, W=2 P=1, 16 MiB batches): 48 MiB in the first epoch, 64 MiB in the next ones
    assert model.shm_peak(16 * MiB, 1, workers, 1, held=held) == ((3 + held) * 16 * MiB if workers else 0)


def test_a_plan_that_fits_only_its_first_epoch_is_not_chosen():
    """Under 64 MB (51.2 MiB budget) 2 workers at prefetch 1 hold 48 MiB of 16 MiB batches in the first epoch, 64
    in the next: ms_shm takes fewer workers unless the workers are forked once."""
    budget_64m = room(64 * MiB)
    assert plan_loader(stats(16, 1), ask(), budget_64m).predicted_shm <= 51.2 * MiB
    assert plan_loader(stats(16, 1), ask(persistent_workers=True, min_workers=2), budget_64m).workers == 2
    with pytest.raises(ShmBudgetError):
        plan_loader(stats(16, 1), ask(workers=2, prefetch_factor=1), budget_64m)


def test_a_loop_that_reads_one_batch_ahead_is_priced_one_batch_more():
    """accelerate's and Lightning's loops hold the next batch beside the current one: an audit's Trainer with
    persistent workers at prefetch 1 under 64 MB had 4 batches of 16 MiB in use against the 3 planned, and met
    ``ShmFullError``. The persistent 2 workers no longer fit there; with one ahead counted they go through pipes
    or fewer."""
    budget_64m = room(64 * MiB)
    plain = plan_loader(stats(16, 1), ask(persistent_workers=True, min_workers=2), budget_64m)
    ahead = plan_loader(stats(16, 1), ask(persistent_workers=True, min_workers=2, read_ahead=1, pipes=True),
                        budget_64m)
    assert plain.predicted_shm == 48 * MiB and (ahead.mode, ahead.predicted_shm) == ("pipes", 0)
    assert "one batch more counted" not in str(plain.decisions)


def test_ample_shm_slow_samples_take_workers():
    p = plan_loader(stats(), ask(), room())
    # 2 storages: a page more; 5 batches in flight and the one the loop holds while the next epoch forks workers
    assert p.workers == 2 and p.prefetch == 2 and p.predicted_shm == 6 * (32 * MiB + 4096)


def test_64m_shm_nothing_with_workers_fits_so_samples_stay_in_the_main_process():
    p = plan_loader(stats(), ask(), room(64 * MiB))
    assert p.workers == 0 and p.predicted_shm == 0


def test_explicit_workers_that_cannot_fit_raise_before_any_worker_starts():
    with pytest.raises(ShmBudgetError) as err:
        plan_loader(stats(), ask(workers=2), room(64 * MiB))
    assert "num_workers=2" in str(err.value) and "--shm-size" in str(err.value)


def test_prefetch_lowered_to_fit():
    # 8 MiB batches, 2 workers: prefetch 2 needs 48 MiB, prefetch 1 needs 32 MiB (and a page per extra storage),
    # budget 35.2 MiB
    p = plan_loader(stats(8), ask(workers=2), room(44 * MiB))
    assert (p.workers, p.prefetch) == (2, 1)
    assert any(d.setting == "prefetch_factor" and d.value == 1 for d in p.decisions)


def test_many_storages_over_the_fd_limit_switch_torch_to_file_system():
    # 512 storages per batch (a collate_fn that keeps 64 samples x 8 tensors apart), soft = hard = 256
    s = stats(1, storages=512)
    p = plan_loader(s, ask(workers=2, can_switch_strategy=True, nofile_soft=256, nofile_hard=256),
                    room(nofile=256))
    d = {d.setting: d for d in p.decisions}
    assert d["sharing_strategy"].value == model.FILE_SYSTEM and "ms-shm clean" in d["sharing_strategy"].reason


def test_many_storages_raise_the_soft_limit_where_the_hard_one_allows():
    p = plan_loader(stats(1, storages=512), ask(workers=2, can_switch_strategy=True, nofile_soft=256,
                                                nofile_hard=1 << 20), room(nofile=256))
    d = {d.setting: d for d in p.decisions}
    assert NOFILE in d and d[NOFILE].value > 256 and "sharing_strategy" not in d


@pytest.mark.parametrize("samples, strategy, soft, hard, raised", [
    (35, model.FILE_DESCRIPTOR, 64, 20000, True),  # torch's test_chain_iterable_style_dataset: 35 batches kept
    (None, model.FILE_DESCRIPTOR, 64, 20000, True),  # an epoch of unknown length: KEPT_BATCHES_UNKNOWN batches
    (35, model.FILE_SYSTEM, 64, 20000, False),  # storages named in /dev/shm: a kept batch holds no fd
    (35, model.FILE_DESCRIPTOR, 64, 64, False),  # nothing to raise it to (tune() picks file_system there)
    (35, model.FILE_DESCRIPTOR, 1024, 1 << 20, False),  # the batches of an epoch fit under the soft limit
    (4000, model.FILE_DESCRIPTOR, 1024, 1 << 20, True),  # they do not
])
def test_an_epochs_kept_batches_raise_the_soft_limit_under_file_descriptor(samples, strategy, soft, hard, raised):
    """Every batch the program keeps (``list(loader)``) holds its storages' fds under file_descriptor: an audit's
    35 kept batches of one worker under ``ulimit -Sn 64`` failed with "Too many open files", planned on the 14
    fds in flight only."""
    s = replace(stats(0.001, storages=1, samples=35, batch_size=1), samples=samples)
    p = plan_loader(s, ask(workers=1, strategy=strategy, nofile_soft=soft, nofile_hard=hard), room(nofile=soft, open_fds=30))
    d = {d.setting: d for d in p.decisions}
    assert (NOFILE in d) is raised
    if raised:
        assert d[NOFILE].value == min(hard, 65536) and "keep" in d[NOFILE].reason and d[NOFILE].default == soft


def test_mindspore_dataloader_cannot_switch_strategy_so_explicit_workers_raise():
    with pytest.raises(ShmBudgetError):
        plan_loader(stats(1, storages=512), ask(workers=2, nofile_soft=256, nofile_hard=256), room(nofile=256))


def test_workers_locked_keep_the_default():
    p = plan_loader(stats(), ask(workers_locked="an iterable dataset"), room())
    assert p.workers == 0 and "iterable" in p.decisions[0].reason


def test_untimed_batches_take_the_fewest_workers():
    p = plan_loader(stats(per_sample=None), ask(), room())
    assert p.workers == 0


# bench_dataloader's workload as the probe sees it: 64 samples of ~8 ms numpy work (~16 ms in the probe's fork,
# collate included), batches of 8 x 2 MiB float32 (16 MiB, 2 storages)
BENCH = dict(batch_mb=16, storages=2, per_sample=0.016, samples=64, batch_size=8)


@pytest.mark.parametrize("case, costs, shm, change, workers", [
    # MindSpore: 2 workers ~0.64 s (moving a batch costs 3.3 ms/MiB; starting them ~34 ms) vs the main process's
    # ~0.78 s; under 64 MB its batches in flight do not fit
    ("mindspore, 64m, idle host", MS_COSTS, 64 * MiB, {}, 0),
    ("mindspore, ample, idle host", MS_COSTS, 4 * GiB, {}, 2),
    ("mindspore, ample, 50 ms samples", MS_COSTS, 4 * GiB, {"seconds_per_sample": 0.05}, 2),
    # torch: a loop reads a 2 MiB sample 7.1 ms faster than the probe's warm reads, workers' loops as the main
    # process's: 2 workers ~0.35 s against ~0.57 (bench_dataloader: W2 1.11 s, W0 1.49 for 256 samples)
    ("torch, ample, idle host", TORCH_COSTS, 4 * GiB, {}, 2),
    ("torch, 64m", TORCH_COSTS, 64 * MiB, {}, 0),
    # ... but samples that mostly wait (I/O) cost the main process as much as a fork: workers overlap them
    ("torch, ample, samples waiting 50 ms", TORCH_COSTS, 4 * GiB,
     {"seconds_per_sample": 0.05, "cpu_seconds_per_sample": 0.005}, 2),
    ("torch, ample, waiting samples, one CPU free: waiting needs none", TORCH_COSTS, 4 * GiB,
     {"seconds_per_sample": 0.05, "cpu_seconds_per_sample": 0.005, "free_cpus": 1.0}, 2),
    ("torch, ample, waiting samples, a 0.5 s fork (a large parent)", TORCH_COSTS, 4 * GiB,
     {"seconds_per_sample": 0.05, "cpu_seconds_per_sample": 0.005, "fork_seconds": 0.5}, 0),
    ("torch, ample, 4 CPUs free: 4 workers (~0.21 s vs 3 ~0.25 s)", TORCH_COSTS, 4 * GiB, {"free_cpus": 4.0}, 4),
    # slow samples making little: a loop saves nothing on them, and the main process alone is not priced lower
    ("torch, ample, 30 ms samples of 1 KiB", TORCH_COSTS, 4 * GiB,
     {"seconds_per_sample": 0.03, "batch_bytes": 8 << 10}, 2),
    ("torch, ample, 4 CPUs usable, one free (the host busy)", TORCH_COSTS, 4 * GiB, {"free_cpus": 1.0}, 0),
])
def test_workers_priced_from_the_frameworks_measured_costs(case, costs, shm, change, workers):
    from dataclasses import replace

    s = replace(stats(**BENCH), **change)
    cpus = 4 if "4 CPUs" in case else 2
    p = plan_loader(s, ask(usable_cpus=cpus), room(shm), LoaderProfile("x", None, costs=costs))
    assert p.workers == workers, (case, p.decisions[0].reason)


@pytest.mark.parametrize("framework, word", [("torch", "2 storage(s)"), ("mindspore-dataloader", "2 tensor(s)")])
def test_a_batchs_shared_memory_files_are_named_in_the_frameworks_word(framework, word):
    p = plan_loader(stats(**BENCH), LoaderRequest(framework, usable_cpus=2), room(), LoaderProfile("x", None))
    assert f"16.0 MiB in {word}" in p.decisions[0].reason, p.decisions[0].reason


def test_start_prices_the_measured_fork_per_worker_and_spawn_an_import():
    s = stats()
    assert planning.start_seconds(0, s, ask(), TORCH_COSTS) == 0
    measured = planning.BatchStats(1, 1, 0.01, 8, 1, fork_seconds=0.1)
    assert planning.start_seconds(2, measured, ask(), TORCH_COSTS) == pytest.approx(
        TORCH_COSTS.pool_seconds + 2 * (TORCH_COSTS.worker_seconds + planning.FORKS_PER_WORKER * 0.1))
    unmeasured = planning.start_seconds(1, s, ask(), TORCH_COSTS)
    assert unmeasured == pytest.approx(TORCH_COSTS.pool_seconds + TORCH_COSTS.worker_seconds
                                       + planning.FORKS_PER_WORKER * planning.FORK_START_SECONDS)


@pytest.mark.parametrize("fork, workers, measured", [
    (0.0018, 1, 0.0283), (0.0018, 2, 0.0336), (0.0018, 4, 0.0561),  # torch 2.13, a program of ~300 MB
    (0.0285, 1, 0.0887), (0.0285, 2, 0.1428), (0.0285, 4, 0.2158),  # ... holding 1 GB more: a fork of 28.5 ms
])
def test_workers_start_priced_near_what_they_cost(fork, workers, measured):
    """An epoch of 4 one-sample batches, less the same without workers (median of 5): the constants before, and
    twice the probe's fork-to-ready (~12 ms over the fork itself), priced 2 workers at 128-135 ms where they cost
    30-50, and an ImageFolder of Pillow decodes kept none, 0.34 s an epoch, where 2 ran 0.28-0.30."""
    s = planning.BatchStats(1, 1, 0.01, 8, 1, fork_seconds=fork)
    assert planning.start_seconds(workers, s, ask(), TORCH_COSTS) == pytest.approx(measured, abs=0.021)
    assert planning.start_seconds(1, s, ask(start_method="spawn"), TORCH_COSTS) > 1.0


@pytest.mark.parametrize("free, usable, expected", [(None, 2, 2), (1.2, 2, 1.2), (0.3, 2, 1), (3.9, 2, 2)])
def test_free_cpus_bound_the_usable_ones(free, usable, expected):
    s = BatchStats(1, 1, 0.01, 8, 1, free_cpus=free)
    assert planning.cpus_free(s, ask(usable_cpus=usable)) == expected


@pytest.mark.parametrize("idle, probe_cpu, window, expected", [
    (0.9, 0.09, 0.1, 1.8),  # an idle host of 2: the probe's own CPU (child and parent) is free for workers too
    (0.0, 0.05, 0.1, 0.5),  # every other CPU busy with another program: half of one, the probe's
    (None, 0.05, 0.1, None),  # /proc/stat unreadable: unknown
    (0.5, 0.05, 0.0, None),  # no window measured: unknown
])
def test_free_cpus_count_the_idle_ones_and_the_probes_own(idle, probe_cpu, window, expected):
    got = probe.free_cpus(idle, probe_cpu, window)
    assert (got is None) if expected is None else (got == pytest.approx(expected))


def test_estimates_within_the_tie_fraction_keep_the_default():
    # a 5% gain from 1 worker is not measured by a few samples: num_workers=0, the default, is kept
    costs = planning.WorkerCosts(0.0, 0.0, 0.0)
    s = BatchStats(1 << 20, 1, 0.01, 100, 10, fork_seconds=0.0, free_cpus=1.0)
    p = plan_loader(s, ask(usable_cpus=1), room(), LoaderProfile("x", None, costs=costs))
    assert p.workers == 0
    slow = BatchStats(1 << 20, 1, 0.01, 100, 10, fork_seconds=0.0, free_cpus=2.0)
    assert plan_loader(slow, ask(), room(), LoaderProfile("x", None, costs=costs)).workers == 2


@pytest.mark.parametrize("walls, expected", [
    ([(0.03, 0.03), (0.012, 0.01), (0.011, 0.011)], (0.011, 0.011)),
    ([(0.02, 0.001)], (0.02, 0.001)),
    ([(0.05, 0.04), (0.01, 0.01)], (0.01, 0.01)),
])
def test_the_cold_first_sample_is_not_the_samples_time(walls, expected):
    assert probe.sample_seconds(walls) == expected


class Sleepy:
    """8 samples, each ``[i]``: the first read sleeps ``first`` seconds, the others ``rest``; reads are counted."""

    def __init__(self, first: float, rest: float):
        self.first, self.rest, self.reads = first, rest, 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import time

        self.reads += 1
        time.sleep(self.first if self.reads == 1 else self.rest)
        return [i]


def test_probe_batch_drops_the_cold_first_sample():
    s = probe.measure_batch(Sleepy(0.08, 0.001), 4, lambda samples: samples, lambda b: (8 * len(b), 1), False)
    assert s.seconds_per_sample < 0.04 and s.batch_size == 4 and s.samples == 8
    assert s.cpu_seconds_per_sample < 0.04  # sleeping is not CPU work


@pytest.mark.parametrize("seconds, reads", [(0.001, 3 + probe.INLINE_SAMPLES), (0.02, 2)])
def test_a_slow_sample_is_read_twice_a_cheap_one_three_times_and_then_twice_as_the_main_process(seconds, reads):
    """Of 8 samples, the main process's reads cost more than ``INLINE_SHARE`` of the epoch: read only where
    cheap (under ``PROBE_SECONDS``)."""
    dataset = Sleepy(seconds, seconds)
    s = probe.measure_batch(dataset, 4, lambda samples: samples, lambda b: (8 * len(b), 1), False)
    assert dataset.reads == reads and s.batch_bytes == 32 and s.seconds_per_sample >= seconds
    assert (s.inline_seconds_per_sample is not None) == (reads > 3)


class Indexed:
    """``length`` samples; records the indices read; raises ``IndexError`` for those in ``bad``."""

    def __init__(self, length: int, bad: tuple = ()):
        self.length, self.bad, self.read = length, bad, []

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i in self.bad:
            raise IndexError(i)
        self.read.append(i)
        return [i]


def test_the_main_process_reads_are_fresh_neighbours_of_the_last_sample_read():
    """Spread over 1,000 samples the probe reads 0, 999, 500; then the main process's two from 501: a sample read
    before could be a cache's hit."""
    dataset = Indexed(1000)
    s = probe.measure_batch(dataset, 4, lambda samples: samples, lambda b: (8 * len(b), 1), False)
    assert dataset.read == [0, 999, 500, 501, 502] and s.inline_seconds_per_sample is not None


@pytest.mark.parametrize("shm, req, win", [
    (64 * MiB, ask(), False),  # 16 MiB batches: two workers' prefetch does not fit Docker's 64 MB, one never wins
    (4 * GiB, ask(), True),
    (64 * MiB, ask(usable_cpus=1), False),  # one CPU: at most one worker, which never beats none
    (64 * MiB, ask(workers=2), True),  # the workers asked: whether samples depend on who reads them still matters
    (64 * MiB, ask(min_workers=1), True),  # persistent workers kept: the same
])
def test_workers_may_win_only_where_two_of_them_fit(shm, req, win):
    assert (planning.why_no_workers(stats(batch_mb=16, per_sample=None), req, room(shm)) is None) is win


@pytest.mark.parametrize("batch_mb, per_sample, cpu, costs, none", [
    (16, 0.005, 0.005, MS_COSTS, True),  # bench_dataloader's samples, MindSpore 2.8: each batch's trip outweighs
    (16, 0.005, 0.005, TORCH_COSTS, False),  # ... torch's trip is cheap: 2 workers may win, the probe reads on
    (0.01, 0.02, 0.02, MS_COSTS, False),  # slow samples, small batches: workers win
    (0.01, 0.02, 0.0, MS_COSTS, False),  # ... waiting ones too
    (0.01, 1e-5, 1e-5, TORCH_COSTS, True),  # trivial samples: the workers' start outweighs the epoch
])
def test_workers_judged_at_their_best_once_the_first_samples_are_timed(batch_mb, per_sample, cpu, costs, none):
    """Priced with a worker's pages and fork at nothing, every CPU free and a loop's sample as slow as a warm one:
    where none still wins, nothing the probe reads later can bring workers back, so it is not read."""
    s = replace(stats(batch_mb=batch_mb, per_sample=per_sample, samples=256, batch_size=8),
                cpu_seconds_per_sample=cpu, worker_bytes=None)
    why = planning.why_no_workers(s, ask(), room(), LoaderProfile("x", None, costs=costs))
    assert (why is not None) is none, why
    assert why is None or "at their best" in why


@pytest.mark.parametrize("costs", [MS_COSTS, TORCH_COSTS])
def test_a_plan_never_chooses_workers_the_probe_ruled_out(costs):
    """What the probe measures after it asks (a worker's pages, the fork, CPUs the host leaves free, a loop's
    samples faster than the warm reads) only moves the plan further from workers: every plan made from what it
    could measure keeps none wherever ``why_no_workers`` said so."""
    profile = LoaderProfile("x", None, costs=costs)
    for batch_mb in (0.01, 1, 4, 16, 32):
        for per_sample in (1e-5, 1e-3, 0.005, 0.02):
            for cpu_share in (0.0, 1.0):
                s = replace(stats(batch_mb=batch_mb, per_sample=per_sample, samples=256, batch_size=8),
                            cpu_seconds_per_sample=cpu_share * per_sample, worker_bytes=None)
                for shm in (64 * MiB, 4 * GiB):
                    if planning.why_no_workers(s, ask(), room(shm), profile) is None:
                        continue
                    for later in (dict(worker_bytes=20 * MiB, fork_seconds=0.01, free_cpus=1.2,
                                       inline_seconds_per_sample=per_sample / 2), dict(worker_bytes=0)):
                        measured = replace(s, **later)
                        assert plan_loader(measured, ask(), room(shm), profile).workers == 0, (measured, shm)


def test_workers_may_win_prices_a_workers_unmeasured_pages_at_none():
    """The probe measures a worker's pages after it asks: priced at the 32 MiB of an unmeasured worker, 2 workers
    of 1 MiB batches did not fit a container's 60 MiB of memory left, and would have fitted at the 12 MiB measured
    after, with the first sample not read again."""
    tight = budget.compute(4 * GiB, 1, 65536, 10, memory_left=75 * MiB, memory_source="a container")
    s = replace(stats(batch_mb=1, per_sample=None), worker_bytes=None)
    assert planning.why_no_workers(s, ask(), tight) is None
    assert planning.why_no_workers(replace(s, worker_bytes=40 * MiB), ask(), tight) is not None


def test_where_workers_cannot_win_the_loops_samples_are_not_read():
    """Spread over 1,000 samples the probe reads 0, 999, 500, then stops: no plan with workers fits, so neither the
    main process's timing samples nor (``probe_loader``) the first sample again are read."""
    dataset = Indexed(1000)
    s = probe.measure_batch(dataset, 4, lambda samples: samples, lambda b: (8 * len(b), 1), False,
                            no_workers=lambda stats: None if stats.batch_bytes > 1 << 20 else "none fits")
    assert dataset.read == [0, 999, 500] and s.workers_ruled_out == "none fits" and s.inline_seconds_per_sample is None
    assert s.seconds_per_sample is not None and s.batch_bytes == 32
    why = plan_loader(s, ask(), room()).decisions[0].reason
    assert "none fits: the samples a loop's timing needs and the first read again were not read" in why, why


def test_the_main_process_reads_wrap_round_and_skip_what_was_read():
    dataset = Indexed(4)
    probe.measure_batch(dataset, 2, lambda samples: samples, lambda b: (8 * len(b), 1), False,
                        sampler=[3, 0, 1, 2])
    assert dataset.read == [3, 0, 1, 2]  # the sampler's first two, then 1 and 2 (0 and 3 read)
    assert probe.inline_seconds(Indexed(2), lambda d, i: d[i], [0, 1], 0.001, 2) is None  # nothing fresh


def test_the_main_process_reads_are_the_callers_samplers_next_indices():
    """Its sampler gives 5, 17, then 42 and 7: those are read, not 18, which the loop never reads (an audit's
    dataset exited, aborted or hung there)."""
    dataset = Indexed(100, bad=tuple(i for i in range(100) if i not in (5, 17, 42, 7)))
    s = probe.measure_batch(dataset, 2, lambda samples: samples, lambda b: (8 * len(b), 1), False,
                            sampler=[5, 17, 42, 7])
    assert dataset.read == [5, 17, 42, 7] and s.inline_seconds_per_sample is not None
    batches = Indexed(100)
    probe.measure_batch(batches, None, lambda samples: samples, lambda b: (8 * len(b), 1), False,
                        batch_sampler=[[9, 8], [9, 30], [31]])
    assert batches.read == [9, 8, 30, 31]  # the rest of the batches, 9 read already


class ColdShards(Indexed):
    """The first read of each shard of 100 samples takes ``cold`` seconds more."""

    def __init__(self, length: int, cold: float):
        super().__init__(length)
        self.cold, self.opened = cold, set()

    def __getitem__(self, i):
        import time

        if i // 100 not in self.opened:
            self.opened.add(i // 100)
            time.sleep(self.cold)
        return super().__getitem__(i)


def test_a_fresh_read_that_runs_cold_ends_the_main_process_reads():
    dataset = ColdShards(1000, 0.2)
    dataset.opened.update({0})
    assert probe.inline_seconds(dataset, lambda d, i: d[i], [98, 99], 0.001, 1000) is None
    assert dataset.read == [100]  # not 101 too


@pytest.mark.parametrize("warm, epoch, reads", [(0.001, 8, 2), (0.02, 8, 0), (0.02, 1000, 2), (0.06, 1000, 0)])
def test_the_main_process_reads_cost_at_most_a_share_of_the_epoch_and_a_tenth_of_a_second(warm, epoch, reads):
    dataset = Indexed(1000)
    probe.inline_seconds(dataset, lambda d, i: d[i], [0], warm, epoch)
    assert len(dataset.read) == reads


@pytest.mark.parametrize("singles, paired, size, share", [
    ([5e-5, 3e-5], 3.2e-5, 256, 3e-5 / 256 + 2e-6 * 255 / 256),  # a call's cost, nearly nothing per sample
    ([1e-3, 5e-4], 1e-3, 8, 5e-4),  # stacking 2 MiB samples: all of it per sample
    ([4e-4], None, 8, 4e-4),  # not batched: a call per sample
    ([1e-3, 1e-4], 5e-3, 4, 1e-4),  # a pair slower than two alone: no more than one alone
])
def test_a_samples_share_of_a_batchs_collate(singles, paired, size, share):
    assert probe.collate_share(singles, paired, size) == pytest.approx(share)


@pytest.mark.parametrize("dataset, seen", [(Indexed(10, bad=(4,)), [2, 3]), ({"a": 1, "b": 2, "c": 3}, ["a"])])
def test_a_main_process_read_that_fails_or_has_no_neighbour_measures_nothing(dataset, seen):
    assert probe.inline_seconds(dataset, lambda d, i: d[i], seen, 0.001, 10) is None


def test_the_main_process_time_read_prices_no_workers_in_place_of_the_engines_saving():
    costs = planning.WorkerCosts(0.0, 0.0, 0.0, saved_per_mib=0.05)
    read = BatchStats(1 << 20, 1, 0.01, 100, 10, inline_seconds_per_sample=0.008)
    assert planning._seconds(read, 0, ask(), costs) == pytest.approx(0.8)
    reasons = " ".join(d.reason for d in plan_loader(read, ask(), room()).decisions)
    assert "10.00 ms per sample (8.00 once warm, as a loop reads them)" in reasons


def test_workers_are_priced_at_the_samples_steady_time_not_the_probes_warm_reads():
    costs = planning.WorkerCosts(0.0, 0.0, 0.0)
    warm = BatchStats(1 << 20, 1, 0.01, 100, 10, cpu_seconds_per_sample=0.01, free_cpus=2.0)
    steady = replace(warm, inline_seconds_per_sample=0.006)
    saved = 100 * (0.01 - 0.006) / 2  # 100 samples over 2 workers
    assert planning._seconds(steady, 2, ask(), costs) == pytest.approx(planning._seconds(warm, 2, ask(), costs) - saved)
    assert planning.steady_sample(steady) == pytest.approx((0.006, 0.006))
    waits = replace(steady, cpu_seconds_per_sample=0.005)  # half of it waiting: half of the steady time too
    assert planning.steady_sample(waits) == pytest.approx((0.006, 0.003))
    slower = replace(warm, inline_seconds_per_sample=0.02)  # a loop's read that ran slower: the warm reads hold
    assert planning.steady_sample(slower) == (0.01, 0.01)


def test_waiting_samples_cost_the_main_process_what_they_cost_a_fork():
    costs = planning.WorkerCosts(0.0, 0.0, 0.0, saved_per_mib=0.05)  # samples of 0.1 MiB: 5 ms saved of 10
    busy = BatchStats(1 << 20, 1, 0.01, 100, 10)
    waiting = BatchStats(1 << 20, 1, 0.01, 100, 10, cpu_seconds_per_sample=0.0)
    assert planning._seconds(busy, 0, ask(), costs) == pytest.approx(0.5)
    assert planning._seconds(waiting, 0, ask(), costs) == pytest.approx(1.0)


def test_idle_cpus_from_two_readings():
    from ms_shm import procfs

    assert procfs.idle_cpus((100, 1000, 2), (110, 1020, 2)) == pytest.approx(1.0)
    assert procfs.idle_cpus((100, 1000, 2), (101, 1004, 2)) is None  # 4 ticks: too coarse
    assert procfs.idle_cpus(None, (1, 2, 2)) is None


def test_cpu_ticks_from_a_fake_proc_stat(tmp_path):
    from ms_shm import procfs

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").write_text("cpu  10 0 5 80 5 0 0 0 0 0\ncpu0 5 0 2 40 3 0 0 0 0 0\n"
                                            "cpu1 5 0 3 40 2 0 0 0 0 0\nintr 1\n")
    assert procfs.cpu_ticks(tmp_path) == (85, 100, 2)
    assert procfs.cpu_ticks(tmp_path / "missing") is None


def test_collate_guard_passes_batches_through_and_stops_one_that_outgrew_its_plan(monkeypatch, caplog):
    from types import SimpleNamespace

    import pytest as _pytest

    from ms_shm.engines.torchstyle import guard
    from ms_shm.engines.torchstyle.guard import GuardedCollate
    from ms_shm.errors import RowTooLargeError

    free = SimpleNamespace(free=130)  # /dev/shm now: less than it (100) and 4 others in flight at the planned 10
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: free)

    class Info:
        id = 1

    weigh = lambda batch: (sum(batch), len(batch))  # noqa: E731
    calls = []

    def collate(samples):
        calls.append(samples)
        return samples

    in_worker = GuardedCollate(collate, weigh, lambda: Info(), 10, 5, 100, "batch_size=1")
    small = [5, 5]
    assert in_worker(small) is small and calls == [small]
    with _pytest.raises(RowTooLargeError) as err:
        in_worker([50, 50])
    text = str(err.value)  # what was checked: the budget, and what is free
    assert "batch 2 of DataLoader worker 1 is 100 B (planned 10 B)" in text, text
    assert "it and the 4 other batch(es) in flight at the planned 10 B need 140 B" in text, text
    assert "over the 100 B this loader may use, and /dev/shm has only 130 B free" in text, text
    assert "Fix: give /dev/shm at least 140 B (docker run --shm-size=" in text and text.endswith("or batch_size=1")
    in_main = GuardedCollate(collate, weigh, lambda: None, 10, 5, 100, "x")
    assert in_main([50, 50]) == [50, 50]  # the main process only calls through
    free.free = 140  # room now for it beside the others: over the budget, yet it fits what is free
    with caplog.at_level("WARNING", logger="ms_shm"):
        assert in_worker([50, 50]) == [50, 50] and in_worker([50, 50]) == [50, 50]
    assert caplog.text.count("going on") == 1


@pytest.mark.parametrize("nbytes, planned, in_flight, limit, free, outcome", [
    (19 * MiB, 4 * MiB, 5, 51 * MiB, 52 * MiB, "ok"),  # the audit's ragged.py: one 16 MiB sample among 1 MiB
    (4 * MiB, 4 * MiB, 5, 20 * MiB, 20 * MiB, "ok"),  # the planned batch, exactly the budget
    (19 * MiB, 4 * MiB, 5, 34 * MiB, 36 * MiB, "over, going on"),  # 35 MiB: over the budget, /dev/shm has it
    (19 * MiB, 4 * MiB, 5, 34 * MiB, 34 * MiB, "RowTooLargeError"),  # ... and /dev/shm has not
    (3 * MiB, 1 * MiB, 1, 2 * MiB, 2 * MiB, "RowTooLargeError"),  # nothing else in flight: it alone
])
def test_a_rare_big_batch_needs_itself_and_the_others_at_their_planned_size(monkeypatch, caplog, nbytes, planned,
                                                                            in_flight, limit, free, outcome):
    """need = the batch + the planned size x the other batches in flight, one rule for the budget, the fix and
    the free space (``GuardedCollate.need``); before, every batch in flight was priced at the outlier's size."""
    from types import SimpleNamespace

    from ms_shm.engines.torchstyle import guard
    from ms_shm.errors import RowTooLargeError

    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(free=free, total=64 * MiB))
    g = guard.GuardedCollate(list, lambda b: (sum(b), 1), lambda: _Worker(), planned, in_flight, limit, "",
                             unshared=lambda b: 0)
    assert g.need(nbytes) == max(nbytes, planned) + planned * (in_flight - 1)
    if outcome == "RowTooLargeError":
        with pytest.raises(RowTooLargeError) as err:
            g([nbytes])
        assert f"need {(nbytes + planned * (in_flight - 1)) / MiB:.1f} MiB" in str(err.value), str(err.value)
        return
    with caplog.at_level("WARNING", logger="ms_shm"):
        assert g([nbytes]) == [nbytes]
    assert ("going on" in caplog.text) == (outcome == "over, going on")


def distinct(batch: list) -> tuple:
    """``(bytes, storages)`` as the frameworks weigh a batch: each object once, 8 bytes each."""
    return 8 * len({id(x) for x in batch}), len({id(x) for x in batch})


def test_with_workers_given_the_first_and_last_samples_are_read_untimed():
    dataset = Sleepy(0.001, 0.001)
    s = probe.measure_batch(dataset, 4, lambda samples: samples, distinct, False, twin=list)
    assert dataset.reads == 2 and s.seconds_per_sample is None
    assert s.batch_bytes == 32 and s.storages == 4 and s.batch_size == 4 and s.samples == 8


class SortedByLength(Sleepy):
    """Samples that grow with their index, as a dataset sorted by length: the largest is the last."""

    def __getitem__(self, i):
        return [i] * (i + 1)


def test_with_workers_given_a_dataset_sorted_by_length_is_planned_at_its_last_sample():
    """An audit's samples of 8-32 MiB by index, planned from sample 0 alone, met the guard mid-epoch under 64 MB
    (``ms-shm run``) where no workers would have delivered them."""
    s = probe.measure_batch(SortedByLength(0, 0), 4, lambda samples: samples, lambda b: (sum(map(len, b)), 1),
                            False, twin=list, first=([0, 7], 4))
    assert (s.batch_bytes, s.batch_bytes_min) == (4 * 8, 4 * 1)


class Single(Sleepy):
    def __len__(self):
        return 1


def test_a_dataset_of_one_sample_is_weighed_beside_its_twin_or_alone():
    def no_twin(sample):
        raise TypeError("cannot copy")

    twinned = probe.measure_batch(Single(0, 0), 4, lambda samples: samples, distinct, False, twin=list)
    assert (twinned.batch_bytes, twinned.storages) == (32, 4)  # the twin brings a second storage
    alone = probe.measure_batch(Single(0, 0), 4, lambda samples: samples, distinct, False, twin=no_twin)
    assert (alone.batch_bytes, alone.storages) == (32, 1)  # its bytes times the batch, its storage once


def test_torchs_twin_copies_owned_storages_and_keeps_views_of_a_shared_one():
    torch = pytest.importorskip("torch")
    from ms_shm.engines.torch import compat

    dataset = torch.arange(1 << 20, dtype=torch.float32)  # a TensorDataset's samples are views of this
    owned, view = torch.ones(4), dataset[8:12]
    Pair = collections.namedtuple("Pair", "a b")
    copy = compat.twin({"x": [owned, view], "y": Pair(owned, 3)})
    assert copy["x"][0] is not owned and torch.equal(copy["x"][0], owned) and copy["x"][1] is view
    assert type(copy["y"]) is Pair and copy["y"].a is not owned and copy["y"].b == 3
    assert compat.weigh([owned, view, copy["x"][0], copy["x"][1]]) == (16 + 4 * (1 << 20) + 16, 3)


class _Engine:
    """The torch engine's rules, without torch."""

    planning = planning

    @staticmethod
    def profile():
        return LoaderProfile("torch", None, costs=TORCH_COSTS)


@pytest.mark.parametrize("preferences", [False, True])
def test_explicit_workers_that_cannot_fit_are_timed_only_to_adapt_them(preferences):
    from ms_shm import loaders

    timed = []

    def timed_stats():
        timed.append(1)
        return stats(per_sample=0.02), Effects(), None

    untimed = stats(per_sample=None)
    assert loaders._plan(_Engine, untimed, ask(workers=2), room(), preferences, timed_stats).workers == 2
    if not preferences:
        with pytest.raises(ShmBudgetError):
            loaders._plan(_Engine, untimed, ask(workers=2), room(64 * MiB), preferences, timed_stats)
        assert timed == []
        return
    p = loaders._plan(_Engine, untimed, ask(workers=2), room(64 * MiB), preferences, timed_stats)
    assert timed == [1] and p.workers == 0 and p.decisions[0].setting == "explicit_arguments"
    assert "ms per sample" in str(p.decisions[1])
    assert p.decisions[0].value == "num_workers=0" and p.decisions[0].default == "num_workers=2"


def test_persistent_workers_adapted_under_patch_keep_one_worker_or_raise_saying_why():
    """The audit's ``persistent_workers=True`` loader under 64 MB went to ``num_workers=0``: torch then drew the
    base seed every epoch (a persistent iterator draws it once), and the shuffle order and the loop's next
    ``torch.rand`` differed from the second epoch on. At least one worker stays; where none fits, the error."""
    from ms_shm import loaders
    from ms_shm.engines.mindspore_dataloader import compat as ms_compat
    from ms_shm.engines.torch import compat as torch_compat

    def adapted(batch_mb: float, **kw):
        timed = stats(batch_mb, per_sample=0.02)
        return loaders._plan(_Engine, stats(batch_mb, per_sample=None), ask(workers=2, **kw), room(50 * MiB), True,
                             lambda: (timed, Effects(), None))

    asked = {"num_workers": 2, "persistent_workers": True}
    assert loaders._seeds_once(types.SimpleNamespace(compat=torch_compat), asked)
    assert not loaders._seeds_once(types.SimpleNamespace(compat=torch_compat), dict(asked, persistent_workers=False))
    assert not loaders._seeds_once(types.SimpleNamespace(compat=ms_compat), asked)  # seeds with workers only
    one = adapted(16, min_workers=1, persistent_workers=True)  # 1 worker at prefetch 1: 2 batches of 16 MiB, 32 of 40
    assert one.workers == 1 and one.decisions[0].value == "num_workers=1, prefetch_factor=1"
    with pytest.raises(ShmBudgetError, match="none without them keeps persistent_workers=True's batches"):
        adapted(32, min_workers=1, persistent_workers=True)
    assert adapted(32).workers == 0  # not persistent: a loader draws the seed per epoch with workers or without


def test_explicit_workers_are_not_adapted_where_the_timed_probe_finds_samples_that_depend_on_the_reader():
    """The first probe of explicit workers reads one sample, once; only when they cannot fit (and may change)
    is a sample read twice, and one that comes back different keeps the workers asked: the budget error."""
    from ms_shm import loaders

    def timed_probe():
        return stats(per_sample=0.02), Effects(rereads_differ="sample 0 read twice came back different"), None

    with pytest.raises(ShmBudgetError):
        loaders._plan(_Engine, stats(per_sample=None), ask(workers=2), room(64 * MiB), True, timed_probe)


@pytest.mark.parametrize("lock_at", ["timed probe", "call"])
def test_explicit_workers_kept_as_workers_change_what_arrives_say_why_and_fix_first_what_keeps_the_batches(lock_at):
    """Under ``ms_shm.patch`` (``ms-shm run bigrand.py``), explicit ``num_workers`` that cannot fit stay where
    workers change what arrives (random samples, a ``worker_init_fn``): the error says so, and its first fix is
    one that keeps the batches; dropping ``num_workers`` comes last, saying the batches would then differ."""
    from ms_shm import loaders

    drawn = "samples draw from torch's global generator"
    wif = "worker_init_fn is passed (it runs in each worker, and only there)"

    def timed_probe():
        return stats(per_sample=0.02), Effects(draws_random=drawn if lock_at == "timed probe" else None), None

    req = ask(workers=2, workers_locked=None if lock_at == "timed probe" else wif)
    with pytest.raises(ShmBudgetError) as err:
        loaders._plan(_Engine, stats(per_sample=None), req, room(64 * MiB), True, timed_probe)
    own = "(each worker would draw from its own copy of the generator, or its own seed)"
    text, why = str(err.value), f"{drawn} {own}" if lock_at == "timed probe" else wif
    assert text.startswith(f"ms_shm could not adapt the explicit num_workers=2, because {why}: with another "
                           f"number of workers what arrives would change"), text
    fix = text.split("Fix: ")[1]
    assert fix.startswith("give /dev/shm at least ") and "a smaller batch_size" in fix, fix
    assert fix.endswith(f"or drop the explicit num_workers=2 so ms_shm can choose (the batches would then differ: "
                        f"{why}).")


@pytest.mark.parametrize("locked", [None, "an iterable dataset (each worker iterates its own copy)"])
def test_the_budget_errors_first_fix_applies(locked):
    """build_dataloader keeps explicit arguments: dropping them is the first fix only where ms_shm could then
    choose freely; a lower explicit prefetch_factor is named."""
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_loader(stats(), ask(workers=2, prefetch_factor=2, workers_locked=locked), room(64 * MiB))
    fix = str(err.value).split("Fix: ")[1]
    assert fix.startswith("give /dev/shm") == bool(locked) and "prefetch_factor=1" in fix, fix
    assert fix.startswith("drop the explicit num_workers=2 / prefetch_factor=2") != bool(locked), fix


@pytest.mark.parametrize("batch_size, limits, offered", [(4, dict(shm=64 * MiB), True),
                                                           (1, dict(shm=64 * MiB), False),
                                                           (4, dict(nofile=40), False)])
def test_a_smaller_batch_size_is_offered_only_where_it_can_help(batch_size, limits, offered):
    """An audit's 24 MiB samples at ``batch_size=1`` under 64 MB, and batches too many fds for ``ulimit -n``
    (a stacked field is one storage at any batch size), were both told "or a smaller batch_size"."""
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_loader(stats(batch_mb=24 * batch_size, storages=40, batch_size=batch_size),
                             ask(workers=2), room(**limits))
    assert ("a smaller batch_size" in str(err.value).split("Fix: ")[1]) == offered, str(err.value)


def test_the_budget_error_sizes_dev_shm_past_what_other_live_pipelines_reserved():
    """64 MB with another loader holding 40 MiB was told "give /dev/shm at least 30.0 MiB (--shm-size=64m)"."""
    b = budget.compute(64 * MiB, 1, 65536, 10, reserved_shm=40 * MiB, reserved_pipelines=1)
    with pytest.raises(ShmBudgetError) as err:
        planning.plan_loader(stats(batch_mb=8), ask(workers=2), b)
    text = str(err.value)
    assert "the smallest needs 32.0 MiB of /dev/shm against 11.2 MiB" in text, text
    assert f"give /dev/shm at least {(32 + 40) / 0.8:.1f} MiB (docker run --shm-size=128m), counting 40.0 MiB " \
           f"reserved by 1 other live pipeline of this process" in text, text


def test_a_guarded_collate_given_back_is_unwrapped_not_guarded_twice(monkeypatch):
    """Lightning and accelerate rebuild a loader from another's attributes (``collate_fn=old.collate_fn``): the
    new loader guards the caller's own collate, and the guard exposes it as ``__wrapped__``."""
    from ms_shm import loaders
    from ms_shm.engines.torchstyle.guard import GuardedCollate

    def mine(samples):
        return samples

    old = GuardedCollate(mine, lambda b: (0, 0), lambda: None, 1, 1, 1, "")
    assert old.__wrapped__ is mine and old.__name__ == "mine"
    seen = {}

    def prepared(eng, asked, p, b):
        seen["collate"] = asked["collate_fn"]
        return GuardedCollate(asked["collate_fn"], lambda b: (0, 0), lambda: None, 1, 1, 1, "")

    monkeypatch.setattr(loaders, "_guarded", prepared)
    torch = pytest.importorskip("torch")
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    new = loaders.build_dataloader(data, batch_size=2, num_workers=1, collate_fn=old)
    assert seen["collate"] is mine and new.collate_fn.collate is mine, new.collate_fn
    assert new.collate_fn.__wrapped__ is mine


def test_adapted_explicit_workers_state_their_new_num_workers_and_prefetch():
    waiting = BatchStats(8 * MiB, 2, 0.2, 64, 4, 16 * MiB, cpu_seconds_per_sample=0.0)  # workers pay off
    p = loaders_mod()._plan(_Engine, waiting, ask(workers=2, prefetch_factor=4), room(48 * MiB), True, lambda: None)
    assert p.workers >= 1 and p.decisions[0].value == f"num_workers={p.workers}, prefetch_factor={p.prefetch}"
    assert p.decisions[0].default == "num_workers=2, prefetch_factor=4"


def loaders_mod():
    from ms_shm import loaders

    return loaders


class _Compat:
    @staticmethod
    def is_iterable(dataset):
        return isinstance(dataset, Stream)


class _LockEngine:
    compat = _Compat


class Stream:
    def __iter__(self):
        return iter(range(3))


class Plain:
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("asked, locked", [
    ({}, None),
    ({"in_order": False}, "in_order=False"),
    ({"in_order": False, "num_workers": 2}, None),  # explicit workers: their order is the caller's choice
    ({"worker_init_fn": print}, "worker_init_fn"),
    ({"worker_init_fn": print, "num_workers": 2}, "worker_init_fn"),  # under patch: kept, never adapted to 0
    ({"persistent_workers": True}, "persistent_workers=True"),
    ({"persistent_workers": False, "timeout": 0}, None),  # the defaults, passed
    ({"prefetch_factor": 4}, "prefetch_factor=4"),
    ({"timeout": 5}, "timeout=5"),
    ({"timeout": "5"}, "timeout='5'"),  # a value the framework refuses: its own check must see it
    ({"multiprocessing_context": "spawn"}, "multiprocessing_context='spawn'"),
    ({"persistent_workers": True, "num_workers": 2}, None),
])
def test_arguments_that_tie_samples_to_workers_or_mean_workers_lock_num_workers(asked, locked):
    why = loaders_mod()._asked_lock(_LockEngine, Plain(), asked)
    assert (why is None) if locked is None else (locked in why), why
    assert "iterable" in loaders_mod()._asked_lock(_LockEngine, Stream(), {})


def test_locked_explicit_workers_that_cannot_fit_raise_under_patch_instead_of_adapting():
    why = loaders_mod()._asked_lock(_LockEngine, Plain(), {"worker_init_fn": print, "num_workers": 2})
    with pytest.raises(ShmBudgetError):
        loaders_mod()._plan(_Engine, stats(per_sample=None), ask(workers=2, workers_locked=why), room(64 * MiB),
                            True, lambda: stats())


def test_a_locked_loader_without_num_workers_gets_the_frameworks_default_unprobed():
    p = planning.kept_plan(ask(workers_locked="in_order=False (why)"), room(), LoaderProfile("torch", None))
    assert p.workers == 0 and p.predicted_shm == 0 and p.fits
    assert "in_order=False" in p.decisions[0].reason and "not probed" in p.decisions[0].reason


def worker_id():
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return -1 if info is None else info.id


class Tagged(Plain):
    def __getitem__(self, i):
        return i, self._tag()

    def _tag(self):
        return worker_id()  # a module function that calls it: followed


class Shard(Plain):
    def __getitem__(self, i):
        import torch.utils.data as data

        return [i for _ in (data.get_worker_info(),)]  # inside a comprehension: nested code


class Wrapper:
    """A Subset-like wrapper: the dataset it holds is read too."""

    def __init__(self, dataset):
        self.dataset, self.indices = dataset, [0, 1]

    def __getitem__(self, i):
        return self.dataset[self.indices[i]]


class TagCollate:
    def __call__(self, samples):
        return samples, worker_id()


def tag_collate(samples, extra=None):
    return samples, worker_id()


def test_code_that_calls_get_worker_info_is_found_through_helpers_wrappers_and_collates():
    import functools

    from ms_shm import codescan

    assert "Tagged.__getitem__" in codescan.worker_info_use(Tagged())
    assert "Shard.__getitem__" in codescan.worker_info_use(Shard())
    assert "Tagged.__getitem__" in codescan.worker_info_use(Wrapper(Tagged()))
    assert "collate_fn" in codescan.worker_info_use(Plain(), tag_collate)
    assert "collate_fn" in codescan.worker_info_use(Plain(), TagCollate())
    assert "collate_fn" in codescan.worker_info_use(Plain(), functools.partial(tag_collate, extra=1))
    assert codescan.worker_info_use(Plain(), lambda samples: samples) is None
    assert codescan.worker_info_use(Wrapper(Plain())) is None


class SeededAug:
    """Per-sample augmentation seeded from ``torch.initial_seed()``: in a worker that is the loader's base seed
    plus the worker's id, so the samples differ from the main process's."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import numpy as np
        import torch

        return np.random.default_rng(torch.initial_seed() + i).random(4)


def test_code_that_seeds_from_torch_initial_seed_is_found():
    from ms_shm import codescan

    assert "SeededAug.__getitem__ calls initial_seed()" in codescan.worker_info_use(SeededAug())


def test_the_frameworks_own_collate_is_not_read():
    torch = pytest.importorskip("torch")  # its collate asks for the worker only to place a batch in shared memory
    from ms_shm import codescan

    subset = torch.utils.data.Subset(torch.utils.data.TensorDataset(torch.zeros(4)), [0, 1])
    assert codescan.worker_info_use(subset, torch.utils.data.default_collate) is None


class Counting(Plain):
    """Deterministic samples from a sampler that draws: the draws are the sampler's, not the samples'."""

    def __getitem__(self, i):
        return i * 2


class DrawingSampler:
    def __iter__(self):
        import random

        order = list(range(3))
        random.shuffle(order)
        return iter(order)

    def __len__(self):
        return 3


def test_the_samplers_own_draws_are_not_the_samples():
    from ms_shm import sandbox

    kept = []
    first = probe.first_batch(2, DrawingSampler(), None, probe.PROBE_SAMPLES)
    _, effects = sandbox.watch_effects(
        lambda: probe.measure_batch(Counting(), 2, lambda s: s, distinct, False, first=first, keep=kept),
        [Counting()], lambda: probe.reread_differs(Counting(), first[0], kept, lambda v: None))
    assert effects.order_dependent is None and kept == [first[0][0] * 2] and first[1] == 2


def test_without_workers_three_batches_count_against_a_container_and_the_fix_names_its_memory():
    # torch 2.13, 96 MiB batches: the main process grew ~210 MB without workers; a 241 MiB share admitted two
    # batches' pricing (192 MiB) and the process was OOM-killed. Three batches (288 MiB) do not fit: an error
    # naming the container's memory, not /dev/shm (2 GiB free) nor the fd limit.
    assert model.memory(96 * MiB, 1, 0, 2, 0, False) == 3 * 96 * MiB
    tight = budget.compute(2 * GiB, 1, 65536, 10, memory_left=int(241 * MiB / budget.DEFAULT_FRACTION))
    with pytest.raises(ShmBudgetError) as err:
        plan_loader(stats(96), ask(), tight)
    text = str(err.value)
    assert "docker run --memory" in text and "--shm-size" not in text and "ulimit" not in text, text


def kept(samples: int = 300, **kw) -> Plan:
    """Batches of one storage, one sample each, 2 workers; ``kw`` the request's strategy and limits."""
    s = stats(0.001, storages=1, samples=samples, batch_size=1)
    return plan_loader(s, ask(workers=2, **kw), room(nofile=kw.get("nofile_soft", 256), open_fds=13))


def test_kept_batches_past_a_low_hard_limit_switch_torch_to_file_system():
    """An audit: ``ulimit -n 256`` (soft = hard), 300 batches kept by ``list(loader)``: raw and build_dataloader
    died alike ("Too many open files"); only tune() switched the strategy."""
    d = {d.setting: d for d in kept(can_switch_strategy=True, nofile_soft=256, nofile_hard=256).decisions}
    assert d["sharing_strategy"].value == model.FILE_SYSTEM and "kept by the program" in d["sharing_strategy"].reason
    assert NOFILE not in d
    # MindSpore's DataLoader cannot switch: as asked, nothing raised (there is nothing to raise it to)
    assert all(x.setting not in (NOFILE, "sharing_strategy") for x in kept(nofile_soft=256, nofile_hard=256).decisions)
    # a hard limit past FILE_SYSTEM_BELOW_HARD keeps the strategy: the soft limit is raised instead
    d = {d.setting: d for d in kept(4000, can_switch_strategy=True, nofile_soft=1024, nofile_hard=8192).decisions}
    assert "sharing_strategy" not in d and d[NOFILE].value == 8192


def test_a_soft_limit_raised_short_of_the_kept_batches_says_so_and_a_default_one_is_raised_quietly():
    short = {d.setting: d for d in kept(500, nofile_soft=256, nofile_hard=400).decisions}[NOFILE]
    assert short.value == 400 and "short of them" in short.reason and "ulimit -Hn" in short.reason, short.reason
    assert not short.precaution  # 256: a starved limit, said as a warning
    usual = {d.setting: d for d in kept(4000, nofile_soft=1024, nofile_hard=1 << 20).decisions}[NOFILE]
    assert usual.precaution and "short of" not in usual.reason  # the usual default, raised for what may be kept


@pytest.mark.parametrize("kw, expected", [
    (dict(can_switch_strategy=True, nofile_soft=256, nofile_hard=256), ("sharing_strategy", model.FILE_SYSTEM)),
    (dict(nofile_soft=256, nofile_hard=256), None),  # MindSpore's DataLoader, nothing to raise it to
    (dict(nofile_soft=64, nofile_hard=20000), (NOFILE, 20000)),
    (dict(nofile_soft=1024, nofile_hard=1 << 20), None),  # the usual default: left as it is, unmeasured
    (dict(nofile_soft=64, nofile_hard=20000, strategy=model.FILE_SYSTEM), None),  # no fd per storage
])
def test_a_loader_whose_probe_failed_still_gets_the_open_files_rules_that_need_no_probe(kw, expected):
    decisions = planning.unplanned_fd_decisions(ask(workers=2, **kw))
    assert [(d.setting, d.value) for d in decisions] == ([expected] if expected else [])


def test_each_workers_copies_of_the_datasets_lists_count_in_its_memory():
    """An audit's 500k token lists under ``num_workers=8``: planned at the probe's pages only, OOM-killed as raw
    was. Each worker's copy (``copied_bytes``) counts: two workers' copies do not fit, fewer workers do."""
    limit = budget.compute(2 * GiB, 1, 65536, 10, memory_left=int(700 * MiB / budget.DEFAULT_FRACTION))
    plain = plan_loader(stats(1), ask(), limit)
    copied = plan_loader(replace(stats(1), copied_bytes=400 * MiB), ask(), limit)
    assert plain.workers == 2 and copied.workers < 2 and copied.predicted_memory <= limit.memory_bytes
    assert any("840.0 MiB of memory" in c.why_not for c in copied.alternatives if c.workers == 2)


def test_workers_whose_copies_do_not_fit_are_told_to_share_the_lists():
    """An audit's 8 workers kept as asked (a generator passed) over 500k token lists: the refusal's fix named the
    container's memory and a smaller batch, not the lists every worker copies."""
    limit = budget.compute(2 * GiB, 1, 65536, 10, memory_left=int(700 * MiB / budget.DEFAULT_FRACTION))
    with pytest.raises(ShmBudgetError) as err:
        plan_loader(replace(stats(1), copied_bytes=400 * MiB), ask(workers=2, workers_locked="a generator"), limit)
    assert "ms_shm.SharedList" in str(err.value) and "~400.0 MiB" in str(err.value), str(err.value)
    with pytest.raises(ShmBudgetError) as err:  # without copies, no such fix
        plan_loader(stats(300), ask(workers=2, workers_locked="a generator"), limit)
    assert "SharedList" not in str(err.value)


@pytest.mark.parametrize("extra", [{"generator": "loader"}, {"sampler": "sampler"}, {"batch_sampler": "batch"}])
def test_a_generator_of_the_callers_keeps_the_workers_and_the_prefetch_asked(extra):
    """A sampler drawing from a generator of the caller's draws as far ahead as the workers read (torch's
    RandomSampler draws its next permutation as one runs out; MindSpore 2.8's iterator also draws its workers'
    seeds from it): an audit's seeded loader adapted from 2 workers to none left epoch 0 early, and epoch 1 came
    in another order. Both frameworks keep ``num_workers`` and ``prefetch_factor`` as asked."""
    from types import SimpleNamespace

    from ms_shm import loaders

    gen = SimpleNamespace(generator=object())
    values = {"loader": object(), "sampler": gen, "batch": SimpleNamespace(sampler=gen)}
    asked = {"dataset": object(), "batch_size": 4, **{k: values[v] for k, v in extra.items()}}
    eng = SimpleNamespace(compat=SimpleNamespace(is_iterable=lambda d: False))
    assert loaders._asked_lock(eng, asked["dataset"], asked) == loaders.DRAWS_AHEAD
    assert loaders._asked_lock(eng, asked["dataset"], {"dataset": asked["dataset"], "batch_size": 4,
                                                      "sampler": SimpleNamespace(generator=None)}) is None


@pytest.mark.parametrize("persistent, locked, bound, prefetch", [
    (True, "rows draw from the global random / numpy.random state", True, 2),  # the audit's: kept at the default
    (False, "rows draw from the global random / numpy.random state", True, None),  # new workers each epoch: free
    (True, "an iterable dataset (each worker iterates its own copy)", False, None),  # samples alike: free
    (False, "DRAWS_AHEAD", False, 2),
])
def test_how_far_ahead_persistent_workers_read_is_kept_where_their_samples_depend_on_who_reads(persistent, locked,
                                                                                               bound, prefetch):
    """Persistent workers go on after a ``break`` from where they stopped: the samples they read ahead of it moved
    their generators. An audit's ``torch.rand`` per sample, 2 persistent workers, 2 batches an epoch: planned at
    prefetch 1 under 64 MB, the later epochs' values were other than raw's (at 2). Under ``ms_shm.patch`` a
    prefetch so kept is not lowered to fit (``_workers_kept``): the pipes, or the error."""
    from types import SimpleNamespace

    from ms_shm import loaders

    profile = LoaderProfile("x", None, costs=TORCH_COSTS)
    eng = SimpleNamespace(name="torch", arithmetic=model, profile=lambda: profile, planning=planning,
                          compat=SimpleNamespace(sharing_strategy=lambda: "file_descriptor"))
    facts = SimpleNamespace(usable_cpus=2, nofile_soft=1024, nofile_hard=4096)
    lock = loaders.DRAWS_AHEAD if locked == "DRAWS_AHEAD" else locked
    req = loaders._request(eng, {"num_workers": 2, "persistent_workers": persistent}, facts, lock, bound)
    assert (req.prefetch_factor, req.prefetch_locked) == (prefetch, prefetch is not None)
    asked = replace(req, prefetch_factor=4)  # an explicit prefetch that does not fit 64 MB at 8 MiB batches
    with pytest.raises(ShmBudgetError) as err:
        plan_loader(stats(8), asked, room(64 * MiB), profile)
    if prefetch:
        with pytest.raises(ShmBudgetError):
            loaders._workers_kept(eng, stats(8), asked, room(64 * MiB), err.value)
    else:
        assert loaders._workers_kept(eng, stats(8), asked, room(64 * MiB), err.value).prefetch < 4


class _HoldsItsRng:
    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return 8


class _PermutesPerEpoch(_HoldsItsRng):
    def __iter__(self):  # one draw as the epoch's first index is asked for, with or without workers
        order = self.rng.permutation(8).tolist()
        for k in range(0, 8, 4):
            yield order[k:k + 4]


class _DrawsPerIndex(_HoldsItsRng):
    def __iter__(self):  # the DataLoader audit's: workers read ahead of a loop that stops early, and draw further
        for _ in range(8):
            yield int(self.rng.integers(8))


@pytest.mark.parametrize("sampler, ahead", [(_PermutesPerEpoch, False), (_DrawsPerIndex, True)])
def test_a_sampler_holding_its_own_generator_draws_ahead_where_it_draws_in_its_loop(sampler, ahead):
    assert loaders_mod()._draws_ahead({"dataset": object(), "batch_sampler": sampler()}) is ahead
    assert loaders_mod()._draws_ahead({"dataset": object(), "sampler": sampler()}) is ahead


# --- samples that vary in size: read spread over the dataset, planned with build_dataset's margin


class Ragged:
    """``n`` samples of 4-8 units (``[i] * size``), as the 4-rank audit's 4-8 MiB ones; reads are logged."""

    def __init__(self, n: int = 48):
        self.n, self.read = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return [i] * (4 + (i * 37 % 5))


@pytest.mark.parametrize("length, sampler, batch_sampler, indices", [
    (48, None, None, [0, 47, 24]),  # shuffle=True or not: the framework's own sampler, made later
    (2, None, None, [0, 1]),
    (None, None, None, [0, 1, 2]),  # no __len__: from the start, as before
    (48, [5, 9, 1, 7], None, [5, 9, 1]),  # the caller's sampler chooses: its first ones
    (48, None, [[3, 4], [5, 6]], [3, 4]),  # a batch sampler's first batch: samples that collate together
])
def test_the_probe_reads_spread_indices_unless_the_caller_chose_them(length, sampler, batch_sampler, indices):
    assert probe.first_batch(4, sampler, batch_sampler, probe.PROBE_SAMPLES, length)[0] == indices


@pytest.mark.parametrize("alone, two, second, size, expected", [
    ([8, 8, 8], 16, 8, 4, (32, 32)),  # alike: one + (two - one) * (size - 1), as before
    ([10, 10], 18, 10, 4, (34, 34)),  # 2 bytes of the batch's own
    ([4, 8, 5], 12, 8, 4, (32, 16)),  # a list collate: size x the largest sample (and the smallest)
    ([4, 8, 5], 12, 8, 1, (8, 4)),  # batch_size=1: the largest sample alone
    ([6, 6], 6, 6, 4, (6, 6)),  # views of one storage: sent once
    ([4, 8], None, 4, 1, (8, 4)),  # not batched
])
def test_batch_bytes_at_the_largest_and_smallest_sample(alone, two, second, size, expected):
    assert probe.batch_bytes_at(alone, two, second, size) == expected


def test_varying_samples_are_read_spread_and_planned_at_the_ragged_margin():
    from ms_shm.engines.mindspore.planning import RAGGED_MARGIN

    dataset = Ragged()
    s = probe.measure_batch(dataset, 1, lambda samples: samples, lambda b: (sum(map(len, b)), len(b)), False)
    assert dataset.read[:3] == [0, 47, 24] and s.batch_bytes == 8 and s.batch_bytes_min == 4 and s.ragged
    planned, why = planning.planned_batch(s)
    assert planned.batch_bytes == int(8 * RAGGED_MARGIN) and why[0].setting == "batch_bytes"
    assert "4 B to 8 B" in why[0].reason and f"{RAGGED_MARGIN}x the largest" in why[0].reason
    p = plan_loader(s, ask(), budget.compute(1 << 30, 1, 65536, 10))
    assert p.row_bytes == 12 and any(d.setting == "batch_bytes" for d in p.decisions)
    alike = BatchStats(8, 1, 0.01, 48, 1, batch_bytes_min=None)
    assert planning.planned_batch(alike) == (alike, [])


def test_a_stacking_collate_that_refuses_two_spread_samples_is_weighed_on_the_first_twice():
    def stack(samples):
        if len({len(s) for s in samples}) > 1:
            raise RuntimeError("stack expects each tensor to be equal size")
        return [x for s in samples for x in s]

    s = probe.measure_batch(Ragged(), 4, stack, lambda b: (len(b), 1), False)
    assert s.batch_bytes == 32 and s.batch_bytes_min == 16  # 4 x 8 and 4 x 4 units


# --- the collate guard: what is free now, and a fix that names only what can go lower


class _Worker:
    id = 0


def test_a_batch_within_its_plan_that_dev_shm_cannot_hold_now_is_a_clear_error(monkeypatch):
    from types import SimpleNamespace

    from ms_shm.engines.torchstyle import guard
    from ms_shm.errors import ShmFullError

    calls = []
    free = SimpleNamespace(free=6 * MiB, total=64 * MiB)  # another process holds 58 MiB of it
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: calls.append(path) or free)
    weigh = lambda batch: (sum(batch), len(batch))  # noqa: E731
    g = guard.GuardedCollate(list, weigh, lambda: _Worker(), 8 * MiB, 3, 64 * MiB, "prefetch_factor=1",
                             ranks=1, to_give=lambda need: int(need / 0.8) + 1)
    assert g([4 * MiB]) == [4 * MiB] and calls == ["/dev/shm"]
    with pytest.raises(ShmFullError) as err:
        g([7 * MiB])
    text = str(err.value)
    assert text.startswith("batch 2 of DataLoader worker 0 is 7.0 MiB (planned 8.0 MiB): /dev/shm has 6.0 MiB "
                           "free, too little to send it"), text
    assert "export LOCAL_WORLD_SIZE (or MS_SHM_LOCAL_RANKS), or ms_shm.tune(ranks=N)" in text
    assert "wait for it forever" in text, text
    assert "needs 24.0 MiB free for it and the 2 other batch(es) in flight at the planned 8.0 MiB" in text, text
    assert "58.0 MiB of the 64.0 MiB of /dev/shm are in use" in text, text
    assert "give /dev/shm at least 82.0 MiB (docker run --shm-size=" in text, text
    assert text.endswith("or prefetch_factor=1")
    shared = guard.GuardedCollate(list, weigh, lambda: _Worker(), 8 * MiB, 3, 64 * MiB, "", unshared=lambda b: 0)
    calls.clear()
    assert shared([7 * MiB]) == [7 * MiB] and calls == []  # already in shared memory: nothing left to write


def test_room_taken_between_the_check_and_the_write_fails_in_the_worker_as_shm_full(monkeypatch):
    """The batch is written to shared memory in the guard (as the framework's queue would): where another
    process took the room after the check, the write fails in the worker's loop, never in a feeder thread."""
    from types import SimpleNamespace

    from ms_shm.engines.torchstyle import guard
    from ms_shm.errors import ShmFullError

    readings = iter([8 * MiB, 1 * MiB, 8 * MiB, 8 * MiB])  # checked: room; after the failed write: none
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(free=next(readings), total=64 * MiB))

    def share(batch):
        raise RuntimeError("unable to allocate shared memory(shm): No space left on device (28)")

    weigh = lambda batch: (sum(batch), len(batch))  # noqa: E731
    g = guard.GuardedCollate(list, weigh, lambda: _Worker(), 8 * MiB, 3, 64 * MiB, "", share=share)
    with pytest.raises(ShmFullError, match="has 1.0 MiB free, too little to send it") as err:
        g([4 * MiB])
    assert isinstance(err.value.__cause__, RuntimeError)
    # room again when read after the failure (the batches beside it taken since): still the guard's error
    with pytest.raises(ShmFullError, match="had too little free to send it when it was written") as err:
        g([4 * MiB])
    assert isinstance(err.value.__cause__, RuntimeError)
    kept = []
    ok = guard.GuardedCollate(list, weigh, lambda: _Worker(), 8 * MiB, 3, 64 * MiB, "", share=kept.append)
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(free=8 * MiB, total=64 * MiB))
    batch = ok([4 * MiB])
    assert kept == [batch] and batch == [4 * MiB]


def test_room_taken_while_the_frameworks_collate_writes_a_grown_batch_is_the_guards_error(monkeypatch):
    """torch's default collate writes its batch to shared memory itself: a batch over its plan that had room at
    the check (``_before``) and lost it to another worker during the collate reaches the loop as the guard's
    ``RowTooLargeError``, torch's ENOSPC its cause (256 MB, samples growing to 24 MiB: 1 run of a suite's)."""
    from types import SimpleNamespace

    from ms_shm.engines.torchstyle import guard
    from ms_shm.errors import RowTooLargeError

    readings = iter([40 * MiB, 5 * MiB])  # checked before the collate: room; after it failed: none
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(free=next(readings), total=64 * MiB))

    def collate(samples):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device")

    weigh = lambda batch: (sum(batch), len(batch))  # noqa: E731
    g = guard.GuardedCollate(collate, weigh, lambda: _Worker(), 4 * MiB, 3, 64 * MiB, "batch_size=1")
    with pytest.raises(RowTooLargeError, match=r"is 24.0 MiB \(planned 4.0 MiB\)") as err:
        g([24 * MiB])
    assert isinstance(err.value.__cause__, RuntimeError) and "unable to allocate" in str(err.value.__cause__)
    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(free=40 * MiB, total=64 * MiB))
    with pytest.raises(RowTooLargeError, match="no room for it when it was written") as err:  # room back since
        g([24 * MiB])
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize("message, out_of_files", [
    ("unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device (28)", True),
    ("stack expects each tensor to be equal size", False),
])
def test_a_failed_write_not_for_want_of_room_is_the_frameworks_own_error(monkeypatch, message, out_of_files):
    """Where ``/dev/shm`` has room after the failure, only a failure for want of room is the guard's: a tmpfs
    out of inodes says ENOSPC too, and a collate's own error is the caller's to read as it was."""
    from types import SimpleNamespace

    from ms_shm.engines.torchstyle import guard
    from ms_shm.errors import Error

    monkeypatch.setattr(guard.procfs, "statvfs", lambda path: SimpleNamespace(
        free=40 * MiB, total=64 * MiB, out_of_files=out_of_files))

    def collate(samples):
        raise RuntimeError(message)

    for planned in (4 * MiB, 64 * MiB):  # over its plan, within it
        g = guard.GuardedCollate(collate, lambda b: (sum(b), len(b)), lambda: _Worker(), planned, 3, 64 * MiB, "")
        with pytest.raises(RuntimeError, match=message[:20]) as err:
            g([24 * MiB])
        assert not isinstance(err.value, Error)


@pytest.mark.parametrize("batch_size, batch_sampler, workers, prefetch, fix", [
    (4, False, 2, 2, "batch_size=2, or prefetch_factor=1, or num_workers=1"),
    (1, False, 1, 1, ""),  # nothing of the loader's can go lower: /dev/shm only
    (None, True, 2, 1, "smaller batches from the batch_sampler, or num_workers=1"),
    (None, False, 1, 3, "prefetch_factor=2"),
])
def test_the_guards_fix_names_only_what_can_go_lower(batch_size, batch_sampler, workers, prefetch, fix):
    from ms_shm.engines.torchstyle.guard import guard_fix

    assert guard_fix(batch_size, batch_sampler, workers, prefetch) == fix


def test_the_guards_free_space_check_costs_microseconds():
    """One statvfs and one walk of the batch per batch in a worker: measured here, kept far below a batch's
    own cost (a 4 MiB sample takes milliseconds to make and send)."""
    import time

    from ms_shm.engines.torchstyle import guard

    g = guard.GuardedCollate(list, lambda b: (len(b), len(b)), lambda: _Worker(), 1 << 40, 1, 1 << 50, "")
    g([1])
    t0 = time.perf_counter()
    for _ in range(2000):
        g([1])
    assert (time.perf_counter() - t0) / 2000 < 200e-6


def test_torchs_unshared_bytes_are_what_sending_would_write_and_share_writes_them():
    torch = pytest.importorskip("torch")
    from ms_shm.engines.torch import compat

    batch = [torch.zeros(1 << 16, dtype=torch.uint8), torch.ones(8, dtype=torch.float32)]
    assert compat.unshared_bytes(batch) == compat.weigh(batch)[0] == (1 << 16) + 32
    compat.share(batch)
    assert compat.unshared_bytes(batch) == 0 and all(t.is_shared() for t in batch)
    assert batch[0].sum().item() == 0 and batch[1].sum().item() == 8  # the same values, now in shared memory


@pytest.mark.parametrize("custom_collate, shm", [(False, 0), (True, 2 * 32 * MiB)])
def test_workers_that_must_stay_send_their_batches_through_their_pipes_where_no_shared_memory_fits(custom_collate,
                                                                                                   shm):
    """Nothing with shared memory fits 2 workers' 32 MiB batches in 64 MB, and they must stay (samples drawn from
    each worker's seed): the last resort keeps them and moves each batch through its worker's pipe, no /dev/shm
    but what a caller's collate_fn may build in each worker (torch's own runs as in the main process there)."""
    req = ask(workers=2, workers_locked="__getitem__ calls torch.rand", custom_collate=custom_collate)
    with pytest.raises(ShmBudgetError):
        plan_loader(stats(), req, room(64 * MiB))
    fits = 64 * MiB if not custom_collate else 128 * MiB
    p = plan_loader(stats(), replace(req, pipes=True), room(fits))
    assert (p.mode, p.workers, p.shared_mem, p.predicted_shm) == ("pipes", 2, False, shm), p
    said = next(d for d in p.decisions if d.setting == "transport")
    assert said.value == "pipes" and "torch.rand" in said.reason and "needs " in said.reason, said
    assert "Fix, for shared memory and its speed: give /dev/shm at least" in said.reason, said


def test_batches_through_pipes_are_only_a_last_resort():
    """Where shared memory fits, the pipes' ~4.7 ms per MiB are never chosen."""
    p = plan_loader(stats(), ask(workers=2, pipes=True), room())
    assert p.mode == "processes" and p.shared_mem and p.predicted_shm > 0


def test_mindspores_dataloader_weighs_its_tensors_not_numpy_arrays(real_mindspore):
    """MindSpore's DataLoader queue pickles a numpy array by value, through the pipe: an audit's collate of numpy
    arrays (16 MiB batches, 2 workers, 64 MB) held 0.1 MiB of /dev/shm at the peak, where ms_shm priced 64 MiB
    and refused it. A Tensor is one shared-memory file, also inside a batch class of the caller's."""
    import numpy as np
    from mindspore import Tensor

    from ms_shm.engines.mindspore_dataloader import compat
    from tests.loader_scenarios import Batch

    arrays = {"x": np.zeros(1024, np.float32), "y": [np.ones(8)]}
    assert compat.weigh(arrays) == (0, 0)
    assert compat.weigh(Batch([Tensor(np.zeros(1024, np.float32))], arrays)) == (4096, 1)
