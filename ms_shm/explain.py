"""Recognise the known shared-memory and fd failures in a log or traceback, and explain them in this host's numbers.

Pure text matching: the caller reads the log and probes the host. What each framework prints is its engine's
(``Engine.signatures()``: MindSpore's are in ``engines/mindspore/signatures.py``); this module only finds them,
orders them, and fills in this host's numbers and fixes from ``advice``, so ``explain`` and ``doctor`` quote the
same sizes. A new engine brings its own signatures; nothing here changes.
"""

from __future__ import annotations

import re
from typing import Any

from ms_shm import advice, engines
from ms_shm._results import Result, mib, record
from ms_shm.engines.base import Signature
from ms_shm.sizes import MiB


@record
class Explanation(Result):
    """One recognised failure.

    Attributes:
        kind: stable identifier: ``bus-error``, ``insufficient-shm``, ``shm-full``, ``no-space``,
            ``too-many-open-files``, ``pytorch-bus-error``, ``pytorch-shm``, ``row-too-big``, ``worker-killed``,
            ``worker-exited``, ``worker-died``, ``ipc-removed``; ms_shm's own errors: ``shm-budget-error``,
            ``row-too-large-error``, ``shm-full-error``.
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


def _own_error(name: str) -> str:
    """One line of an ms_shm error, as a traceback ends with it (``ms_shm.errors.X: message Fix: ...``); the same
    class re-raised by MindSpore in the main process names the module of the worker's copy (``ms_shm.guard``)."""
    return (r"(?m)\b(?:ms_shm\.[\w.]+\.)?" + name +
            r": (?P<detail>[^\n]*?)(?:\s*Fix: (?P<own_fix>[^\n]*))?$")


# ms_shm's own errors: raised instead of the bus error the settings would end in (``ms_shm.errors``). Their
# messages carry the sizes and the fix worked out for the pipeline, so no host snippet of a typical pipeline's
# size is added to contradict them.
OWN_SIGNATURES = (
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


def signatures(facts: Any = None) -> tuple:
    """What ms_shm itself and every engine print when they fail, the engines' worded for the host's release of
    each framework."""
    found: list = list(OWN_SIGNATURES)
    for engine in engines.all_engines():
        found += engine.signatures(getattr(facts, f"{engine.name}_version", None))
    return tuple(found)


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


# A record ms_shm logged (``ms-shm run``'s "LEVEL: message", or logging's default "LEVEL:ms_shm:message"): its
# predictions quote the failures they prevent ("fails with 'recommended shm size is at least 5 GB'"), and are none
_OWN_RECORD = re.compile(r"^(?:DEBUG|INFO|WARNING)(?:: |:ms_shm(?:\.[\w.]+)?:)")


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


def _shm_state(facts: Any) -> str:
    """A sentence on this host's /dev/shm against a typical pipeline, as the doctor judges it."""
    total, free = getattr(facts, "shm_total", None), getattr(facts, "shm_free", None)
    t = advice.Typical.of(facts)
    if total is None:
        return "This host's /dev/shm could not be read."
    here = (f"This host's /dev/shm is {mib(total)} ({mib(free)} free); a typical pipeline here ({t.shape}) "
            f"peaks at {mib(t.peak)}, {mib(t.need)} with ms_shm's headroom.")
    if t.peak and t.at(total).fits:
        here += (" That fits, so if the job ran elsewhere (another container or node), run `ms-shm doctor` "
                 "there: its /dev/shm was smaller.")
    return here


def _shm_need(facts: Any, t: advice.Typical, fields: dict) -> int:
    """The /dev/shm to ask for: a typical pipeline's need, or what makes a pre-check of ``required`` pass (it
    compares with 80% of the free space at launch) plus what was already in use, whichever is larger."""
    required = fields.get("required")
    if required is None:
        return t.need
    total, free = getattr(facts, "shm_total", None), getattr(facts, "shm_free", None)
    used = total - free if total is not None and free is not None else 0
    return max(t.need, int(required / advice.HEADROOM) + used + MiB)


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


def _words(facts: Any, sig: Signature, fields: dict) -> dict:
    """Every template field: the matched ones, the engine's derived ones, and this host's numbers."""
    t = advice.Typical.of(facts)
    fds = advice.fds_needed(facts, t.workers, t.prefetch)
    required, available = fields.get("required"), fields.get("available")
    words = {"pid": None, "signal": None, "code": None, "required": required, "available": available}
    words.update(fields)
    words.update(
        shm_state=_shm_state(facts), size=advice.human_size(_shm_need(facts, t, fields)),
        who=f"worker {fields['pid']}" if fields.get("pid") else "a worker",
        memory_limit=mib(getattr(facts, "memory_limit", None)), workers=t.workers, prefetch=t.prefetch, fds=fds,
        target=_nofile_target(facts, fds), limits=_limits(facts, fds), required_mib=mib(required),
        available_mib=mib(available),
        ratio=(required / available if available else float("inf")) if required is not None else 0.0,
        **_ipc_words(facts))
    if sig.words is not None:
        words.update(sig.words(fields))
    return words


def _nofile_target(facts: Any, fds: int) -> int:
    """The open-files limit to name: rounded up, but not past this host's hard limit where that allows ``fds``
    (``ulimit -n`` above it fails; ``doctor`` names the same number)."""
    hard = getattr(facts, "nofile_hard", None)
    target = advice.nofile_target(fds)
    return min(target, hard) if hard is not None and hard >= fds else target


def _host_snippets(facts: Any, need: str, fields: dict) -> tuple:
    """This host's fixes for the resource a signature is about."""
    t = advice.Typical.of(facts)
    container = getattr(facts, "container", None)
    if need == "nofile":
        return advice.nofile_fixes(advice.fds_needed(facts, t.workers, t.prefetch), container,
                                   getattr(facts, "nofile_hard", None))  # as doctor: not past this host's hard
    if need == "ipc":
        lg = getattr(facts, "logind", None)
        return advice.removeipc_fixes(lg.user) if lg is not None and lg.at_risk else ()
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
    text = without_own_records(text)
    hits = [h for h in (_hit(sig, text) for sig in signatures(facts)) if h is not None]
    kinds = {sig.kind for _, sig, _ in hits}
    hits = [h for h in hits if not set(h[1].yields_to) & kinds]
    hits = [h for h in hits if not h[1].alone] or hits
    placed = sorted(_one_per_line(hits, text), key=lambda h: h[0])
    return tuple(_explanation(text, facts, *h) for h in placed)


__all__ = ["OWN_SIGNATURES", "Explanation", "Report", "explain", "known", "signatures", "without_own_records"]
