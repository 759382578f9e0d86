"""``ms-shm``: the command line a user reaches for when training dies. The only module that prints.

``doctor`` shows the host as MindSpore's dataset engine sees it and what to change; ``plan`` answers "what if"
without running anything; ``explain`` reads a log and names the failure in this host's numbers; ``clean``
removes what crashed runs left behind; ``run`` runs an unchanged script with ``ms_shm.patch()`` installed. Each command parses its arguments, asks ``host.probe``, ``advice``, the
engine (``outcome``, ``what_if_report``), ``explain`` or ``cleanup`` for a result, and prints it: as text here,
or as the result's ``to_dict()`` under ``--json``. Every rule lives in those modules, so the text and the JSON
are the same facts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import textwrap
from typing import Any

from ms_shm import advice as advice_mod
from ms_shm import budget as budget_mod
from ms_shm import engines, host, sizes
from ms_shm._results import mib
from ms_shm.cli.run import cmd_run, split_run_argv

SCHEMA = 1  # bumped when a key of the --json output changes meaning or goes away
EXIT_OK, EXIT_NOTHING, EXIT_CRASH = 0, 1, 2
EXIT_USAGE = 2  # as argparse exits for a usage error
MAX_MIB = 1 << 30  # sizes given in MiB: above a PiB is a typo, and float MiB overflow int() as bytes
_LABEL = 20
_WIDTH = 100
_UNLIMITED = 1 << 62


def _engine():
    return engines.get("mindspore")


def _print_json(result: Any) -> None:
    """A result's ``to_dict()`` under the schema number: the one shape of every ``--json`` output."""
    print(json.dumps({"schema": SCHEMA, **result.to_dict()}, indent=2))


# ------------------------------------------------------------------------------------------- formatting


def _unknown(facts: Any, *keys: str) -> str:
    """``None`` as the user should read it: "could not determine (why)"."""
    for note in facts.notes:
        if any(k in note for k in keys):
            return f"could not determine ({note})"
    return "could not determine"


def _size(value: int | None, facts: Any, *keys: str) -> str:
    return _unknown(facts, *keys) if value is None else mib(value)


def _big(value: int | None, facts: Any, key: str, unit: str = "") -> str:
    if value is None:
        return _unknown(facts, key)
    if value >= _UNLIMITED:
        return "unlimited"
    return f"{mib(value)}" if unit == "bytes" else str(value)


def _pages(facts: Any) -> str:
    value = facts.shmall_pages
    if value is None or value >= _UNLIMITED:
        return _big(value, facts, "shmall")
    return f"{value} pages ({mib(value * sizes.PAGE)})"


def bar(used: float, width: int = 30) -> str:
    """``[#########.....]  31% used``: how full /dev/shm is, readable in any terminal and in a CI log."""
    used = min(1.0, max(0.0, used))
    filled = int(round(used * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {used:4.0%} used"


def _row(label: str, text: str) -> list:
    width = _WIDTH - _LABEL - 3
    lines = [piece for line in text.splitlines()
             for piece in (textwrap.wrap(line, width, break_on_hyphens=False) or [""])] or [""]
    out = [f"  {label:<{_LABEL}} {lines[0]}"]
    out += [f"  {'':<{_LABEL}} {line}" for line in lines[1:]]
    return out


def _wrap(text: str, indent: str, first: str = "") -> list:
    return textwrap.wrap(text, _WIDTH, initial_indent=indent + first, subsequent_indent=indent + " " * len(first),
                         break_on_hyphens=False, break_long_words=False) or [indent + first]


def _snippets(snippets: tuple, indent: str) -> list:
    out = []
    for label, text in snippets:
        out.append(f"{indent}{label}:")
        out += [f"{indent}    {line}" for line in text.splitlines()]
    return out


def _read_config() -> tuple:
    """MindSpore's dataset config through the engine, and why it is missing when it is."""
    try:
        config = _engine().read_config()
    except (ImportError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken MindSpore install must not crash the doctor: report it
        return None, f"reading mindspore.dataset.config failed: {type(exc).__name__}: {exc}"
    if config is None:
        return None, "MindSpore is not importable"
    return config, None


# ------------------------------------------------------------------------------------------- doctor


def _shm_row(facts: host.HostFacts) -> tuple:
    if facts.shm_total is None:
        return ("/dev/shm", f"{facts.shm_path}: {_unknown(facts, 'statvfs')}")
    free = facts.shm_free if facts.shm_free is not None else facts.shm_total
    used = 1 - free / facts.shm_total if facts.shm_total else 1.0
    readonly = ", mounted read-only" if facts.shm_readonly else ""
    return ("/dev/shm", f"{mib(facts.shm_total)} total, {_size(facts.shm_free, facts, 'statvfs')} free "
                        f"({facts.shm_path}{readonly})\n{bar(used)}")


def _memory_rows(facts: host.HostFacts) -> list:
    rows = [("RAM", f"{_size(facts.mem_total, facts, 'meminfo')} total, "
                    f"{_size(facts.mem_available, facts, 'meminfo')} available")]
    if facts.cgroup_version is None:
        rows.append(("cgroup", _unknown(facts, "cgroup")))
    else:
        limit = "none" if facts.cgroup_mem_limit is None else mib(facts.cgroup_mem_limit)
        usage = "" if facts.cgroup_mem_usage is None else f", {mib(facts.cgroup_mem_usage)} in use"
        rows.append(("cgroup", f"{facts.cgroup_version}, memory limit {limit}{usage}"))
    quota = "none" if facts.cpu_quota is None else f"{facts.cpu_quota:g} CPUs"
    rows.append(("CPUs", f"{facts.usable_cpus} usable (online {facts.cpu_count if facts.cpu_count else '?'}, "
                         f"affinity {facts.cpu_affinity if facts.cpu_affinity else '?'}, cgroup quota {quota})"))
    return rows


def _files_row(facts: host.HostFacts) -> tuple:
    nofile_note = next((n for n in facts.notes if "RLIMIT_NOFILE" in n), None)
    if nofile_note:
        files = f"could not determine ({nofile_note})"
    else:
        soft = "unlimited" if facts.nofile_soft is None else facts.nofile_soft
        hard = "unlimited" if facts.nofile_hard is None else facts.nofile_hard
        files = f"soft {soft}, hard {hard}"
    opened = _unknown(facts, "open fds") if facts.open_fds is None else f"{facts.open_fds} open now"
    return ("open files", f"{files}; {opened}")


def _sysv_rows(facts: host.HostFacts) -> list:
    rows = [("SysV limits", f"shmmax {_big(facts.shmmax, facts, 'shmmax', 'bytes')}, shmall {_pages(facts)}, "
                            f"shmmni {_big(facts.shmmni, facts, 'shmmni')}, msgmni {_big(facts.msgmni, facts, 'msgmni')}")]
    if facts.sysv_segments is None:
        rows.append(("SysV in use", _unknown(facts, "sysvipc")))
    else:
        detached = facts.sysv_detached_segments
        attached = "" if detached is None or not facts.sysv_segments else (
            f" ({facts.sysv_segments - detached} attached by running processes, {detached} by none)")
        rows.append(("SysV in use", f"{facts.sysv_segments} segment(s), {mib(facts.sysv_bytes or 0)}{attached}"))
    return rows


def _config_row(config: Any, config_note: str | None) -> tuple:
    if config is None:
        return ("dataset config", f"could not determine ({config_note})")
    shared = {True: "on", False: "OFF", None: "could not determine"}[config.shared_mem]
    return ("dataset config", f"prefetch_size {config.prefetch_size}, num_parallel_workers "
                              f"{config.num_parallel_workers}, shared memory {shared}, start method "
                              f"{config.start_method}")


def fact_rows(facts: host.HostFacts, config: Any, config_note: str | None, typical: Any) -> list:
    """The doctor's two-column table: (label, text) pairs, unknowns spelled out."""
    rows = [_shm_row(facts)] + _memory_rows(facts) + [_files_row(facts)] + _sysv_rows(facts)
    rows.append(("container", facts.container or "none detected (bare host)"))
    rows.append(("ranks on this host", f"{facts.ranks.local_size} (local rank {facts.ranks.local_rank}; "
                                       f"{facts.ranks.source})"))
    rows.append(("share per rank", budget_mod.compute(facts.shm_free, facts.ranks.local_size, None, None,
                                                  ranks_source=facts.ranks.source).reason))
    rows.append(("MindSpore", facts.mindspore_version or "could not determine (not installed)"))
    rows.append(_config_row(config, config_note))
    rows.append(("Python", f"{platform.python_version()}, start method "
                           f"{facts.start_method or _unknown(facts, 'start method')}"))
    need = (f"\n-> a /dev/shm of {advice_mod.human_size(typical.need)}, and {mib(typical.memory)} "
            f"of container memory beside the training itself (/dev/shm pages count against it)") if typical.need else ""
    rows.append(("typical pipeline", typical.reason + need))
    return rows


def advice_lines(findings: tuple) -> list:
    out = []
    for number, item in enumerate(findings, 1):
        tag = f"{number}. [{item.severity}] "
        out += _wrap(item.problem, "  ", tag)
        out += _wrap(item.fix, "  " + " " * len(tag), "fix: ")
        out += _snippets(item.snippets, "  " + " " * len(tag))
        out.append("")
    return out


def doctor_lines(report: advice_mod.Checkup, strict: bool) -> list:
    lines = ["ms-shm doctor: this host as MindSpore's dataset engine sees it", ""]
    for label, text in fact_rows(report.host, report.mindspore, report.mindspore_note, report.typical):
        lines += _row(label, text)
    lines.append("")
    if report.findings:
        lines += ["Problems, worst first:", ""] + advice_lines(report.findings)
    if not report.ok:
        lines.append(f"Result: {report.count('crash')} problem(s) would crash a typical pipeline"
                     f"{'' if strict else ' (--strict exits 2 on these)'}.")
    elif report.findings:
        lines.append(f"Result: nothing would crash a typical pipeline; {report.count('slow')} slow, "
                     f"{report.count('info')} informational.")
    else:
        lines.append("Result: no problems found.")
    return lines


def cmd_doctor(args: argparse.Namespace) -> int:
    facts = host.probe(ranks=args.ranks)
    config, config_note = _read_config()
    row = None if args.row_mb is None else int(args.row_mb * sizes.MiB)
    report = advice_mod.checkup(facts, config, config_note, workers=args.workers, row_bytes=row,
                                leftovers=_leftovers())
    if args.json:
        _print_json(report)
    else:
        print("\n".join(doctor_lines(report, args.strict)))
    return EXIT_CRASH if args.strict and not report.ok else EXIT_OK


def _leftovers() -> Any:
    """What dead processes left, as ``ms-shm clean --dry-run`` finds it; ``None`` where that fails (the doctor
    reports the rest)."""
    try:
        from ms_shm import cleanup

        return cleanup.clean(dry_run=True)
    except Exception as exc:  # a probe that fails must not take the doctor's other findings with it
        logging.getLogger("ms_shm").debug("ms-shm doctor: leftovers not read: %s: %s", type(exc).__name__, exc)
        return None


# ------------------------------------------------------------------------------------------- plan


def _plan_table(report: Any) -> list:
    inp, asked = report.input, report.asked
    epoch = f" over one epoch of {inp.rows} rows" if inp.rows else ""
    lines = [f"Predicted peak /dev/shm ({asked.slots} slots per worker{epoch}; * = MindSpore {inp.mindspore}):",
             f"  {'MindSpore':<11}{'transport':<44}{'per rank':>11}{'all ranks':>12}  outcome"]
    for r in report.versions:
        mark = "*" if r is asked else " "
        lines.append(f" {mark}{r.version:<11}{r.transport:<44}{mib(r.per_rank):>11}{mib(r.all_ranks):>12}  "
                     f"{r.outcome}")
    lines += ["", f"map(python_multiprocessing=True) with {inp.workers} workers and the same rows:"]
    lines += [f"  {r.version:<11}{r.map.where}" for r in report.versions]
    return lines


def _plan_pick(report: Any) -> list:
    chosen = report.plan
    if chosen is None:
        return [f"ms_shm would pick: could not determine ({report.plan_note})"]
    lines = _wrap(f"ms_shm would pick (MindSpore {report.input.mindspore}): {chosen.summary()}", "")
    lines += _wrap(f"budget: {chosen.budget.reason}", "    ", "- ")
    for d in getattr(chosen, "decisions", ()):
        lines += _wrap(str(d), "    ", "- ")
    if getattr(chosen, "advice", ()):
        lines += [""] + advice_lines(chosen.advice)
    return lines


def plan_lines(report: Any) -> list:
    inp, shm = report.input, report.shm
    free_text = "could not determine" if shm.free is None else f"{mib(shm.free)} free of {mib(shm.total)}"
    lines = [f"ms-shm plan: GeneratorDataset, {inp.workers} workers, {mib(inp.row_bytes)} rows, prefetch "
             f"{inp.prefetch}, {inp.ranks} rank(s) on one host",
             f"/dev/shm: {free_text} ({shm.source})", ""]
    lines += _plan_table(report) + [""] + _plan_pick(report)
    lines += ["", "Result: " + ("fits." if report.fits else "does NOT fit as asked.")]
    return lines


def loader_what_if(args: argparse.Namespace, facts: host.HostFacts) -> tuple:
    """``ms-shm plan --framework torch|mindspore-dataloader``: the budget, the plan ms_shm would pick (``None``
    when nothing fits as asked) and why not, for the batches in flight."""
    from ms_shm.budget import compute
    from ms_shm.engines.torchstyle.planning import BatchStats, LoaderRequest
    from ms_shm.errors import ShmBudgetError

    eng = engines.get(args.framework)
    shm = args.shm if args.shm is not None else facts.shm_free
    memory_left, memory_source = _memory_left(args, facts)
    b = compute(shm, args.ranks or facts.ranks.local_size, facts.nofile_soft, facts.open_fds,
                memory_left=memory_left, memory_source=memory_source)
    stats = BatchStats(int(args.batch_mb * sizes.MiB), args.storages, None, None, 1)
    req = LoaderRequest(args.framework, args.workers, args.prefetch_factor, eng.profile().default_strategy,
                        eng.profile().can_switch_strategy, usable_cpus=facts.usable_cpus,
                        nofile_soft=facts.nofile_soft, nofile_hard=facts.nofile_hard)
    problem = eng.compat.numpy_problem() if args.workers else None
    if problem:  # fits or not, its workers fail here: said as doctor says it (msloader-numpy2)
        return b, None, problem
    try:
        return b, eng.planning.plan_loader(stats, req, b, eng.profile()), None
    except ShmBudgetError as exc:
        return b, None, str(exc)


def _memory_left(args: argparse.Namespace, facts: host.HostFacts) -> tuple:
    """``(bytes, where from)``: ``--memory``, else what this host has left (a cgroup's limit less its usage, or
    MemAvailable): a plan that ignored it said 'fits' in a 500 MB container that OOM-killed the pipeline."""
    return (args.memory, "given with --memory") if args.memory is not None else facts.memory_left


def loader_plan_lines(args: argparse.Namespace, budget: Any, chosen: Any, note: str | None) -> list:
    lines = [f"ms-shm plan: {args.framework} DataLoader, {args.workers} workers, batches of {args.batch_mb:g} MiB in "
             f"{args.storages} storage(s); this pipeline's budget: {mib(budget.shm_bytes)} of /dev/shm "
             f"({budget.reason}), {budget.fds if budget.fds is not None else 'unlimited'} fds", ""]
    if chosen is None:
        return lines + _wrap(note or "", "") + ["", "Result: does NOT fit as asked."]
    lines += _wrap(f"ms_shm would pick: num_workers={chosen.workers}, prefetch_factor={chosen.prefetch}: /dev/shm "
                   f"{mib(chosen.predicted_shm)} ({chosen.workers} x {chosen.prefetch} + 1 batches in flight), "
                   f"{chosen.predicted_fds} fds in the main process", "")
    for d in chosen.decisions:
        lines += _wrap(str(d), "    ", "- ")
    return lines + ["", "Result: fits."]


def loader_plan_dict(args: argparse.Namespace, facts: host.HostFacts, budget: Any, chosen: Any,
                     note: str | None) -> dict:
    """``--json`` of a DataLoader plan, in the shape of GeneratorDataset's (``input``, ``shm``, ``plan``,
    ``plan_note``, ``fits``) plus the pipeline's ``budget``."""
    shm = ({"total": args.shm, "free": args.shm, "source": "given with --shm"} if args.shm is not None else
           {"total": facts.shm_total, "free": facts.shm_free, "source": f"this host's {facts.shm_path}"})
    return {"input": {"framework": args.framework, "batch_bytes": int(args.batch_mb * sizes.MiB),
                      "storages": args.storages, "workers": args.workers, "prefetch_factor": args.prefetch_factor,
                      "ranks": budget.ranks},
            "shm": shm, "budget": budget.to_dict(), "plan": chosen.to_dict() if chosen is not None else None,
            "plan_note": note, "fits": chosen is not None and bool(chosen.fits)}


def _usage(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_USAGE


def cmd_plan(args: argparse.Namespace) -> int:
    facts = host.probe(ranks=args.ranks)
    if args.framework != "mindspore":
        if args.batch_mb is None:
            return _usage("ms-shm plan: --framework torch / mindspore-dataloader needs --batch-mb")
        budget, chosen, note = loader_what_if(args, facts)
        if args.json:
            print(json.dumps({"schema": SCHEMA, **loader_plan_dict(args, facts, budget, chosen, note)}, indent=2,
                             default=str))
        else:
            print("\n".join(loader_plan_lines(args, budget, chosen, note)))
        return EXIT_OK
    if args.row_mb is None:
        return _usage("ms-shm plan: --row-mb is required for GeneratorDataset (--framework mindspore)")
    report = _engine().what_if_report(facts, int(args.row_mb * sizes.MiB), args.workers, args.prefetch,
                                      args.ranks, args.mindspore, args.shm, args.rows, args.memory)
    if args.json:
        _print_json(report)
    else:
        print("\n".join(plan_lines(report)))
    return EXIT_OK


# ------------------------------------------------------------------------------------------- explain


def explain_lines(found: tuple, where: str) -> list:
    lines = [f"ms-shm explain: recognised {len(found)} failure(s) in {where}", ""]
    for number, e in enumerate(found, 1):
        extra = [f"pid {e.pid}" if e.pid else "", f"signal {e.signal}" if e.signal else "",
                 f"required {mib(e.required)}" if e.required is not None else "",
                 f"available {mib(e.available)}" if e.available is not None else ""]
        extra = ", ".join(x for x in extra if x)
        tag = f"{number}. "
        lines.append(f"  {tag}{e.kind} [{e.severity}]" + (f" ({extra})" if extra else ""))
        pad = "  " + " " * len(tag)
        lines += _wrap(e.line, pad, "line:  ")
        lines += _wrap(e.cause, pad, "cause: ")
        lines += _wrap(e.fix, pad, "fix:   ")
        lines += _snippets(e.snippets, pad)
        lines.append("")
    return lines


def _read_log(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    with open(name, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def cmd_explain(args: argparse.Namespace) -> int:
    from ms_shm import explain as explain_mod

    try:
        text = _read_log(args.file)
    except OSError as exc:
        if args.json:  # a pipeline reading --json gets JSON whatever happens
            print(json.dumps({"schema": SCHEMA, "source": args.file, "error": f"cannot read {args.file}: {exc}"},
                             indent=2))
        else:
            print(f"ms-shm explain: cannot read {args.file}: {exc}", file=sys.stderr)
        return EXIT_CRASH
    facts = host.probe()
    found = explain_mod.explain(text, facts)
    if args.json:
        _print_json(explain_mod.Report(args.file, found, facts))
        return EXIT_OK if found else EXIT_NOTHING
    where = "standard input" if args.file == "-" else args.file
    if not found:
        print(f"ms-shm explain: recognised nothing in {where} ({len(text.splitlines())} lines). Known: "
              + ", ".join(explain_mod.known(facts)) + ".")
        return EXIT_NOTHING
    print("\n".join(explain_lines(found, where)).rstrip())
    return EXIT_OK


# ------------------------------------------------------------------------------------------- clean


def cmd_clean(args: argparse.Namespace) -> int:
    try:
        from ms_shm import cleanup
    except ImportError as exc:
        print(f"ms-shm clean: could not determine leftovers ({type(exc).__name__}: {exc})", file=sys.stderr)
        return EXIT_NOTHING
    kwargs = {"dry_run": (not args.yes) or args.dry_run}
    if args.orphan_keys:
        kwargs["orphan_keys"] = True
    if args.private_ipc:
        kwargs["private_ipc"] = True
    report = cleanup.clean(**kwargs)
    if args.json:
        _print_json(report)
    else:
        print("\n".join(report.lines()))
    return EXIT_CRASH if getattr(report, "failed", ()) else EXIT_OK


# ------------------------------------------------------------------------------------------- watch


def cmd_watch(args: argparse.Namespace) -> int:
    """``ms-shm watch PID``: ``ms_shm.watch()`` on a running job from another shell (``docker exec``, a second
    ssh session), its warnings as they come, the summary when the job ends or on Ctrl-C."""
    import logging
    import signal
    import time

    from ms_shm import procfs
    from ms_shm.errors import UsageError
    from ms_shm.watch import watch

    if not os.path.isdir(f"/proc/{args.pid}"):
        return _watch_refused(args, f"no process {args.pid}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logging.getLogger("ms_shm").addHandler(handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a summary on `kill` too, as on Ctrl-C
    watcher = watch(interval=args.interval, csv_path=args.csv, main_pid=args.pid)
    try:
        watcher.start()
    except UsageError as exc:  # --csv in a directory that does not exist
        return _watch_refused(args, str(exc))
    try:
        while os.path.isdir(f"/proc/{args.pid}") and not procfs.is_zombie(args.pid):
            time.sleep(min(args.interval, 0.5))
    except KeyboardInterrupt:
        pass
    watcher.stop()
    if args.json:
        _print_json(watcher.summary)
    else:
        print("\n".join(watcher.summary.lines()))
    return EXIT_OK


def _watch_refused(args: argparse.Namespace, error: str) -> int:
    """A watch that cannot start (no such process, an unwritable --csv): exit 2 as for any usage error, with
    the reason on stderr, or as JSON under --json, since a script reading --json must get JSON on this path too."""
    if args.json:
        print(json.dumps({"schema": SCHEMA, "pid": args.pid, "error": error}))
    else:
        print(f"ms-shm watch: {error}", file=sys.stderr)
    return EXIT_USAGE


MIN_INTERVAL = 0.01  # seconds: ``--interval 1e-9`` kept 54-62% of a core sampling (an audit)


def _interval_seconds(text: str) -> float:
    """``watch --interval``: seconds, finite and at least ``MIN_INTERVAL``. ``nan`` and ``inf`` parse as floats,
    and ``inf`` would take one sample, then none until the job ends; the sizes' ``_positive_float`` said "MiB" for
    them."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0: {text}")
    if value < MIN_INTERVAL:
        raise argparse.ArgumentTypeError(f"at least {MIN_INTERVAL} s: {text} would keep a core busy sampling")
    return value


# ------------------------------------------------------------------------------------------- main


def _size_arg(text: str) -> int:
    try:
        return advice_mod.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def _number(text: str) -> float:
    """An argument that must parse as a float (``nan`` and ``inf`` do: the callers judge those)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_float(text: str) -> float:
    """A size in MiB: a finite number above 0 (``inf`` would reach ``int()`` as an OverflowError)."""
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of MiB: {text}")
    if value > MAX_MIB:  # 1e308 MiB is finite, and infinite in bytes (OverflowError)
        raise argparse.ArgumentTypeError(f"too large: {text} MiB (at most {MAX_MIB} MiB, 1 PiB)")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _mindspore_version(text: str) -> str:
    """``--mindspore``: a release the profiles model (2.0 to 2.10, with or without a patch number); anything else
    would silently be planned as the newest release."""
    from ms_shm.engines.mindspore import profiles

    if not profiles.is_modeled(text):
        raise argparse.ArgumentTypeError(f"unknown MindSpore version {text!r}: known releases are "
                                         f"{', '.join(profiles.modeled_releases())}")
    return text


def _add_doctor(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="the host as MindSpore's dataset engine sees it, and its problems",
                            description="Report /dev/shm, memory, CPUs, fd and SysV limits, container and ranks, "
                                        "then the problems a typical pipeline would hit, worst first, with fixes.")
    doctor.add_argument("--json", action="store_true", help="one JSON object (keys documented in the README)")
    doctor.add_argument("--strict", action="store_true",
                        help="exit 2 when a finding would crash a typical pipeline (CI, init containers)")
    doctor.add_argument("--ranks", type=_positive_int, help="ranks sharing this /dev/shm (default: from the launcher)")
    doctor.add_argument("--workers", type=_positive_int,
                        help="judge for this many workers (default: min(8, usable CPUs))")
    doctor.add_argument("--row-mb", type=_positive_float, help="judge for rows of this size (default: 8 MiB)")
    doctor.set_defaults(func=cmd_doctor)


def _add_plan(sub: Any) -> None:
    default_prefetch = _engine().arithmetic.DEFAULT_PREFETCH  # MindSpore's default prefetch_size
    plan = sub.add_parser("plan", help="what-if: predicted shared memory, and what ms_shm would pick",
                          description="Predict the peak /dev/shm of a GeneratorDataset per MindSpore version "
                                      "without running anything, and the configuration ms_shm would choose.")
    plan.add_argument("--framework", choices=("mindspore", "torch", "mindspore-dataloader"), default="mindspore",
                      help="mindspore: GeneratorDataset (default); torch / mindspore-dataloader: a PyTorch-style "
                           "DataLoader (give --batch-mb)")
    plan.add_argument("--row-mb", type=_positive_float, help="largest row in MiB (all columns; GeneratorDataset)")
    plan.add_argument("--batch-mb", type=_positive_float, help="one collated batch in MiB (DataLoaders)")
    plan.add_argument("--storages", type=_positive_int, default=1,
                      help="tensor storages per batch (DataLoaders: one /dev/shm file and fd each; default 1)")
    plan.add_argument("--prefetch-factor", type=_positive_int, help="DataLoader prefetch_factor (default: ms_shm picks)")
    plan.add_argument("--workers", type=_positive_int, required=True, help="num_parallel_workers / num_workers")
    plan.add_argument("--prefetch", type=_positive_int, default=default_prefetch,
                      help=f"ds.config prefetch size (default {default_prefetch})")
    plan.add_argument("--ranks", type=_positive_int, help="ranks on one host (default: from the launcher, else 1)")
    plan.add_argument("--mindspore", metavar="VERSION", type=_mindspore_version,
                      help="MindSpore release 2.0 to 2.10, e.g. 2.3 or 2.10 (default: installed)")
    plan.add_argument("--shm", type=_size_arg, metavar="SIZE",
                      help="assume a /dev/shm of this size, e.g. 64m or 2g (default: this host's free space)")
    plan.add_argument("--memory", type=_size_arg, metavar="SIZE",
                      help="assume this much memory left for the pipeline, e.g. 4g (default: this host's: a "
                           "container's limit less its usage, or available RAM)")
    plan.add_argument("--rows", type=_positive_int, help="rows per epoch (small datasets create fewer slots)")
    plan.add_argument("--json", action="store_true", help="one JSON object")
    plan.set_defaults(func=cmd_plan)


def _add_explain_and_clean(sub: Any) -> None:
    explain = sub.add_parser("explain", help="recognise a shared-memory or fd failure in a log",
                             description="Read a log or traceback and explain the known failures in this host's "
                                         "numbers. Exit 1 when nothing is recognised.")
    explain.add_argument("file", nargs="?", default="-", metavar="FILE", help="log file, or - for stdin (default)")
    explain.add_argument("--json", action="store_true", help="one JSON object")
    explain.set_defaults(func=cmd_explain)
    clean = sub.add_parser("clean", help="remove what crashed runs left behind (dry run unless --yes)",
                           description="Find SysV segments, message queues and files that dead MindSpore or "
                                       "PyTorch pipelines left behind. Only reports unless --yes.")
    clean.add_argument("--yes", action="store_true", help="really remove them")
    clean.add_argument("--dry-run", action="store_true", help="only report (the default; wins over --yes)")
    clean.add_argument("--orphan-keys", action="store_true",
                       help="also remove SysV pairs with MindSpore's key shape whose /tmp/dataset_ipc file is gone")
    clean.add_argument("--private-ipc", action="store_true",
                       help="in a container: its /dev/shm and SysV IPC are its own (Docker's default --ipc, not host, "
                            "another container's or a pod's), so the pids they name can be judged here")
    clean.add_argument("--json", action="store_true", help="one JSON object")
    clean.set_defaults(func=cmd_clean)


def _add_watch(sub: Any) -> None:
    watch = sub.add_parser("watch", help="watch a running job's /dev/shm, SysV memory, workers and fds",
                           description="Sample a running job (PID: its main process) and its worker processes "
                                       "until it ends or Ctrl-C, with ms_shm.watch()'s warnings as they come; "
                                       "then print the peaks.")
    watch.add_argument("pid", type=_positive_int, metavar="PID", help="the job's main process")
    watch.add_argument("--interval", type=_interval_seconds, default=1.0, help="seconds between samples (default 1)")
    watch.add_argument("--csv", metavar="FILE", help="write every sample to FILE as it is taken")
    watch.add_argument("--json", action="store_true", help="the summary as one JSON object")
    watch.set_defaults(func=cmd_watch)


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="run a script or module unchanged, with ms_shm protecting its pipelines",
                         description="Run SCRIPT (or -m MODULE) in this process as `python SCRIPT ARGS...` would, "
                                     "after ms_shm.tune() and ms_shm.patch(): every GeneratorDataset, Dataset.map "
                                     "and Dataset.batch(per_batch_map=...) goes through ms_shm's planner.")
    run.add_argument("--strict", action="store_true",
                     help="explicit python_multiprocessing / num_parallel_workers / max_rowsize are orders: "
                          "raise ShmBudgetError where they cannot fit (default: adapt them, with a warning)")
    run.add_argument("--report", metavar="FILE", help="write every pipeline built, its plan and call site (JSON)")
    run.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                     help="ms_shm's messages shown on stderr (default WARNING)")
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a library module as a script, like python -m")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]")
    run.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ms-shm",
        description="Why MindSpore data pipelines die of shared memory or file descriptors, and what to change.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_doctor(sub)
    _add_plan(sub)
    _add_explain_and_clean(sub)
    _add_watch(sub)
    _add_run(sub)
    return parser


def main(argv: list | None = None) -> int:
    """Entry point of ``ms-shm`` and ``python -m ms_shm``; returns the exit code."""
    argv, module, target = split_run_argv(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if target is not None:
        args.module, args.argv = module, target
    try:
        return args.func(args)
    except BrokenPipeError:  # `ms-shm doctor | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
