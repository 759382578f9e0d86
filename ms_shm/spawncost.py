"""What a spawned (or forkserver) worker holds of its own before it reads a row, measured once per process.

A forked worker shares its parent's pages, and the probe child measures what it adds (a few MiB). A spawned one
starts a fresh interpreter and imports the framework and the program's modules again: an audit's MindSpore
workers held 159 MiB each of their own (3-4 forked), and a plan that priced them as forked was OOM-killed in an
800 MB container, as raw MindSpore was. So where memory may bind, a fresh interpreter (the one spawned workers
run) imports the libraries this process has imported, from site-packages and ``PYTHONPATH`` (what the program's
script and the framework's worker import again; the program's own modules, in its script's folder, are never
run: they may do anything at import) and says what it holds privately
(``Private_Dirty``: the pages a memory cgroup is charged for; the libraries' file pages are shared with this
process). It takes one to a few seconds, once per process, and only for pipelines that would spawn workers under
a memory limit, whose pools cost seconds to start anyway.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import time

from ms_shm import procfs, sites
from ms_shm._results import Result, mib, record

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0
_CHILD = """
import gc, importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
gc.collect()
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("Private_Dirty:"):
        sys.stdout.write(str(int(line.split()[1]) * 1024))
"""


@record
class SpawnedWorker(Result):
    """A fresh interpreter's own memory after the imports.

    Attributes:
        private_bytes: its ``Private_Dirty`` (``None``: not measured; ``why`` says why).
        modules: the top-level packages it imported.
        seconds: what the measurement took.
        why: why there is no figure, or ``None``.
    """

    private_bytes: int | None
    modules: tuple = ()
    seconds: float = 0.0
    why: str | None = None


def imported_packages() -> tuple:
    """The top-level packages this process has imported from outside the standard library (which costs the
    fresh interpreter little) and the program's own folder (whose modules may do anything at import), sorted:
    site-packages, and folders on ``PYTHONPATH`` (``pip install --target``, conda-pack: an audit's transformers
    there was left out, and spawned workers held 212 MiB against the 148 measured)."""
    home = _program_folder()
    names = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." in name or name.startswith("_") or not isinstance(path, str) or sites.standard(path):
            continue
        if sites.installed(path, standard=False) or home is None or not os.path.realpath(path).startswith(home):
            names.add(name)  # site-packages, wherever it lies (a virtual environment inside the project)
    return tuple(sorted(names - {"__main__", "sitecustomize", "usercustomize"}))


def _program_folder() -> str | None:
    """The folder of the program's script (``__main__``), else the working directory: its modules are the
    program's."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        folder = os.path.dirname(os.path.realpath(main)) if isinstance(main, str) else os.getcwd()
    except OSError:
        return None
    return os.path.join(folder, "")


@functools.lru_cache(maxsize=1)
def measure() -> SpawnedWorker:
    """Once per process: a fresh interpreter's ``Private_Dirty`` after importing ``imported_packages()``."""
    modules, began = imported_packages(), time.perf_counter()
    try:
        done = subprocess.run([_spawned_executable(), "-c", _CHILD, *modules], capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        figure = int(done.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        why = f"a fresh interpreter's memory not measured ({type(exc).__name__}: {exc})"
        return SpawnedWorker(None, modules, time.perf_counter() - began, why)
    found = SpawnedWorker(figure, modules, time.perf_counter() - began)
    log.info("ms_shm: a spawned worker's own memory: %s (a fresh interpreter importing %s, measured in %.1f s)",
             mib(figure), ", ".join(modules) or "nothing", found.seconds)
    return found


def _spawned_executable() -> str:
    """The interpreter spawned workers run: ``multiprocessing.set_executable``'s (an embedded interpreter's
    ``sys.executable`` may be no Python at all), else ``sys.executable``."""
    try:
        from multiprocessing import spawn

        return spawn.get_executable() or sys.executable
    except Exception:  # noqa: BLE001 - an odd multiprocessing: the interpreter this process runs
        return sys.executable


def worker_bytes(start_method: str, forked_bytes: int | None) -> int | None:
    """A worker process's own memory under ``start_method``: ``forked_bytes`` (the probe child's) under fork;
    under spawn and forkserver the larger of that and a fresh interpreter's, or where that could not be
    measured, this process's own (an upper bound: a worker imports what it imported), said."""
    if start_method == "fork":
        return forked_bytes
    fresh = measure()
    if fresh.private_bytes is None:
        own = procfs.private_bytes()
        log.info("ms_shm: %s; each %s worker is priced at this process's own memory, %s", fresh.why,
                 start_method, mib(own))
        return max(forked_bytes or 0, own or 0) or forked_bytes
    return max(forked_bytes or 0, fresh.private_bytes)


__all__ = ["SpawnedWorker", "imported_packages", "measure", "worker_bytes"]
