"""Threads per worker: the pure decision over a table of hosts, the probe on the real host (types, never raises),
the wrappers' transparency without MindSpore, and one real-MindSpore run: workers capped, the main process's
pools unchanged, rows identical to raw."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ms_shm import threads
from ms_shm.budget import Budget
from ms_shm.plan import Plan
from ms_shm.threads import CappedCall, CappedSource, ThreadPool, ThreadPools, decide
from tests import isolated

BLAS = lambda n: ThreadPools((ThreadPool("blas", "openblas", n),))  # noqa: E731
BLAS_OMP = ThreadPools((ThreadPool("blas", "openblas", 4), ThreadPool("openmp", "openmp", 16)))
CV = ThreadPools((ThreadPool("blas", "openblas", 2), ThreadPool("opencv", "opencv", 8)))


@pytest.mark.parametrize("workers, pools, cpus, enabled, cap, reason", [
    (2, BLAS(2), 2, True, 1, "capped to 1 per worker: 2 workers × 2 BLAS/OpenMP threads > 2 CPUs"),
    (8, BLAS(64), 64, True, 8, "capped to 8 per worker: 8 workers × 64 BLAS/OpenMP threads > 64 CPUs"),
    (3, BLAS(8), 8, True, 2, "capped to 2 per worker: 3 workers × 8 BLAS/OpenMP threads > 8 CPUs"),
    (16, BLAS(4), 4, True, 1, "capped to 1 per worker: 16 workers × 4 BLAS/OpenMP threads > 4 CPUs"),  # never 0
    (2, BLAS_OMP, 16, True, 8, "capped to 8 per worker: 2 workers × 16 BLAS/OpenMP threads > 16 CPUs"),  # largest
    (2, CV, 4, True, 2, "capped to 2 per worker: 2 workers × 8 OpenCV threads > 4 CPUs"),
    (2, BLAS(1), 2, True, None, "not capped: 2 workers × 1 BLAS/OpenMP threads <= 2 CPUs"),
    (4, BLAS(2), 8, True, None, "not capped: 4 workers × 2 BLAS/OpenMP threads <= 8 CPUs"),
    (2, BLAS(2), 2, False, None, "not capped (MS_SHM_THREAD_CAP=0): 2 workers × 2 BLAS/OpenMP threads > 2 CPUs"),
    (0, BLAS(2), 2, True, None, "not capped: no worker processes, rows are made in this process, whose pools "
                                "ms_shm never changes"),
    (2, ThreadPools(), 2, True, None, "not capped: no BLAS, OpenMP or OpenCV thread pool is loaded"),
    (2, ThreadPools((), False, ("threadpoolctl.threadpool_info(): OSError: boom",)), 2, True, None,
     "not capped: native thread pools unknown (threadpoolctl.threadpool_info(): OSError: boom)"),
])
def test_the_cap_is_cpus_over_workers_only_when_workers_times_threads_exceed_the_cpus(workers, pools, cpus,
                                                                                     enabled, cap, reason):
    got = decide(workers, pools, cpus, enabled)
    assert (got.threads_per_worker, got.reason) == (cap, reason)
    d = got.decision()
    assert d.setting == "num_threads" and d.default == (pools.largest().num_threads if pools.largest() else None)
    assert d.value == (cap if cap is not None else d.default)


NO_THREAD_STARTED = ("not capped: the probe rows' work started no native thread (it runs on the worker's own "
                     "thread), so the pools stay idle in the workers")


@pytest.mark.parametrize("started, cap, reason", [
    (None, 1, "capped to 1 per worker: 2 workers × 2 BLAS/OpenMP threads > 2 CPUs"),  # not measured: as before
    (1, 1, "capped to 1 per worker: 2 workers × 2 BLAS/OpenMP threads > 2 CPUs"),  # the rows started a pool
    (0, None, NO_THREAD_STARTED),  # a limit would only start OpenBLAS's pool again in each worker
])
def test_a_stage_whose_probe_rows_start_no_native_thread_is_not_capped(started, cap, reason):
    got = decide(2, BLAS(2), 2, True, threads_started=started)
    assert (got.threads_per_worker, got.reason) == (cap, reason)


def test_the_pools_are_read_only_where_a_stage_in_worker_processes_started_a_native_thread(monkeypatch):
    """Reading the pools walks every loaded library (15-28 ms with MindSpore loaded): a plan without worker
    processes, or whose probe rows started no native thread, has nothing to cap and does not pay it."""
    reads = []
    monkeypatch.setattr(threads, "probe", lambda: reads.append(1) or BLAS(2))
    processes, inline = plan(), plan("inline", 1, False)
    assert threads.plan_cap(inline, 2, threads_started=1) == (inline, None) and not reads
    p, n = threads.plan_cap(processes, 2, threads_started=0)
    assert (n, p.decisions[-1].reason, reads) == (None, NO_THREAD_STARTED, [])
    assert threads.plan_cap(processes, 2, threads_started=1)[1] == 1 and reads == [1]
    assert decide(2, None, 2, True, threads_started=None).reason == "not capped: native thread pools unknown (not read)"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("work, started", [("numpy elementwise", 0), ("BLAS matmul", 1)])
def test_the_probe_child_counts_the_native_threads_the_rows_start(work, started, monkeypatch):
    """Measured, not modelled: an elementwise numpy row starts no thread in the probe child, a matmul starts
    OpenBLAS's pool again (a fork keeps only the calling thread). Forced to two BLAS threads, so that the pool
    has a thread to start on any host."""
    import threadpoolctl

    from ms_shm import sandbox

    a = np.ones((256, 256))
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        a @ a  # the parent's pool runs
        rows = (lambda: np.resize(a, 1 << 20).sum()) if work == "numpy elementwise" else (lambda: float((a @ a)[0, 0]))
        outcome = sandbox.run_in_fork(rows)
    assert outcome.value is not None and outcome.threads_started == started


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False), (" False ", False)])
def test_the_opt_out_is_ms_shm_thread_cap_0(value, on):
    assert threads.enabled({} if value is None else {"MS_SHM_THREAD_CAP": value}) is on


def test_the_probe_on_this_host_returns_types_and_never_raises():
    pools = threads.probe()
    assert pools.known and all(isinstance(p.num_threads, int) and p.user_api in ("blas", "openmp", "opencv")
                               for p in pools.pools)
    assert any(p.user_api == "blas" for p in pools.pools)  # numpy's BLAS is loaded: ms_shm imports numpy
    json.dumps(pools.to_dict())


def test_a_failing_probe_is_unknown_and_no_cap(monkeypatch):
    import threadpoolctl

    def boom():
        raise OSError("dl_iterate_phdr failed")

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", boom)
    monkeypatch.setattr(threads, "_probed", {})
    pools = threads.probe()
    assert not pools.known and "OSError: dl_iterate_phdr failed" in pools.notes[0]
    assert decide(2, pools, 2).threads_per_worker is None


def test_the_probe_reads_the_pools_once_until_a_module_other_than_ms_shms_is_imported(monkeypatch):
    import sys

    import threadpoolctl

    calls = []

    class Counted:
        def __init__(self):
            calls.append(1)

        def info(self):
            return []

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", Counted)
    monkeypatch.setattr(threads, "_probed", {})
    monkeypatch.setattr(threads, "_controller", ())
    threads.probe(), threads.probe()
    assert len(calls) == 1
    monkeypatch.setitem(sys.modules, "ms_shm.a_lazily_imported_module", object())  # ms_shm's own: no library
    threads.probe()
    assert len(calls) == 1
    monkeypatch.setitem(sys.modules, "ms_shm_lookalike", object())  # somebody else's module, however named
    threads.probe()
    assert len(calls) == 2


def _unloaded_extension() -> str | None:
    """A standard-library extension module this process has not imported: importing it loads a shared object."""
    import importlib.util

    return next((name for name in ("_sqlite3", "_lzma", "_bz2", "_curses", "_dbm", "_gdbm", "readline")
                 if name not in sys.modules and importlib.util.find_spec(name) is not None), None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_worker_limits_its_pools_through_the_plans_reading_without_walking_the_libraries(monkeypatch):
    """A fork after the probe, with no library loaded since, applies the cap through the controller the plan
    read (~1 ms) rather than ``threadpool_limits`` (9-16 ms per worker with MindSpore loaded); after a library
    was loaded it walks the libraries anew, so that library's pool is capped too."""
    import threadpoolctl

    extension = _unloaded_extension()
    if extension is None:
        pytest.skip("every candidate extension module is already imported here")
    monkeypatch.setattr(threads, "_probed", {})
    threads.probe()

    def in_fork(load_first: bool) -> tuple:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child side
            walked = []
            real = threadpoolctl.threadpool_limits
            threadpoolctl.threadpool_limits = lambda **kw: walked.append(kw) or real(**kw)
            if load_first:
                __import__(extension)
            threads.limit_this_process(1)
            blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
            os.write(write_end, json.dumps([len(walked), max(blas)]).encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        with os.fdopen(read_end) as f:
            return tuple(json.loads(f.read()))

    assert in_fork(load_first=False) == (0, 1)
    assert in_fork(load_first=True) == (1, 1)


def plan(mode="processes", workers=2, multiprocessing=True) -> Plan:
    return Plan("generator", mode, workers, 16, multiprocessing, True, None, 1024, 0, 0, 0,
                Budget(1 << 30, None, 1, 0.8, 0, 0, "test"), True, 0, 0, None, None)


@pytest.mark.parametrize("mode, multiprocessing, recorded", [("processes", True, True), ("pipes", True, True),
                                                              ("threads", False, False), ("inline", False, False)])
def test_only_worker_process_plans_get_a_decision_and_a_wrapper(monkeypatch, caplog, mode, multiprocessing,
                                                                 recorded):
    monkeypatch.setattr(threads, "probe", lambda: BLAS(2))
    caplog.set_level("INFO", logger="ms_shm")
    source = [1, 2, 3]
    p, feed = threads.cap_source(plan(mode, 2, multiprocessing), source, 2)
    assert [d.setting for d in p.decisions] == (["num_threads"] if recorded else [])
    assert (type(feed) is CappedSource) is recorded and (feed is source) is not recorded
    logged = [r.getMessage() for r in caplog.records if r.name == "ms_shm.threads"]
    assert logged == (["num_threads: capped to 1 per worker: 2 workers × 2 BLAS/OpenMP threads > 2 CPUs"]
                      if recorded else [])


def test_the_opt_out_records_why_and_wraps_nothing(monkeypatch):
    monkeypatch.setattr(threads, "probe", lambda: BLAS(2))
    monkeypatch.setenv("MS_SHM_THREAD_CAP", "0")
    source = [1, 2, 3]
    p, feed = threads.cap_source(plan(), source, 2)
    assert feed is source and "MS_SHM_THREAD_CAP=0" in p.decisions[-1].reason


def test_only_the_first_plain_python_operation_is_wrapped(monkeypatch):
    monkeypatch.setattr(threads, "probe", lambda: BLAS(2))

    class Transform:  # what MindSpore's own transforms look like to map: they carry ``implementation``
        implementation = "C"

        def __call__(self, x):
            return x

    first, second, t = (lambda x: x), (lambda x: x), Transform()
    _, ops = threads.cap_operations(plan(), [t, first, second], 2)
    assert ops[0] is t and type(ops[1]) is CappedCall and ops[1]._ms_shm_wrapped is first and ops[2] is second
    _, single = threads.cap_operations(plan(), first, 2)
    assert type(single) is CappedCall
    _, untouched = threads.cap_operations(plan(), [t], 2)
    assert untouched == [t]


class Source:
    def __init__(self):
        self.rows, self.seen, self.extra = [b"a", b"b"], [], "attr"

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        self.seen.append(index)
        if index == 9:
            raise KeyError("no row 9")
        return self.rows[index]


def per_batch(x, y, batch_info):
    return x, y


def test_wrappers_return_pass_and_raise_exactly_what_the_wrapped_object_does():
    src = Source()
    wrapped = CappedSource(src, 1)
    index = np.int64(1)  # MindSpore's sampler passes numpy integers: the very object reaches the source
    row = wrapped[index]
    assert row is src.rows[1] and len(wrapped) == 2 and wrapped.extra == "attr" and wrapped._ms_shm_wrapped is src
    with pytest.raises(KeyError) as exc:
        wrapped[9]
    assert exc.value.args == ("no row 9",)
    assert src.seen[0] is index and src.seen[1] == 9
    call = CappedCall(per_batch, 1)
    out = object()
    assert call(out, 2, None)[0] is out and call.__name__ == "per_batch"
    assert inspect.signature(call) == inspect.signature(per_batch)  # MindSpore checks per_batch_map's arity
    assert repr(call) == repr(per_batch)


def test_wrappers_pickle_and_copy_without_recursion_and_start_pending():
    import copy

    wrapped = CappedSource(Source(), 3)
    for clone in (pickle.loads(pickle.dumps(wrapped)), copy.deepcopy(wrapped), copy.copy(wrapped)):
        assert clone._ms_shm_threads == 3 and clone[0] == b"a" and clone.extra == "attr"
    call = pickle.loads(pickle.dumps(CappedCall(per_batch, 2)))
    assert call(1, 2, None) == (1, 2)


def test_the_main_process_never_applies_the_cap(monkeypatch):
    applied = []
    monkeypatch.setattr(threads, "limit_this_process", applied.append)
    wrapped = CappedSource(Source(), 1)
    wrapped[0]
    assert applied == [] and wrapped._ms_shm_pending
    wrapped._ms_shm_plan_pid = -1  # as a worker sees it: another pid built the plan
    wrapped[0]
    wrapped[1]
    assert applied == [1] and not wrapped._ms_shm_pending  # once per worker


WORKERS_SCRIPT = r"""
import json, logging, os
import numpy as np, threadpoolctl
import mindspore.dataset as ds
import ms_shm

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")

def blas():
    return max(p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas")

class Rows:
    def __len__(self):
        return 24
    def __getitem__(self, i):  # a matmul big enough for OpenBLAS to use its pool: the probe sees it start
        a = np.arange(65536, dtype=np.float64).reshape(256, 256) / (i + 1)
        return (a @ a, np.array(blas(), np.int64), np.array(os.getpid(), np.int64))

def with_threads(x):
    return (x @ x) * 0 + x * 2, np.array(blas(), np.int64)

def rows(d):
    return [[c.tobytes() for c in r] for r in d.create_tuple_iterator(output_numpy=True, num_epochs=1)]

kw = dict(num_parallel_workers=2, python_multiprocessing=True, shuffle=False)
names = ["x", "threads", "pid"]
before = blas()
raw = rows(ds.GeneratorDataset(Rows(), names, **kw))
built = ms_shm.build_dataset(Rows(), names, **kw)
ours = rows(built)
mapped = ms_shm.map(ds.GeneratorDataset(Rows(), names, shuffle=False), with_threads, input_columns=["x"],
                    output_columns=["x", "mt"], num_parallel_workers=2, python_multiprocessing=True)
mapped_rows = [r for r in mapped.create_dict_iterator(output_numpy=True, num_epochs=1)]
t = lambda rs, k: sorted({int(np.frombuffer(r[k], np.int64)[0]) for r in rs})
print("RESULT " + json.dumps({
    "before": before, "after": blas(), "decision": ms_shm.plan_of(built).decisions[-1].to_dict(),
    "map_decision": ms_shm.plan_of(mapped).decisions[-1].to_dict(),
    "raw_threads": t(raw, 1), "our_threads": t(ours, 1), "map_threads": sorted({int(r["mt"]) for r in mapped_rows}),
    "our_pids": t(ours, 2), "same_x": [r[0] for r in raw] == [r[0] for r in ours], "rows": [len(raw), len(ours)],
    "map_rows": len(mapped_rows), "cpus": ms_shm.probe().usable_cpus}))
"""


@pytest.mark.mindspore
def test_real_workers_are_capped_while_the_main_process_keeps_its_pools():
    """Two GeneratorDataset worker processes (and two map workers) report their BLAS threads in the row: capped
    to ``C // 2`` through ms_shm, the pools' own count raw. The BLAS pool is forced to the CPU count (any host
    oversubscribes with 2 workers then). The threads column is the one intended difference."""
    why = isolated.mindspore_missing()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                              "MS_SHM_THREAD_CAP")}
    env.update(OPENBLAS_NUM_THREADS=str(os.cpu_count()), GLOG_v="2",
               PYTHONPATH=str(isolated.REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(WORKERS_SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(isolated.REPO))
    r = isolated.result_of(proc)
    cap, pool = max(1, r["cpus"] // 2), os.cpu_count()
    assert r["before"] == r["after"] == pool, "the main process's pools must be untouched"
    assert r["raw_threads"] == [pool] and r["our_threads"] == [cap] and r["map_threads"] == [cap]
    assert len(r["our_pids"]) == 2 and os.getpid() not in r["our_pids"]
    assert r["same_x"] and r["rows"] == [24, 24] and r["map_rows"] == 24
    reason = f"capped to {cap} per worker: 2 workers × {pool} BLAS/OpenMP threads > {r['cpus']} CPUs"
    assert r["decision"] == {"setting": "num_threads", "value": cap, "default": pool, "reason": reason,
                             "asked": False, "precaution": False}
    assert r["map_decision"]["reason"] == reason
    assert f"ms_shm.threads num_threads: {reason}" in proc.stderr


def test_the_wrappers_attributes_are_the_users_to_read_and_write():
    """``dataset.source.scale = 2`` between epochs reaches the user's object, and the user's own ``source``,
    ``threads`` or ``spec`` attribute is not shadowed by the wrapper's state."""
    from ms_shm.engines.mindspore.guard import GuardedSource, GuardSpec

    class Named:
        def __init__(self):
            self.source, self.threads, self.spec, self.scale = "train.txt", 4, {"aug": "none"}, 1

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return (np.full(2, self.scale),)

    user = Named()
    guarded = GuardedSource(user, GuardSpec(slots=4, worker_bytes=1 << 30, planned_row_bytes=16, fix="-"))
    for wrapped in (CappedSource(user, 1), CappedSource(guarded, 1), guarded):
        assert (wrapped.source, wrapped.threads, wrapped.spec) == ("train.txt", 4, {"aug": "none"})
        wrapped.scale = 3
        assert user.scale == 3 and wrapped[0][0].tolist() == [3, 3]
        del wrapped.scale
        assert not hasattr(user, "scale")
        user.scale = 1
