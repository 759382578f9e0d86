"""``ms_shm.watch``: the pure rules, the sampler on this host, then real MindSpore under a private /dev/shm."""

from __future__ import annotations

import csv
import json
import logging
import os
import resource
import shlex
import subprocess
import sys
import time

import pytest

import ms_shm
from ms_shm.watch import CSV_COLUMNS, descendants, fd_warning, growth, job_segments, shm_warning, watch

MiB = 1 << 20


@pytest.mark.parametrize("used, total, fires", [
    (int(0.85 * 64 * MiB), 64 * MiB, True),
    (int(0.80 * 64 * MiB), 64 * MiB, False),  # "passes 80%": exactly 80% is not yet
    (10 * MiB, 64 * MiB, False),
    (None, 64 * MiB, False),
    (10 * MiB, None, False),
    (10 * MiB, 0, False),
])
def test_shm_warning_threshold(used, total, fires):
    text = shm_warning(used, total)
    assert (text is not None) == fires
    if fires:
        assert "85% full" in text and "54.4 MiB of 64.0 MiB" in text
        assert "--shm-size=1g" in text and "medium: Memory" in text


def test_shm_warning_suggests_double_of_a_big_mount():
    assert "--shm-size=16g" in shm_warning(7 << 30, 8 << 30)


@pytest.mark.parametrize("fds, soft, hard, expect", [
    (900, 1024, 1_048_576, "ulimit -n 65536"),
    (900, 1024, 4096, "ulimit -n 4096"),
    (900, 1024, 1024, "hard limit (1024) is reached"),
    (900, 1024, resource.RLIM_INFINITY, "ulimit -n 65536"),
    (800, 1024, 4096, None),
    (5, resource.RLIM_INFINITY, resource.RLIM_INFINITY, None),
    (None, 1024, 4096, None),
])
def test_fd_warning(fds, soft, hard, expect):
    text = fd_warning(fds, soft, hard, "a worker process")
    if expect is None:
        assert text is None
    else:
        assert expect in text and "Too many open files" in text and "a worker process" in text


@pytest.mark.parametrize("series, steady", [
    ([100 * MiB, 120 * MiB, 140 * MiB, 160 * MiB], True),           # a leak: +20 MiB every epoch
    ([100 * MiB, 300 * MiB, 301 * MiB, 301 * MiB], False),          # warm-up, then flat
    ([100 * MiB, 120 * MiB, 140 * MiB], False),                     # two epochs are not a trend yet
    ([100 * MiB, 105 * MiB, 110 * MiB, 115 * MiB], False),          # under 8 MiB per epoch
    ([4 << 30, (4 << 30) + 20 * MiB, (4 << 30) + 40 * MiB, (4 << 30) + 60 * MiB], False),  # under 1%
    ([100 * MiB, 150 * MiB, 140 * MiB, 160 * MiB, 180 * MiB, 200 * MiB], True),  # the last three count
])
def test_growth_rule(series, steady):
    diffs, is_steady = growth(series)
    assert is_steady == steady
    assert diffs == tuple(b - a for a, b in zip(series, series[1:]))


def test_sampler_on_this_host_writes_csv_and_summary(tmp_path):
    streamed = tmp_path / "stream.csv"
    with watch(interval=0.02, csv_path=streamed, pids=[], shm_path=tmp_path) as w:
        time.sleep(0.15)
        w.mark_epoch()
        w.mark_epoch()
    summary = w.summary
    assert summary is w.stop()  # stopping twice returns the same summary
    assert summary.samples >= 2 and summary.epochs == 2  # the thread's first sample and stop()'s, at least
    assert summary.shm_total_bytes > 0 and 0 <= summary.peak_shm_fraction <= 1
    assert summary.peak_fds > 0 and summary.fd_soft_limit > 0
    assert summary.peak_workers == 0 and summary.warnings == ()
    assert isinstance(summary.sampler_cpu_fraction, float) and summary.sampler_cpu_fraction >= 0  # not a timing claim
    json.loads(summary.to_json())
    assert any("sampler CPU" in line for line in summary.lines())
    with open(streamed) as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == summary.samples + 1
    written = w.write_csv(tmp_path / "after.csv")
    assert written.read_text() == streamed.read_text()
    assert rows[-1][CSV_COLUMNS.index("epoch")] == "2"


def test_watcher_cannot_restart():
    w = watch(interval=0.05, pids=[]).start()
    w.stop()
    with pytest.raises(RuntimeError):
        w.start()
    with pytest.raises(ValueError):
        watch(interval=0)


def test_thresholds_fire_once_through_the_logger(tmp_path, caplog):
    (tmp_path / "data").write_bytes(b"x" * 65536)  # statvfs of a real mount: used > 0
    with caplog.at_level(logging.WARNING, logger="ms_shm.watch"):
        with watch(interval=0.01, pids=[], shm_path=tmp_path, shm_threshold=0.0, fd_threshold=0.0) as w:
            time.sleep(0.1)
    texts = [r.getMessage() for r in caplog.records if r.name == "ms_shm.watch"]
    assert sum("full" in t for t in texts) == 1 and sum("file descriptors" in t for t in texts) == 1
    assert len(w.summary.warnings) == 2


def test_unreadable_sources_become_notes(tmp_path):
    with watch(interval=0.05, pids=[], shm_path=tmp_path / "missing", sysv_path=tmp_path / "nope") as w:
        pass
    summary = w.summary
    assert summary.peak_shm_used_bytes is None and summary.peak_sysv_bytes is None
    assert any("statvfs" in note for note in summary.notes) and any("nope" in note for note in summary.notes)


GROWER = """
import sys
hoard = []
for line in sys.stdin:
    hoard.append(bytearray(int(line)))  # touched pages: unique memory that only grows, like a leak
    hoard[-1][::4096] = b"x" * len(hoard[-1][::4096])
    print("ok", flush=True)
"""


def test_steady_growth_of_a_real_child_warns(caplog):
    child = subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.pid in descendants(os.getpid())
        with caplog.at_level(logging.WARNING, logger="ms_shm.watch"):
            with watch(interval=0.05) as w:
                for _ in range(4):
                    child.stdin.write(f"{24 * MiB}\n")
                    child.stdin.flush()
                    assert child.stdout.readline().strip() == "ok"
                    w.mark_epoch()
    finally:
        child.kill()
        child.wait()
    growth_of_child = [item for item in w.summary.worker_growth if item.pid == child.pid]
    assert growth_of_child and growth_of_child[0].steady
    assert all(step > 20 * MiB for step in growth_of_child[0].growth_per_epoch)
    assert len(w.summary.growth_per_epoch_bytes) == 3
    assert any(f"worker pid {child.pid} grew" in r.getMessage() for r in caplog.records)


def test_the_sampler_reports_its_own_cpu_time():
    """At the default interval the thread samples at once and ``stop()`` once more, and the sampler's CPU time
    per wall second is reported. How small it is at 1 s is ``benchmarks/bench_watch.py``'s figure: a test
    asserts no CPU time."""
    with watch(pids=[]) as w:
        pass
    assert w.summary.interval_s == 1.0
    assert w.summary.samples == 2, w.summary
    assert isinstance(w.summary.sampler_cpu_fraction, float) and w.summary.sampler_cpu_fraction >= 0


def test_uss_is_rationed_by_its_budget():
    """USS reads smaps_rollup (~2.5 ms per MindSpore worker): with no budget it is only read at marks."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with watch(interval=0.01, pids=[child.pid], uss_budget=0.0) as w:
            time.sleep(0.1)
            w.mark_epoch()
    finally:
        child.kill()
        child.wait()
    assert w.summary.uss_samples == 1 and w.summary.peak_workers_uss_bytes > 0
    assert sum(s.workers_uss is not None for s in w.samples) == 1
    assert isinstance(w, ms_shm.Watcher)  # the class is public for type hints


# ------------------------------------------------------------------------------------- real MindSpore

GENERATOR_UNDER_WATCH = r"""
import json, os, sys, numpy as np, mindspore.dataset as ds
from ms_shm.watch import watch

class Rows:
    def __getitem__(self, i):
        return (np.full((1 << 18,), i, dtype=np.float32),)  # 1 MiB
    def __len__(self):
        return 48

data = ds.GeneratorDataset(Rows(), ["x"], num_parallel_workers=2, python_multiprocessing=True, shuffle=False)
with watch(interval=0.05, csv_path=sys.argv[1]) as w:
    for epoch in range(2):
        for row in data.create_tuple_iterator(output_numpy=True, num_epochs=1):
            pass
        w.mark_epoch()
print("RESULT " + w.summary.to_json(indent=None))
"""


@pytest.mark.mindspore
@pytest.mark.privileged
def test_real_generator_pipeline_under_watch(real_mindspore, tmp_path):
    csv_path = tmp_path / "samples.csv"
    result = real_mindspore.run_shell(
        f"exec {sys.executable} -c {shlex.quote(GENERATOR_UNDER_WATCH)} {csv_path}", shm="64m",
        env={"GLOG_v": "3"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, real_mindspore.describe(result)
    summary = json.loads(lines[-1][len("RESULT "):])
    assert summary["peak_shm_used_bytes"] > 0, summary
    assert summary["shm_total_bytes"] == 64 * MiB
    # 2 workers plus MindSpore's GeneratorCleanProcess, alive as long as they are: /proc cannot tell them apart
    assert summary["peak_workers"] == 3, summary
    assert summary["epochs"] == 2 and summary["warnings"] == []
    with open(csv_path) as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0].keys()) == CSV_COLUMNS and len(rows) == summary["samples"]
    assert max(int(row["workers"]) for row in rows) >= 2


MAP_UNDER_WATCH = r"""
import numpy as np, mindspore.dataset as ds
from ms_shm.watch import watch

class Rows:
    def __getitem__(self, i):
        return (np.full((1 << 18,), i, dtype=np.float32),)  # 1 MiB
    def __len__(self):
        return 48

def plus(x):
    return x + 1

data = ds.GeneratorDataset(Rows(), ["x"], shuffle=False)
data = data.map(plus, input_columns=["x"], num_parallel_workers=2, python_multiprocessing=True)
with watch(interval=0.05) as w:
    for row in data.create_tuple_iterator(output_numpy=True, num_epochs=1):
        pass
print("RESULT " + w.summary.to_json(indent=None))
"""


@pytest.mark.mindspore
@pytest.mark.privileged
def test_real_map_pipeline_counts_only_its_own_sysv_segments(real_mindspore):
    """MindSpore 2.7+ moves map rows through SysV segments: one per worker, created by the main process and
    attached by its worker. Run in this host's IPC namespace, beside whatever other jobs left there, the peak is
    those 2 segments of 1 MiB (plus MindSpore's 32-byte header each), nothing else."""
    result = real_mindspore.run_shell(f"exec {sys.executable} -c {shlex.quote(MAP_UNDER_WATCH)}", shm="64m",
                                      env={"GLOG_v": "3"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, real_mindspore.describe(result)
    summary = json.loads(lines[-1][len("RESULT "):])
    assert summary["peak_sysv_segments"] == 2, summary
    assert summary["peak_sysv_bytes"] == 2 * (MiB + 32), summary


@pytest.mark.privileged
def test_full_dev_shm_warns_with_the_fix(private_shm):
    code = ("import logging, time; logging.basicConfig(level=logging.WARNING); "
            "from ms_shm.watch import watch\n"
            "with watch(interval=0.05, pids=[]) as w: time.sleep(0.2)\n"
            "print('RESULT', w.summary.peak_shm_fraction, len(w.summary.warnings))")
    result = private_shm.run_shell(
        f"fallocate -l 55m /dev/shm/filler && exec {sys.executable} -c \"{code}\"", shm="64m")
    assert result.returncode == 0, private_shm.describe(result)
    assert "WARNING:ms_shm.watch:/dev/shm is 86% full" in result.stderr, private_shm.describe(result)
    assert "--shm-size=1g" in result.stderr
    fraction, count = result.stdout.split()[1:]
    assert float(fraction) > 0.8 and count == "1"


def test_memory_warning_names_the_container_limit_and_the_fix():
    from ms_shm.watch import memory_warning

    assert memory_warning(100 << 20, 450 << 20) is None and memory_warning(None, 1) is None
    assert memory_warning(440 << 20, None) is None
    text = memory_warning(430 << 20, 450 << 20)
    assert "96% used" in text and "450.0 MiB limit" in text and "--memory" in text and "exit 137" in text


# ------------------------------------------------------------------------------------- the watched job only


def test_job_segments_are_those_its_processes_created_or_attached():
    rows = [{"shmid": 1, "cpid": 100, "lpid": 100}, {"shmid": 2, "cpid": 100, "lpid": 101},  # main made, worker attached
            {"shmid": 3, "cpid": 900, "lpid": 101},  # made elsewhere, attached by a worker
            {"shmid": 4, "cpid": 900, "lpid": 901}, {"shmid": 5, "cpid": 900, "lpid": 0}]  # someone else's leftovers
    assert [row["shmid"] for row in job_segments(rows, {100, 101})] == [1, 2, 3]


HOLD_SEGMENT = r"""
import ctypes, subprocess, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0, int(sys.argv[1]), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
if shmid < 0 or libc.shmat(shmid, None, 0) == ctypes.c_void_p(-1).value:
    sys.exit("shmget/shmat failed: errno %d" % ctypes.get_errno())
libc.shmctl(shmid, 0, None)  # IPC_RMID now: the segment goes with this process, however it ends
if len(sys.argv) > 2:  # a worker of its own, holding the next size
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin (and our death closes the worker's)
"""


def test_sysv_peak_counts_only_the_watched_process_tree():
    """A job (main 1 MiB, worker 2 MiB) beside a 4 MiB segment of another process and this host's leftovers:
    only the job's 3 MiB in 2 segments count ("49.0 MiB in 5 segment(s)" was every segment on the machine)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    other = libc.shmget(0, 4 * MiB, 0o1600)  # IPC_PRIVATE segment of this (unwatched) process
    if other < 0:
        pytest.skip(f"no SysV shared memory here: errno {ctypes.get_errno()}")
    job = subprocess.Popen([sys.executable, "-c", HOLD_SEGMENT, str(MiB), HOLD_SEGMENT, str(2 * MiB)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "ready\n"
        with watch(interval=0.05, main_pid=job.pid) as w:
            time.sleep(0.3)
    finally:
        job.stdin.close()
        job.wait(10)
        libc.shmctl(other, 0, None)
    summary = w.summary
    assert (summary.peak_sysv_segments, summary.peak_sysv_bytes) == (2, 3 * MiB), summary.lines()
    assert "peak SysV shared memory of the watched job: 3.0 MiB in 2 segment(s)" in summary.lines()


def test_a_job_that_ends_is_no_failed_reading():
    """`ms-shm watch PID` of a `sleep` that ends: no notes about its vanished /proc files, no literal None."""
    job = subprocess.Popen(["sleep", "0.2"])
    with watch(interval=0.05, main_pid=job.pid) as w:
        job.wait(10)
        time.sleep(0.15)  # samples after the job is gone, as the CLI's last one is
    summary = w.summary
    assert summary.notes == (), summary.notes
    text = "\n".join(summary.lines())
    assert "None" not in text and "peak open fds: main " in text and ", worker -," in text
    assert "peak workers: 0\n" in text  # no "largest unknown" for a job without workers


def test_a_bad_interval_or_csv_path_is_a_usage_error(tmp_path):
    with pytest.raises(ms_shm.Error, match="finite number of seconds"):
        watch(interval=float("nan"))
    with pytest.raises(ms_shm.Error, match="cannot write the CSV file"):
        watch(interval=0.05, pids=[], csv_path=tmp_path / "missing" / "x.csv").start()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ms_shm", *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cli_refuses_an_unwritable_csv_and_a_nan_interval_with_exit_2(tmp_path):
    job = subprocess.Popen(["sleep", "30"])
    try:
        csv_path = tmp_path / "missing" / "x.csv"
        r = _cli("watch", str(job.pid), "--csv", str(csv_path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr == f"ms-shm watch: cannot write the CSV file {csv_path}: No such file or directory\n"
        r = _cli("watch", str(job.pid), "--csv", str(csv_path), "--json")
        assert r.returncode == 2 and json.loads(r.stdout)["error"].startswith("cannot write the CSV file")
        r = _cli("watch", str(job.pid), "--interval", "nan")
        assert r.returncode == 2 and "must be a finite number of seconds above 0: nan" in r.stderr
        assert "MiB" not in r.stderr
        r = _cli("watch", str(job.pid), "--interval", "1e-9")  # an audit: 54-62% of a core sampling
        assert r.returncode == 2 and "at least 0.01 s: 1e-9 would keep a core busy sampling" in r.stderr
    finally:
        job.kill()
        job.wait()
