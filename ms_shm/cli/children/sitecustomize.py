"""Run by Python at start-up in a process the script of ``ms-shm run`` started (``MS_SHM_RUN_CHILDREN`` set, this
folder first on ``PYTHONPATH``): Lightning's DDP ranks, which run the script again as ``python script.py``; the
processes of ``torch.multiprocessing.spawn``; a launcher's ranks. Each is patched as the script is
(``ms_shm.cli.run.protect_child``). Then the ``sitecustomize`` this one hides, if any, runs. Nothing here may stop
the process from starting as it would: a failure is one line on stderr."""

import os
import sys


def _hidden_sitecustomize() -> None:
    """The next ``sitecustomize`` on ``sys.path`` (a virtual environment's, the distribution's), run as Python would
    have run it."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _protect() -> None:
    """A script or module run as a rank, or a multiprocessing worker (``--multiprocessing-fork``); not other
    ``-c`` commands (multiprocessing's resource tracker, a one-liner), which do not even import ms_shm."""
    options = os.environ.get("MS_SHM_RUN_CHILDREN")
    if options and (sys.argv[:1] != ["-c"] or "--multiprocessing-fork" in sys.argv):
        from ms_shm.cli.run import protect_child

        protect_child(options)


for _step in (_protect, _hidden_sitecustomize):
    try:
        _step()
    except Exception as _exc:  # noqa: BLE001 - the process starts regardless
        print(f"ms-shm run: in child process {os.getpid()}: {_step.__name__[1:]} failed: {type(_exc).__name__}: "
              f"{_exc}", file=sys.stderr)
