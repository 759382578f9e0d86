"""``ms-shm run``: a script or module run in this process exactly as ``python SCRIPT ARGS`` / ``python -m MODULE
ARGS`` would run it, with ``ms_shm.patch()`` installed. Part of the command line, so it may print.

Exactly as python means: the script runs in a fresh module installed as ``sys.modules["__main__"]`` for the rest of
the process (atexit handlers, non-daemon threads and late pickling still find the script's classes there), with
an absolute ``__file__``, ``__builtins__`` the builtins module, ``__package__`` ``None`` and a
``SourceFileLoader``; ``sys.path[0]`` is replaced by the directory of the script's real path (a directory or a zip
file is itself ``sys.path[0]``, and its ``__main__`` runs); ``sys.argv[0]`` stays as typed. ``-m`` goes through
``runpy._run_module_as_main``, the function python itself calls for ``python -m``. An uncaught exception goes to
``sys.excepthook`` (the script's own, if it set one) with the traceback from the script's first frame, a
KeyboardInterrupt still ends the process by SIGINT, and a missing script or module gets python's one line.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import importlib.machinery
import importlib.util
import io
import logging
import marshal
import os
import pkgutil
import runpy
import sys
import time
import types
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
# Frames of ours between the interpreter and the script: never shown. runpy's are python's own under ``-m`` (it
# prints them too), and a script is not run through runpy at all.
_OWN_FRAMES = ("ms_shm",)
_VALUE_OPTIONS = ("--report", "--log-level")  # ms-shm run's options that take a value


# ------------------------------------------------------------------------------------------- the command line


def split_run_argv(argv: list) -> tuple:
    """``run [OPTIONS] SCRIPT ARGS...`` / ``run [OPTIONS] -m MODULE ARGS...`` (also ``-mMODULE`` and ``run --
    SCRIPT``): everything after the script or module is its own, whatever it looks like, as with python; argparse
    alone would read ``--strict`` after a script as ms-shm's. Returns ``(ms-shm's argv, module, target argv)``:
    ``module`` is ``None`` for a script, ``target argv`` is ``None`` when ``argv`` is no ``run`` command."""
    if argv[:1] != ["run"]:
        return argv, None, None
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], None, argv[i + 1:]
        if token == "-m" and i + 1 < len(argv):
            return argv[:i], argv[i + 1], argv[i + 2:]
        if token.startswith("-m") and not token.startswith("--") and len(token) > 2:
            return argv[:i], token[2:], argv[i + 1:]
        if _takes_a_value(token):
            i += 2
        elif token.startswith("-") and token != "-":
            i += 1
        else:
            return argv[:i], None, argv[i:]
    return argv, None, None


def _takes_a_value(token: str) -> bool:
    """An option of run's that takes its value from the next word: in full, or abbreviated as argparse allows
    (``--rep FILE``, ``--log INFO``); ``--report=FILE`` holds its own."""
    return "=" not in token and len(token) > 2 and any(o.startswith(token) for o in _VALUE_OPTIONS)


def report_path(path: str | None) -> str | None:
    """``--report FILE`` as an absolute path, resolved now (the script may ``chdir``), after proving it can be
    written: a run of hours must not learn at its exit that the report has nowhere to go. The probe leaves no
    file behind that was not there."""
    if path is None:
        return None
    path = os.path.abspath(path)
    existed = os.path.lexists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            os.unlink(path)
    except OSError as exc:
        print(f"ms-shm run: cannot write report {path}: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    return path


def write_report_at_exit(path: str) -> None:
    """The ``--report`` atexit handler: a report that cannot be written is one line on stderr, not a traceback,
    and the script's exit status stands."""
    from ms_shm.patch import write_report

    try:
        write_report(path)
    except OSError as exc:
        print(f"ms-shm run: cannot write report {path}: {exc.strerror or exc}", file=sys.stderr)


def _log_to_stderr(level: str) -> None:
    """ms_shm's messages on stderr, once: a run inside a run (``ms-shm run`` started by a script under ``ms-shm
    run``) said each twice."""
    logger = logging.getLogger("ms_shm")
    if any(getattr(h, "ms_shm_run", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.ms_shm_run = True
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # ms-shm run shows ms_shm's messages once, even if the script configures logging
    for name in _own_logger_names():
        logging.getLogger(name).__class__ = ShownLogger


class ShownLogger(logging.Logger):
    """An ms_shm logger under ``ms-shm run``, which the script's logging configuration does not switch off:
    ``logging.config.dictConfig`` / ``fileConfig`` disable every logger that exists when they run
    (``disable_existing_loggers`` defaults to true), and ms_shm's exist before the script does. A script
    configuring its logging so lost every line run promises, the warnings naming what it adapted and where
    included. (``logging.disable(level)`` still applies: it is not a logger's switch.)"""

    @property
    def disabled(self) -> bool:
        return False

    @disabled.setter
    def disabled(self, value: bool) -> None:
        pass


def _own_logger_names() -> list:
    """``ms_shm`` and a logger per module of the package, made now (a logger made later would be a plain one),
    and the loggers made so far under ``ms_shm.`` with names of their own (``ms_shm.sentinel``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = {"ms_shm", *(n for n in logging.Logger.manager.loggerDict if n.startswith("ms_shm."))}
    for folder, _, files in os.walk(package):
        parts = os.path.relpath(folder, os.path.dirname(package)).split(os.sep)
        names.update(".".join(parts + [f[:-3]]) for f in files if f.endswith(".py") and f != "__init__.py")
    return sorted(names)


def _tune_at_import(framework: str) -> None:
    """``tune()`` once the script has imported ``framework``, before it builds any pipeline: tuned before the
    script ran, a torch script would import MindSpore (seconds) and torch's own settings would be skipped."""
    from ms_shm.advice import TYPICAL_PIPELINE_CODES
    from ms_shm.api import tune
    from ms_shm.patch import record_tune
    from ms_shm.state import SESSION

    started = time.perf_counter()
    SESSION.hold_advice(TYPICAL_PIPELINE_CODES)  # said at the script's first GeneratorDataset, map or batch
    tune()
    record_tune(time.perf_counter() - started)


def cmd_run(args: argparse.Namespace) -> int:
    """``ms-shm run``: patch, then the script as ``__main__``, tuned once it has imported its framework. A
    ``SystemExit`` of the script passes through as is; any other exception goes to ``sys.excepthook`` from the
    script's first frame, exit 1 (a KeyboardInterrupt: killed by SIGINT, as python does)."""
    from ms_shm.patch import on_framework_import, patch

    if not args.module and not args.argv:
        print("usage: ms-shm run [options] SCRIPT [ARGS...] | -m MODULE [ARGS...]\nms-shm run: error: give a SCRIPT "
              "or -m MODULE", file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's
    report = report_path(args.report)
    _log_to_stderr(args.log_level)
    if report:
        atexit.register(write_report_at_exit, report)
    patch(strict=args.strict)
    on_framework_import(_tune_at_import)  # the script imports its framework: ms_shm imports none itself
    _protect_children(args.strict, args.log_level)
    try:
        if args.module:
            return run_module(args.module, list(args.argv))
        if args.argv[0] == "-":
            return run_stdin(list(args.argv))
        return run_path(args.argv[0], list(args.argv))
    finally:
        _script_globals_first_at_exit()


# ------------------------------------------------------------------------------------------- child processes
CHILDREN_ENV = "MS_SHM_RUN_CHILDREN"  # the run's options, for the Python processes its script starts
_CHILDREN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children")  # their sitecustomize


def _protect_children(strict: bool, log_level: str) -> None:
    """Python processes the script starts are patched too: Lightning's DDP ranks run the script again as ``python
    script.py``, and an audit's rank 1 died of ENOSPC under 64 MB where rank 0 ran (``torch.multiprocessing.spawn``
    likewise). Through the environment, as ``ddtrace-run`` does: ``children/sitecustomize.py`` first on
    ``PYTHONPATH`` (the script sees it there), which runs any ``sitecustomize`` it hides."""
    import json

    os.environ[CHILDREN_ENV] = json.dumps({"strict": bool(strict), "log_level": log_level})
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _CHILDREN_PATH not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_CHILDREN_PATH, *paths])


def protect_child(options: str, worker: bool) -> Any:
    """In a Python process the run's script started: patched as the script is, and (a script or module run as a
    rank) tuned once it imports its framework. A multiprocessing ``worker`` (``--multiprocessing-fork``: a spawned
    DataLoader worker, a ``torch.multiprocessing.spawn`` process) is patched only: the run's ``tune()`` settings
    reach it through its parent, its loaders apply what they need. The run's ``--report`` lists the run's own
    process only. Returns ms_shm's import finder, for the framework import that set this off."""
    import json

    from ms_shm.patch import FINDER, on_framework_import, patch

    settings = json.loads(options)
    _log_to_stderr(settings.get("log_level") or "WARNING")
    patch(strict=bool(settings.get("strict")))
    if not worker:
        on_framework_import(_tune_at_import)
    return FINDER


# ------------------------------------------------------------------------------------------- running as python


def _program() -> str:
    """The interpreter's name as python prints it in ``python: can't open file ...``."""
    return (getattr(sys, "orig_argv", None) or [sys.executable])[0]


def _set_path0(entry: str) -> None:
    """``sys.path[0]`` is the script's directory, in place of the one python put there for ``ms-shm`` itself (the
    cwd for ``python -m ms_shm``, the bin directory for the console script); nothing under ``-P`` / ``-I``."""
    if getattr(sys.flags, "safe_path", False) or sys.flags.isolated:
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.append(entry)


def _new_main() -> types.ModuleType:
    """A fresh ``__main__`` for the rest of the process, as python's own: ``runpy.run_path`` would put a
    temporary module there and take it away when the script's code returns, under its atexit handlers."""
    main = types.ModuleType("__main__")
    main.__annotations__ = {}  # python's own __main__ starts with one (``print(__annotations__)`` at top level)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if MP_MAIN in sys.modules:  # multiprocessing's alias, set to ms_shm's own __main__ when ms_shm imported it
        sys.modules[MP_MAIN] = main
    return main


MP_MAIN = "__mp_main__"


def _script_globals_first_at_exit() -> None:
    """Have python's exit wipe the script's globals before any module's, as it does under plain ``python``.

    At exit python clears the modules still alive in reverse order of ``sys.modules``. The script's ``__main__``
    takes the place of ms_shm's, near the start, so its objects would be destroyed after the library modules they
    use are wiped: every MindSpore ``Cell`` left in the script's globals printed "Exception ignored in: <function
    Cell.__del__>" (``weakref``'s globals already None). Under plain ``python`` multiprocessing's alias
    ``__mp_main__``, added when the framework first imports it, comes after ``weakref``; re-added last here, the
    script's globals go first, while every module is whole."""
    main = sys.modules.get("__main__")
    if main is not None and MP_MAIN in sys.modules:
        del sys.modules[MP_MAIN]
        sys.modules[MP_MAIN] = main


def _is_path_entry(path: str) -> bool:
    """A directory or zip file: python puts it on ``sys.path`` and runs its ``__main__``."""
    return os.path.isdir(path) or pkgutil.get_importer(path) is not None


def _read_script(path: str) -> bytes:
    """The script's bytes; an unreadable one ends the run as python ends it (exit 2, one line)."""
    try:
        with io.open_code(path) as handle:
            return handle.read()
    except OSError as exc:
        print(f"{_program()}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def _compile(data: bytes, path: str) -> types.CodeType:
    """Source or a ``.pyc``, as python runs either."""
    if data[:4] == importlib.util.MAGIC_NUMBER:
        return marshal.loads(data[16:])
    return compile(data, path, "exec", dont_inherit=True)


def run_path(typed: str, argv: list) -> int:
    """``python SCRIPT ARGS``: ``typed`` is the script as given, ``argv`` the whole ``sys.argv`` (``typed``
    first, kept as typed)."""
    path = os.path.abspath(typed)
    sys.argv = argv
    if _is_path_entry(path):
        _set_path0(path)
        _new_main()
        return _guarded(lambda: runpy._run_module_as_main("__main__", alter_argv=False))
    data = _read_script(path)
    _set_path0(os.path.dirname(os.path.realpath(path)))
    main = _new_main()
    pyc = data[:4] == importlib.util.MAGIC_NUMBER
    loader = importlib.machinery.SourcelessFileLoader if pyc else importlib.machinery.SourceFileLoader
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader("__main__", path))
    try:
        code = _guarded(lambda: exec(_compile(data, path), main.__dict__))
    except SystemExit:
        raise  # python exits at once: atexit handlers and threads still find __file__
    except BaseException:
        _forget_file(main)
        raise
    _forget_file(main)
    return code


def run_stdin(argv: list) -> int:
    """``python - ARGS``: the program read from stdin, as python runs it (``__file__`` ``'<stdin>'``,
    ``sys.path[0]`` ``''``): ``ms-shm run -`` looked for a file named ``-`` (an audit)."""
    sys.argv = argv
    data = sys.stdin.buffer.read()
    _set_path0("")
    main = _new_main()
    main.__dict__.update(__file__="<stdin>", __loader__=importlib.machinery.BuiltinImporter)
    return _guarded(lambda: exec(compile(data, "<stdin>", "exec", dont_inherit=True), main.__dict__))


def _forget_file(main: types.ModuleType) -> None:
    """Python removes ``__file__`` and ``__cached__`` once the script's code has returned or raised (not on
    ``sys.exit``)."""
    main.__dict__.pop("__file__", None)
    main.__dict__.pop("__cached__", None)


def run_module(module: str, args: list) -> int:
    """``python -m MODULE ARGS``: found from the cwd, run in a fresh ``__main__`` that stays, ``sys.argv[0]``
    the module's file; a module that cannot be found is python's one line and exit 1 (runpy's own)."""
    _set_path0(os.getcwd())
    sys.argv = ["-m", *args]
    _new_main()
    return _guarded(lambda: runpy._run_module_as_main(module, alter_argv=True))


# ------------------------------------------------------------------------------------------- errors as python


def _guarded(call: Any) -> int:
    """``call()``; an exception it raises is handled as python handles an uncaught one."""
    try:
        call()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the script's uncaught exception, reported as python does
        _report_uncaught(exc)
        if isinstance(exc, KeyboardInterrupt):
            _silence_once(exc)
            raise  # the interpreter ends by SIGINT after atexit: exit status 130, as plain python
        return EXIT_ERROR
    return EXIT_OK


def from_script(exc: BaseException) -> Any:
    """The traceback from the first frame outside ms_shm, as ``python SCRIPT`` / ``python -m MODULE`` would print
    it; ``None`` for a SyntaxError in the script itself (python prints only its block); else the whole traceback."""
    tb = first = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").split(".")[0] in _OWN_FRAMES:
        tb = tb.tb_next
    if tb is None and isinstance(exc, SyntaxError):
        return None
    return tb or first


def _report_uncaught(exc: BaseException) -> None:
    """What python's ``PyErr_Print`` does: ``sys.last_*`` set, then ``sys.excepthook`` (the script's own when it
    set one); a hook that raises ``SystemExit`` ends the program with its code (a launcher's hook that logs, then
    ``sys.exit(9)``: an audit saw 1 and a "failing hook" report under ``run``); a hook that fails otherwise is
    reported before the original exception, its own traceback from its own frame, as python prints it.

    Raises:
        SystemExit: the hook's own.
    """
    tb = from_script(exc)
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    hook = getattr(sys, "excepthook", sys.__excepthook__)
    try:
        hook(type(exc), exc, tb)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - python's own words for a failing hook
        err.__suppress_context__ = True  # python calls the hook with no exception being handled
        print("Error in sys.excepthook:", file=sys.stderr)
        err = err.with_traceback(err.__traceback__.tb_next or err.__traceback__)  # from the hook's frame
        sys.__excepthook__(type(err), err, err.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


def _silence_once(exc: BaseException) -> None:
    """Let ``exc``, already reported, reach the interpreter without being printed twice: python then runs the
    atexit handlers and kills itself with SIGINT (exit status 130 / -2), as for a script's own Ctrl-C."""
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        sys.excepthook = previous
        if value is not exc:
            previous(kind, value, tb)

    sys.excepthook = hook


__all__ = ["cmd_run", "from_script", "report_path", "run_module", "run_path", "run_stdin", "split_run_argv"]
