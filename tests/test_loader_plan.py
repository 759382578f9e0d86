"""PyTorch-style DataLoader planning (``engines/torchstyle``): fake facts in, decisions out. Pure."""

from __future__ import annotations

import pytest

from ms_shm import budget
from ms_shm.changes import NOFILE
from ms_shm.engines.torchstyle import arithmetic as model
from ms_shm.engines.torchstyle.planning import BatchStats, LoaderRequest, plan_loader
from ms_shm.errors import ShmBudgetError

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


def test_ample_shm_slow_samples_take_workers():
    p = plan_loader(stats(), ask(), room())
    assert p.workers == 2 and p.prefetch == 2 and p.predicted_shm == 5 * (32 * MiB + 4096)  # 2 storages: a page more


def test_64m_shm_nothing_with_workers_fits_so_samples_stay_in_the_main_process():
    p = plan_loader(stats(), ask(), room(64 * MiB))
    assert p.workers == 0 and p.predicted_shm == 0


def test_explicit_workers_that_cannot_fit_raise_before_any_worker_starts():
    with pytest.raises(ShmBudgetError) as err:
        plan_loader(stats(), ask(workers=2), room(64 * MiB))
    assert "num_workers=2" in str(err.value) and "--shm-size" in str(err.value)


def test_prefetch_lowered_to_fit():
    # 8 MiB batches, 2 workers: prefetch 2 needs 40 MiB, prefetch 1 needs 24 MiB, budget 32 MiB
    p = plan_loader(stats(8), ask(workers=2), room(40 * MiB))
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


def test_mindspore_dataloader_cannot_switch_strategy_so_explicit_workers_raise():
    with pytest.raises(ShmBudgetError):
        plan_loader(stats(1, storages=512), ask(workers=2, nofile_soft=256, nofile_hard=256), room(nofile=256))


def test_workers_locked_keep_the_default():
    p = plan_loader(stats(), ask(workers_locked="an iterable dataset"), room())
    assert p.workers == 0 and "iterable" in p.decisions[0].reason


def test_untimed_batches_take_the_fewest_workers():
    p = plan_loader(stats(per_sample=None), ask(), room())
    assert p.workers == 0


def test_collate_guard_passes_batches_through_and_stops_one_that_outgrew_its_plan():
    import pytest as _pytest

    from ms_shm.engines.torchstyle.guard import GuardedCollate
    from ms_shm.errors import RowTooLargeError

    class Info:
        id = 1

    weigh = lambda batch: (sum(batch), len(batch))  # noqa: E731
    calls = []

    def collate(samples):
        calls.append(samples)
        return samples

    in_worker = GuardedCollate(collate, weigh, lambda: Info(), 10, 5, 100, "lower batch_size")
    small = [5, 5]
    assert in_worker(small) is small and calls == [small]
    with _pytest.raises(RowTooLargeError) as err:
        in_worker([30, 30])
    assert "batch 2 of DataLoader worker 1" in str(err.value) and "Fix: lower batch_size" in str(err.value)
    in_main = GuardedCollate(collate, weigh, lambda: None, 10, 5, 100, "x")
    assert in_main([30, 30]) == [30, 30]  # the main process only calls through
