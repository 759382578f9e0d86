"""Turn host facts into findings and fixes a user can paste: ``docker run``, compose, Kubernetes YAML, ``ulimit``.

Pure: facts in, ``Advice`` out. No I/O, no clock, no MindSpore import, so the planner, the CLI and the tests
all call the same rules. Sizes are computed from the host (usable CPUs, ranks on the host) with the measured
shared-memory formula of the host's release (the engine's ``outcome``: static slots on <= 2.3, dynamic on 2.4+),
never copied from a constant: MindSpore's own "5 GB" advice is what the formula gives for 8 ranks of 8 workers
with 8 MiB rows, and is only the reference when nothing better is known. How a release fails (its pre-check or a
bus error) is worded by the engine from the release's profile, never here.
"""

from __future__ import annotations

import math
from typing import Any

from ms_shm import budget as budget_mod
from ms_shm import engines, sizes
from ms_shm._results import Result, mib, record
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import profiles
from ms_shm.host import NUMPY1_INSTALL
from ms_shm.sizes import HEADROOM, k8s_size, nofile_target, parse_size
from ms_shm.sizes import shm_size_flag as human_size

# Same headroom as the planner's budget: MindSpore's own static check refuses at 80% of free /dev/shm, and
# other processes (the semaphores of map pools, a second pipeline) need the rest.
REFERENCE_ROW_BYTES = 8 * model.MiB  # a decoded 1080p RGB frame is 6 MiB; MindSpore's "5 GB" assumes ~8 MiB
TYPICAL_MAX_WORKERS = 8  # MindSpore's default num_parallel_workers, capped by the CPU count
SEVERITIES = ("crash", "slow", "info")
_HUGE = 1 << 62  # kernel "unlimited" SysV values are near 2**64
_GiB = 1 << 30


@record
class Advice(Result):
    """One finding: what is wrong in numbers, how bad, and the fix for where the process runs.

    Attributes:
        problem: the finding, with the measured numbers.
        severity: ``"crash"`` (a typical pipeline dies: bus error, EMFILE, OOM kill), ``"slow"`` (it runs,
            but ms_shm or MindSpore must fall back to a slower path) or ``"info"``.
        fix: one line saying what to change.
        snippets: ``(label, text)`` pairs to paste, the one for where we run first.
        code: a stable identifier (``"shm-small"``, ``"nofile-soft"``...) for scripts and tests.
    """

    problem: str
    severity: str
    fix: str
    snippets: tuple = ()
    code: str = ""

    @property
    def rank(self) -> int:
        """Sort key: crash before slow before info."""
        return SEVERITIES.index(self.severity) if self.severity in SEVERITIES else len(SEVERITIES)


#: Findings about a typical GeneratorDataset / map pipeline (its slots, rows in flight, SysV segments), as opposed
#: to the host itself: a program that builds none (a DataLoader script under ``ms-shm run``) has no use for them.
TYPICAL_PIPELINE_CODES = frozenset({"shm-small", "shm-tight", "shm-nearly-full", "cgroup-small", "sysv-shmmax",
                                    "sysv-shmall"})


# ----------------------------------------------------------------------------------------------- snippets


def _kubernetes_fix(k8s: str, limit_line: str) -> tuple:
    return ("kubernetes", "\n".join([
        "spec:",
        "  containers:",
        "  - name: train",
        "    volumeMounts:",
        "    - name: dshm",
        "      mountPath: /dev/shm",
        "    resources:",
        "      limits:",
        limit_line,
        "  volumes:",
        "  - name: dshm",
        "    emptyDir:",
        "      medium: Memory",
        f"      sizeLimit: {k8s}",
        "# An emptyDir with medium: Memory is RAM charged to the pod's memory limit: raise",
        "# resources.limits.memory by the sizeLimit, or the pod is OOM-killed instead of bus-erroring.",
    ]))


def memory_target(memory_limit: int, shm_size: str, at_least: int = 0) -> str:
    """The memory limit to ask for, as ``--memory`` takes it: the present limit raised by the /dev/shm size (a
    memory-backed ``emptyDir`` counts against it), and not below ``at_least`` (what a pipeline adds). One number
    for a finding's text and its Kubernetes block, so the two never disagree."""
    return human_size(max(memory_limit + parse_size(shm_size), at_least))


def shm_fixes(size_bytes: int, container: str | None, memory_limit: int | None = None,
              memory_at_least: int = 0) -> tuple:
    """Ways to give the process a ``/dev/shm`` of at least ``size_bytes``, the one for ``container`` first.

    Every place is listed, because the same image runs under ``docker run``, compose and Kubernetes.

    Args:
        size_bytes: the size wanted; rounded up with ``human_size``.
        container: ``host.detect_container()``'s answer: ``"kubernetes"``, ``"docker"``, ``"podman"``,
            ``"container"`` or ``None`` (bare host).
        memory_limit: the container's memory limit when known. A memory-backed ``emptyDir`` counts against
            it, so the Kubernetes block suggests a limit raised by the /dev/shm size.
        memory_at_least: the least memory limit to suggest (``memory_target``).

    Returns:
        ``(label, text)`` pairs.
    """
    size = human_size(size_bytes)
    k8s = k8s_size(size)
    if memory_limit:
        raised = memory_target(memory_limit, size, memory_at_least)
        limit_line = f"        memory: {k8s_size(raised)}   # was {mib(memory_limit)}; /dev/shm pages count against it"
    else:
        limit_line = f"        memory: <your limit + {k8s}>   # /dev/shm pages count against it"
    docker = ("docker run", f"docker run --shm-size={size} ...   # or --ipc=host to share the host's /dev/shm")
    compose = ("docker-compose", f"services:\n  train:\n    shm_size: \"{size}\"")
    kube = _kubernetes_fix(k8s, limit_line)
    podman = ("podman run", f"podman run --shm-size={size} ...")
    host = ("bare host", f"sudo mount -o remount,size={size} /dev/shm\n"
                         f"# and in /etc/fstab, to keep it after a reboot:\n"
                         f"tmpfs  /dev/shm  tmpfs  defaults,size={size}  0 0")
    return _for_container(container, host, docker, compose, kube, podman)


def _for_container(container: str | None, host: tuple, docker: tuple, compose: tuple, kube: tuple,
                   podman: tuple) -> tuple:
    """A fix's snippets, the one for where the process runs first: every place is listed, because the same
    image runs under ``docker run``, compose and Kubernetes."""
    if container == "kubernetes":
        return (kube, docker, compose)
    if container == "podman":
        return (podman, docker, compose, kube)
    if container in ("docker", "container"):
        return (docker, compose, kube)
    return (host, docker, compose, kube)


def memory_fixes(target: str, container: str | None, cgroup_version: str | None = None,
                 was: int | None = None) -> tuple:
    """Ways to raise the memory limit to ``target`` (``docker run --memory``'s form), the one for ``container``
    first: the ``cgroup-small`` finding's fix (its snippets were ``--shm-size``, which leaves the limit as it is,
    an audit found)."""
    docker = ("docker run", f"docker run --memory={target} ...")
    compose = ("docker-compose", f"services:\n  train:\n    mem_limit: \"{target}\"")
    kube = ("kubernetes", f"spec:\n  containers:\n  - name: train\n    resources:\n      limits:\n"
                          f"        memory: {k8s_size(target)}" + (f"   # was {mib(was)}" if was else ""))
    podman = ("podman run", f"podman run --memory={target} ...")
    knob = "memory.limit_in_bytes" if cgroup_version == "v1" else "memory.max"
    host = ("bare host", f"# the memory cgroup the job runs in (cat /proc/self/cgroup): raise its {knob}\n"
                         f"sudo systemd-run --scope -p MemoryMax={target.upper()} python train.py   # or a new scope")
    return _for_container(container, host, docker, compose, kube, podman)


def nofile_fixes(n: int, container: str | None = None, hard: int | None = None) -> tuple:
    """Ways to raise the open-files limit to at least ``n`` (rounded up to 1024, 4096, 65536..., but not past a
    ``hard`` limit that already allows ``n``: ``ulimit -n`` above it fails).

    The soft limit can be raised by the process itself up to the hard limit; the hard limit only by root,
    the container runtime (``--ulimit``) or PAM (``limits.conf``) at login.
    """
    target = nofile_target(n) if hard is None or hard < n else min(nofile_target(n), hard)
    shell = ("shell", f"ulimit -n {target}   # before starting training; cannot exceed the hard limit (ulimit -Hn)")
    limits = ("limits.conf", f"# /etc/security/limits.conf (new logins):\n*  soft  nofile  {target}\n"
                             f"*  hard  nofile  {target}")
    python = ("python", "import resource\n"
                        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                        f"new = {target} if hard == resource.RLIM_INFINITY else min({target}, hard)\n"
                        "resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))   # the soft limit, up to the hard")
    docker = ("docker run", f"docker run --ulimit nofile={target}:{target} ...")
    compose = ("docker-compose", f"services:\n  train:\n    ulimits:\n      nofile:\n"
                                 f"        soft: {target}\n        hard: {target}")
    kube = ("kubernetes", "# Kubernetes has no per-pod nofile setting: the container runtime's default applies\n"
                          "# (containerd: LimitNOFILE in its systemd unit). Raise the soft limit in the entrypoint:\n"
                          f"command: [\"sh\", \"-c\", \"ulimit -n {target} && exec python train.py\"]")
    if container == "kubernetes":
        return (kube, shell, python)
    if container in ("docker", "podman", "container"):
        return (docker, compose, shell, python)
    return (shell, limits, python)


def ds_config_fixes(prefetch: int | None = None, shared_mem_off: bool = False, workers: int | None = None) -> tuple:
    """``mindspore.dataset.config`` calls that make a pipeline fit without touching the container."""
    lines = ["import mindspore.dataset as ds"]
    if prefetch is not None:
        lines.append(f"ds.config.set_prefetch_size({prefetch})   # fewer shared-memory slots per worker")
    if workers is not None:
        lines.append(f"ds.config.set_num_parallel_workers({workers})")
    if shared_mem_off:
        lines.append("ds.config.set_enable_shared_mem(False)   # rows go through pipes: 2-4x slower, but no /dev/shm")
        lines.append("# or GeneratorDataset(..., python_multiprocessing=False): threads, no /dev/shm")
    return (("ds.config", "\n".join(lines)),)


# ----------------------------------------------------------------------------------------------- sizing


def _engine():
    return engines.get("mindspore")


def _get(config: Any, name: str) -> Any:
    """A field of MindSpore's dataset config, whether it came as the engine's dataclass or a dict."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def typical_workers(facts: Any) -> int:
    """Workers of a typical pipeline on this host: MindSpore's default 8, capped by the usable CPUs."""
    return max(1, min(TYPICAL_MAX_WORKERS, int(getattr(facts, "usable_cpus", None) or 1)))


def _local_ranks(facts: Any) -> int:
    return max(1, int(getattr(getattr(facts, "ranks", None), "local_size", 1) or 1))


@record
class Typical(Result):
    """The pipeline the host is judged for: MindSpore's defaults on this host unless the caller says otherwise.

    Attributes:
        need: recommended /dev/shm bytes for every local rank, headroom included.
        peak: the same without headroom: what the release's slots take (static slots: all at launch).
        reason: how ``need`` was computed, step by step.
        version: the MindSpore release judged for (``HostFacts.mindspore_version``; ``None``: the newest).
        slot_mb: the release's static slot size, ``None`` for dynamic slots sized to each row.
        failure: how this release fails when the slots do not fit (the engine's words).
        memory: container memory the pipelines of every local rank add, headroom included: their /dev/shm
            pages (charged to the writer's cgroup), rows in flight and each worker's own pages; on top of what
            the training processes themselves hold.
    """

    workers: int
    prefetch: int
    ranks: int
    row_bytes: int
    row_known: bool
    need: int
    peak: int
    reason: str
    version: str | None = None
    slot_mb: int | None = None
    failure: str = ""
    memory: int = 0

    def at(self, shm_free: int | None) -> Any:
        """The engine's ``Outcome`` of this pipeline at ``shm_free`` bytes of /dev/shm (``fits``, ``why``...)."""
        return _engine().outcome(self.row_bytes, self.workers, self.prefetch, self.ranks, shm_free, self.version)

    @property
    def shape(self) -> str:
        """``2 workers x 18 slots x 8.0 MiB rows x 1 rank(s)``: the pipeline in one phrase. Static slots take
        their size whatever the row (MindSpore 2.0.0's "18 static 6 MiB slots x 8.0 MiB rows" read as a product
        that was not the peak, an audit): the rows are said beside them, and whether they fit."""
        slots = model.slots(self.prefetch, self.workers)
        if self.slot_mb:
            fits = "" if self.row_bytes <= self.slot_mb << 20 else ", which do not fit them (pipes)"
            return (f"{self.workers} workers x {slots} static {self.slot_mb} MiB slots x {self.ranks} rank(s), "
                    f"for {mib(self.row_bytes)} rows{fits}")
        return f"{self.workers} workers x {slots} slots x {mib(self.row_bytes)} rows x {self.ranks} rank(s)"

    @classmethod
    def of(cls, facts: Any, ms_config: Any = None, workers: int | None = None,
           row_bytes: int | None = None) -> "Typical":
        """The typical pipeline of ``facts``' host and release, with the configured prefetch."""
        p = _get(ms_config, "prefetch_size")
        return typical(facts, workers=workers, row_bytes=row_bytes,
                       prefetch=p if isinstance(p, int) and p > 0 else None)


def typical(facts: Any, row_bytes: int | None = None, workers: int | None = None, ranks: int | None = None,
            prefetch: int | None = None, version: str | None = None) -> Typical:
    """The one rule for the typical pipeline: what ``doctor``, ``explain`` and ``tune`` size for.

    Args:
        facts: ``HostFacts`` (``usable_cpus``, ``ranks.local_size`` and ``mindspore_version`` are read).
        row_bytes: largest row; the 8 MiB reference row when unknown.
        workers: worker processes; ``min(8, usable CPUs)`` when unknown.
        ranks: ranks sharing this /dev/shm; the launcher's count when unknown.
        prefetch: ``ds.config.get_prefetch_size()``; MindSpore's default 16 when unknown.
        version: the MindSpore release; the host's when not given.
    """
    reference = row_bytes is None
    row = REFERENCE_ROW_BYTES if reference else int(row_bytes)
    w = typical_workers(facts) if workers is None else max(1, int(workers))
    r = _local_ranks(facts) if ranks is None else max(1, int(ranks or 1))
    p = model.DEFAULT_PREFETCH if prefetch is None else max(1, int(prefetch))
    v = getattr(facts, "mindspore_version", None) if version is None else version
    o = _engine().outcome(row, w, p, r, None, v)
    reason = _reason(o, w, p, r, row, reference, workers is None)
    mode = "processes" if w > 1 else "inline"
    memory = int(r * model.generator_memory(mode, row, w, p, o.per_rank if w > 1 else 0, None) / HEADROOM)
    return Typical(w, p, r, row, not reference, o.need if w > 1 else 0, o.all_ranks, reason, v, o.slot_mb,
                   o.failure, memory)


def _reason(o: Any, w: int, p: int, r: int, row: int, reference: bool, defaulted: bool) -> str:
    """How the typical need was computed, step by step, in the release's slot terms."""
    how = f" (MindSpore's default {TYPICAL_MAX_WORKERS}, capped at the usable CPUs)" if defaulted else ""
    if w <= 1:
        return (f"1 worker{how}: MindSpore reads the source in the main process and uses no /dev/shm "
                f"for rows")
    rows = f"{mib(row)} rows" + (" (reference row: real size unknown)" if reference else "")
    sums = (f" + semaphores = {mib(o.per_rank)} per rank x {r} rank(s) on this host = {mib(o.all_ranks)}; "
            f"/ {HEADROOM:.0%} headroom = {mib(o.need)}")
    if not o.slot_mb:
        return f"{w} workers{how} x {o.slots} slots (prefetch {p}) x {rows}" + sums
    carried = ("fit them" if model.static_row_fits(row, o.slot_mb) else
               "do not fit them and go through pipes (slow)")
    return (f"{w} workers{how} x {o.slots} static {o.slot_mb} MiB slots (prefetch {p}; {o.release_name}'s "
            f"default max_rowsize, committed at launch){sums}. {rows[0].upper()}{rows[1:]} {carried}")


def recommended_shm(facts: Any, row_bytes: int | None = None, workers: int | None = None,
                    ranks: int | None = None, prefetch: int | None = None, version: str | None = None) -> tuple:
    """The /dev/shm size this host needs for a typical GeneratorDataset pipeline on every local rank.

    The peak per rank is the engine's (``outcome``: exact to the byte on 2.10, static slots on <= 2.3); all
    ranks on the host share one /dev/shm; and ms_shm keeps 20% headroom, so the total is divided by 0.8.
    Arguments as ``typical``.

    Returns:
        ``(bytes, explanation)``: bytes is 0 when a typical pipeline uses no shared memory (one worker).

    Examples:
        8 ranks of 8 workers with 8 MiB rows need 8 x 10 x 8 MiB = 640 MiB each, 5 GiB together: MindSpore's
        "5 GB" advice. With headroom that is 6.25 GiB.
    """
    t = typical(facts, row_bytes, workers, ranks, prefetch, version)
    return t.need, t.reason


def fitting_prefetch(row_bytes: int, workers: int, budget: int, current: int = model.DEFAULT_PREFETCH,
                     version: str | None = None) -> int | None:
    """The largest prefetch (<= ``current``) whose slots fit ``budget`` bytes on ``version`` (``None``: the
    newest release), or ``None`` when even prefetch 1 does not."""
    static = profiles.profile_for(version).generator_default_max_rowsize_mb
    return model.fitting_prefetch(row_bytes, workers, budget, current, static)


def prefetch_fixes(t: Typical, shm_total: int) -> tuple:
    """``(prefetch, snippets)``: the prefetch at which ``t`` fits this rank's share of ``shm_total`` (``None``:
    none does) and the ``ds.config`` lines that set it, or that turn shared memory off."""
    share = budget_mod.compute(shm_total, t.ranks, None, None).shm_bytes
    p_fit = fitting_prefetch(t.row_bytes, t.workers, share, t.prefetch, t.version)
    return p_fit, ds_config_fixes(prefetch=p_fit) if p_fit else ds_config_fixes(shared_mem_off=True)


def fds_needed(facts: Any, workers: int, prefetch: int, pipelines: int = 1) -> int:
    """Fds the main process needs for ``pipelines`` typical pipelines (slots and pipes), a margin, and what is
    open already."""
    return sizes.fds_needed(_engine().pipeline_fds(workers, prefetch), getattr(facts, "open_fds", None), pipelines)


# ----------------------------------------------------------------------------------------------- diagnose


def _note(facts: Any, *keys: str) -> str | None:
    for note in getattr(facts, "notes", ()) or ():
        if any(k in note for k in keys):
            return note
    return None


def _shm_missing(facts: Any, t: Typical, fixes: tuple) -> Advice:
    note = _note(facts, "statvfs") or "statvfs failed"
    if "FileNotFoundError" in note:
        return Advice(
            f"{facts.shm_path} does not exist ({note}): multiprocessing cannot create its semaphores, so "
            "every multi-worker GeneratorDataset or map fails at launch",
            "crash", f"mount a tmpfs of at least {human_size(t.need)} at /dev/shm", fixes, "shm-missing")
    return Advice(f"/dev/shm size: could not determine ({note})", "info", "check it with: df -h /dev/shm", (),
                  "shm-unknown")


_CLEAN_SNIPPET = (("shell", "df -h /dev/shm\nms-shm clean --dry-run"),)

READONLY_FIX = ("remount /dev/shm read-write (`mount -o remount,rw /dev/shm`, as root), or give the container a "
                "writable one: docker run --shm-size={size} (no read-only mount over /dev/shm), Kubernetes an "
                "emptyDir with medium: Memory mounted at /dev/shm")


def readonly_fixes(size_bytes: int, container: str | None, memory_limit: int | None = None) -> tuple:
    """Ways to make /dev/shm writable: remount it (root, on the host or a privileged container), else the
    container's own writable /dev/shm of ``size_bytes`` (``shm_fixes``); the one for where we run first."""
    remount = ("shell", "sudo mount -o remount,rw /dev/shm\n"
                        "grep ' /dev/shm ' /proc/mounts   # the options start with 'rw,' once it is writable")
    fixes = shm_fixes(size_bytes, container, memory_limit)
    return (remount,) + fixes if container is None else fixes + (remount,)


def _shm_readonly_findings(facts: Any, t: Typical) -> list:
    """A /dev/shm mounted read-only (the probe's statvfs flag; unknown is not read-only): no size helps, since
    multiprocessing cannot create a semaphore there, so every worker pool of any framework fails at launch."""
    if not getattr(facts, "shm_readonly", None):
        return []
    size = max(t.need, 1)
    total = "" if facts.shm_total is None else f" (its {mib(facts.shm_total)} cannot be used)"
    return [Advice(
        f"{facts.shm_path} is mounted read-only{total}: multiprocessing cannot create its semaphores there (EROFS), "
        "so every worker pool fails at launch: PyTorch's DataLoader and map workers with 'OSError: [Errno 30] "
        "Read-only file system', GeneratorDataset with 'Init multiprocessing.Event() failed, This might be "
        "caused by insufficient shm, and the recommended shm size is at least 5 GB'",
        "crash", READONLY_FIX.format(size=human_size(size)),
        readonly_fixes(size, facts.container, facts.cgroup_mem_limit), "shm-readonly")]


def _shm_size_findings(facts: Any, t: Typical, fixes: tuple) -> list:
    """The /dev/shm size against the typical pipeline, judged as the release judges it (``Outcome.fits``)."""
    total = facts.shm_total
    at_total = t.at(total)
    if t.need and not at_total.fits:
        p_fit, config = prefetch_fixes(t, total)
        return [Advice(
            f"/dev/shm is {mib(total)}, but a typical GeneratorDataset pipeline here ({t.shape}) peaks at "
            f"{mib(t.peak)}. {at_total.why}",
            "crash", f"give the container a /dev/shm of {human_size(t.need)}"
                     + (f", or lower the prefetch to {p_fit}" if p_fit else ", or turn shared memory off"),
            fixes + config, "shm-small")]
    if t.need and total < t.need:
        return [Advice(
            f"/dev/shm is {mib(total)}: a typical GeneratorDataset pipeline here ({t.shape}) fits ({mib(t.peak)}) "
            f"but not with the 20% headroom ms_shm keeps ({mib(t.need)}), so ms_shm will lower the prefetch",
            "slow", f"give the container a /dev/shm of {human_size(t.need)}", fixes, "shm-tight")]
    return []


def _shm_findings(facts: Any, t: Typical) -> list:
    fixes = shm_fixes(max(t.need, 1), facts.container, facts.cgroup_mem_limit)
    if facts.shm_total is None:
        return [_shm_missing(facts, t, fixes)]
    total, free = facts.shm_total, facts.shm_free
    sem = model.semaphore_bytes(t.workers) * t.ranks
    used = total - free if free is not None else None
    out = _shm_readonly_findings(facts, t)
    if free is not None and free < sem:
        # "full" only where something holds it: an audit's --ranks 900 in an empty 64 MB one read "is full ... (0 B
        # used)", where its semaphores alone outgrow it
        held = bool(used) and used >= sem
        state = f"full: {mib(free)} free of {mib(total)} ({mib(used)} used)" if held else \
            f"too small for {t.ranks} rank(s): {mib(free)} free of {mib(total)}"
        fix = ("free /dev/shm: stop the process holding it, or remove leftovers with `ms-shm clean`; files there "
               "may be held open by live processes (`lsof +D /dev/shm`)") if held else \
            f"give the container a /dev/shm of {human_size(t.need or sem)}, or run fewer ranks on this host"
        out.append(Advice(
            f"/dev/shm is {state}. MindSpore cannot even create "
            f"its semaphores ({mib(sem)} for {t.ranks} rank(s)): GeneratorDataset fails with 'recommended shm "
            "size is at least 5 GB', map with '[Errno 28] No space left on device'",
            "crash", fix, _CLEAN_SNIPPET if held else fixes, "shm-full"))
    out += _shm_size_findings(facts, t, fixes)
    if free is not None and t.need and sem <= free and t.at(total).fits and not t.at(free).fits:
        out.append(Advice(
            f"/dev/shm is nearly full: {mib(free)} free of {mib(total)}; {mib(used)} is held by other processes "
            f"or leftovers, and a typical GeneratorDataset pipeline here ({t.shape}) needs {mib(t.peak)}",
            "crash", "find what holds it (`lsof +D /dev/shm`, `ipcs -m`) or remove leftovers with `ms-shm clean`",
            _CLEAN_SNIPPET, "shm-nearly-full"))
    elif used is not None and used >= max(_HELD_BEFORE_MIN, total // 4) and not any(
            a.code == "shm-full" for a in out):
        out.append(Advice(
            f"/dev/shm already holds {mib(used)} of its {mib(total)} ({used / total:.0%}) before any pipeline of "
            f"this program: other processes' files, or leftovers of dead runs; every budget here is taken from "
            f"what is free", "info",
            "see what holds it (`ls -laS /dev/shm`, `lsof +D /dev/shm`) and remove leftovers with `ms-shm clean`",
            _CLEAN_SNIPPET, "shm-held"))
    return out


_HELD_BEFORE_MIN = 8 * 1024 * 1024  # /dev/shm in use below this (Python's semaphores, a few arenas) is not said


def _nofile_findings(facts: Any, t: Typical) -> list:
    soft, hard = facts.nofile_soft, facts.nofile_hard
    note = _note(facts, "RLIMIT_NOFILE")
    if note:
        return [Advice(f"open-files limit: could not determine ({note})", "info",
                       "check it with: ulimit -Sn; ulimit -Hn", (), "nofile-unknown")]
    need = fds_needed(facts, t.workers, t.prefetch)
    out = []
    if soft is not None and soft < need:
        can_raise = hard is None or hard >= need
        target = nofile_target(need) if not can_raise or hard is None else min(nofile_target(need), hard)
        out.append(Advice(
            f"open-files soft limit is {soft}, but a typical {t.workers}-worker pipeline (prefetch {t.prefetch}) "
            f"needs about {need} fds in the main process (one per shared-memory slot plus pipes, "
            f"{facts.open_fds or 0} open now): it fails with 'Too many open files' (errno 24)",
            "crash", f"raise the soft limit to {target}"
                     + (" (the hard limit allows it)" if can_raise else f"; the hard limit {hard} must go up first"),
            nofile_fixes(need, facts.container, hard), "nofile-soft"))
    two = fds_needed(facts, t.workers, t.prefetch, pipelines=2)  # a train and an eval pipeline alive together
    if hard is not None and hard < two:
        out.append(Advice(
            f"open-files hard limit is {hard}: a process that is not root cannot raise its soft limit above it, "
            f"and a train plus an eval pipeline here need about {two}",
            "crash" if hard < need else "slow",
            f"raise the hard limit to {nofile_target(two)} where the process starts (runtime or limits.conf)",
            nofile_fixes(two, facts.container), "nofile-hard"))
    return out


def _cgroup_findings(facts: Any, t: Typical) -> list:
    limit = facts.cgroup_mem_limit
    if limit is None:
        return []
    out = []
    if t.memory and limit < t.memory:
        target = memory_target(limit, human_size(t.need), t.memory)
        out.append(Advice(
            f"the cgroup memory limit is {mib(limit)}, smaller than the {mib(t.memory)} a typical GeneratorDataset "
            f"pipeline here adds ({mib(t.peak)} of /dev/shm, rows in flight and each worker's own pages, 20% "
            f"headroom): tmpfs "
            "pages are charged to the writer's cgroup (a Kubernetes emptyDir to the pod), so the kernel "
            "OOM-kills the job (exit 137) before /dev/shm fills; ms_shm plans within the memory left, slower",
            "crash", f"raise the memory limit to at least {target} (resources.limits.memory, docker run --memory)",
            memory_fixes(target, facts.container, facts.cgroup_version, limit), "cgroup-small"))
    elif facts.shm_total is not None and facts.shm_total > limit:
        out.append(Advice(
            f"/dev/shm ({mib(facts.shm_total)}) is larger than the cgroup memory limit ({mib(limit)}): filling "
            "it gets the process OOM-killed ('Killed', signal 9) rather than a clear 'No space left on device'",
            "info", "keep /dev/shm use below the memory limit; ms_shm budgets by the smaller of the two",
            (), "cgroup-below-shm"))
    return out


def _sysv_limit_findings(facts: Any, t: Typical) -> list:
    """kernel.shmmax / shmall / shmmni / msgmni against map/batch workers of releases that use SysV (2.7+)."""
    o = t.at(None)
    cost = o.map
    if cost.transport != "sysv":
        return []
    out = []
    if facts.shmmax is not None and facts.shmmax < cost.sysv_segment:
        out.append(Advice(
            f"kernel.shmmax is {mib(facts.shmmax)}: a map/batch worker ({o.release_name} sends rows through one "
            f"SysV segment per worker) cannot hold a {mib(t.row_bytes)} row",
            "crash", f"raise kernel.shmmax to at least {cost.sysv_segment} (sysctl; --sysctl in docker)",
            (("sysctl", f"sysctl -w kernel.shmmax={cost.sysv_segment * 4}"),
             ("docker run", f"docker run --sysctl kernel.shmmax={cost.sysv_segment * 4} ...")), "sysv-shmmax"))
    pool = cost.sysv * t.ranks
    if facts.shmall_pages is not None and facts.shmall_pages < _HUGE // model.PAGE:
        room = facts.shmall_pages * model.PAGE - (facts.sysv_bytes or 0)
        if room < pool:
            out.append(Advice(
                f"kernel.shmall allows {mib(facts.shmall_pages * model.PAGE)} of SysV memory "
                f"({mib(facts.sysv_bytes or 0)} in use); {t.ranks} rank(s) of {t.workers} map workers with "
                f"{mib(t.row_bytes)} rows need {mib(pool)}",
                "crash", "raise kernel.shmall (in pages)",
                (("sysctl", f"sysctl -w kernel.shmall={math.ceil(2 * pool / model.PAGE)}"),), "sysv-shmall"))
    segments = t.workers * t.ranks
    for name, value in (("shmmni", facts.shmmni), ("msgmni", facts.msgmni)):
        if value is not None and value < segments + (facts.sysv_segments or 0):
            what = "segments" if name == "shmmni" else "message queues"
            out.append(Advice(
                f"kernel.{name} is {value}: {t.ranks} rank(s) x {t.workers} map workers need {segments} SysV "
                f"{what}", "crash", f"raise kernel.{name}",
                (("sysctl", f"sysctl -w kernel.{name}={max(4096, 2 * segments)}"),), f"sysv-{name}"))
    return out


def _sysv_findings(facts: Any, t: Typical) -> list:
    """Segments nobody has attached are what killed map/batch pools leave; a running pool keeps its own attached,
    so those are not called leftovers (a live job's were, while ``ms-shm clean`` rightly kept them)."""
    out = _sysv_limit_findings(facts, t)
    detached = getattr(facts, "sysv_detached_segments", None)
    if detached is None and facts.sysv_segments:
        what = (f"{facts.sysv_segments} SysV shared-memory segment(s) in use ({mib(facts.sysv_bytes or 0)}); "
                "if no pipeline is running now they are leftovers")
    elif detached:
        what = (f"{detached} SysV shared-memory segment(s) that no process has attached "
                f"({mib(facts.sysv_detached_bytes or 0)}): possible leftovers")
    else:
        return out
    out.append(Advice(
        f"{what}. MindSpore's map/batch workers leave theirs behind when the whole process group is SIGKILLed "
        "(OOM killer)", "info",
        "list them with `ipcs -m`; `ms-shm clean` accounts for each: it removes MindSpore's leftovers (never what a "
        "live process uses), names those that need `--orphan-keys` (MindSpore's pairs whose /tmp/dataset_ipc file "
        "is gone), and says why it leaves the rest (not recognisably MindSpore's: `ipcrm -m SHMID` once you know "
        "whose they are)",
        (("shell", "ipcs -m\nms-shm clean --dry-run"),), "sysv-in-use"))
    return out


def leftover_findings(leftovers: Any) -> list:
    """Files in ``/dev/shm`` that dead processes left (``leftovers``: ``cleanup.clean``'s dry run): a killed
    torch ``file_system`` loader's ``torch_*`` files, MindSpore 2.0-2.3's slots, stray semaphores. Each holds
    memory the host (or the container's limit) is charged for until removed, and the size findings only see
    the space they take."""
    files = [item for item in getattr(leftovers, "leftovers", ()) if item.kind == "dev-shm"]
    if not files:
        return []
    names = ", ".join(item.name.rsplit("/", 1)[-1] for item in files[:3]) + (", ..." if len(files) > 3 else "")
    return [Advice(
        f"{len(files)} file(s) in /dev/shm left by dead processes, holding {mib(sum(i.size_bytes for i in files))} "
        f"({names}): tmpfs pages stay charged to this host's (or container's) memory and take /dev/shm space "
        "until removed", "info",
        "remove them with `ms-shm clean --yes` (it never removes a file a live process has open or mapped)",
        (("shell", "ms-shm clean --dry-run\nms-shm clean --yes"),), "dev-shm-leftovers")]


def _unknown_findings(facts: Any, mindspore: bool = True) -> list:
    """A finding per reading that failed; MindSpore's version only where MindSpore is in use."""
    out = []
    checks = (
        ("memory", facts.mem_total, "proc/meminfo"),
        ("cgroup", facts.cgroup_version, "cgroup"),
        ("kernel.shmmax", facts.shmmax, "shmmax"),
        ("SysV segments in use", facts.sysv_segments, "sysvipc"),
        ("open fds", facts.open_fds, "open fds"),
    ) + ((("MindSpore version", facts.mindspore_version, None),) if mindspore else ())
    for label, value, key in checks:
        if value is None:
            note = (_note(facts, key) if key else None) or (
                "MindSpore is not installed" if label == "MindSpore version" else "no reading")
            out.append(Advice(f"{label}: could not determine ({note})", "info",
                              "nothing to do unless another finding points here", (), "unknown"))
    return out


def _config_findings(config: Any, facts: Any) -> list:
    out = []
    if config is None:
        return out
    if _get(config, "shared_mem") is False:
        out.append(Advice(
            "MindSpore's shared memory is off (ds.config.set_enable_shared_mem(False)): GeneratorDataset rows "
            "are pickled through pipes, 2-4x slower for large rows",
            "slow", "turn it back on once /dev/shm is large enough",
            (("ds.config", "import mindspore.dataset as ds\nds.config.set_enable_shared_mem(True)"),),
            "config-shm-off"))
    if "spawn" in str(_get(config, "start_method") or ""):
        out.append(Advice(
            "the multiprocessing start method is spawn: a static max_rowsize then fails to launch "
            "('Failed to launch multiprocessing of GeneratorDataset'), and the source is pickled with dill",
            "info", "keep max_rowsize=None (dynamic slots) with spawn", (), "config-spawn"))
    workers = _get(config, "num_parallel_workers")
    if isinstance(workers, int) and workers > facts.usable_cpus:
        out.append(Advice(
            f"ds.config num_parallel_workers is {workers} but only {facts.usable_cpus} CPU(s) are usable here "
            "(affinity and cgroup quota): the extra workers only add shared-memory slots",
            "slow", f"use at most {facts.usable_cpus} workers",
            ds_config_fixes(workers=facts.usable_cpus), "config-workers"))
    return out


def removeipc_fixes(user: str | None) -> tuple:
    """Ways to keep systemd-logind from deleting ``user``'s IPC at logout: turn ``RemoveIPC`` off for every
    user (root, a drop-in, logind restarted: it reads its configuration only at start), or let this one user
    linger, which keeps it "logged in" and costs a user manager running from boot."""
    who = user or "$USER"
    conf = ("logind.conf", "sudo mkdir -p /etc/systemd/logind.conf.d\n"
                           "printf '[Login]\\nRemoveIPC=no\\n' | sudo tee /etc/systemd/logind.conf.d/ms_shm.conf\n"
                           "sudo systemctl restart systemd-logind   # logind reads its configuration at start")
    linger = ("shell", f"sudo loginctl enable-linger {who}\n"
                       f"ls /var/lib/systemd/linger   # lists {who} once lingering is on")
    return (conf, linger)


def _loader_findings(facts: Any, numpy_version: str | None) -> list:
    """MindSpore 2.8+'s DataLoader under NumPy 2: every batch from a worker fails (measured on 2.10.0 with NumPy
    2.4.6); GeneratorDataset is not affected, so this is information until a DataLoader is used."""
    version = profiles.parse_version(getattr(facts, "mindspore_version", None))
    major = profiles.parse_version(numpy_version)
    if version is None or version < (2, 8) or major is None or major[0] < 2:
        return []
    return [Advice(
        f"MindSpore {facts.mindspore_version}'s DataLoader (mindspore.dataset.dataloader) can fail on batches "
        f"from worker processes under NumPy {numpy_version} ('SystemError: ... returned a result with an "
        f"exception set' in restore_tensor: its C++ was built against NumPy 1.x); GeneratorDataset is not "
        f"affected", "info", f"{NUMPY1_INSTALL} before using its DataLoader with num_workers > 0 "
        "(ms_shm.build_dataloader keeps samples in the main process unless num_workers is passed)",
        (("pip", NUMPY1_INSTALL),), "msloader-numpy2")]


def _removeipc_findings(facts: Any, t: Typical) -> list:
    """systemd-logind's RemoveIPC against the user running this: a finding when the IPC goes at logout."""
    lg = getattr(facts, "logind", None)
    if lg is None or not (lg.at_risk or lg.undetermined):
        return []
    if not lg.at_risk:
        return [Advice(f"systemd-logind RemoveIPC at logout: could not determine ({lg.reason})", "info",
                       "check with: systemd-analyze cat-config systemd/logind.conf | grep RemoveIPC; "
                       "ls /var/lib/systemd/linger", (), "removeipc-unknown")]
    who = lg.user or f"uid {lg.uid}"
    o = t.at(None)
    hit = (f"{o.release_name}'s map/batch workers talk to the main process through one SysV message queue each, "
           "so the pipeline stops with 'Exec msgrcv failed'" if o.map.transport == "sysv" else
           "the pipeline's /dev/shm slots and multiprocessing's semaphores vanish under it")
    return [Advice(
        f"systemd-logind has RemoveIPC=yes ({lg.source}) and {who} (uid {lg.uid}) is neither a system user nor "
        f"lingering: when {who}'s last login session ends, logind deletes its SysV message queues and "
        f"semaphores, its unattached SysV segments and its files in /dev/shm; {hit}. A job started from a "
        "shell keeps that session open (logind shows it 'closing') until the job exits; a job running outside "
        f"{who}'s sessions (a Slurm or PBS job, a systemd service or systemd-run unit as {who}, a container with "
        f"--ipc=host) dies mid-run when {who} closes the last ssh session",
        "info", f"set RemoveIPC=no (a drop-in, then restart systemd-logind) or `loginctl enable-linger {who}`; "
                "a system service running as the same user is not enough, and `systemd-run --user` units stop "
                "at logout unless lingering is on",
        removeipc_fixes(lg.user), "removeipc")]


def diagnose(facts: Any, ms_config: Any = None, *, workers: int | None = None,
             row_bytes: int | None = None, mindspore: bool = True) -> tuple:
    """Every problem this host has for a typical MindSpore pipeline, worst first.

    The typical pipeline is MindSpore's default: ``min(8, usable CPUs)`` workers, prefetch 16 (or the
    configured prefetch), the 8 MiB reference row, on each of the ranks the launcher put on this host.

    Args:
        facts: ``host.HostFacts``.
        ms_config: the engine's reading of ``mindspore.dataset.config`` (fields ``prefetch_size``,
            ``shared_mem``, ``start_method``, ``num_parallel_workers``), a dict, or ``None``.
        workers: judge for this many workers instead of the typical count.
        row_bytes: judge for rows of this size instead of the 8 MiB reference.
        mindspore: ``False`` for a program that uses torch and not MindSpore (``tune()`` there): only what holds
            for any framework. A torch script under ``ms-shm run`` was told of 18 GeneratorDataset slots and
            ``ds.config`` lines; its DataLoaders are sized by ``build_dataloader`` from their own batches.

    Returns:
        ``Advice`` tuple sorted crash, slow, info; empty when nothing is wrong.
    """
    if not mindspore:
        return tuple(sorted(_neutral_findings(facts), key=lambda a: a.rank))
    t = Typical.of(facts, ms_config, workers, row_bytes)
    findings = []
    findings += _shm_findings(facts, t)
    findings += _nofile_findings(facts, t)
    findings += _cgroup_findings(facts, t)
    findings += _sysv_findings(facts, t)
    findings += _config_findings(ms_config, facts)
    findings += _removeipc_findings(facts, t)
    findings += _loader_findings(facts, getattr(facts, "numpy_version", None))
    findings += _ranks_findings(facts)
    findings += _unknown_findings(facts)
    return tuple(sorted(findings, key=lambda a: a.rank))


def _neutral_findings(facts: Any) -> list:
    """What holds whatever the framework: a /dev/shm that is missing, unreadable or read-only, ranks assumed,
    readings that failed (MindSpore's version aside)."""
    t = Typical.of(facts)
    missing = [_shm_missing(facts, t, ())] if facts.shm_total is None else []
    return (missing + _shm_readonly_findings(facts, t) + _ranks_findings(facts)
            + _unknown_findings(facts, mindspore=False))


def _ranks_findings(facts: Any) -> list:
    if "assumed" not in facts.ranks.source and "at least" not in facts.ranks.source:
        return []
    return [Advice(f"ranks on this host: {facts.ranks.local_size}, assumed from {facts.ranks.source}",
                   "info", "export LOCAL_WORLD_SIZE (or MS_SHM_LOCAL_RANKS) with the ranks per host to size exactly",
                   (), "ranks-assumed")]


# ----------------------------------------------------------------------------------------------- doctor


@record
class Recommendation(Result):
    """The /dev/shm to give the host: ``bytes``, ``size`` as in ``--shm-size=`` (``None``: none needed)."""

    bytes: int
    size: str | None
    reason: str


@record
class Checkup(Result):
    """``ms-shm doctor``'s answer: the host, MindSpore's config, the typical pipeline, the size and findings.

    ``to_dict()`` is the ``--json`` object of schema 1 (README "--json keys") without ``schema``.
    """

    host: Any
    mindspore: Any
    mindspore_note: str | None
    typical: Typical
    recommended_shm: Recommendation
    findings: tuple
    ok: bool

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)


def checkup(facts: Any, ms_config: Any = None, config_note: str | None = None, *, workers: int | None = None,
            row_bytes: int | None = None, leftovers: Any = None) -> Checkup:
    """Everything ``ms-shm doctor`` reports, from facts already read (arguments as ``diagnose``; ``leftovers``:
    a dry run of ``cleanup.clean``, or ``None`` where not read)."""
    t = Typical.of(facts, ms_config, workers, row_bytes)
    findings = tuple(sorted(diagnose(facts, ms_config, workers=workers, row_bytes=row_bytes)
                            + tuple(leftover_findings(leftovers)), key=lambda a: a.rank))
    recommended = Recommendation(t.need, human_size(t.need) if t.need else None, t.reason)
    return Checkup(facts, ms_config, config_note, t, recommended, findings,
                   not any(f.severity == "crash" for f in findings))
