"""Recognise the known shared-memory and fd failures in a log or traceback, and explain them in this host's numbers.

Pure text matching: the caller reads the log and probes the host. The patterns are the messages MindSpore and
PyTorch really print (``tests/data/logs`` holds logs captured from failing MindSpore runs), matched loosely
enough to survive the GLOG prefix, a Python traceback around them or a line wrapped by a job scheduler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ms_shm import advice
from ms_shm._results import Result, mib
from ms_shm.engines.mindspore import arithmetic as model


@dataclass(frozen=True)
class Explanation(Result):
    """One recognised failure.

    Attributes:
        kind: stable identifier: ``bus-error``, ``insufficient-shm``, ``shm-full``, ``no-space``,
            ``too-many-open-files``, ``pytorch-bus-error``, ``pytorch-shm``, ``row-too-big``, ``worker-killed``,
            ``worker-exited``.
        severity: as ``Advice.severity``.
        line: the first line of the log that matched, trimmed.
        cause: why it happened, with this host's numbers.
        fix: one line.
        snippets: ``(label, text)`` pairs, as in ``Advice``.
        pid: the worker pid the log names, if any.
        signal: the signal the log names, if any.
        required: bytes MindSpore said it needed ("Insufficient shared memory available. Required: X").
        available: bytes MindSpore said were free.
    """

    kind: str
    severity: str
    line: str
    cause: str
    fix: str
    snippets: tuple = ()
    pid: int | None = None
    signal: str | None = None
    required: int | None = None
    available: int | None = None


# Each pattern: kind, compiled regex. Order does not matter: results are sorted by where they first appear.
_PATTERNS = (
    ("bus-error", re.compile(r"Unexpected bus error encountered in process")),
    ("sigchld", re.compile(r"Dataset worker process (\d+) (?:was killed by signal: ([A-Za-z ]+?)\.|"
                           r"exited unexpectedly with exit code (-?\d+))")),
    ("insufficient-shm", re.compile(r"Insufficient shared memory available\.\s*Required:\s*(\d+),\s*"
                                    r"Available:\s*(\d+)")),
    ("shm-full", re.compile(r"recommended shm size is at least\s*(\d+)\s*GB")),
    ("no-space", re.compile(r"\[Errno 28\] No space left on device|errno:? 28\b|ENOSPC")),
    ("too-many-open-files", re.compile(r"Too many open files|\[Errno 24\]|errno:? 24\b|EMFILE")),
    ("pytorch-bus-error", re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([A-Za-z ]+?)\.|"
                                     r"Unexpected bus error encountered in worker")),
    ("pytorch-shm", re.compile(r"unable to (?:write to|open shared memory object|mmap)[^\n]*</?torch_")),
    ("row-too-big", re.compile(r"rowsize is larger than allocated memory max_rowsize:\s*([\d.]+)MB,\s*"
                               r"current rowsize:\s*([\d.]+)MB")),
)
_SEMAPHORE_HINTS = ("SemLock", "synchronize.py", "sem_open", "multiprocessing.Event", "multiprocessing.Value",
                    "Lock()", "Semaphore")


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start:end if end >= 0 else len(text)].strip()
    return line if len(line) <= 300 else line[:297] + "..."


def _shm_state(facts: Any) -> str:
    """A sentence on this host's /dev/shm against a typical pipeline, as the doctor judges it."""
    total, free = getattr(facts, "shm_total", None), getattr(facts, "shm_free", None)
    t = advice.Typical.of(facts)
    if total is None:
        return "This host's /dev/shm could not be read."
    here = (f"This host's /dev/shm is {mib(total)} ({mib(free)} free); a typical pipeline here ({t.shape}) "
            f"peaks at {mib(t.peak)}, {mib(t.need)} with ms_shm's headroom.")
    if t.peak and total >= t.peak:
        here += (" That fits, so if the job ran elsewhere (another container or node), run `ms-shm doctor` "
                 "there: its /dev/shm was smaller.")
    return here


def _shm_fix(facts: Any, at_least: int = 0) -> tuple:
    """The size to ask for: what a typical pipeline of this host needs, or ``at_least``, whichever is larger."""
    need = max(advice.Typical.of(facts).need, at_least)
    return need, advice.shm_fixes(need, getattr(facts, "container", None),
                                  getattr(facts, "cgroup_mem_limit", None))


def _prefetch_fix(facts: Any) -> tuple:
    """A ``ds.config`` snippet when this host's /dev/shm forces a lower prefetch (or no shared memory)."""
    t = advice.Typical.of(facts)
    if getattr(facts, "shm_total", None) is None or not t.peak or facts.shm_total >= t.peak:
        return ()
    budget = int(facts.shm_total * advice.HEADROOM / t.ranks)
    p_fit = advice.fitting_prefetch(t.row_bytes, t.workers, budget)
    return advice.ds_config_fixes(prefetch=p_fit) if p_fit else advice.ds_config_fixes(shared_mem_off=True)


def _bus_error(facts: Any, pid: int | None, line: str) -> Explanation:
    need, snippets = _shm_fix(facts)
    who = f"worker {pid}" if pid else "a worker"
    return Explanation(
        "bus-error", "crash", line,
        f"MindSpore's GeneratorDataset {who} wrote a row into a shared-memory slot after /dev/shm was full; "
        "the kernel answers that with SIGBUS, and the main process then terminates itself. Dynamic slots (the "
        f"default since 2.4) are not checked in advance. {_shm_state(facts)}",
        f"give the container a /dev/shm of {advice.human_size(need)}, or lower prefetch/workers "
        "(`ms-shm plan --row-mb <row> --workers <W>` shows what fits)",
        snippets + _prefetch_fix(facts), pid=pid, signal="Bus error")


def _insufficient(facts: Any, required: int, available: int, line: str) -> Explanation:
    ratio = required / available if available else float("inf")
    # The check compares Required with 80% of the free space at launch; ask for what makes it pass, plus
    # what was already in use.
    used = (facts.shm_total - facts.shm_free) if facts.shm_total is not None and facts.shm_free is not None else 0
    at_least = int(required / advice.HEADROOM) + used + model.MiB
    need, snippets = _shm_fix(facts, at_least=at_least)
    snippets += advice.ds_config_fixes(prefetch=2)
    return Explanation(
        "insufficient-shm", "crash", line,
        f"MindSpore's launch check for a static max_rowsize refused: the slots need {mib(required)} "
        f"(workers x (prefetch-based queue + 2) x max_rowsize, x ranks up to 8) but only {mib(available)} of "
        f"/dev/shm was free ({ratio:.1f}x), and it allows at most 80%. Asking for {mib(required)} / 80% plus "
        f"what is in use gives {advice.human_size(need)}. {_shm_state(facts)}",
        f"drop max_rowsize (MindSpore 2.4+ sizes slots to each row), lower prefetch or workers, or give the "
        f"container a /dev/shm of {advice.human_size(need)}",
        snippets, required=required, available=available)


def _shm_full(facts: Any, line: str, what: str) -> Explanation:
    need, snippets = _shm_fix(facts)
    snippets = (("shell", "df -h /dev/shm\nms-shm clean --dry-run"),) + snippets
    return Explanation(
        "shm-full" if what == "event" else "no-space", "crash", line,
        "/dev/shm had no room left even for multiprocessing's semaphores (one page each), so the pipeline "
        "could not start: something else filled it (another job, or files a crashed run left). MindSpore's "
        f"'5 GB' is a rule of thumb. {_shm_state(facts)}",
        "free /dev/shm (stop whatever holds it; `ms-shm clean` removes MindSpore's leftovers), then give the "
        f"container a /dev/shm of {advice.human_size(need)}",
        snippets)


def _no_space_elsewhere(line: str) -> Explanation:
    return Explanation(
        "no-space", "info", line,
        "A filesystem is full (errno 28). The traceback does not go through multiprocessing's semaphores, so "
        "it is probably not /dev/shm: check the disk the job writes to",
        "check with: df -h; df -h /dev/shm", ())


def _too_many_files(facts: Any, line: str) -> Explanation:
    workers = advice.typical_workers(facts)
    need = advice.fds_needed(facts, workers, model.DEFAULT_PREFETCH)
    target = advice.nofile_target(need)
    soft, hard = facts.nofile_soft, facts.nofile_hard
    limits = (f"this shell's soft limit is {'unlimited' if soft is None else soft} and hard limit "
              f"{'unlimited' if hard is None else hard}")
    if soft is None or soft >= need:
        limits += (", which would be enough: the job ran with a lower limit (see `grep 'open files' "
                   "/proc/<pid>/limits` of a running job)")
    return Explanation(
        "too-many-open-files", "crash", line,
        "A process ran out of file descriptors (errno 24, EMFILE). Every MindSpore shared-memory slot is an fd "
        f"passed to the main process, so a {workers}-worker pipeline at prefetch {model.DEFAULT_PREFETCH} holds "
        f"about {need}; {limits}",
        f"raise the job's open-files limit to at least {target} (`ulimit -n` before training, or the "
        "container's --ulimit)",
        advice.nofile_fixes(need, getattr(facts, "container", None)))


def _pytorch(facts: Any, pid: int | None, sig: str | None, line: str, kind: str) -> Explanation:
    need, snippets = _shm_fix(facts)
    return Explanation(
        kind, "crash", line,
        "A PyTorch DataLoader worker was killed while putting a batch into /dev/shm (PyTorch moves every "
        "batch tensor through a shared-memory file: about workers x prefetch_factor x batch bytes at once). "
        f"{_shm_state(facts)} (MindSpore's formula; PyTorch's need depends on the batch size)",
        f"give the container a /dev/shm of {advice.human_size(need)} (or --ipc=host), or lower num_workers / "
        "prefetch_factor",
        snippets, pid=pid, signal=sig or ("Bus error" if kind == "pytorch-bus-error" else None))


def _row_too_big(facts: Any, slot_mb: float, row_mb: float, line: str) -> Explanation:
    better = model.static_rowsize_for(int(row_mb * model.MiB))
    return Explanation(
        "row-too-big", "slow", line,
        f"A row of {row_mb:g} MB did not fit the static {slot_mb:g} MB slots (it must be strictly smaller), so "
        "MindSpore pickled it through a pipe instead: measured about 4x slower",
        f"use max_rowsize=None (dynamic slots, MindSpore 2.4+) or max_rowsize={better}",
        (("python", f"ds.GeneratorDataset(source, column_names, num_parallel_workers=W, max_rowsize={better})"),))


def _worker_signal(facts: Any, pid: int, sig: str, line: str) -> Explanation:
    limit = getattr(facts, "memory_limit", None)
    return Explanation(
        "worker-killed", "crash", line,
        f"MindSpore's dataset worker {pid} was killed by signal {sig}. SIGKILL ('Killed') is usually the OOM "
        f"killer: /dev/shm pages count against the memory limit ({mib(limit)} here). After a SIGKILL of the "
        "whole process group, map/batch workers leave SysV segments behind",
        "check `dmesg | grep -i oom`, lower workers or row size, raise the memory limit; `ms-shm clean` removes "
        "leftovers",
        (("shell", "dmesg | grep -i -E 'oom|killed process'\nipcs -m\nms-shm clean --dry-run"),),
        pid=pid, signal=sig)


def _worker_exit(pid: int, code: str, line: str) -> Explanation:
    return Explanation(
        "worker-exited", "crash", line,
        f"MindSpore's dataset worker {pid} exited with code {code}; its own traceback, printed above this line, "
        "names the cause, and nothing in it matched a known shared-memory or fd failure",
        "read the worker's traceback; run `ms-shm doctor` for the host's limits", (), pid=pid)


def explain(text: str, facts: Any) -> tuple:
    """Every known failure found in ``text``, in the order it first appears, with cause and fix for this host.

    Args:
        text: a log, a traceback, or a whole job's output.
        facts: ``host.HostFacts`` of the host the job runs on (the numbers in the causes come from it).

    Returns:
        ``Explanation`` tuple; empty when nothing is recognised.
    """
    first: dict = {}
    for kind, pattern in _PATTERNS:
        for match in pattern.finditer(text):
            first.setdefault(kind, []).append(match)
    found = []  # (position, Explanation)
    sigchld = first.get("sigchld", [])
    bus_pid = None
    for m in sigchld:
        if m.group(2) and "bus" in m.group(2).lower():
            bus_pid = int(m.group(1))
            break
    if "bus-error" in first or bus_pid is not None:
        bus_matches = first.get("bus-error", []) + [m for m in sigchld if m.group(2) and "bus" in m.group(2).lower()]
        pos = min(m.start() for m in bus_matches)
        found.append((pos, _bus_error(facts, bus_pid, _line_at(text, pos))))
    for m in first.get("insufficient-shm", [])[:1]:
        found.append((m.start(), _insufficient(facts, int(m.group(1)), int(m.group(2)), _line_at(text, m.start()))))
    for m in first.get("shm-full", [])[:1]:
        found.append((m.start(), _shm_full(facts, _line_at(text, m.start()), "event")))
    for m in first.get("no-space", [])[:1]:
        if any(h in text for h in _SEMAPHORE_HINTS) or "/dev/shm" in text:
            found.append((m.start(), _shm_full(facts, _line_at(text, m.start()), "semaphore")))
        else:
            found.append((m.start(), _no_space_elsewhere(_line_at(text, m.start()))))
    for m in first.get("too-many-open-files", [])[:1]:
        found.append((m.start(), _too_many_files(facts, _line_at(text, m.start()))))
    pt = first.get("pytorch-bus-error", [])
    if pt:
        pid = sig = None
        for m in pt:
            if m.group(1):
                pid, sig = int(m.group(1)), m.group(2)
                break
        shm_related = sig is None or "bus" in sig.lower()
        kind = "pytorch-bus-error" if shm_related else "worker-killed"
        if shm_related:
            found.append((pt[0].start(), _pytorch(facts, pid, sig, _line_at(text, pt[0].start()), kind)))
        else:
            found.append((pt[0].start(), _worker_signal(facts, pid, sig, _line_at(text, pt[0].start()))))
    for m in first.get("pytorch-shm", [])[:1]:
        if not pt:
            found.append((m.start(), _pytorch(facts, None, None, _line_at(text, m.start()), "pytorch-shm")))
    for m in first.get("row-too-big", [])[:1]:
        found.append((m.start(), _row_too_big(facts, float(m.group(1)), float(m.group(2)),
                                              _line_at(text, m.start()))))
    # A worker killed by another signal, or exiting with a code: only worth saying when nothing above explains it.
    for m in sigchld:
        if m.group(2) and "bus" not in m.group(2).lower():
            found.append((m.start(), _worker_signal(facts, int(m.group(1)), m.group(2), _line_at(text, m.start()))))
            break
    if not found:
        for m in sigchld[:1]:
            if m.group(3) is not None:
                found.append((m.start(), _worker_exit(int(m.group(1)), m.group(3), _line_at(text, m.start()))))
    found.sort(key=lambda item: item[0])
    return tuple(e for _, e in found)
