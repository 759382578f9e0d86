"""Run by Python at start-up in a process the script of ``ms-shm run`` started (``MS_SHM_RUN_CHILDREN`` set, this
folder first on ``PYTHONPATH``): Lightning's DDP ranks, which run the script again as ``python script.py``; the
processes of ``torch.multiprocessing.spawn``; a launcher's ranks. Each is patched as the script is
(``ms_shm.cli.run.protect_child``) once it imports a framework: a child that imports none (pip, a helper script)
loads nothing of ms_shm (an audit: every child paid ~100-180 ms for it). The ``sitecustomize`` this one hides, if
any, runs first and stays ``sys.modules["sitecustomize"]``. Nothing here may stop a process from starting as it
would: a child whose Python cannot import ms_shm is left alone, silently; another failure is one line on stderr."""

import os
import sys

_FRAMEWORKS = ("torch", "torchdata", "mindspore")


def _hidden_sitecustomize():
    """The next ``sitecustomize`` on ``sys.path`` (a virtual environment's, a site's), run as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


class _OnFrameworkImport:
    """A meta path finder that finds nothing: at the child's first import of a framework it patches the child,
    then hands that import to ms_shm's own finder (which tunes a rank once the framework is in)."""

    def __init__(self, options, worker):
        self.options, self.worker, self.done = options, worker, False

    def find_spec(self, name, path=None, target=None):
        if self.done or name.partition(".")[0] not in _FRAMEWORKS:
            return None
        self.done = True  # stays in sys.meta_path, inert: removing it mid-import would skip the next finder
        try:
            from ms_shm.cli.run import protect_child
        except ImportError:  # another Python, another environment: the child runs as it would
            return None
        try:
            return protect_child(self.options, self.worker).find_spec(name, path, target)
        except Exception as exc:  # noqa: BLE001 - the child starts regardless
            _say(f"not patched: {type(exc).__name__}: {exc}")
            return None


def _install():
    options = os.environ.get("MS_SHM_RUN_CHILDREN")
    worker = "--multiprocessing-fork" in sys.argv  # read now: a spawned worker takes its parent's argv later
    # a script or module run as a rank, or a multiprocessing worker; not other -c commands (the resource tracker)
    if options and (sys.argv[:1] != ["-c"] or worker):
        sys.meta_path.insert(0, _OnFrameworkImport(options, worker))


def _say(what):
    """One line through ms_shm's logger (unconfigured in a child: Python's last-resort handler puts a warning on
    stderr); ``logging`` is loaded only then, not at every start-up."""
    import logging

    logging.getLogger("ms_shm.cli.run").warning("ms-shm run: in child process %s: %s", os.getpid(), what)


for _step in (_hidden_sitecustomize, _install):
    try:
        _step()
    except Exception as _exc:  # noqa: BLE001 - the process starts regardless
        _say(f"{_step.__name__.strip('_')} failed: {type(_exc).__name__}: {_exc}")
