"""Watch a running data pipeline: /dev/shm, SysV memory, worker memory and file descriptors.

Why: the failures this package prevents arrive late. ``/dev/shm`` fills up slowly until a worker dies with
SIGBUS; forked workers that read Python lists copy pages on every refcount touch ("copy-on-read"), so their
unique memory grows epoch after epoch until the OOM killer arrives; fds run out only under load. A plan made
before the run cannot see any of that, so ``watch()`` samples it while the run goes, warns once per problem
with the fix, and hands back peaks that can size the next run.

Cost: one sample reads ``statvfs``, ``/proc/sysvipc/shm``, the process tree's ``task/*/children`` files and,
per worker, ``statm`` and the ``fd`` directory: about 0.3 ms of CPU with two workers. A worker's USS needs
``smaps_rollup``, which walks its page tables (about 2.5 ms per MindSpore worker measured on this machine),
so USS is sampled only as often as ``uss_budget`` allows (0.5% of a core by default) and always at
``mark_epoch()``. The sampler measures its own CPU time with ``time.thread_time()`` and reports it as
``sampler_cpu_fraction``.
"""

from __future__ import annotations

import collections
import csv
import logging
import math
import os
import resource
import threading
import time
from dataclasses import field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Union

from ms_shm import host, procfs, sizes
from ms_shm._results import Result, mib, record
from ms_shm.errors import UsageError

if TYPE_CHECKING:  # psutil is imported where it is used: at ms_shm's import it cost 60-110 ms
    import psutil

log = logging.getLogger(__name__)

PidSource = Union[Iterable[int], Callable[[], Iterable[int]], None]

#: CSV columns, in order; ``Sample`` has the same fields.
CSV_COLUMNS = ("timestamp", "shm_used", "shm_total", "sysv_bytes", "sysv_segments", "workers", "workers_rss",
               "workers_uss", "fds", "fd_soft_limit", "worker_fds_max", "epoch", "memory_used", "memory_limit")


@record
class Sample(Result):
    """One reading. ``None`` means "could not read" (or, for ``workers_uss``, "not measured this time").

    Attributes:
        timestamp: ``time.time()`` of the reading.
        shm_used: Bytes used on the shm mount (statvfs; files MindSpore unlinks at once count here too).
        shm_total: Size of the shm mount.
        sysv_bytes: Sum of the sizes of the watched job's SysV segments (map/batch rows travel there on
            MindSpore 2.7+; which segments are the job's: ``job_segments``).
        sysv_segments: How many SysV segments the watched job has.
        workers: Worker processes found.
        workers_rss: Sum of the workers' RSS (shared pages counted once per worker).
        workers_uss: Sum of the workers' USS (pages only they hold), when measured.
        fds: Open fds of this (the main) process.
        fd_soft_limit: ``RLIMIT_NOFILE`` soft limit of this process.
        worker_fds_max: Most open fds in any one worker (the limit is per process).
        epoch: Epochs marked before this reading.
        memory_used: The memory cgroup's working set (usage less inactive page cache; /dev/shm pages count).
        memory_limit: That cgroup's limit (``None``: no limit).
    """

    timestamp: float
    shm_used: int | None
    shm_total: int | None
    sysv_bytes: int | None
    sysv_segments: int | None
    workers: int
    workers_rss: int | None
    workers_uss: int | None
    fds: int | None
    fd_soft_limit: int | None
    worker_fds_max: int | None = None
    epoch: int = 0
    memory_used: int | None = None
    memory_limit: int | None = None


@record
class WorkerGrowth(Result):
    """How one worker's unique memory (USS; RSS where USS was unreadable) moved between epoch marks.

    Attributes:
        pid: The worker.
        memory_at_marks: Its memory at each ``mark_epoch()`` it was alive for (plus the start, if alive then).
        growth_per_epoch: Differences between consecutive marks, in bytes.
        steady: True when the last ``growth_epochs`` differences all exceeded the threshold.
    """

    pid: int
    memory_at_marks: tuple
    growth_per_epoch: tuple
    steady: bool = False


@record
class WatchSummary(Result):
    """Peaks and trends of one ``watch()``; sizes in bytes, ``None`` where never readable."""

    samples: int
    duration_s: float
    interval_s: float
    shm_path: str
    shm_total_bytes: int | None
    peak_shm_used_bytes: int | None
    peak_shm_fraction: float | None
    peak_sysv_bytes: int | None
    peak_sysv_segments: int | None
    peak_workers: int
    peak_workers_rss_bytes: int | None
    peak_worker_rss_bytes: int | None
    peak_workers_uss_bytes: int | None
    peak_worker_uss_bytes: int | None
    peak_fds: int | None
    peak_worker_fds: int | None
    fd_soft_limit: int | None
    epochs: int
    growth_per_epoch_bytes: tuple  # all workers' USS together, between consecutive marks
    worker_growth: tuple  # WorkerGrowth per worker seen at two marks or more
    warnings: tuple
    uss_samples: int
    sampler_cpu_fraction: float | None  # CPU seconds of the sampler thread per wall second
    notes: tuple = field(default_factory=tuple)

    def lines(self) -> list:
        """Human lines for logs and the CLI."""
        shm = (f"{mib(self.peak_shm_used_bytes)} of {mib(self.shm_total_bytes)}"
               f" ({self.peak_shm_fraction:.0%})" if self.peak_shm_fraction is not None else "unknown")
        out = [
            f"watched {self.duration_s:.1f} s, {self.samples} samples every {self.interval_s:g} s",
            f"peak {self.shm_path}: {shm}",
            f"peak SysV shared memory of the watched job: {mib(self.peak_sysv_bytes)} in "
            f"{_or_dash(self.peak_sysv_segments)} segment(s)",
            self._workers_line(),
            f"peak open fds: main {_or_dash(self.peak_fds)}, worker {_or_dash(self.peak_worker_fds)}, "
            f"soft limit {_or_dash(self.fd_soft_limit)}",
        ]
        if self.growth_per_epoch_bytes:
            out.append("workers' USS growth per epoch: "
                       + ", ".join(("+" if g >= 0 else "") + mib(g) for g in self.growth_per_epoch_bytes))
        if self.sampler_cpu_fraction is not None:
            out.append(f"sampler CPU: {self.sampler_cpu_fraction:.3%} of one core")
        out.extend(f"warning: {text}" for text in self.warnings)
        out.extend(f"note: {text}" for text in self.notes)
        return out

    def _workers_line(self) -> str:
        """The workers' peaks; a job that never had a worker (``ms-shm watch`` of a plain process) gets just the
        count, not "largest unknown" for sizes nobody could have read."""
        if not self.peak_workers:
            return "peak workers: 0"
        return (f"peak workers: {self.peak_workers}, RSS {mib(self.peak_workers_rss_bytes)} "
                f"(largest {mib(self.peak_worker_rss_bytes)}), USS {mib(self.peak_workers_uss_bytes)} "
                f"(largest {mib(self.peak_worker_uss_bytes)})")


def _or_dash(value) -> str:
    """A count as the summary prints it: ``-`` where none was ever read (no worker seen, the job ended before
    its fds could be read), not a literal ``None``."""
    return "-" if value is None else str(value)


# ------------------------------------------------------------------------------------- pure rules


def shm_warning(used: int | None, total: int | None, shm_path: str = "/dev/shm",
                threshold: float = 0.8) -> str | None:
    """The warning for a nearly full shm mount, or None. Pure, so the wording is tested without a mount."""
    if used is None or not total or used / total <= threshold:
        return None
    suggest = sizes.shm_size_flag(max(2 * total, 1 << 30))
    return (f"{shm_path} is {used / total:.0%} full ({mib(used)} of {mib(total)}); MindSpore workers die with "
            f"SIGBUS (dynamic rows) or refuse to start (static max_rowsize) when it fills. Give it more room: "
            f"`docker run --shm-size={suggest} ...` (Kubernetes: an emptyDir with medium: Memory and "
            f"sizeLimit: {suggest} mounted at /dev/shm), or lower num_parallel_workers or "
            "ds.config.set_prefetch_size")


def memory_warning(used: int | None, limit: int | None, threshold: float = 0.9) -> str | None:
    """The warning for a memory cgroup close to its limit, or None: the OOM killer ends the run there, and
    /dev/shm pages count against it."""
    if used is None or not limit or used / limit <= threshold:
        return None
    return (f"the container's memory is {used / limit:.0%} used ({mib(used)} of its {mib(limit)} limit); /dev/shm "
            f"pages and every worker's rows count against it, and the OOM killer ends the run (exit 137) when it "
            f"fills. Give it more: `docker run --memory=...` (Kubernetes: resources.limits.memory, raised by "
            f"the /dev/shm emptyDir's sizeLimit), or lower num_parallel_workers or ds.config.set_prefetch_size")


def fd_warning(fds: int | None, soft: int | None, hard: int | None = None, who: str = "this process",
               threshold: float = 0.8) -> str | None:
    """The warning for a process close to its fd soft limit, or None."""
    if fds is None or not soft or soft == resource.RLIM_INFINITY or fds / soft <= threshold:
        return None
    ceiling = None if hard in (None, resource.RLIM_INFINITY) else hard
    wanted = sizes.nofile_target(2 * fds)
    target = wanted if ceiling is None else min(wanted, ceiling)
    if target > soft:
        hint = f"`ulimit -n {target}` before starting"
    else:
        hint = (f"the hard limit ({hard}) is reached, so raise that too "
                f"(`docker run --ulimit nofile={wanted}:{wanted}`)")
    return (f"{who} has {fds} open file descriptors, {fds / soft:.0%} of its soft limit {soft}; shared-memory "
            f"rows travel as fds, and at the limit workers fail with `OSError: [Errno 24] Too many open "
            f"files`. Raise it: {hint}, or resource.setrlimit(RLIMIT_NOFILE) early in the script")


def growth(series: list, epochs: int = 3, min_bytes: int = 8 << 20, min_fraction: float = 0.01) -> tuple:
    """(differences, steady) for one worker's memory at consecutive epoch marks.

    Steady means each of the last ``epochs`` differences exceeded ``max(min_bytes, min_fraction * value
    before it)``: the copy-on-read pattern (refcounts dirtying pages of a Python list in forked workers)
    and plain leaks both look like this, while allocator noise and a warm-up in the first epoch do not.
    """
    diffs = tuple(b - a for a, b in zip(series, series[1:]))
    if len(diffs) < epochs:
        return diffs, False
    tail = list(zip(series[-epochs - 1:-1], diffs[-epochs:]))
    return diffs, all(d > max(min_bytes, min_fraction * before) for before, d in tail)


def job_segments(rows: list, job_pids: set) -> list:
    """The ``/proc/sysvipc/shm`` rows that belong to the watched job: created (``cpid``) or last attached
    (``lpid``) by one of its processes.

    Why not every row: the table lists the whole IPC namespace, and on a shared host that holds other jobs'
    segments and killed runs' leftovers. Counting them all, ``ms-shm watch`` of a plain ``sleep`` reported
    "peak SysV shared memory: 49.0 MiB in 5 segment(s)", none of them its own.

    Why these two columns suffice for MindSpore: a 2.10 ``GeneratorDataset(...).map(fn, num_parallel_workers=2,
    python_multiprocessing=True)`` of 1 MiB rows showed 2 segments of 1 MiB, each created by the main process
    (``cpid``) and attached last by its own worker (``lpid``), ``nattch`` 2. Both pids are in the tree, and
    ``shmat`` sets ``lpid``, so a segment made elsewhere but attached by a worker is caught too. Reading every
    process's ``/proc/PID/maps`` for ``/SYSV…`` mappings would find the same segments at about 3 ms per MindSpore
    process (1000 mappings each), ten times the rest of a sample, so it is not done; what this misses is a
    segment that someone outside the job attached after the job did.

    ``job_pids`` should hold every process seen in the tree so far, not only the live ones: a dead worker's
    segment keeps its pids, and while it exists it is still the job's memory.
    """
    return [row for row in rows if row.get("cpid") in job_pids or row.get("lpid") in job_pids]


# ------------------------------------------------------------------------------------- reading


#: All descendants of a pid, from the per-thread children lists (kept here for old imports).
descendants = procfs.descendants


@record(frozen=False)
class _WorkerReading:
    """One sample's worker figures: sums, per-worker bytes for growth, and the fds of each."""

    uss_ok: bool
    rss: int = 0
    uss: int = 0
    fds: list = field(default_factory=list)
    per_worker: dict = field(default_factory=dict)  # pid -> USS when read, else RSS


class Watcher:
    """Background sampler; use it through ``watch()``.

    Thread-safe: ``mark_epoch()`` may be called from the training loop while the sampler runs.
    """

    def __init__(self, interval: float = 1.0, csv_path: str | os.PathLike | None = None, pids: PidSource = None,
                 shm_path: str | os.PathLike = "/dev/shm", *, shm_threshold: float = 0.8,
                 fd_threshold: float = 0.8, growth_epochs: int = 3, growth_bytes: int = 8 << 20,
                 growth_fraction: float = 0.01, uss_budget: float = 0.005, max_samples: int = 100_000,
                 sysv_path: str | os.PathLike = "/proc/sysvipc/shm", main_pid: int | None = None):
        if not (math.isfinite(interval) and interval > 0):  # nan passes a plain `<= 0` test
            raise UsageError(f"interval must be a finite number of seconds above 0, got {interval}")
        self.interval = float(interval)
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.shm_path = str(shm_path)
        self._pid_source = pids
        self._main = main_pid  # the training's main process, watched from outside (``ms-shm watch PID``)
        self._sysv_path = Path(sysv_path)
        self._shm_threshold = shm_threshold
        self._fd_threshold = fd_threshold
        self._growth = (growth_epochs, growth_bytes, growth_fraction)
        self._uss_budget = uss_budget
        self._samples: collections.deque = collections.deque(maxlen=max_samples)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._procs: dict = {}
        self._job_pids: set = {main_pid or os.getpid()}  # every process seen in the job: its SysV segments count
        self._fast_children = procfs.children_files_exist()
        self._memory_dirs = host.memory_dirs()
        self._notes: list = []
        self._noted: set = set()
        self._warned: dict = {}
        self._peaks: dict = {}
        self._count = 0
        self._uss_count = 0
        self._uss_cost = 0.0  # CPU seconds of the last USS round
        self._last_uss = -math.inf
        self._marks: list = []  # per mark: {pid: bytes}
        self._epoch = 0
        self._csv_handle = None
        self._csv_writer = None
        self._started = self._stopped = None
        self._thread_cpu = None
        self._summary: WatchSummary | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Watcher:
        """Start sampling in a daemon thread (the first sample is taken at once)."""
        if self._thread is not None:
            raise UsageError("this Watcher was already started; make a new one with ms_shm.watch()")
        if self.csv_path is not None:
            self._csv_handle = self._open_csv()
            self._csv_writer = csv.writer(self._csv_handle)
            self._csv_writer.writerow(CSV_COLUMNS)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ms_shm.watch", daemon=True)
        self._thread.start()
        return self

    def _open_csv(self):
        """The CSV file, opened for the samples; a path that cannot be written is the caller's mistake
        (``ms-shm watch PID --csv /no/such/dir/x.csv``), so it is a ``UsageError`` before sampling starts."""
        try:
            return open(self.csv_path, "w", newline="")
        except OSError as exc:
            raise UsageError(f"cannot write the CSV file {self.csv_path}: {exc.strerror or exc}",
                             fix="give --csv / csv_path a file in a directory that exists and is writable") from exc

    def stop(self) -> WatchSummary:
        """Stop sampling, take a last sample, close the CSV, and return the summary."""
        if self._summary is not None:
            return self._summary
        if self._thread is None:
            raise UsageError("this Watcher was never started")
        self._stop.set()
        self._thread.join(timeout=self.interval + 30)
        if self._thread.is_alive():
            self._note("the sampler thread did not stop within its interval + 30 s; summary may miss its last sample")
        self._sample(force_uss=False)
        self._stopped = time.monotonic()
        if self._csv_handle is not None:
            self._csv_handle.close()
        self._summary = self._summarize()
        return self._summary

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---------------------------------------------------------------- user calls

    def mark_epoch(self) -> None:
        """Record the end of an epoch: every worker's USS is read now, in the caller's thread.

        Growth across epochs separates the copy-on-read and leak patterns from a one-off warm-up, which a
        plain time series cannot. A warning is logged (once) when a worker grew in each of the last
        ``growth_epochs`` epochs by more than ``max(growth_bytes, growth_fraction × its size)``.
        """
        with self._lock:
            self._epoch += 1
            _, per_worker = self._sample(force_uss=True)
            self._marks.append(per_worker)
            for item in self._worker_growth():
                if item.steady:
                    steps = ", ".join("+" + mib(d) for d in item.growth_per_epoch[-self._growth[0]:])
                    self._warn("growth", (
                        f"worker pid {item.pid} grew in each of the last {self._growth[0]} epochs ({steps}; now "
                        f"{mib(item.memory_at_marks[-1])} unique memory). Forked workers that read Python "
                        "lists/dicts of objects copy the pages they touch (copy-on-read), or the dataset code "
                        "leaks: keep samples in numpy arrays (or ms_shm's shared list) instead of Python "
                        "objects, and look for caches that never shrink"))
                    break

    @property
    def samples(self) -> tuple:
        """The samples kept in memory (the last ``max_samples``)."""
        with self._lock:
            return tuple(self._samples)

    @property
    def summary(self) -> WatchSummary:
        """The summary; while running, a summary of what was seen so far."""
        if self._summary is not None:
            return self._summary
        with self._lock:
            return self._summarize()

    def write_csv(self, path: str | os.PathLike) -> Path:
        """Write the samples kept in memory as CSV (header ``CSV_COLUMNS``); returns the path."""
        path = Path(path)
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(CSV_COLUMNS)
            for sample in self.samples:
                writer.writerow(_row(sample))
        return path

    # ---------------------------------------------------------------- sampling

    def _run(self) -> None:
        cpu0 = time.thread_time()
        wall0 = time.monotonic()
        try:
            while True:
                self._sample(force_uss=False)
                self._thread_cpu = (time.thread_time() - cpu0, time.monotonic() - wall0)
                if self._stop.wait(self.interval):
                    break
        except Exception as exc:  # a dying daemon thread would otherwise vanish without a word
            log.exception("the sampler stopped")
            self._note(f"sampler stopped early: {type(exc).__name__}: {exc}")
        self._thread_cpu = (time.thread_time() - cpu0, time.monotonic() - wall0)

    def _workers(self) -> list:
        source = self._pid_source
        if source is None:
            if self._fast_children or self._main is not None:
                return descendants(self._main or os.getpid())
            import psutil  # here, not at import: it costs ms_shm's import 60-110 ms, and most runs never watch

            try:
                return [child.pid for child in psutil.Process().children(recursive=True)]
            except psutil.Error as exc:
                self._note(f"cannot list child processes: {type(exc).__name__}")
                return []
        return [int(pid) for pid in (source() if callable(source) else source)]

    def _process(self, pid: int) -> psutil.Process | None:
        import psutil

        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = self._procs[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return proc

    def _sample(self, force_uss: bool) -> tuple:
        """Take one reading, update peaks and warnings; returns (sample, {pid: bytes at this mark})."""
        with self._lock:
            now = time.monotonic()
            shm_used, shm_total = self._read_shm()
            pids = self._workers()
            self._job_pids.update(pids)
            sysv_bytes, sysv_segments = self._read_sysv()
            live = set(pids)
            for gone in [pid for pid in self._procs if pid not in live]:
                del self._procs[gone]
            take_uss = self._uss_due(now, force_uss)
            uss_cpu0 = time.thread_time()
            workers = self._read_workers(pids, take_uss)
            if take_uss and not force_uss:
                self._uss_cost = time.thread_time() - uss_cpu0
                self._last_uss = now
            fds, soft, hard = self._own_fds()
            memory_limit, memory_used = host.read_memory(*self._memory_dirs)
            per_worker = workers.per_worker
            sample = Sample(
                timestamp=time.time(), shm_used=shm_used, shm_total=shm_total, sysv_bytes=sysv_bytes,
                sysv_segments=sysv_segments, workers=len(per_worker),
                workers_rss=workers.rss if per_worker else 0,
                workers_uss=(workers.uss if workers.uss_ok else None) if per_worker else (0 if take_uss else None),
                fds=fds, fd_soft_limit=soft, worker_fds_max=max(workers.fds) if workers.fds else None,
                epoch=self._epoch, memory_used=memory_used, memory_limit=memory_limit)
            self._record(sample, hard)
            if take_uss:
                self._uss_count += 1
            return sample, per_worker

    def _uss_due(self, now: float, force: bool) -> bool:
        """Whether this sample reads USS: always at a mark, otherwise only as often as ``uss_budget`` pays for
        (one round costs ``_uss_cost`` CPU seconds, since ``smaps_rollup`` walks every page table)."""
        cost_due = (now - self._last_uss) * self._uss_budget
        return force or (self._uss_budget > 0 and cost_due >= self._uss_cost)

    def _read_workers(self, pids: list, take_uss: bool) -> _WorkerReading:
        """RSS and fds of every worker, and USS when ``take_uss``; workers that exit meanwhile are skipped."""
        import psutil

        reading = _WorkerReading(uss_ok=take_uss)
        for pid in pids:
            proc = self._process(pid)
            if proc is None:
                continue
            try:
                rss = proc.memory_info().rss
                reading.fds.append(proc.num_fds())
            except psutil.Error:
                continue
            reading.rss += rss
            self._peak("worker_rss", rss)
            reading.per_worker[pid] = rss
            if take_uss:
                self._read_uss(proc, pid, reading)
        return reading

    def _read_uss(self, proc: psutil.Process, pid: int, reading: _WorkerReading) -> None:
        import psutil

        try:
            uss = proc.memory_full_info().uss
        except psutil.AccessDenied:
            reading.uss_ok = False
            self._note("worker USS unreadable (no access to smaps_rollup); growth uses RSS")
            return
        except psutil.Error:
            return
        reading.uss += uss
        reading.per_worker[pid] = uss
        self._peak("worker_uss", uss)

    def _read_shm(self) -> tuple:
        try:
            space = procfs.statvfs(self.shm_path)
        except OSError as exc:
            self._note(f"statvfs({self.shm_path}): {type(exc).__name__}: {exc}")
            return None, None
        return space.used, space.total

    def _read_sysv(self) -> tuple:
        notes: list = []
        try:
            rows = procfs.read_sysvipc(self._sysv_path, notes=notes)
        except OSError as exc:
            self._note(f"{self._sysv_path}: {type(exc).__name__}: {exc}")
            return None, None
        for note in notes[:1]:  # one garbled row is worth a note; a table of them is worth no more
            self._note(note)
        segments, nbytes = procfs.segment_totals(job_segments(rows, self._job_pids))
        return nbytes, segments

    def _own_fds(self) -> tuple:
        """The main process's fds and open-files limits: this process's, or ``main_pid``'s."""
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE) if self._main is None else \
                procfs.nofile_limits(self._main)
        except (OSError, ValueError) as exc:
            if not self._main_ended():
                self._note(f"open-files limit: {exc}")
            soft = hard = None
        try:
            fds = procfs.open_fd_count(self._main or "self")
        except OSError as exc:
            if not self._main_ended():
                self._note(f"/proc/{self._main or 'self'}/fd: {type(exc).__name__}")
            fds = None
        return fds, soft, hard

    def _main_ended(self) -> bool:
        """Whether the watched main process (``main_pid``) has exited. ``ms-shm watch PID`` takes its last sample
        just after the job ends, when ``/proc/PID/limits`` and ``/proc/PID/fd`` are gone (or empty, for a zombie):
        that is the end of the job, not a reading that failed, so it earns no note."""
        return self._main is not None and (not os.path.isdir(f"/proc/{self._main}") or procfs.is_zombie(self._main))

    def _record(self, sample: Sample, hard: int | None) -> None:
        self._samples.append(sample)
        self._count += 1
        if self._csv_writer is not None:
            self._csv_writer.writerow(_row(sample))
            self._csv_handle.flush()
        self._peak("shm_used", sample.shm_used)
        if sample.shm_used is not None and sample.shm_total:
            self._peak("shm_fraction", sample.shm_used / sample.shm_total)
            self._peaks["shm_total"] = sample.shm_total
        self._peak("sysv_bytes", sample.sysv_bytes)
        self._peak("sysv_segments", sample.sysv_segments)
        self._peak("workers", sample.workers)
        self._peak("workers_rss", sample.workers_rss)
        self._peak("workers_uss", sample.workers_uss)
        self._peak("fds", sample.fds)
        self._peak("worker_fds", sample.worker_fds_max)
        if sample.fd_soft_limit is not None:
            self._peaks["fd_soft_limit"] = sample.fd_soft_limit
        text = shm_warning(sample.shm_used, sample.shm_total, self.shm_path, self._shm_threshold)
        if text:
            self._warn("shm", text)
        text = (fd_warning(sample.fds, sample.fd_soft_limit, hard, "the main process", self._fd_threshold)
                or fd_warning(sample.worker_fds_max, sample.fd_soft_limit, hard, "a worker process",
                              self._fd_threshold))
        if text:
            self._warn("fds", text)
        self._peak("memory_used", sample.memory_used)
        text = memory_warning(sample.memory_used, sample.memory_limit)
        if text:
            self._warn("memory", text)

    def _peak(self, name: str, value) -> None:
        if value is not None and (name not in self._peaks or value > self._peaks[name]):
            self._peaks[name] = value

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned[kind] = text
            log.warning("%s", text)

    def _note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self._notes.append(text)

    # ---------------------------------------------------------------- summary

    def _worker_growth(self) -> list:
        epochs, min_bytes, min_fraction = self._growth
        series: dict = {}
        for mark in self._marks:
            for pid, value in mark.items():
                series.setdefault(pid, []).append(value)
        out = []
        for pid, values in series.items():
            if len(values) < 2:
                continue
            diffs, steady = growth(values, epochs, min_bytes, min_fraction)
            out.append(WorkerGrowth(pid, tuple(values), diffs, steady))
        return out

    def _summarize(self) -> WatchSummary:
        peaks = self._peaks
        totals = [sum(mark.values()) for mark in self._marks]
        if self._thread_cpu is not None and self._thread_cpu[1] > 0:
            cpu_fraction = self._thread_cpu[0] / self._thread_cpu[1]
        else:
            cpu_fraction = None
        end = self._stopped if self._stopped is not None else time.monotonic()
        return WatchSummary(
            samples=self._count,
            duration_s=(end - self._started) if self._started is not None else 0.0,
            interval_s=self.interval,
            shm_path=self.shm_path,
            shm_total_bytes=peaks.get("shm_total"),
            peak_shm_used_bytes=peaks.get("shm_used"),
            peak_shm_fraction=peaks.get("shm_fraction"),
            peak_sysv_bytes=peaks.get("sysv_bytes"),
            peak_sysv_segments=peaks.get("sysv_segments"),
            peak_workers=peaks.get("workers", 0),
            peak_workers_rss_bytes=peaks.get("workers_rss"),
            peak_worker_rss_bytes=peaks.get("worker_rss"),
            peak_workers_uss_bytes=peaks.get("workers_uss"),
            peak_worker_uss_bytes=peaks.get("worker_uss"),
            peak_fds=peaks.get("fds"),
            peak_worker_fds=peaks.get("worker_fds"),
            fd_soft_limit=peaks.get("fd_soft_limit"),
            epochs=self._epoch,
            growth_per_epoch_bytes=tuple(b - a for a, b in zip(totals, totals[1:])),
            worker_growth=tuple(self._worker_growth()),
            warnings=tuple(self._warned.values()),
            uss_samples=self._uss_count,
            sampler_cpu_fraction=cpu_fraction,
            notes=tuple(self._notes),
        )


def _row(sample: Sample) -> list:
    values = {f.name: getattr(sample, f.name) for f in fields(sample)}
    return ["" if values[name] is None else values[name] for name in CSV_COLUMNS]


def watch(interval: float = 1.0, csv_path: str | os.PathLike | None = None, pids: PidSource = None,
          shm_path: str | os.PathLike = "/dev/shm", **options) -> Watcher:
    """Watch /dev/shm, SysV memory, the worker processes and fds while a pipeline runs.

    Args:
        interval: Seconds between samples. At the default the sampler stays well under 1% of one core.
        csv_path: Stream every sample to this CSV file as it is taken (survives a crash of the run).
        pids: Worker pids, or a callable returning them; default: every descendant of the main process
            (MindSpore's Generator workers, MapWorkers and their clean processes are all children).
        shm_path: The shm mount to watch.
        **options: ``shm_threshold``/``fd_threshold`` (0.8), ``growth_epochs`` (3), ``growth_bytes``
            (8 MiB), ``growth_fraction`` (0.01), ``uss_budget`` (0.005 of a core), ``max_samples``,
            ``main_pid`` (the main process, where it is another one: ``ms-shm watch PID``; default this one).

    Returns:
        A ``Watcher``; it starts on ``with`` (or ``.start()``), and ``.summary`` holds the result after.

    Examples:
        >>> with ms_shm.watch(csv_path="shm.csv") as w:          # doctest: +SKIP
        ...     for epoch in range(epochs):
        ...         for batch in it: ...
        ...         w.mark_epoch()
        >>> logging.getLogger("train").info("\\n".join(w.summary.lines()))  # doctest: +SKIP
    """
    return Watcher(interval, csv_path, pids, shm_path, **options)


__all__ = ["watch", "Watcher", "WatchSummary", "WorkerGrowth", "Sample", "CSV_COLUMNS", "shm_warning",
           "fd_warning", "memory_warning", "growth", "descendants", "job_segments"]
