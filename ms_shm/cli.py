"""``ms-shm``: the command line a user reaches for when training dies. The only module that prints.

``doctor`` shows the host as MindSpore's dataset engine sees it and what to change; ``plan`` answers "what if"
without running anything; ``explain`` reads a log and names the failure in this host's numbers; ``clean``
removes what crashed runs left behind. Each command only composes ``host.probe``, ``advice``, ``explain``,
``plan`` and ``cleanup``: every rule lives there, so the text here and the JSON are the same facts.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import textwrap
from typing import Any

from ms_shm import advice as advice_mod
from ms_shm import host
from ms_shm._results import mib, plain
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import profiles

SCHEMA = 1  # bumped when a key of the --json output changes meaning or goes away
EXIT_OK, EXIT_NOTHING, EXIT_CRASH = 0, 1, 2
_LABEL = 20
_WIDTH = 100
_UNLIMITED = 1 << 62


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
    return f"{value} pages ({mib(value * model.PAGE)})"


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
        from ms_shm.engines.mindspore import compat as engine

        config = engine.read_config()
    except (ImportError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken MindSpore install must not crash the doctor: report it
        return None, f"reading mindspore.dataset.config failed: {type(exc).__name__}: {exc}"
    if config is None:
        return None, "MindSpore is not importable"
    return config, None


def fact_rows(facts: host.HostFacts, config: Any, config_note: str | None, typical: Any) -> list:
    """The doctor's two-column table: (label, text) pairs, unknowns spelled out."""
    rows = []
    if facts.shm_total is None:
        rows.append(("/dev/shm", f"{facts.shm_path}: {_unknown(facts, 'statvfs')}"))
    else:
        free = facts.shm_free if facts.shm_free is not None else facts.shm_total
        used = 1 - free / facts.shm_total if facts.shm_total else 1.0
        rows.append(("/dev/shm", f"{mib(facts.shm_total)} total, {_size(facts.shm_free, facts, 'statvfs')} free "
                                 f"({facts.shm_path})\n{bar(used)}"))
    rows.append(("RAM", f"{_size(facts.mem_total, facts, 'meminfo')} total, "
                        f"{_size(facts.mem_available, facts, 'meminfo')} available"))
    if facts.cgroup_version is None:
        rows.append(("cgroup", _unknown(facts, "cgroup")))
    else:
        limit = "none" if facts.cgroup_mem_limit is None else mib(facts.cgroup_mem_limit)
        usage = "" if facts.cgroup_mem_usage is None else f", {mib(facts.cgroup_mem_usage)} in use"
        rows.append(("cgroup", f"{facts.cgroup_version}, memory limit {limit}{usage}"))
    quota = "none" if facts.cpu_quota is None else f"{facts.cpu_quota:g} CPUs"
    rows.append(("CPUs", f"{facts.usable_cpus} usable (online {facts.cpu_count if facts.cpu_count else '?'}, "
                         f"affinity {facts.cpu_affinity if facts.cpu_affinity else '?'}, cgroup quota {quota})"))
    nofile_note = next((n for n in facts.notes if "RLIMIT_NOFILE" in n), None)
    if nofile_note:
        files = f"could not determine ({nofile_note})"
    else:
        soft = "unlimited" if facts.nofile_soft is None else facts.nofile_soft
        hard = "unlimited" if facts.nofile_hard is None else facts.nofile_hard
        files = f"soft {soft}, hard {hard}"
    opened = _unknown(facts, "open fds") if facts.open_fds is None else f"{facts.open_fds} open now"
    rows.append(("open files", f"{files}; {opened}"))
    rows.append(("SysV limits", f"shmmax {_big(facts.shmmax, facts, 'shmmax', 'bytes')}, "
                                f"shmall {_pages(facts)}, "
                                f"shmmni {_big(facts.shmmni, facts, 'shmmni')}, "
                                f"msgmni {_big(facts.msgmni, facts, 'msgmni')}"))
    if facts.sysv_segments is None:
        rows.append(("SysV in use", _unknown(facts, "sysvipc")))
    else:
        rows.append(("SysV in use", f"{facts.sysv_segments} segment(s), {mib(facts.sysv_bytes or 0)}"))
    rows.append(("container", facts.container or "none detected (bare host)"))
    rows.append(("ranks on this host", f"{facts.ranks.local_size} (local rank {facts.ranks.local_rank}; "
                                       f"{facts.ranks.source})"))
    rows.append(("MindSpore", facts.mindspore_version or "could not determine (not installed)"))
    if config is None:
        rows.append(("dataset config", f"could not determine ({config_note})"))
    else:
        shared = {True: "on", False: "OFF", None: "could not determine"}[config.shared_mem]
        rows.append(("dataset config", f"prefetch_size {config.prefetch_size}, num_parallel_workers "
                                       f"{config.num_parallel_workers}, shared memory {shared}, start method "
                                       f"{config.start_method}"))
    rows.append(("Python", f"{platform.python_version()}, start method "
                           f"{facts.start_method or _unknown(facts, 'start method')}"))
    if typical.need:
        rows.append(("typical pipeline", f"{typical.reason}\n-> a /dev/shm of {advice_mod.human_size(typical.need)}"))
    else:
        rows.append(("typical pipeline", typical.reason))
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


# ------------------------------------------------------------------------------------------- doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    facts = host.probe(ranks=args.ranks)
    config, config_note = _read_config()
    row = None if args.row_mb is None else int(args.row_mb * model.MiB)
    typical = advice_mod.Typical.of(facts, config, args.workers, row)
    findings = advice_mod.diagnose(facts, config, workers=args.workers, row_bytes=row)
    crash = any(f.severity == "crash" for f in findings)
    if args.json:
        out = {
            "schema": SCHEMA,
            "host": facts.to_dict(),
            "mindspore": None if config is None else config.to_dict(),
            "mindspore_note": config_note,
            "typical": typical.to_dict(),
            "recommended_shm": {"bytes": typical.need, "size": advice_mod.human_size(typical.need)
                                if typical.need else None, "reason": typical.reason},
            "findings": [f.to_dict() for f in findings],
            "ok": not crash,
        }
        print(json.dumps(out, indent=2))
    else:
        lines = ["ms-shm doctor: this host as MindSpore's dataset engine sees it", ""]
        for label, text in fact_rows(facts, config, config_note, typical):
            lines += _row(label, text)
        lines.append("")
        if findings:
            lines.append("Problems, worst first:")
            lines.append("")
            lines += advice_lines(findings)
        counts = {s: sum(1 for f in findings if f.severity == s) for s in advice_mod.SEVERITIES}
        if crash:
            lines.append(f"Result: {counts['crash']} problem(s) would crash a typical pipeline"
                         f"{'' if args.strict else ' (--strict exits 2 on these)'}.")
        elif findings:
            lines.append(f"Result: nothing would crash a typical pipeline; {counts['slow']} slow, "
                         f"{counts['info']} informational.")
        else:
            lines.append("Result: no problems found.")
        print("\n".join(lines))
    return EXIT_CRASH if args.strict and crash else EXIT_OK


# ------------------------------------------------------------------------------------------- plan


def version_rows(row_bytes: int, workers: int, prefetch: int, ranks: int, shm_free: int | None,
                 versions: list, rows: int | None = None) -> list:
    """Predicted GeneratorDataset and map peaks per MindSpore version, and what happens at this /dev/shm."""
    out = []
    device_num = min(ranks, 8)
    for version in versions:
        profile = profiles.profile_for(version)
        static = profile.generator_default_max_rowsize_mb
        peak = model.generator_peak(row_bytes, workers, prefetch, rows, static)
        total = peak * ranks
        if workers <= 1:
            transport, outcome, fits = "in the main process (1 worker)", "fits: no shared memory", True
        elif static:
            transport = f"static {static} MiB slots (default max_rowsize)"
            if shm_free is not None and model.static_precheck_fails(workers, prefetch, static, shm_free,
                                                                    device_num):
                outcome, fits = "RuntimeError at launch: 'Insufficient shared memory available'", False
            elif shm_free is not None and total > shm_free:
                outcome, fits = "fails: slots do not fit the free /dev/shm", False
            else:
                outcome, fits = "fits", True
            if not model.static_row_fits(row_bytes, static):
                outcome += f"; rows >= {static} MiB are pickled through pipes (slow)"
        else:
            transport = "dynamic slots, sized to the row"
            if shm_free is None:
                outcome, fits = "unknown: /dev/shm could not be read", False
            elif total > shm_free:
                outcome, fits = "Bus error when /dev/shm fills", False
            elif total > shm_free * advice_mod.HEADROOM:
                outcome, fits = "fits, but without the 20% headroom ms_shm keeps", True
            else:
                outcome, fits = "fits", True
        cost = model.map_pool_cost(profile, workers, row_bytes, row_bytes)
        out.append({"version": version, "profile": profile.note, "transport": transport, "per_rank": peak,
                    "all_ranks": total, "outcome": outcome, "fits": fits,
                    "map": {"dev_shm": cost.dev_shm, "sysv": cost.sysv, "sysv_segment": cost.sysv_segment,
                            "transport": profile.map_transport}})
    return out


def _call_planner(facts: host.HostFacts, **kwargs: Any) -> tuple:
    """``plan.what_if`` with the arguments it takes; ``(None, why)`` when the planner is not there."""
    try:
        from ms_shm.engines.mindspore import planning as planner

        what_if = planner.what_if
    except (ImportError, AttributeError) as exc:
        return None, f"ms_shm.plan is not available: {type(exc).__name__}: {exc}"
    kwargs.update(facts=facts, cpu_count=facts.cpu_count, nofile_soft=facts.nofile_soft, open_fds=facts.open_fds)
    try:
        accepted = inspect.signature(what_if).parameters
    except (TypeError, ValueError):
        accepted = kwargs
    return what_if(**{k: v for k, v in kwargs.items() if k in accepted}), None


def cmd_plan(args: argparse.Namespace) -> int:
    facts = host.probe(ranks=args.ranks)
    row = int(args.row_mb * model.MiB)
    ranks = args.ranks or facts.ranks.local_size
    version = args.mindspore or facts.mindspore_version or "2.10"
    if args.shm is not None:
        shm_total = shm_free = args.shm
        shm_source = "given with --shm"
    else:
        shm_total, shm_free = facts.shm_total, facts.shm_free
        shm_source = f"this host's {facts.shm_path}"
    versions = ["2.3", "2.10"]
    if profiles.parse_version(version) not in [profiles.parse_version(v) for v in versions]:
        versions.append(version)
    table = version_rows(row, args.workers, args.prefetch, ranks, shm_free, versions, args.rows)
    chosen, why_not = _call_planner(facts, row_bytes=row, workers=args.workers, prefetch=args.prefetch,
                                    ranks=ranks, version=version, shm_total=shm_total, shm_free=shm_free)
    asked = next(r for r in table if profiles.parse_version(r["version"]) == profiles.parse_version(version))
    fits = chosen.fits if chosen is not None else asked["fits"]
    if args.json:
        print(json.dumps({
            "schema": SCHEMA,
            "input": {"row_bytes": row, "workers": args.workers, "prefetch": args.prefetch, "ranks": ranks,
                      "mindspore": version, "rows": args.rows},
            "shm": {"total": shm_total, "free": shm_free, "source": shm_source},
            "versions": table,
            "plan": None if chosen is None else plain(chosen),
            "plan_note": why_not,
            "fits": fits,
        }, indent=2))
        return EXIT_OK
    free_text = "could not determine" if shm_free is None else f"{mib(shm_free)} free of {mib(shm_total)}"
    lines = [f"ms-shm plan: GeneratorDataset, {args.workers} workers, {mib(row)} rows, prefetch {args.prefetch}, "
             f"{ranks} rank(s) on one host",
             f"/dev/shm: {free_text} ({shm_source})", ""]
    slots = model.slots(args.prefetch, args.workers)
    lines.append(f"Predicted peak /dev/shm ({slots} slots per worker; * = MindSpore {version}):")
    head = f"  {'MindSpore':<11}{'transport':<44}{'per rank':>11}{'all ranks':>12}  outcome"
    lines.append(head)
    for r in table:
        mark = "*" if r is asked else " "
        lines.append(f" {mark}{r['version']:<11}{r['transport']:<44}{mib(r['per_rank']):>11}"
                     f"{mib(r['all_ranks']):>12}  {r['outcome']}")
    lines.append("")
    lines.append(f"map(python_multiprocessing=True) with {args.workers} workers and the same rows:")
    for r in table:
        m = r["map"]
        where = (f"SysV {mib(m['sysv'])} (one {mib(m['sysv_segment'])} segment per worker) + /dev/shm "
                 f"{mib(m['dev_shm'])}" if m["transport"] == "sysv"
                 else f"/dev/shm {mib(m['dev_shm'])} (6 slots per worker)")
        lines.append(f"  {r['version']:<11}{where}")
    lines.append("")
    if chosen is None:
        lines.append(f"ms_shm would pick: could not determine ({why_not})")
    else:
        lines += _wrap(f"ms_shm would pick (MindSpore {version}): {chosen.summary()}", "")
        for d in getattr(chosen, "decisions", ()):
            lines += _wrap(str(d), "    ", "- ")
        if getattr(chosen, "advice", ()):
            lines.append("")
            lines += advice_lines(chosen.advice)
    lines.append("")
    lines.append("Result: " + ("fits." if fits else "does NOT fit as asked."))
    print("\n".join(lines))
    return EXIT_OK


# ------------------------------------------------------------------------------------------- explain


def cmd_explain(args: argparse.Namespace) -> int:
    from ms_shm.explain import explain

    name = args.file
    try:
        if name == "-":
            text = sys.stdin.read()
        else:
            with open(name, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
    except OSError as exc:
        print(f"ms-shm explain: cannot read {name}: {exc}", file=sys.stderr)
        return EXIT_CRASH
    facts = host.probe()
    found = explain(text, facts)
    if args.json:
        print(json.dumps({"schema": SCHEMA, "source": name, "recognised": [e.to_dict() for e in found],
                          "host": facts.to_dict()}, indent=2))
        return EXIT_OK if found else EXIT_NOTHING
    where = "standard input" if name == "-" else name
    if not found:
        print(f"ms-shm explain: recognised nothing in {where} ({len(text.splitlines())} lines). Known: MindSpore's "
              "bus error and SIGCHLD lines, 'Insufficient shared memory available', 'recommended shm size is at "
              "least 5 GB', 'No space left on device', 'Too many open files', PyTorch's DataLoader bus error.")
        return EXIT_NOTHING
    lines = [f"ms-shm explain: recognised {len(found)} failure(s) in {where}", ""]
    for number, e in enumerate(found, 1):
        extra = [f"worker {e.pid}" if e.pid else "", f"signal {e.signal}" if e.signal else "",
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
    print("\n".join(lines).rstrip())
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
    report = cleanup.clean(**kwargs)
    if args.json:
        print(json.dumps({"schema": SCHEMA, **report.to_dict()}, indent=2))
    else:
        print("\n".join(report.lines()))
    return EXIT_CRASH if getattr(report, "failed", ()) else EXIT_OK


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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ms-shm",
        description="Why MindSpore data pipelines die of shared memory or file descriptors, and what to change.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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

    plan = sub.add_parser("plan", help="what-if: predicted shared memory, and what ms_shm would pick",
                          description="Predict the peak /dev/shm of a GeneratorDataset per MindSpore version "
                                      "without running anything, and the configuration ms_shm would choose.")
    plan.add_argument("--row-mb", type=_positive_float, required=True, help="largest row in MiB (all columns)")
    plan.add_argument("--workers", type=_positive_int, required=True, help="num_parallel_workers")
    plan.add_argument("--prefetch", type=_positive_int, default=model.DEFAULT_PREFETCH,
                      help=f"ds.config prefetch size (default {model.DEFAULT_PREFETCH})")
    plan.add_argument("--ranks", type=_positive_int, help="ranks on one host (default: from the launcher, else 1)")
    plan.add_argument("--mindspore", metavar="VERSION", help="MindSpore version, e.g. 2.3 or 2.10 (default: installed)")
    plan.add_argument("--shm", type=_size_arg, metavar="SIZE",
                      help="assume a /dev/shm of this size, e.g. 64m or 2g (default: this host's free space)")
    plan.add_argument("--rows", type=_positive_int, help="rows per epoch (small datasets create fewer slots)")
    plan.add_argument("--json", action="store_true", help="one JSON object")
    plan.set_defaults(func=cmd_plan)

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
    clean.add_argument("--json", action="store_true", help="one JSON object")
    clean.set_defaults(func=cmd_clean)
    return parser


def main(argv: list | None = None) -> int:
    """Entry point of ``ms-shm`` and ``python -m ms_shm``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `ms-shm doctor | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
