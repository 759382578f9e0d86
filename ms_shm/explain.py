"""Recognise the known shared-memory and fd failures in a log or traceback, and explain them in this host's numbers.

Pure text matching: the caller reads the log and probes the host. What each framework prints is its engine's
(``Engine.signatures()``: MindSpore's are in ``engines/mindspore/signatures.py``); this module only finds them,
orders them, and fills in this host's numbers and fixes from ``advice``, so ``explain`` and ``doctor`` quote the
same sizes. A new engine brings its own signatures; nothing here changes.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ms_shm import advice, engines
from ms_shm._results import Result, mib, record
from ms_shm.engines.base import OOM_CAUSE, Signature
from ms_shm.engines.mindspore import signatures as ms_signatures
from ms_shm.sizes import GiB, KiB, MiB


@record
class Explanation(Result):
    """One recognised failure.

    Attributes:
        kind: stable identifier: ``bus-error``, ``insufficient-shm``, ``shm-full``, ``shm-readonly`` (an EROFS in
            /dev/shm, or MindSpore's "insufficient shm" line on a host whose /dev/shm is read-only), ``no-space``,
            ``too-many-open-files``, ``pytorch-bus-error``, ``pytorch-shm``, ``msloader-bus-error`` (MindSpore's
            DataLoader), ``row-too-big``, ``worker-killed``,
            ``worker-exited``, ``worker-died``, ``ipc-removed``; a process killed by SIGKILL: ``oom-killed`` (the
            kernel's OOM-kill lines), ``sigkill`` (an exit status -9 / 137 or a named SIGKILL), ``killed`` (the
            shell's bare "Killed"); ms_shm's own errors: ``shm-budget-error``, ``memory-budget-error``,
            ``row-too-large-error``, ``shm-full-error``.
        severity: as ``Advice.severity``, or ``likely`` for weak evidence (the shell's bare "Killed": the OOM
            killer is only the likeliest of the senders of SIGKILL).
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


@record
class Report(Result):
    """``ms-shm explain``'s answer; ``to_dict()`` is its ``--json`` object without ``schema``."""

    source: str
    recognised: tuple
    host: Any


_INTS = ("pid", "required", "available")


def _own_words(default_fix: str) -> Any:
    """``words`` of ms_shm's own errors: the fix their message carries ("... Fix: ..."), else ``default_fix``."""
    def words(fields: dict) -> dict:
        return {"detail": (fields.get("detail") or "").strip(), "own_fix": fields.get("own_fix") or default_fix}

    return words


def _own_error(name: str, naming: str = "") -> str:
    """One line of an ms_shm error, as a traceback ends with it (``ms_shm.errors.X: message Fix: ...``); the same
    class re-raised by MindSpore in the main process names the module of the worker's copy (``ms_shm.guard``),
    and MindSpore's own header of that re-raise (``ShmFullError: Traceback (most recent call last):``) is not it:
    read as the error, it hid the worker's message and its fix (an audit's log of 4 ranks under 64 MB).
    ``naming``: a pattern the line must contain, to tell apart errors of one class that bind on different limits."""
    return (r"(?m)\b(?:ms_shm\.[\w.]+\.)?" + name + r": (?!Traceback \(most recent call last\))" +
            (rf"(?=[^\n]*?{naming})" if naming else "") + r"(?P<detail>[^\n]*?)(?:\s*Fix: (?P<own_fix>[^\n]*))?$")


# A candidate the planner ruled out for memory ("threads x2: needs 656.0 MiB of memory > 109.8 MiB left for it"):
# the container's memory limit, not /dev/shm, is what the settings do not fit.
_MEMORY_BOUND = r"of memory > "


# ms_shm's own errors: raised instead of the bus error the settings would end in (``ms_shm.errors``). Their
# messages carry the sizes and the fix worked out for the pipeline, so no host snippet of a typical pipeline's
# size is added to contradict them.
OWN_SIGNATURES = (
    Signature(
        "memory-budget-error", "ms_shm's ShmBudgetError for memory (settings that cannot fit the memory limit)",
        _own_error("ShmBudgetError", _MEMORY_BOUND), "crash",
        "ms_shm refused, before any worker started, settings the code insisted on (explicit arguments under "
        "`ms-shm run --strict` / `patch(strict=True)`, or given to ms_shm as orders): they need more memory than "
        "the container's memory limit leaves for the pipeline. Its /dev/shm pages, the rows in flight and each "
        "worker's own pages all count against that limit, so running them would have ended in an OOM kill "
        "(SIGKILL: 'Killed', exit 137), not a bus error. {detail}",
        "{own_fix}", engine="ms_shm",
        words=_own_words("drop the explicit python_multiprocessing / num_parallel_workers (or run without "
                         "--strict) so ms_shm can choose what fits the memory left, or raise the container's "
                         "memory limit (docker run --memory; Kubernetes resources.limits.memory)")),
    Signature(
        "shm-budget-error", "ms_shm's ShmBudgetError (settings insisted on that cannot fit)",
        _own_error("ShmBudgetError"), "crash",
        "ms_shm refused, before any worker started, settings the code insisted on (explicit arguments under "
        "`ms-shm run --strict` / `patch(strict=True)`, or given to ms_shm as orders): they cannot fit this rank's "
        "/dev/shm or fd budget, and running them would end in a bus error. {detail} {shm_state}",
        "{own_fix}", engine="ms_shm",
        words=_own_words("drop the explicit python_multiprocessing / num_parallel_workers / max_rowsize (or run "
                         "without --strict) so ms_shm can choose what fits, or give the container a bigger "
                         "/dev/shm (`ms-shm doctor` says how much)")),
    Signature(
        "row-too-large-error", "ms_shm's RowTooLargeError (a row larger than planned, stopped in the worker)",
        _own_error("RowTooLargeError"), "crash",
        "A worker read a row larger than the shared-memory slots ms_shm planned from the probe rows, and ms_shm "
        "stopped it before the write, which would have ended in a bus error: the rows grow after the first ones. "
        "{detail}",
        "{own_fix}", engine="ms_shm",
        words=_own_words("give /dev/shm room for the largest row, lower num_parallel_workers, or pass "
                         "python_multiprocessing=False")),
    Signature(
        "shm-full-error", "ms_shm's ShmFullError (/dev/shm filled by something else while running)",
        _own_error("ShmFullError"), "crash",
        "/dev/shm filled up under the running pipeline (something else wrote to it after ms_shm planned), and "
        "ms_shm stopped the worker before its row's write, which would have ended in a bus error. {detail}",
        "{own_fix}", engine="ms_shm", snippets=(("shell", "df -h /dev/shm\nms-shm clean --dry-run"),),
        words=_own_words("make room in /dev/shm (`df -h /dev/shm`; `ms-shm clean` removes what crashed runs "
                         "left), lower num_parallel_workers, or pass python_multiprocessing=False")),
)


def _oom_answer() -> Signature:
    """MindSpore's "worker ... was killed by signal: Killed" signature: the one OOM answer (its fix, its dmesg
    snippet), which every other kill line reuses so that they all give the same fix."""
    return next(s for s in ms_signatures.signatures() if s.kind == "worker-killed")


_CGROUP_CHECK = ("cgroup", "cat /sys/fs/cgroup/memory/memory.failcnt   # v1: times the memory limit was hit\n"
                           "grep oom_kill /sys/fs/cgroup/memory.events   # v2: OOM kills in this cgroup")
_CHECK = (" To confirm: `dmesg | grep -i oom` (a 'Memory cgroup out of memory: Killed process' line names it), "
          "and the cgroup's memory.failcnt (v1) or the oom_kill count in memory.events (v2).")


def _kill_words(fields: dict) -> dict:
    """Who the kernel's OOM-kill lines name, and whether a memory cgroup's limit (the container's) or the whole
    host ran out: ``CONSTRAINT_MEMCG`` / "Memory cgroup out of memory" say the former."""
    scope = f"{fields.get('scope') or ''} {fields.get('constraint') or ''}"
    where = ("a memory cgroup (the container) reached its limit" if "MEMCG" in scope or "cgroup" in scope else
             "the host ran out of memory" if scope.strip() else "memory ran out")
    victim = fields.get("victim_pid")  # not ``pid``: that names a dataset worker, and this may be the job itself
    return {"victim": f"process {victim}" if victim else "a process", "where": where}


def kill_signatures() -> tuple:
    """A process killed by SIGKILL, as the kernel, a shell, subprocess and torchrun report it: most likely the
    OOM killer at the cgroup memory limit. Strong evidence (the kernel's own lines, a named SIGKILL) is a crash;
    the shell's bare "Killed" only ``likely``. A framework's own kill line, when there, explains it first."""
    oom = _oom_answer()

    def kill(kind: str, label: str, regex: str, severity: str, what: str, yields_to: tuple) -> Signature:
        return replace(oom, kind=kind, label=label, regex=regex, severity=severity, engine="os", signal="Killed",
                       cause=what + " " + OOM_CAUSE + _CHECK,  # the engine's one OOM sentence
                       snippets=oom.snippets + (_CGROUP_CHECK,),
                       yields_to=yields_to, words=_kill_words)

    return (
        kill("oom-killed", "the kernel's OOM-kill lines ('Memory cgroup out of memory: Killed process')",
             r"(?P<scope>Memory cgroup out of memory|Out of memory): Kill(?:ed)? process (?P<victim_pid>\d+)|"
             r"oom-kill:constraint=(?P<constraint>CONSTRAINT_\w+)|invoked oom-killer|"
             r"Reason:[ \t]+OOMKilled\b|\"OOMKilled\":[ \t]*true",  # kubectl describe pod, docker inspect
             "crash", "The kernel's OOM killer killed {victim}: {where}.", ("worker-killed",)),
        kill("sigkill", "an exit status -9 or 137, or a named SIGKILL (subprocess, torchrun)",
             r"returned non-zero exit status -9\b|\bexitcode:? -9\b|\bSignal 9 \(SIGKILL\)|"
             r"<Signals\.SIGKILL: 9>|\b[Ee]xit(?:ed)?(?: with)? (?:[Cc]ode|[Ss]tatus):?[ \t]+137\b",
             "crash", "A process was killed by SIGKILL (signal 9; exit status -9, or 137 from a shell); the "
             "log does not say who sent it.", ("worker-killed", "oom-killed")),
        kill("killed", "the shell's bare 'Killed'",
             r"(?m)^[ \t]*(?:[^\n:]+: line \d+:[ \t]+\d+[ \t]+|\[\d+\][+-]?[ \t]+)?Killed(?:[ \t]+(?!process\b)"
             r"[^\n]*)?$|^zsh: killed[ \t]",  # bash (a script's line, a job's [1]+), zsh
             "likely", "The shell printed 'Killed': the job was killed by SIGKILL; nothing else in the log "
             "says why, so this is a guess from the signal alone.", ("worker-killed", "oom-killed", "sigkill")),
    )


# Where an EROFS is /dev/shm's: multiprocessing's semaphores and heap (its Arena files), PyTorch's and MindSpore's
# DataLoader storages (shm_open of /torch_*, MapAllocator).
_SHM_FILES = ms_signatures.SEMAPHORE_HINTS + ("sharedctypes.py", "heap.py", "/torch_", "MapAllocator", "shm_open")
_READONLY_CAUSE = (" No worker pool of any framework starts there, whatever the size (PyTorch's DataLoader, "
                   "MindSpore's DataLoader, map and GeneratorDataset workers alike).")
READONLY = Signature(
    "shm-readonly", "'Read-only file system' (EROFS) in /dev/shm",
    r"\[Errno 30\] Read-only file system|Read-only file system \(30\)|errno:? 30\b|\bEROFS\b", "crash",
    "/dev/shm is mounted read-only: multiprocessing's semaphores or heap, or a DataLoader's shared-memory file, "
    "could not be created there (EROFS, errno 30)." + _READONLY_CAUSE + " {readonly_state}",
    advice.READONLY_FIX, need="shm-readonly", near=_SHM_FILES, engine="os")


def _hidden_readonly(sig: Signature) -> Signature:
    """``sig``, a message MindSpore also prints for a read-only /dev/shm without the errno, told as the read-only
    mount this host's /dev/shm is."""
    return replace(READONLY, label=sig.label, regex=sig.regex, near=sig.near, not_near=sig.not_near,
                   cause="This host's /dev/shm is mounted read-only, and MindSpore prints this line when "
                         "multiprocessing cannot create its semaphores there: it hides the EROFS, and its '5 GB' "
                         "has nothing to do with it." + _READONLY_CAUSE)


def _on_this_host(sig: Signature, facts: Any) -> Signature:
    """The signature as this host tells it: where /dev/shm is read-only (the probe's statvfs flag), a message
    that a read-only mount also produces (``HIDES_READONLY``) is that mount, not a full /dev/shm."""
    if getattr(facts, "shm_readonly", None) and sig.kind in ms_signatures.HIDES_READONLY:
        return _hidden_readonly(sig)
    return sig


def signatures(facts: Any = None) -> tuple:
    """What ms_shm itself and every engine print when they fail, the engines' worded for the host's release of
    each framework, then the operating system's: an EROFS in /dev/shm, and the kill lines (a framework's own line
    about a kill is the more specific)."""
    found: list = list(OWN_SIGNATURES)
    for engine in engines.all_engines():
        found += engine.signatures(getattr(facts, f"{engine.name}_version", None))
    return tuple(_on_this_host(s, facts) for s in found) + (READONLY,) + kill_signatures()


def known(facts: Any = None) -> list:
    """The failures ``explain`` recognises, in a few words each."""
    return list(dict.fromkeys(s.label for s in signatures(facts)))


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start:end if end >= 0 else len(text)].strip()
    return line if len(line) <= 300 else line[:297] + "..."


def _hit(sig: Signature, text: str) -> tuple | None:
    """``(positions, signature, fields)`` when ``sig`` is in ``text``: every match's position, and for each named
    group the first value any match gave."""
    if sig.near and not any(n in text for n in sig.near):
        return None
    if sig.not_near and any(n in text for n in sig.not_near):
        return None
    matches = list(re.finditer(sig.regex, text))
    if not matches:
        return None
    fields: dict = {}
    for m in matches:
        for name, value in m.groupdict().items():
            if value is not None and fields.get(name) is None:
                fields[name] = int(value) if name in _INTS else value
    return [m.start() for m in matches], sig, fields


# A record ms_shm logged: its predictions quote the failures they prevent ("fails with 'recommended shm size is at
# least 5 GB'", "'SystemError: ... returned a result with an exception set' in restore_tensor"), and are none.
# Told by ``ms-shm run``'s "LEVEL: message" or logging's default "LEVEL:ms_shm:message"; by a level beside the
# logger name ms_shm in any other format ("INFO ms_shm: ...", "12:00:01 - ms_shm.api - WARNING - ..."); or, with
# no prefix at all, by the shape of ms_shm's advice: "problem Fix: fix" on a line that does not start with an
# exception (ms_shm's own errors, "ms_shm.errors.ShmBudgetError: ... Fix: ...", are failures and stay).
_LEVEL = r"(?:DEBUG|INFO|WARNING)"
_LOGGER = r"ms_shm(?:\.[\w.]+)?"
_OWN_RECORD = re.compile(
    rf"^{_LEVEL}(?:: |:{_LOGGER}:)|"
    rf"^[^\n]{{0,60}}?\b{_LEVEL}\]?[ \t:|-]+\[?{_LOGGER}\b|"
    rf"^[^\n]{{0,60}}?\b{_LOGGER}\]?[ \t:|-]+\[?{_LEVEL}\b|"
    r"^(?![ \t]*[\w.]*(?:Error|Exception)\b:)[^\n]*\S Fix: \S|"
    r"^ms_shm\.tune: budget ")  # ``str(TuneReport)`` printed or logged: its advice lines follow, indented


def without_own_records(text: str) -> str:
    """``text`` with the records ms_shm logged, and the indented lines that continue them (their snippets),
    blanked: explaining ms_shm's own warnings as crashes would send the reader after a failure that never was.
    Lines stay where they were, so positions still name the log's lines."""
    lines, own = text.split("\n"), False
    for number, line in enumerate(lines):
        own = bool(_OWN_RECORD.match(line)) or (own and line[:1] in (" ", "\t"))
        if own:
            lines[number] = ""
    return "\n".join(lines)


def _one_per_line(hits: list, text: str) -> list:
    """Each hit at its first match on a line no earlier hit took (hits in signature order): two signatures that
    match the same line explain it once, by the first (the more specific)."""
    taken: set = set()
    placed = []
    for positions, sig, fields in hits:
        for pos in positions:
            line = text.rfind("\n", 0, pos) + 1
            if line not in taken:
                taken.add(line)
                placed.append((pos, sig, fields))
                break
    return placed


# MindSpore's "MB" in its row warnings is MiB; df -h's K/M/G/T are binary too
_UNITS = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "MB": MiB, "": 1, "K": KiB, "M": MiB, "G": GiB, "T": GiB << 10}
# Row sizes a log shows: MindSpore's static-slot warning, ms_shm's plan line and its ShmBudgetError.
_ROW_SIZES = (r"current rowsize:\s*(?P<n>[\d.]+)\s*(?P<unit>MB)", r"\brow=(?P<n>[\d.]+) (?P<unit>[KMG]iB)\b",
              r"\brows of (?P<n>[\d.]+) (?P<unit>[KMG]iB)\b")
# /dev/shm sizes a log shows, each a floor of the job's /dev/shm: ms_shm's budget line ("512.0 MiB free in
# /dev/shm") and `df -h /dev/shm`'s row.
_SHM_SIZES = (r"(?P<n>[\d.]+) (?P<unit>[KMG]iB) free in /dev/shm\b",
              r"(?m)^\S+[ \t]+(?P<n>[\d.]+)(?P<unit>[KMGT]?)[ \t]+\S+[ \t]+\S+[ \t]+\d+%[ \t]+/dev/shm[ \t]*$")


def _largest(patterns: tuple, text: str) -> int | None:
    """The largest size any of ``patterns`` finds in ``text``, in bytes (``None``: none found)."""
    found = [int(float(m["n"]) * _UNITS[m["unit"]]) for pattern in patterns for m in re.finditer(pattern, text)]
    return max(found) if found else None


def log_sizes(text: str) -> dict:
    """The row and /dev/shm sizes the log itself shows (``row_bytes``, ``shm_seen``; absent when not shown),
    read before ms_shm's own records are set aside: their numbers are the job's, where the host's may not be."""
    found = {"row_bytes": _largest(_ROW_SIZES, text), "shm_seen": _largest(_SHM_SIZES, text)}
    return {k: v for k, v in found.items() if v is not None}


def _typical(facts: Any, fields: dict) -> advice.Typical:
    """The pipeline the host is judged for, with the log's row size where it shows one."""
    return advice.Typical.of(facts, row_bytes=fields.get("row_bytes"))


ELSEWHERE = 4  # a host whose /dev/shm holds this many times a typical pipeline's need is not where it failed


def _shm_floor(facts: Any, fields: dict, t: advice.Typical) -> int | None:
    """The /dev/shm the job had at least: what the log shows (its own numbers), else this host's size, where
    the job plausibly failed here. A log read on a roomy machine is not this host's story: a bus error from a
    64 MB container, explained on a 24 GB host, was told to give /dev/shm 24g (more than it had here)."""
    seen = [v for v in (fields.get("shm_seen"), fields.get("available")) if v]
    if seen:
        return max(seen)
    return getattr(facts, "shm_total", None) if _here(facts, t) else None


def _here(facts: Any, t: advice.Typical) -> bool:
    """Whether the job plausibly failed on this host: its /dev/shm is read, and not ``ELSEWHERE`` times what a
    typical pipeline needs."""
    total = getattr(facts, "shm_total", None)
    return bool(total) and (not t.need or total < ELSEWHERE * t.need)


def _shm_state(facts: Any, fields: dict) -> str:
    """A sentence on the job's /dev/shm against a typical pipeline, as the doctor judges it; rows of a size the log
    does not show are named as the 8 MiB assumption they are."""
    total, free = getattr(facts, "shm_total", None), getattr(facts, "shm_free", None)
    t, seen = _typical(facts, fields), fields.get("shm_seen")
    if seen is None and total is None:
        return "This host's /dev/shm could not be read."
    # a floor either way: ms_shm's budget line gives what was free, `df -h`'s row the size (its Avail may be 0)
    where = (f"The log shows the job's /dev/shm at {mib(seen)} or more" if seen is not None else
             f"This host's /dev/shm is {mib(total)} ({mib(free)} free)")
    rows = "" if t.row_known else "; the log does not show the row size, so 8 MiB is assumed"
    here = (f"{where}; a typical pipeline here ({t.shape}{rows}) peaks at {mib(t.peak)}, {mib(t.need)} with "
            "ms_shm's headroom.")
    if t.peak and t.at(seen if seen is not None else total).fits:
        here += (" That fits, so if the job ran elsewhere (another container or node), run `ms-shm doctor` "
                 "there: its /dev/shm was smaller." if t.row_known else
                 " That fits only if the rows are at most 8 MiB: they were probably larger (`ms-shm plan --row-mb "
                 "<row>` with their size says what fits), or the job ran elsewhere (run `ms-shm doctor` there).")
    return here


_LOADERS = ("torch", "mindspore-dataloader")  # engines whose workers send batches, not GeneratorDataset rows
_LOADER_PREFETCH = 2  # both DataLoaders' default prefetch_factor


def _loader_shm_state(facts: Any, engine: str, t: advice.Typical, size: int) -> str:
    """A DataLoader's /dev/shm in a sentence: the batches the fix's size holds, in place of a GeneratorDataset's
    slots (a torch ENOSPC was told of "2 workers x 18 slots x 8.0 MiB rows"), and the command that sizes the
    job's own batches (the log does not show them)."""
    total, free = getattr(facts, "shm_total", None), getattr(facts, "shm_free", None)
    where = ("This host's /dev/shm could not be read" if total is None else
             f"This host's /dev/shm is {mib(total)} ({mib(free)} free)")
    batches, told = t.workers * _LOADER_PREFETCH + 1, advice.human_size(size)
    largest = int(advice.parse_size(told) * advice.HEADROOM / batches / max(1, t.ranks))
    return (f"{where}. The log does not show the batch size: a /dev/shm of {told} holds "
            f"{t.workers} workers x prefetch_factor {_LOADER_PREFETCH} (+1) = {batches} batches of up to "
            f"{mib(largest)} for each of {t.ranks} rank(s); `ms-shm plan --framework {engine} --batch-mb <MB> "
            f"--workers <W>` says what fits for yours.")


def _shm_need(facts: Any, t: advice.Typical, fields: dict) -> int:
    """The /dev/shm to ask for: a typical pipeline's need, or what makes a pre-check of ``required`` pass (it
    compares with 80% of the free space at launch) plus what was already in use, whichever is larger; and never
    a size the job already had (``_shm_floor``): it failed in that, so at least the next step up."""
    need = max(t.need, _passing_check(facts, t, fields) or 0)
    floor = _shm_floor(facts, fields, t)
    return max(need, floor + 1) if floor else need


def _passing_check(facts: Any, t: advice.Typical, fields: dict) -> int | None:
    """The /dev/shm at which a pre-check of ``required`` bytes passes: 80% of it free, after what was in use."""
    required = fields.get("required")
    return None if required is None else int(required / advice.HEADROOM) + _used_at_check(facts, fields, t) + MiB


def _check_sum(facts: Any, t: advice.Typical, fields: dict, size: int) -> str:
    """How ``size`` was reached for a pre-check's failure: from its numbers, or a typical pipeline's need where
    that is larger (an audit read "108.0 MiB / 80% plus what is in use gives 512m", ~136 MiB by that sum)."""
    passing = _passing_check(facts, t, fields)
    if passing is None:
        return ""
    said = f"Asking for {mib(fields['required'])} / 80% plus what is in use gives {mib(passing)}"
    if advice.human_size(passing) == advice.human_size(size):
        return f"{said} ({advice.human_size(size)})."
    return f"{said}; {advice.human_size(size)} also holds a typical pipeline of this host's, or the next size up."


def _used_at_check(facts: Any, fields: dict, t: advice.Typical) -> int:
    """What was in use when the pre-check ran: this host's size less the ``Available`` the log shows, where the
    job plausibly ran here (the pipeline's earlier stages held it: 2.0.0's batch asked 384 MiB with 103.6 MiB of
    512 MiB available, and "512m" was said again, as the space in use *now* is none), else what is in use now."""
    total, free, available = (getattr(facts, "shm_total", None), getattr(facts, "shm_free", None),
                              fields.get("available"))
    if _here(facts, t) and available is not None and available <= total:
        return total - available
    return total - free if total is not None and free is not None else 0


def _limits(facts: Any, need: int) -> str:
    soft, hard = facts.nofile_soft, facts.nofile_hard
    text = (f"this shell's soft limit is {'unlimited' if soft is None else soft} and hard limit "
            f"{'unlimited' if hard is None else hard}")
    if soft is None or soft >= need:
        text += (", which would be enough: the job ran with a lower limit (see `grep 'open files' "
                 "/proc/<pid>/limits` of a running job)")
    return text


def _ipc_words(facts: Any) -> dict:
    """Whether this host's systemd-logind deletes the job's IPC at logout (``ipc_state``) and the fix (``ipc_fix``),
    from ``HostFacts.logind``: RemoveIPC is named as the cause only where it applies."""
    lg = getattr(facts, "logind", None)
    if lg is not None and lg.at_risk:
        who = lg.user or f"uid {lg.uid}"
        return {"ipc_state": f"Likely cause: systemd-logind on this host has RemoveIPC=yes ({lg.source}), and {who} "
                             f"is neither a system user nor lingering, so logind deletes {who}'s queues, semaphores "
                             f"and /dev/shm files when {who}'s last login session ends; a job running outside those "
                             "sessions (a Slurm job, a service, a container with --ipc=host) loses them then.",
                "ipc_fix": f"set RemoveIPC=no for systemd-logind (a drop-in, then restart systemd-logind) or run "
                           f"`loginctl enable-linger {who}`, then restart the job"}
    if lg is None:
        state = ("Whether systemd-logind's RemoveIPC (it deletes a non-system user's IPC at the user's last "
                 "logout) did it was not checked.")
    elif lg.undetermined:
        state = f"Whether systemd-logind's RemoveIPC deleted it could not be determined ({lg.reason})."
    else:
        state = f"systemd-logind's RemoveIPC does not delete it here ({lg.reason})."
    return {"ipc_state": state + " Other culprits: an `ipcrm` or a /dev/shm clean-up run by another job or a cron "
                                 "script; or the job ran on another host (run `ms-shm doctor` there).",
            "ipc_fix": "find what deletes IPC objects under running jobs (`ipcrm`, /dev/shm clean-ups); on a "
                       "systemd host, `ms-shm doctor` says whether logind's RemoveIPC does"}


# This host's /dev/shm mount flag, ``HostFacts.shm_readonly``, in a sentence.
_READONLY_STATE = {True: "This host's /dev/shm is mounted read-only.",
                   False: "This host's /dev/shm is writable (if the job ran elsewhere, `ms-shm doctor` there "
                          "checks that host's).",
                   None: "Whether this host's /dev/shm is read-only could not be read."}


def _size_for(facts: Any, need: str, t: advice.Typical, fields: dict) -> int:
    """The /dev/shm to ask for: a read-only mount's size was not what failed, so a typical pipeline's need, not
    the next step past it (``_shm_need``)."""
    return max(t.need, 1) if need == "shm-readonly" else _shm_need(facts, t, fields)


def _words(facts: Any, sig: Signature, fields: dict) -> dict:
    """Every template field: the matched ones, the engine's derived ones, and this host's numbers."""
    t = _typical(facts, fields)
    fds = advice.fds_needed(facts, t.workers, t.prefetch)
    required, available = fields.get("required"), fields.get("available")
    words = {"pid": None, "signal": None, "code": None, "required": required, "available": available}
    words.update(fields)
    size = _size_for(facts, sig.need, t, fields)
    words.update(
        shm_state=(_loader_shm_state(facts, sig.engine, t, size) if sig.engine in _LOADERS else
                   _shm_state(facts, fields)), size=advice.human_size(size),
        readonly_state=_READONLY_STATE.get(getattr(facts, "shm_readonly", None)),
        who=f"worker {fields['pid']}" if fields.get("pid") else "a worker",
        memory_limit=_memory_limit(facts), workers=t.workers, prefetch=t.prefetch, fds=fds,
        target=_nofile_target(facts, fds), limits=_limits(facts, fds), required_mib=mib(required),
        check_sum=_check_sum(facts, t, fields, size),
        available_mib=mib(available),
        ratio=(required / available if available else float("inf")) if required is not None else 0.0,
        **_ipc_words(facts))
    if sig.words is not None:  # given every field so far: the engine's arithmetic may need the host's too
        words.update(sig.words(dict(words)))
    return words


def _memory_limit(facts: Any) -> str:
    """The limit the OOM killer enforced, as far as this host tells: its cgroup's, else no limit but RAM (an
    audit: "the memory limit (23.5 GiB here)" named a host's RAM as a limit it never had)."""
    limit, total = getattr(facts, "cgroup_mem_limit", None), getattr(facts, "mem_total", None)
    if limit:
        return f"this cgroup's limit is {mib(limit)}"
    return ("no container limit here, and RAM is " + mib(total) if total else "no limit could be read here") + \
        "; if the job ran in a container, its limit there"


def _nofile_target(facts: Any, fds: int) -> int:
    """The open-files limit to name: rounded up, but not past this host's hard limit where that allows ``fds``
    (``ulimit -n`` above it fails; ``doctor`` names the same number)."""
    hard = getattr(facts, "nofile_hard", None)
    target = advice.nofile_target(fds)
    return min(target, hard) if hard is not None and hard >= fds else target


def _host_snippets(facts: Any, need: str, fields: dict) -> tuple:
    """This host's fixes for the resource a signature is about."""
    t = _typical(facts, fields)
    container = getattr(facts, "container", None)
    if need == "nofile":
        return advice.nofile_fixes(advice.fds_needed(facts, t.workers, t.prefetch), container,
                                   getattr(facts, "nofile_hard", None))  # as doctor: not past this host's hard
    if need == "ipc":
        lg = getattr(facts, "logind", None)
        return advice.removeipc_fixes(lg.user) if lg is not None and lg.at_risk else ()
    if need == "shm-readonly":
        return advice.readonly_fixes(_size_for(facts, need, t, fields), container,
                                     getattr(facts, "cgroup_mem_limit", None))
    if not need.startswith("shm"):
        return ()
    fixes = advice.shm_fixes(_shm_need(facts, t, fields), container, getattr(facts, "cgroup_mem_limit", None))
    total = getattr(facts, "shm_total", None)
    if need == "shm-slots" and total is not None and t.peak and not t.at(total).fits:
        fixes += advice.prefetch_fixes(t, total)[1]
    elif need == "shm-check":
        fixes += advice.ds_config_fixes(prefetch=2)
    return fixes


def _explanation(text: str, facts: Any, pos: int, sig: Signature, fields: dict) -> Explanation:
    words = _words(facts, sig, fields)
    snippets = tuple((label, body.format_map(words)) for label, body in sig.snippets)
    snippets += _host_snippets(facts, sig.need, fields)
    return Explanation(sig.kind, sig.severity, _line_at(text, pos), sig.cause.format_map(words),
                       sig.fix.format_map(words), snippets, fields.get("pid"), fields.get("signal") or sig.signal,
                       fields.get("required"), fields.get("available"))


def explain(text: str, facts: Any) -> tuple:
    """Every known failure found in ``text``, in the order it first appears, with cause and fix for this host.

    A failure that is only the consequence of another (``Signature.alone``: a worker's exit) is reported when
    nothing else is recognised; a line is explained once, and the records ms_shm itself logged are not read.

    Args:
        text: a log, a traceback, or a whole job's output.
        facts: ``host.HostFacts`` of the host the job runs on (the numbers in the causes come from it).

    Returns:
        ``Explanation`` tuple; empty when nothing is recognised.
    """
    seen = log_sizes(text)
    text = without_own_records(text)
    hits = [(p, sig, {**seen, **fields}) for p, sig, fields in
            (h for h in (_hit(sig, text) for sig in signatures(facts)) if h is not None)]
    kinds = {sig.kind for _, sig, _ in hits}
    hits = [h for h in hits if not set(h[1].yields_to) & kinds]
    hits = [h for h in hits if not h[1].alone] or hits
    placed = sorted(_one_per_line(hits, text), key=lambda h: h[0])
    return tuple(_explanation(text, facts, *h) for h in placed)


__all__ = ["OWN_SIGNATURES", "READONLY", "Explanation", "Report", "explain", "known", "signatures",
           "without_own_records"]
