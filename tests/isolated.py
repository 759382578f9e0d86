"""Run Python code the way a container would: private small /dev/shm, fake CPU count, starved fd limit.

Everything here needs root and ``unshare``; ``unavailable()`` says why not, so tests skip with a reason
instead of passing silently.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def private_tmp(size: str = "64m") -> str:
    """Shell lines that put a fresh tmpfs on /tmp, keeping the checkout and the interpreter visible.

    MindSpore writes its ``/tmp/dataset_ipc_*`` key files to the fixed path /tmp, so fault tests give each run
    its own /tmp. A checkout or virtualenv that itself lives under /tmp (a CI runner's workspace) would vanish
    under the new mount; those directories are bound back from a saved view of the old /tmp.
    """
    needed = {REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              Path(sys.executable).resolve().parent}
    keep = sorted(p for p in needed if p.is_relative_to("/tmp"))
    mount = f"mount -t tmpfs -o size={size} tmpfs /tmp"
    if not keep:
        return mount
    lines = ['saved=$(mktemp -d /var/tmp/ms_shm_oldtmp.XXXXXX)', 'mount --bind /tmp "$saved"', mount]
    for path in keep:
        rel = shlex.quote(str(path.relative_to("/tmp")))
        lines += [f"mkdir -p /tmp/{rel}", f'mount --bind "$saved"/{rel} /tmp/{rel}']
    lines += ['umount "$saved"', 'rmdir "$saved"']
    return " && ".join(lines)


@lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why a private /dev/shm cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs on /dev/shm"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm && df -k /dev/shm"],
        capture_output=True, text=True, timeout=30,
    )
    if probe.returncode != 0:
        return f"unshare/mount failed: {probe.stderr.strip()[:200]}"
    return None


@lru_cache(maxsize=None)
def mindspore_missing() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import mindspore.dataset"], capture_output=True, text=True)
    return None if r.returncode == 0 else "mindspore is not importable: " + r.stderr.strip()[-200:]


def _memory_root() -> tuple:
    """Where new memory cgroups are made here: (version, directory), or (None, why not)."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return "v1", v1
    control = Path("/sys/fs/cgroup/cgroup.subtree_control")
    if control.exists() and "memory" in control.read_text(errors="replace").split():
        return "v2", control.parent
    return None, "no writable memory cgroup controller (v1 memory or v2 with memory delegated)"


@lru_cache(maxsize=None)
def memory_cgroup_unavailable() -> str | None:
    """Why a memory cgroup (a container's memory limit) cannot be made here, or None when it can."""
    if unavailable():
        return unavailable()
    version, where = _memory_root()
    if version is None:
        return where
    try:
        with memory_cgroup("1G"):
            return None
    except OSError as exc:
        return f"cannot create a memory cgroup under {where}: {exc}"


class memory_cgroup:
    """A fresh memory cgroup with ``limit`` (``docker run --memory``); ``shell_line`` moves a shell into it.

    Exit removes it (after its processes are gone) and keeps ``peak`` (v1 ``max_usage_in_bytes``, v2
    ``memory.peak``) and ``oom_kills`` (how many processes the OOM killer ended in it).
    """

    def __init__(self, limit: str) -> None:
        self.version, root = _memory_root()
        self.path = Path(root) / f"ms_shm_test_{os.getpid()}_{id(self)}"
        self.limit = limit
        self.peak: int | None = None
        self.oom_kills: int | None = None

    def __enter__(self) -> "memory_cgroup":
        self.path.mkdir()
        knob = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        (self.path / knob).write_text(self.limit)
        return self

    def shell_line(self) -> str:
        return f"echo $$ > {shlex.quote(str(self.path / 'cgroup.procs'))}"

    def __exit__(self, *exc) -> None:
        peak = self.path / ("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak")
        try:
            self.peak = int(peak.read_text())
        except (OSError, ValueError):
            self.peak = None
        events = self.path / ("memory.oom_control" if self.version == "v1" else "memory.events")
        try:
            counts = dict(line.split() for line in events.read_text().splitlines() if line.count(" ") == 1)
            self.oom_kills = int(counts.get("oom_kill", 0))
        except (OSError, ValueError):
            self.oom_kills = None
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # its last processes are still exiting
                time.sleep(0.1)


def shell_prefix(shm: str | None = "64m", cpus: int | None = None, nofile: int | None = None,
                 nofile_hard: int | None = None, cgroup: "memory_cgroup | None" = None) -> str:
    """Shell lines that set up the private namespace before the command runs."""
    lines = [cgroup.shell_line()] if cgroup is not None else []
    if shm:
        lines.append(f"mount -t tmpfs -o size={shm} tmpfs /dev/shm")
    if cpus:
        lines.append(f'f=$(mktemp); echo 0-{cpus - 1} > "$f"; mount --bind "$f" /sys/devices/system/cpu/online')
    if nofile:
        lines.append(f"ulimit -Sn {nofile}")  # soft first: the hard limit may not drop below it
    if nofile_hard:
        lines.append(f"ulimit -Hn {nofile_hard}")
    return " && ".join(lines) if lines else "true"


def run_shell(command: str, shm: str | None = "64m", cpus: int | None = None, nofile: int | None = None,
              nofile_hard: int | None = None, timeout: float = 300, env: dict | None = None,
              cgroup: memory_cgroup | None = None) -> subprocess.CompletedProcess:
    """Run a shell command inside a fresh private mount namespace (and ``cgroup``, charged for its tmpfs)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("GLOG_v", "2")
    if env:
        full_env.update(env)
    script = shell_prefix(shm, cpus, nofile, nofile_hard, cgroup) + " && " + command
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(REPO))


def as_from_a_terminal() -> None:
    """A child's ``preexec_fn``: SIGINT at its default, as for a program started at a terminal. A suite run as a
    background job of a script inherits it ignored (``cmd &`` without job control), and Python then installs no
    handler for it: a test that sends SIGINT would wait in vain."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a Python snippet (dedented) in a private namespace; see ``run_shell`` for the options."""
    code = textwrap.dedent(code)
    return run_shell(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", **kwargs)


def describe(result: subprocess.CompletedProcess) -> str:
    """Text for an assertion message: exit code and the tails of both streams."""
    return (f"rc={result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}"
            f"\n--- stderr ---\n{result.stderr[-3000:]}")


# How raw MindSpore dies when dynamic slots run past the end of /dev/shm (2.10, measured): SIGBUS in a worker,
# then its SIGCHLD handler ends the main process with SIGTERM.
BUS_WORKER = "Unexpected bus error encountered in process. Non-existent physical address."
BUS_MAIN = "was killed by signal: Bus error. Main process will be terminated."
TERMINATED = -15
RAW_LIMIT = "timeout -s KILL 120"  # prefix of a raw run that may hang after its worker's bus error
HUNG = 128 + 9  # the shell's status of a run ``RAW_LIMIT`` killed


def run_loader_scenario(framework: str, scenario: str, mode: str, shm: str = "64m", nofile: int | None = None,
                        hard: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """One ``tests.loader_scenarios`` run (``framework`` 'torch' or 'mindspore'; ``mode`` 'raw', 'ms_shm' or
    'patch') in a private namespace: ``shm`` of /dev/shm, optionally a soft / hard open-files limit."""
    code = f"from tests.loader_scenarios import run; run({framework!r}, {scenario!r}, {mode!r})"
    return run_shell(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm=shm, nofile=nofile,
                     nofile_hard=hard, timeout=timeout)


def assert_through_pipes(run: Callable, scenario: str, reference: list, batches: int = 12) -> None:
    """``build_dataloader`` and unchanged code under ``ms_shm.patch`` deliver ``reference`` (``batches``) under
    64 MB with the 2 workers asked, each batch through its worker's pipe, almost no /dev/shm."""
    for mode in ("ms_shm", "patch"):
        ours = result_of(run(scenario, mode))
        assert ours["digests"] == reference and len(reference) == batches, mode
        assert ours["plan"]["workers"] == 2 and ours["plan"]["shm"] == 0, ours["plan"]
        assert any(d.startswith("transport=pipes") for d in ours["plan"]["decisions"]), ours["plan"]
        assert ours["peak"] is None or ours["peak"] < 8 << 20, ours["peak"]


def result_of(proc: subprocess.CompletedProcess) -> dict:
    """The last ``RESULT {json}`` line a scenario printed; the run must have succeeded."""
    import json

    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, describe(proc)
    return json.loads(lines[-1][len("RESULT "):])


def assert_bus_error(proc: subprocess.CompletedProcess, hung_ok: bool = False) -> None:
    """Raw dynamic slots past the end of /dev/shm: SIGBUS in a worker, then MindSpore kills the main process (or,
    with spawn workers, the main process raises before it does: 1 suite run). ``hung_ok``: the run was limited by ``RAW_LIMIT``, and a main process that hung after its worker's bus error
    (MindSpore's SIGCHLD handler deadlocks in malloc, about 1 run in 8 on 2.7.2-2.10) was killed by it."""
    if hung_ok and proc.returncode == HUNG:
        assert BUS_WORKER in proc.stderr and "RESULT " not in proc.stdout, describe(proc)
        return
    if proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr:
        assert BUS_WORKER in proc.stderr and "RESULT " not in proc.stdout, describe(proc)
        return
    assert proc.returncode in (TERMINATED, 128 - TERMINATED), \
        "raw MindSpore was expected to die of SIGBUS:\n" + describe(proc)
    assert BUS_WORKER in proc.stderr and BUS_MAIN in proc.stderr, describe(proc)
    assert "RESULT " not in proc.stdout
