"""Read the host as MindSpore's dataset engine will meet it. Facts only: no decision is made here.

Every reader takes ``root`` so tests can point it at a fake tree (``tmp_path/proc/...``), the way psutil's
``PROCFS_PATH`` works. A fact that cannot be read is ``None`` and a note says why; nothing here raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import sys
from dataclasses import field, replace
from pathlib import Path
from typing import Any, Mapping

from ms_shm import procfs
from ms_shm._results import Result, mib, record
from ms_shm.logind import LogindFacts, read_logind

log = logging.getLogger(__name__)

PAGE = 4096
_UNLIMITED_CGROUP = 1 << 60  # cgroup v1 writes ~2**63 rounded to a page for "no limit"


@record
class Ranks(Result):
    """How many training processes share this host's /dev/shm, and which one we are."""

    local_size: int
    local_rank: int
    source: str  # the variable (or "override", or "default") the numbers came from


@record
class HostFacts(Result):
    """What the host offers a data pipeline. ``None`` means "could not determine"; ``notes`` say why."""

    shm_path: str
    shm_total: int | None
    shm_free: int | None
    mem_total: int | None
    mem_available: int | None
    cgroup_version: str | None
    cgroup_mem_limit: int | None
    cgroup_mem_usage: int | None
    cpu_count: int | None
    cpu_affinity: int | None
    cpu_quota: float | None
    usable_cpus: int
    nofile_soft: int | None
    nofile_hard: int | None
    open_fds: int | None
    shmmax: int | None
    shmall_pages: int | None
    shmmni: int | None
    msgmni: int | None
    sysv_segments: int | None
    sysv_bytes: int | None
    container: str | None
    ranks: Ranks
    mindspore_version: str | None
    start_method: str | None
    notes: tuple = field(default_factory=tuple)
    logind: LogindFacts | None = None  # systemd-logind's RemoveIPC for this user (``logind.read_logind``)
    numpy_version: str | None = None  # MindSpore's DataLoader workers need NumPy 1.x
    live: bool = False  # read from this machine (``probe`` of "/"): its memory may be read again (``memory_now``)
    shm_readonly: bool | None = None  # /dev/shm mounted read-only (``read_shm_readonly``): no worker pool starts
    sysv_detached_segments: int | None = None  # SysV segments no process has attached: a live pool keeps its own
    sysv_detached_bytes: int | None = None

    @property
    def memory_left(self) -> tuple:
        """Memory a new pipeline may still take, and where the number comes from: the cgroup's limit less its
        working set (what the OOM killer compares), or available RAM, whichever is smaller."""
        options = []
        if self.cgroup_mem_limit and self.cgroup_mem_usage is not None:
            options.append((self.cgroup_mem_limit - self.cgroup_mem_usage,
                            f"cgroup {self.cgroup_version} limit {mib(self.cgroup_mem_limit)}"))
        if self.mem_available is not None:
            options.append((self.mem_available, "MemAvailable"))
        return min(options, key=lambda o: o[0]) if options else (None, "")

    @property
    def memory_limit(self) -> int | None:
        """The tighter of RAM and the cgroup limit: Kubernetes counts an in-memory /dev/shm against it."""
        values = [v for v in (self.mem_total, self.cgroup_mem_limit) if v]
        return min(values) if values else None


class _Notes(list):
    def add(self, what: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.append(f"{what}: {text}")


def _read(path: Path, notes: _Notes) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        notes.add(str(path), exc)
        return None


def _read_int(path: Path, notes: _Notes) -> int | None:
    text = _read(path, notes)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError) as exc:
        notes.add(str(path), exc)
        return None


def read_shm(shm_path: Path, notes: _Notes) -> tuple[int | None, int | None]:
    """Total and free bytes of the filesystem behind /dev/shm (statvfs: files there are unlinked at once)."""
    try:
        space = procfs.statvfs(shm_path)
    except OSError as exc:
        notes.add(f"statvfs({shm_path})", exc)
        return None, None
    return space.total, space.free


def read_shm_readonly(shm_path: Path, notes: _Notes) -> bool | None:
    """Whether the filesystem behind /dev/shm is mounted read-only (statvfs's ``ST_RDONLY`` flag): its size
    then says nothing, since multiprocessing cannot create a semaphore there (EROFS) and no worker pool starts.
    ``None`` when statvfs fails (the note says why)."""
    try:
        flags = os.statvfs(shm_path).f_flag
    except OSError as exc:
        notes.add(f"statvfs({shm_path}) flags", exc)
        return None
    return bool(flags & getattr(os, "ST_RDONLY", 1))


def read_meminfo(root: Path, notes: _Notes) -> tuple[int | None, int | None]:
    text = _read(root / "proc/meminfo", notes)
    if text is None:
        return None, None
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    total, avail = values.get("MemTotal"), values.get("MemAvailable", values.get("MemFree"))
    if total is not None and avail is not None and avail > total:  # psutil's rule: containers can lie
        notes.add("MemAvailable", "greater than MemTotal; using MemFree")
        avail = values.get("MemFree")
    return total, avail


def _own_cgroup(root: Path, notes: _Notes) -> tuple[str | None, dict]:
    """The cgroup version and this process's path per controller, from /proc/self/cgroup."""
    text = _read(root / "proc/self/cgroup", notes)
    if text is None:
        return None, {}
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(",") if parts[1] else [""]:
            paths[ctrl] = parts[2]
    version = "v2" if set(paths) == {""} else "v1"
    return version, paths


def _cgroup_dirs(base: Path, rel: str) -> list:
    """The cgroup's own directory then its ancestors: the tightest limit may sit on a parent."""
    rel = rel.strip("/")
    candidates = [base]
    if rel:
        parts = rel.split("/")
        candidates = [base.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)] + [base]
    # Inside a container the namespace often shows "/" while the files sit right at the mount point.
    return [d for d in dict.fromkeys(candidates) if d.is_dir()]


def _working_set(usage: int | None, directory: Path, inactive_key: str) -> int | None:
    """Usage less the inactive page cache, as ``docker stats`` and the kubelet count it: the kernel reclaims
    that cache before it OOM-kills, so counting it would call a container with a warm cache full."""
    if usage is None:
        return None
    text = _read(directory / "memory.stat", _Notes()) or ""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key and value.strip().isdigit():
            return max(0, usage - int(value))
    return usage


_MEMORY_FILES = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                 "v2": ("memory.max", "memory.current", "inactive_file")}


def memory_dirs(root: Path = Path("/"), notes: _Notes | None = None) -> tuple:
    """This process's memory cgroup directory and its ancestors, with the cgroup version: ``(None, [])``
    when there is no cgroup to read. ``watch()`` reads them again per sample through ``read_memory``."""
    version, paths = _own_cgroup(root, notes if notes is not None else _Notes())
    fs = root / "sys/fs/cgroup"
    if version == "v2":
        return version, _cgroup_dirs(fs, paths.get("", "/"))
    if version == "v1":
        return version, _cgroup_dirs(fs / "memory", paths.get("memory", "/"))
    return None, []


def read_memory(version: str | None, dirs: list, notes: _Notes | None = None) -> tuple:
    """The binding memory limit and that cgroup's working set: of every level with a limit (a container's
    own cgroup, a pod's above it), the one with the least room left. Without a limit, (None, own usage)."""
    if version not in _MEMORY_FILES:
        return None, None
    limit_file, usage_file, inactive_key = _MEMORY_FILES[version]
    notes = notes if notes is not None else _Notes()
    best, own = None, None
    for d in dirs:
        usage = _working_set(_read_int(d / usage_file, _Notes()), d, inactive_key)
        own = usage if own is None else own
        raw = _read(d / limit_file, _Notes())
        if raw is None or raw.strip() == "max":
            continue
        try:
            limit = int(raw)
        except ValueError as exc:
            notes.add(str(d / limit_file), exc)
            continue
        if limit < _UNLIMITED_CGROUP and (best is None or limit - (usage or 0) < best[0] - (best[1] or 0)):
            best = (limit, usage)
    if best is None:
        return None, own
    return best[0], best[1] if best[1] is not None else own


def installed_version(module: str, distributions: tuple = ()) -> str | None:
    """The version of ``module``: the imported module's own (what this process runs; a dict look-up), else the
    first of ``distributions`` (default: the module's name) installed, from package metadata (~4 ms a look-up,
    and it imports nothing). ``None`` when neither says."""
    imported = getattr(sys.modules.get(module), "__version__", None)
    if isinstance(imported, str):
        return str(imported)
    try:
        from importlib import metadata
    except ImportError:  # Python 3.7
        return None
    for dist in distributions or (module,):
        try:
            return metadata.version(dist)
        except Exception:  # not installed as a distribution (vendored, or broken metadata): the next, or unknown
            continue
    return None


def _numpy_version() -> str | None:
    return installed_version("numpy")


# The pip line that brings NumPy 1.x without breaking ``import mindspore``: MindSpore imports SciPy
# (``train.callback._landscape``), and SciPy 1.18's wheels need NumPy 2 (``np.long``). Measured with MindSpore
# 2.10.0 on Python 3.12, where pip takes SciPy 1.18.1: ``pip install 'numpy<2'`` alone left ``import mindspore``
# failing (AttributeError: module 'numpy' has no attribute 'long'); with the SciPy pin beside it (1.15.3 kept) it
# imports and its DataLoader's workers run. Where SciPy is older (Python 3.11 has no 1.18) the pin changes nothing.
NUMPY1_INSTALL = "pip install 'numpy<2' 'scipy<1.18'"


def memory_now(facts: HostFacts) -> HostFacts:
    """``facts`` with the memory available and the cgroup's working set read now, limits kept: what the program
    allocated since (a model loaded after ``tune()``) is not there for the next pipeline (a budget taken at
    ``tune()`` planned 670 MiB that a 450 MiB allocation had taken, and the run was OOM-killed). Facts not read
    from this machine come back as they are."""
    if not facts.live:
        return facts
    notes = _Notes()
    _, available = read_meminfo(Path("/"), notes)
    limit, usage = read_memory(*memory_dirs(Path("/"), notes), notes)
    return replace(facts, mem_available=available if available is not None else facts.mem_available,
                   cgroup_mem_usage=usage if usage is not None and limit == facts.cgroup_mem_limit
                   else facts.cgroup_mem_usage)


def read_cgroup(root: Path, notes: _Notes) -> tuple[str | None, int | None, int | None, float | None]:
    """cgroup version, memory limit and working set in bytes, and CPU quota in CPUs (None = unlimited/unknown)."""
    version, paths = _own_cgroup(root, notes)
    fs = root / "sys/fs/cgroup"
    if version is None:
        return None, None, None, None
    limit, usage = read_memory(*memory_dirs(root), notes)
    quota = None
    if version == "v2":
        for d in _cgroup_dirs(fs, paths.get("", "/")):
            cpu = _read(d / "cpu.max", _Notes())
            if cpu is not None and quota is None:
                q, _, period = cpu.strip().partition(" ")
                if q != "max" and period:
                    try:
                        quota = int(q) / int(period)
                    except (ValueError, ZeroDivisionError) as exc:
                        notes.add(str(d / "cpu.max"), exc)
    else:
        cpu_rel = paths.get("cpu", paths.get("cpu,cpuacct", "/"))
        for base in (fs / "cpu", fs / "cpu,cpuacct"):
            for d in _cgroup_dirs(base, cpu_rel):
                q = _read_int(d / "cpu.cfs_quota_us", _Notes())
                p = _read_int(d / "cpu.cfs_period_us", _Notes())
                if q is not None and p and q > 0 and quota is None:
                    quota = q / p
    if limit is None and usage is None and not fs.is_dir():
        notes.add(str(fs), "no cgroup filesystem mounted")
    return version, limit, usage, quota


def read_cpus(root: Path, notes: _Notes, quota: float | None) -> tuple[int | None, int | None, int]:
    """OS CPU count, affinity, and the usable count (loky's rule: the minimum of all of them)."""
    count = os.cpu_count()
    if count is None:
        notes.add("os.cpu_count()", "returned None")
    affinity = None
    if hasattr(os, "sched_getaffinity"):
        try:
            affinity = len(os.sched_getaffinity(0))
        except OSError as exc:
            notes.add("sched_getaffinity", exc)
    limits = [c for c in (count, affinity) if c]
    if quota:
        limits.append(max(1, int(quota)))
    return count, affinity, max(1, min(limits)) if limits else 1


def read_nofile(root: Path, notes: _Notes, pid: str = "self") -> tuple[int | None, int | None, int | None]:
    """Soft and hard RLIMIT_NOFILE, and how many fds this process already holds."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError) as exc:
        notes.add("getrlimit(RLIMIT_NOFILE)", exc)
        soft = hard = None
    inf = resource.RLIM_INFINITY
    soft = None if soft == inf else soft
    hard = None if hard == inf else hard
    try:
        open_fds = procfs.open_fd_count(pid, root)
    except OSError as exc:
        notes.add("open fds", exc)
        open_fds = None
    return soft, hard, open_fds


def read_sysv(root: Path, notes: _Notes) -> dict:
    """Kernel SysV limits (map/batch workers use SysV in MindSpore 2.7+) and what is in use now."""
    kernel = root / "proc/sys/kernel"
    out = {
        "shmmax": _read_int(kernel / "shmmax", notes),
        "shmall_pages": _read_int(kernel / "shmall", notes),
        "shmmni": _read_int(kernel / "shmmni", notes),
        "msgmni": _read_int(kernel / "msgmni", notes),
        "sysv_segments": None,
        "sysv_bytes": None,
        "sysv_detached_segments": None,
        "sysv_detached_bytes": None,
    }
    table = procfs.sysvipc_path(root, "shm")
    try:
        rows = procfs.read_sysvipc(table, notes=notes)
        out["sysv_segments"], out["sysv_bytes"] = procfs.segment_totals(rows)
        out["sysv_detached_segments"], out["sysv_detached_bytes"] = procfs.detached_totals(rows)
    except OSError as exc:
        notes.add(str(table), exc)
    return out


def detect_container(root: Path, env: Mapping[str, str]) -> str | None:
    """Where we run, which decides the fix to print: Kubernetes, Docker, Podman, another container or None."""
    if env.get("KUBERNETES_SERVICE_HOST") or (root / "var/run/secrets/kubernetes.io").exists():
        return "kubernetes"
    if (root / "run/.containerenv").exists():
        return "podman"
    if (root / ".dockerenv").exists():
        return "docker"
    try:
        cg = (root / "proc/1/cgroup").read_text()
    except OSError:
        cg = ""
    for marker, name in (("kubepods", "kubernetes"), ("docker", "docker"), ("containerd", "container"),
                         ("lxc", "container")):
        if marker in cg:
            return name
    if env.get("container"):
        return "container"
    return None


_LOCAL_SIZE_VARS = (
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("LOCAL_WORLD_SIZE", "LOCAL_RANK"),
    ("MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
    ("SLURM_NTASKS_PER_NODE", "SLURM_LOCALID"),
    ("MV2_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH2
    ("HOROVOD_LOCAL_SIZE", "HOROVOD_LOCAL_RANK"),  # horovodrun with gloo
    ("PALS_LOCAL_SIZE", "PALS_LOCAL_RANKID"),  # Cray PALS (aprun's successor)
    ("JSM_NAMESPACE_LOCAL_SIZE", "JSM_NAMESPACE_LOCAL_RANK"),  # LSF jsrun
)
# Launchers that say only the global count: msrun (``MS_WORKER_NUM``, ``RANK_SIZE``), and torch's legacy
# ``torch.distributed.launch`` and hand-rolled ``mp.spawn`` scripts (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``): read
# as MindSpore's own shm check reads them. WORLD_SIZE was not read: under 64 MB two such ranks planned for 1 and 2
# ranks, and one or both died of ShmFullError (an audit, 3 runs of 3).
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "DEVICE_ID",
                    "MV2_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "PALS_LOCAL_RANKID", "JSM_NAMESPACE_LOCAL_RANK")
_GLOBAL_SIZE_VARS = (("MS_WORKER_NUM", "RANK_ID"), ("RANK_SIZE", "RANK_ID"), ("WORLD_SIZE", "RANK"))
_DEVICES_PER_HOST = 8  # MindSpore's own assumption: device_num = min(group_size, 8)


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(str(env.get(name, "")).split("(")[0].split(",")[0])
    except ValueError:
        return None
    return value if value >= 0 else None


def sharing_hint(local_ranks: int, shm_path: str | os.PathLike = "/dev/shm") -> tuple:
    """(hint, fix) when /dev/shm filled up after planning: other ranks sizing themselves as if alone. Where more
    copies of this program run here than were planned for, the hint names them with what they hold and the fix
    is the count to export; else the hint says what to check and the fix is empty."""
    from ms_shm import siblings

    found = siblings.find(shm_path)
    if found is not None and len(found.pids) + 1 > local_ranks:
        n = len(found.pids) + 1
        return (f"{len(found.pids)} other process(es) run this same command here (pid {_named_pids(found)}), "
                f"holding {mib(found.shm_bytes)} of {shm_path}: {n} copies share it, where ms_shm planned for "
                f"{local_ranks} rank(s) using it{_msrun_scheduler(os.environ)}",
                f"tell every rank how many share {shm_path}: export LOCAL_WORLD_SIZE={n} (or "
                f"MS_SHM_LOCAL_RANKS={n}), or ms_shm.tune(ranks={n}); or ")
    return (f"ms_shm planned for {local_ranks} rank(s) using this host's /dev/shm; where more ranks run here, "
            f"tell each how many: export LOCAL_WORLD_SIZE (or MS_SHM_LOCAL_RANKS), or ms_shm.tune(ranks=N)", "")


def _msrun_scheduler(env: Mapping[str, str]) -> str:
    """msrun starts the script once more as its scheduler (``MS_ROLE=MS_SCHED``), which runs it like a rank until
    ``mindspore.communication.init()`` ends it there (an audit: a data script without ``init()`` under msrun ran
    3 copies where ``MS_WORKER_NUM`` said 2)."""
    if not env.get("MS_ROLE"):
        return ""
    return ("; under msrun its scheduler (MS_ROLE=MS_SCHED) runs the script too until "
            "mindspore.communication.init() ends it there: call init() before building the pipeline")


NO_LAUNCHER = "default (no launcher variables)"


def detect_ranks(env: Mapping[str, str], override: int | None = None) -> Ranks:
    """Ranks sharing this host's /dev/shm, from the launcher's environment.

    Launchers that know the local count say so directly (Open MPI, torchrun, MPICH, Slurm). msrun exports
    only the global ``MS_WORKER_NUM`` / ``RANK_SIZE``; like MindSpore's own shm check we then assume at most
    8 ranks per host, and the ``source`` says it was assumed.
    """
    local_rank = None
    for name in _LOCAL_RANK_VARS:
        local_rank = _int(env, name)
        if local_rank is not None:
            break
    if override is not None:
        return Ranks(max(1, int(override)), local_rank or 0, "override")
    if _int(env, "MS_SHM_LOCAL_RANKS"):
        return Ranks(_int(env, "MS_SHM_LOCAL_RANKS"), local_rank or 0, "MS_SHM_LOCAL_RANKS")
    if str(env.get("MS_SHM_LOCAL_RANKS", "")).strip():  # set, and not a count: said, not silently dropped
        ranks = _from_launcher(env, local_rank)
        return replace(ranks, source=f"{ranks.source}; MS_SHM_LOCAL_RANKS={env['MS_SHM_LOCAL_RANKS']!r} ignored: "
                                     f"not a count of 1 or more")
    return _from_launcher(env, local_rank)


def _from_launcher(env: Mapping[str, str], local_rank: int | None) -> Ranks:
    """``detect_ranks``' answer from the launcher's variables alone."""
    for size_var, rank_var in _LOCAL_SIZE_VARS:
        size = _int(env, size_var)
        if size:
            return Ranks(size, _int(env, rank_var) or 0, size_var)
    slurm = _slurm_tasks_here(env)
    if slurm:
        return _at_least(Ranks(slurm[0], local_rank or 0, slurm[1]))
    for size_var, rank_var in _GLOBAL_SIZE_VARS:
        size = _int(env, size_var)
        if size:
            local = min(size, _DEVICES_PER_HOST)
            if local_rank is None:
                rank_id = _int(env, rank_var)
                local_rank = rank_id % local if rank_id is not None else 0
            how = "assumed all on this host" if size <= _DEVICES_PER_HOST else f"assumed {_DEVICES_PER_HOST} per host"
            return _at_least(Ranks(local, local_rank, f"{size_var}={size} ({how})"))
    if local_rank is not None:
        return _at_least(Ranks(1, local_rank, "a local rank without a local size"))
    return Ranks(1, 0, NO_LAUNCHER)


def _copies_as_ranks(ranks: Ranks, shm_path: Path, root: Path) -> Ranks:
    """Where no launcher said how many ranks run here, the copies of this program's command line running here now
    (``siblings.find``: 1-2 ms for ~90 processes) are its local ranks: 4 copies of one script sharing a 256m
    /dev/shm each planned as if alone, 2 worker processes at prefetch 16, and 8 ranks of 12 died of
    ``ShmFullError`` where raw's defaults, reading in the main process, ran 4 of 4 (an audit, 3 runs). Copies
    started after this one are not seen: its ``ShmFullError`` still names them (``sharing_hint``)."""
    if ranks.source != NO_LAUNCHER:
        return ranks
    from ms_shm import siblings

    found = siblings.find(shm_path, root)
    if found is None or not found.pids:
        return ranks
    n, me = len(found.pids) + 1, os.getpid()
    return Ranks(n, sum(pid < me for pid in found.pids), f"{n} copies of this command line run here (pid "
                 f"{_named_pids(found)} beside this one), no launcher variables")


def _named_pids(found: Any) -> str:
    """The copies' pids as said in a log line or an error: the first 8."""
    return ", ".join(str(pid) for pid in found.pids[:8]) + (", ..." if len(found.pids) > 8 else "")


def _at_least(ranks: Ranks) -> Ranks:
    """A local rank of k means k + 1 ranks on this host at least: msrun's ``DEVICE_ID=11`` on a 16-device host,
    whose ``MS_WORKER_NUM=16`` reads as 8 per host, or a rank index without a count."""
    if ranks.local_rank < ranks.local_size:
        return ranks
    return Ranks(ranks.local_rank + 1, ranks.local_rank,
                 f"{ranks.source}; at least {ranks.local_rank + 1}: local rank {ranks.local_rank}")


def _slurm_tasks_here(env: Mapping[str, str]) -> tuple | None:
    """``(tasks on this node, the variable)`` from Slurm's per-node layout, which ``srun -n N`` sets without
    ``--ntasks-per-node``: ``SLURM_STEP_TASKS_PER_NODE`` (this step's) or ``SLURM_TASKS_PER_NODE`` (the job's),
    e.g. ``2(x3),1``: this node's entry by ``SLURM_NODEID``, else the largest (the smaller share)."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = _per_node(str(env.get(name, "")))
        if counts:
            node = _int(env, "SLURM_NODEID")
            here = counts[node] if node is not None and node < len(counts) else max(counts)
            return (here, name) if here > 0 else None
    return None


def _per_node(layout: str) -> list:
    """Slurm's ``2(x3),1`` as ``[2, 2, 2, 1]`` (``[]``: unreadable)."""
    counts: list = []
    for part in filter(None, layout.replace(" ", "").split(",")):
        count, _, times = part.partition("(x")
        try:
            counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return []
    return counts


def mindspore_version() -> str | None:
    """MindSpore's version, without importing MindSpore (any of its builds' distributions)."""
    return installed_version("mindspore", ("mindspore", "mindspore-ascend", "mindspore-gpu", "mindspore-cpu"))


def probe(root: Path | str = Path("/"), env: Mapping[str, str] | None = None, shm_path: Path | str | None = None,
          ranks: int | None = None) -> HostFacts:
    """Read the host. Never raises: anything unreadable becomes ``None`` and a note.

    Args:
        root: filesystem root for /proc and /sys (tests pass a fake tree).
        env: environment to read launcher variables from (default ``os.environ``).
        shm_path: the shared-memory mount (default ``<root>/dev/shm``).
        ranks: override for the number of ranks sharing this host.
    """
    root = Path(root)
    env = os.environ if env is None else env
    notes = _Notes()
    shm = Path(shm_path) if shm_path is not None else root / "dev/shm"
    shm_total, shm_free = read_shm(shm, notes)
    shm_readonly = read_shm_readonly(shm, notes) if shm_total is not None else None  # else read_shm noted why
    mem_total, mem_avail = read_meminfo(root, notes)
    cg_version, cg_limit, cg_usage, quota = read_cgroup(root, notes)
    count, affinity, usable = read_cpus(root, notes, quota)
    soft, hard, fds = read_nofile(root, notes)
    sysv = read_sysv(root, notes)
    try:
        start_method = multiprocessing.get_start_method(allow_none=True) or "fork (default)"
    except (RuntimeError, ValueError) as exc:
        notes.add("start method", exc)
        start_method = None
    facts = HostFacts(
        shm_path=str(shm), shm_total=shm_total, shm_free=shm_free,
        mem_total=mem_total, mem_available=mem_avail,
        cgroup_version=cg_version, cgroup_mem_limit=cg_limit, cgroup_mem_usage=cg_usage,
        cpu_count=count, cpu_affinity=affinity, cpu_quota=quota, usable_cpus=usable,
        nofile_soft=soft, nofile_hard=hard, open_fds=fds,
        container=detect_container(root, env), ranks=_copies_as_ranks(detect_ranks(env, ranks), shm, root),
        mindspore_version=mindspore_version(), start_method=start_method,
        notes=tuple(notes), **sysv, logind=read_logind(root), numpy_version=_numpy_version(),
        live=root == Path("/"), shm_readonly=shm_readonly,
    )
    for note in notes:
        log.debug("probe: could not determine %s", note)
    return facts
