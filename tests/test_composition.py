"""``tune``, ``build_dataset`` and ``map`` composed in-process on a fake engine: no MindSpore, no root.

What is checked is the composition: which arguments reach the framework (only those ms_shm changed), which
global settings are changed and recorded in the session, that ``restore()`` undoes them, and that a request
that cannot fit stops before anything is built.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ms_shm
from ms_shm import api
from ms_shm import state as session_mod
from ms_shm.changes import NOFILE
from tests.fakes import FakeConfig, FakeEngine, MiB, host_facts


class Rows:
    def __init__(self, n=64, nbytes=MiB):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return (np.zeros(self.nbytes, np.uint8), np.array(index, np.int64))


@pytest.fixture
def fake(monkeypatch):
    """A fake engine behind ``ms_shm.api``, and a host the test sets with ``fake.host(**facts)``."""
    engine = FakeEngine()
    monkeypatch.setattr(api, "_engine", lambda: engine)
    # A MindSpore program, whatever this test process imported before (torch, by another test file, made tune()
    # leave MindSpore's settings alone: a row size's prefetch was not set, run after test_rows.py)
    monkeypatch.setattr(api, "_mindspore_in_use", lambda: True)
    state = {"facts": host_facts()}
    monkeypatch.setattr(session_mod.host, "probe", lambda ranks=None: state["facts"])
    engine.host = lambda **kw: state.update(facts=host_facts(**kw))
    ms_shm.reset()
    yield engine
    ms_shm.reset()


def test_an_iterable_reaches_the_framework_untouched(fake):
    source = [(np.array([i]),) for i in range(3)].__iter__()
    dataset = ms_shm.build_dataset(source, ["x"], num_parallel_workers=2)
    assert dataset.source is source and dataset.kwargs == {"num_parallel_workers": 2}
    assert ms_shm.plan_of(dataset).mode == "inline"


def test_a_roomy_host_changes_nothing_global_and_passes_only_what_it_chose(fake):
    dataset = ms_shm.build_dataset(Rows(), ["data", "label"], shuffle=False)
    p = ms_shm.plan_of(dataset)
    assert fake.applied == [] and ms_shm.session().changes == []
    expected = {"shuffle": False}
    if p.workers != 1:
        expected["num_parallel_workers"] = p.workers
    if p.mode != "processes" and p.workers != 1:
        expected["python_multiprocessing"] = False
    assert dataset.kwargs == expected


def test_a_small_dev_shm_with_explicit_processes_lowers_prefetch_records_it_and_restores(fake):
    fake.host(shm_total=64 * MiB, shm_free=64 * MiB)
    dataset = ms_shm.build_dataset(Rows(nbytes=8 * MiB), ["data", "label"], shuffle=False, num_parallel_workers=2,
                                   python_multiprocessing=True)
    p = ms_shm.plan_of(dataset)
    # 2 workers x 4 slots (prefetch 2) x 8 MiB = 64 MiB > 51.2 MiB budget: only pipes fit
    assert (p.mode, p.workers) == ("pipes", 2)
    assert dataset.kwargs == {"shuffle": False, "num_parallel_workers": 2, "python_multiprocessing": True}
    assert ("shared_mem", False) in fake.applied
    assert [c.setting for c in ms_shm.session().changes] == [s for s, _ in fake.applied]
    ms_shm.session().restore()
    assert fake.config.shared_mem is True and fake.config.prefetch_size == 16
    assert ms_shm.session().changes == []


def test_explicit_settings_that_cannot_fit_stop_before_anything_is_built(fake):
    fake.config = FakeConfig(has_shared_mem_switch=False)  # no pipes on this release
    fake.host(shm_total=64 * MiB, shm_free=64 * MiB)
    with pytest.raises(ms_shm.ShmBudgetError) as err:
        ms_shm.build_dataset(Rows(nbytes=8 * MiB), ["data", "label"], num_parallel_workers=2,
                             python_multiprocessing=True)
    assert isinstance(err.value, ms_shm.Error) and "Fix:" in str(err.value)
    assert fake.built == []


def test_map_measures_in_the_child_and_keeps_unmeasurable_inputs_as_asked(fake):
    base = ms_shm.build_dataset(Rows(n=8, nbytes=1024), ["data", "label"], shuffle=False)
    mapped = ms_shm.map(base, lambda d: np.concatenate([d, d]), input_columns=["data"], num_parallel_workers=1)
    p = ms_shm.plan_of(mapped)
    assert p.row_bytes == 2048  # the output row, measured on rows the child re-read from the source
    assert mapped.kwargs == {"num_parallel_workers": 1}
    foreign = ms_shm.map(fake.compat.generator_dataset([1], ["data"], {}), lambda d: d, input_columns=["data"])
    assert "mode_locked" in {d.setting for d in ms_shm.plan_of(foreign).decisions}
    assert foreign.kwargs == {}


def test_a_map_that_passed_no_workers_says_the_global_number_it_leaves(fake, caplog):
    """MindSpore runs such a map at its global ``num_parallel_workers``, which a program may have set
    (``ds.config.set_num_parallel_workers(1)``, an audit): where ms_shm chooses another number, it says so at
    INFO, naming the global."""
    fake.config = FakeConfig(num_parallel_workers=1)
    base = ms_shm.build_dataset(Rows(n=8, nbytes=1024), ["data", "label"], shuffle=False)
    with caplog.at_level(logging.INFO, logger="ms_shm"):
        p = ms_shm.plan_of(ms_shm.map(base, lambda d: d, input_columns=["data"]))
    said = [d for d in p.decisions if d.setting == "num_parallel_workers"]
    assert said == ([] if p.workers == 1 else [said[0]]), p.decisions
    if said:
        assert (said[0].default, said[0].value) == (1, p.workers)
        assert "global num_parallel_workers=1" in caplog.text
    for default in (1, 2, 3):
        fake.config = FakeConfig(num_parallel_workers=default)
        p = ms_shm.plan_of(ms_shm.map(base, lambda d: d, input_columns=["data"]))
        expected = [] if p.workers == default else [("num_parallel_workers", default, p.workers)]
        assert [(d.setting, d.default, d.value) for d in p.decisions if d.setting == "num_parallel_workers"] \
            == expected
    assert p.workers != 3  # the fake host has 2 CPUs: one of the three differs


def test_tune_raises_a_low_fd_limit_only_when_not_a_dry_run(fake, monkeypatch):
    fake.host(nofile_soft=40, nofile_hard=4096)
    calls = []
    monkeypatch.setattr(api.changes_mod, "set_nofile_soft", lambda value, reason: calls.append(value))
    dry = ms_shm.tune(dry_run=True)
    assert [d.setting for d in dry.decisions] == [NOFILE] and calls == [] and dry.changes == ()
    ms_shm.tune()
    assert calls == [4096]  # the target (65536) capped at the hard limit


def test_tune_with_a_row_size_sets_a_fitting_prefetch_and_restores_it(fake):
    fake.host(shm_total=256 * MiB, shm_free=256 * MiB)
    report = ms_shm.tune(row_mb=8, workers=2)
    # Budget 0.8 x 256 MiB = 204.8 MiB. With 2 workers a worker has S = P + 2 slots, so the peak is
    # 2 x (P + 2) x 8 MiB + 19 semaphore pages: P = 10 needs 192 MiB + 76 KiB, P = 11 needs 208 MiB.
    chosen = next(d.value for d in report.decisions if d.setting == "prefetch_size")
    assert chosen == 10
    assert fake.config.prefetch_size == chosen
    report.restore()
    assert fake.config.prefetch_size == 16


class Paths(Rows):
    """A source holding a list every forked worker comes to copy as it reads (copy-on-read)."""

    def __init__(self):
        super().__init__()
        self.names = [f"images/{i:08d}.jpg" for i in range(100_000)]


def test_what_each_worker_copies_of_the_sources_lists_counts_in_its_memory(fake):
    """A source holding 2M paths was planned in processes at 479 of a 485 MiB memory budget, without the
    ~189 MiB each worker copies, and was OOM-killed."""
    from dataclasses import replace

    from ms_shm import cow, measure
    from ms_shm.rows import RowStats

    copied = sum(f.bytes_per_worker for f in cow.inspect_source(Paths(), workers=1))
    probe = measure.StageProbe(replace(RowStats.synthetic(MiB), worker_bytes=5 * MiB))
    facts = ms_shm.session().host_facts()
    assert copied > 1 << 20
    paths = api._copies([(api.SOURCE, Paths())], facts, "fork")
    assert api._with_worker_memory(probe, paths, "fork", facts).stats.worker_bytes == 5 * MiB + copied
    assert api._with_worker_memory(probe, api._copies([(api.SOURCE, Rows())], facts, "fork"), "fork", facts) is probe
