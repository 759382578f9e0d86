"""Importable test doubles: a host built by hand, and an engine that records what ms_shm asked of the framework.

The fake engine keeps MindSpore's real rules (profiles, arithmetic, planning, guard: pure, importable without
MindSpore) and replaces only the adapter that would touch MindSpore, so the composition in ``ms_shm.api`` runs
in-process, without MindSpore and without root.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ms_shm.changes import Change
from ms_shm.engines.mindspore import MindSporeEngine
from ms_shm.host import HostFacts, Ranks
from ms_shm.logind import LogindFacts

MiB, GiB = 1 << 20, 1 << 30
HUGE = 18446744073692774399


def host_facts(**overrides: Any) -> HostFacts:
    """A roomy 2-CPU bare host; each test changes only what it is about."""
    base = dict(
        shm_path="/dev/shm", shm_total=32 * GiB, shm_free=32 * GiB, mem_total=24 * GiB, mem_available=20 * GiB,
        cgroup_version="v1", cgroup_mem_limit=None, cgroup_mem_usage=None, cpu_count=2, cpu_affinity=2,
        cpu_quota=None, usable_cpus=2, nofile_soft=65536, nofile_hard=65536, open_fds=6, shmmax=HUGE,
        shmall_pages=HUGE, shmmni=4096, msgmni=32000, sysv_segments=0, sysv_bytes=0, container=None,
        ranks=Ranks(1, 0, "default"), mindspore_version="2.10.0", start_method="fork", notes=(),
    )
    base.update(overrides)
    return HostFacts(**base)


@dataclass(frozen=True)
class FakeConfig:
    version: str | None = "2.10.0"
    prefetch_size: int | None = 16
    shared_mem: bool | None = True
    start_method: str | None = "fork"
    num_parallel_workers: int | None = 2
    has_shared_mem_switch: bool = True
    generator_takes_max_rowsize: bool = True


@dataclass(eq=False)  # hashable by identity, as MindSpore's datasets are
class FakeDataset:
    """What ``GeneratorDataset(...)`` or ``.map(...)`` was called with."""

    source: Any
    column_names: Any
    kwargs: dict
    operations: Any = None
    children: list = field(default_factory=list)

    def get_col_names(self) -> list:
        return list(self.column_names or [])


class FakeCompat:
    """The adapter's surface, recording every call instead of touching MindSpore."""

    def __init__(self, engine: "FakeEngine"):
        self.engine = engine

    def real_method(self, kind):
        return None

    def validate(self, kind, real, *args, **kwargs):
        return None  # MindSpore's own checks: none without MindSpore

    def arguments_fit(self, kind, *args, **kwargs):
        return True

    def row_check(self):
        return None

    def column_dtypes(self, column_types, schema=None):
        return None

    def processes_blocker(self):
        return None

    def in_use(self, dataset):
        return lambda: True  # no iterators without MindSpore: every pipeline keeps its reservation

    def follows_prefetch(self, dataset):
        return lambda: True  # no iterator made yet: the next one reads the global prefetch

    def pipeline_of(self, dataset):
        return ()  # no tree of stages: each is a pipeline of its own

    def switch_workers(self, stage, workers, processes):
        stage.kwargs["num_parallel_workers"] = workers
        if workers > 1:
            stage.kwargs["python_multiprocessing"] = processes

    def generator_dataset(self, source, column_names, kwargs, threads_asked=True):
        self.engine.built.append(FakeDataset(source, column_names, dict(kwargs)))
        return self.engine.built[-1]

    def map_dataset(self, dataset, operations, input_columns, output_columns, kwargs):
        names = list(output_columns or input_columns or dataset.get_col_names())
        self.engine.built.append(FakeDataset(None, names, dict(kwargs), operations, [dataset]))
        return self.engine.built[-1]

    def rows_come_from(self, dataset):
        return dataset

    def rows_per_epoch(self, dataset, known):
        return known(dataset)

    def batches(self, rows, batch_size, drop_remainder):
        from ms_shm.engines.mindspore import compat

        return compat.batches(rows, batch_size, drop_remainder)

    def network_operators_in(self, source):
        return None

    def sampled_rows(self, kwargs):
        return None

    def probe_rows_drawn(self, kwargs):
        return True  # no sampler without MindSpore: the probe's rows are drawn

    def is_dataset(self, value):
        return isinstance(value, FakeDataset)

    def one_worker_by_mindspore(self, kind, target, dataset=None):
        return None

    def source_code_read_once(self):
        import contextlib

        return contextlib.nullcontext()

    def starts_python_pool(self, operations):
        from ms_shm.engines.mindspore import compat

        return compat.starts_python_pool(operations)

    def python_code_in(self, dataset):
        return "FakeDataset (a Python source)"

    def column_names(self, dataset):
        return dataset.get_col_names()

    def take_rows(self, dataset, count):
        raise AssertionError("a pipeline with Python code must not be run ahead")

    def failing_row_fate(self, config):
        from ms_shm.engines.mindspore import compat

        return compat.failing_row_fate(config)


class FakeEngine(MindSporeEngine):
    """MindSpore's rules, a recording adapter, and a config the test sets."""

    def __init__(self, config: FakeConfig | None = FakeConfig()):
        self.config = config
        self.built: list = []
        self.applied: list = []
        self.undone: list = []
        self._compat = FakeCompat(self)

    @property
    def compat(self):
        return self._compat

    def read_config(self):
        return self.config

    def apply_setting(self, setting, value, reason):
        old = getattr(self.config, setting)
        if old == value:
            return None
        self.config = replace(self.config, **{setting: value})
        self.applied.append((setting, value))
        return Change(setting, old, value, reason)

    def undo(self, changes):
        for change in reversed(list(changes)):
            self.config = replace(self.config, **{change.setting: change.old})
            self.undone.append(change.setting)


def logind_facts(**overrides: Any) -> LogindFacts:
    """systemd-logind as Debian and Ubuntu ship it (RemoveIPC=yes by default) for alice, a normal user who does
    not linger: her IPC goes when her last session ends. Pass it as ``host_facts(logind=logind_facts(...))``."""
    base = dict(remove_ipc=True, source="systemd default", systemd_present=True, user="alice", uid=1000,
                system_user=False, sys_uid_max=999, linger=False, at_risk=True, reason="RemoveIPC=yes", notes=())
    base.update(overrides)
    return LogindFacts(**base)


class FakeClock:
    """A probe clock the code under test advances: exact figures, no wall-clock time asserted on. ``kernel`` is
    the system CPU time of the thread (``parallel.kernel_seconds``), ``pool`` the CPU time other threads of the
    process burned (a library's own thread pool: ``time.process_time`` counts it, ``thread_time`` does not)."""

    def __init__(self) -> None:
        self.now = self.kernel = self.pool = 0.0

    def perf_counter(self) -> float:
        return self.now

    thread_time = perf_counter

    def process_time(self) -> float:
        return self.now + self.pool


def fake_probe_clock(monkeypatch: Any) -> FakeClock:
    """Every probe read is timed through ``parallel.timed_call``: this clock in place of its wall, CPU and kernel
    time."""
    from ms_shm import parallel

    clock = FakeClock()
    monkeypatch.setattr(parallel, "time", clock)
    monkeypatch.setattr(parallel, "kernel_seconds", lambda: clock.kernel)
    monkeypatch.setattr(parallel, "GilWatch", _UnwatchedGil)  # naps on a fake clock would time nothing
    return clock


class _UnwatchedGil:
    """``parallel.GilWatch`` that saw too little: pairs timed on a fake clock fall back to their overlap."""

    def start(self) -> "_UnwatchedGil":
        return self

    def stop(self) -> None:
        pass

    def busy(self, begin: float, end: float) -> None:
        return None
