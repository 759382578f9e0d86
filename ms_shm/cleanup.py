"""Find and remove what crashed MindSpore (and PyTorch) data pipelines left behind.

Why this exists: MindSpore's ``map``/``batch`` with ``python_multiprocessing=True`` talk to their workers
through one SysV shared-memory segment and one SysV message queue per worker. When the whole process
group dies at once (OOM killer, ``kill -9 -PGID``, a cgroup kill) nobody calls ``IPC_RMID`` and the
row-sized segments stay in RAM until ``ipcrm``, a reboot, or the end of the IPC namespace. In a Kubernetes
pod the IPC namespace outlives container restarts, so the leak grows with every crash.

How a leftover is recognised (MindSpore 2.10, measured):

* SysV keys are ``ftok("/tmp/dataset_ipc_<mainpid>_<threadptr>_<worker>", 0)``. Running a ``map`` pipeline
  with two workers showed ``/tmp/dataset_ipc_4770_..._0`` with ``st_dev=0x29, st_ino=0x3`` and both the
  segment and the queue under key ``0x00290003``: glibc's ftok with ``proj_id`` 0. The main process never
  deletes these files, so they outlive even clean runs.
* A segment is removed only when its key matches such a file, nobody is attached (``nattch == 0``), and the
  creator, the last attacher and the pipeline's main process are all dead. A queue needs its key to match
  and its last sender, last receiver and main process dead. Message queues have no attach count, so the
  pids are all we have.
* Without the ``/tmp`` file (``/tmp`` was wiped, or a restarted container got a fresh one while the pod's
  IPC namespace lived on) the key alone is weak evidence: any program may call ``ftok(path, 0)``. Such
  objects are removed only with ``orphan_keys=True``, and only when they look exactly like MindSpore's
  pair: a segment and a queue under the same key, ``proj_id`` 0, every pid dead, nothing attached.
* ``/dev/shm`` files: regular files named ``mindspore_<pid>_*``, ``pym-<pid>-*`` or ``torch_<pid>_*`` whose
  pid is dead, and Python's ``sem.mp-*`` semaphores (they carry no pid, so they go only when every live
  process's memory maps could be read and none maps them). Other ``sem.*`` names belong to programs that
  may keep a named semaphore between runs on purpose; they are left alone.
* Every file is skipped when a live process has it open or mapped (one scan of ``/proc/*/fd`` and
  ``/proc/*/maps``), when it is not a regular file (symlinks are never followed), or when it belongs to
  another user (root may clean anyone's).

Limits: liveness is judged in this process's PID namespace, and ``/proc/sysvipc`` shows this process's
IPC namespace. A process in another PID namespace that shares our ``/tmp`` or ``/dev/shm`` looks dead;
the open-file scan cannot see it either. Run the cleaner where the pipelines ran.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ms_shm._results import Result, mib

log = logging.getLogger(__name__)

#: ``proj_id`` MindSpore passes to ``ftok`` (found by experiment, see the module docstring).
MINDSPORE_FTOK_PROJ = 0

KIND_SHM = "sysv-shm"
KIND_MSG = "sysv-msg"
KIND_IPC_FILE = "ipc-file"
KIND_DEV_SHM = "dev-shm"

_KIND_TEXT = {
    KIND_SHM: "SysV shared memory segment",
    KIND_MSG: "SysV message queue",
    KIND_IPC_FILE: "/tmp/dataset_ipc file",
    KIND_DEV_SHM: "/dev/shm file",
}

_IPC_FILE = re.compile(r"^dataset_ipc_(\d+)_(\d+)_(\d+)$")
#: /dev/shm names that carry the creating pid. MindSpore's dynamic Generator slots, CPython's heap arenas
#: (``multiprocessing.heap``), and PyTorch's ``NewProcessWideShmHandle`` (``/torch_<pid>_<rand>[_<n>]``).
_PID_FILES = (
    ("mindspore", re.compile(r"^mindspore_(\d+)_")),
    ("python multiprocessing heap", re.compile(r"^pym-(\d+)-")),
    ("pytorch", re.compile(r"^torch_(\d+)_\d")),
)
#: Python's ``multiprocessing`` semaphores: ``sem_open("/mp-XXXXXXXX")`` → ``/dev/shm/sem.mp-XXXXXXXX``.
_MP_SEM = re.compile(r"^sem\.mp-[A-Za-z0-9_]+$")

_IPC_RMID = 0
_GONE = "already gone"  # removed by someone else between the scan and our attempt


@dataclass(frozen=True)
class Leftover(Result):
    """One object a crashed run left behind.

    Attributes:
        kind: ``"sysv-shm"``, ``"sysv-msg"``, ``"ipc-file"`` or ``"dev-shm"``.
        name: The SysV id and key (``"shmid 3 key 0x00290003"``) or the file's path.
        size_bytes: Memory that comes back when it goes: resident plus swapped bytes of a segment (its size
            on kernels without those columns), bytes queued in a message queue, allocated bytes of a file.
        owner_pid: The pid whose death makes it a leftover (the pipeline's main process when known).
        reason: Why it is considered leaked, in one line.
        removed: True once it is gone (always False in a dry run).
        error: Why removal failed, or None.
    """

    kind: str
    name: str
    size_bytes: int
    owner_pid: int | None
    reason: str
    removed: bool = False
    error: str | None = None


@dataclass(frozen=True)
class CleanReport(Result):
    """What ``clean()`` found and did.

    Attributes:
        leftovers: Objects that are (or in a dry run would be) removed, with the outcome of each.
        bytes_freed: Bytes freed, or in a dry run the bytes a real run would free.
        dry_run: True when nothing was removed on purpose.
        notes: What could not be read or was deliberately kept, so a short list is never mistaken for
            "nothing there".
    """

    leftovers: tuple = ()
    bytes_freed: int = 0
    dry_run: bool = True
    notes: tuple = field(default_factory=tuple)

    @property
    def failed(self) -> tuple:
        """Leftovers whose removal was attempted and failed (one that vanished meanwhile is no failure)."""
        return tuple(item for item in self.leftovers if item.error and item.error != _GONE)

    def lines(self) -> list:
        """Human lines for ``ms-shm clean``: one per object, a total, then the notes."""
        out = []
        verb = "would remove" if self.dry_run else "removed"
        if not self.leftovers:
            out.append("nothing to clean: no leftovers of dead MindSpore/PyTorch runs found")
        for item in self.leftovers:
            if self.dry_run:
                state = "would remove"
            elif item.removed:
                state = "removed"
            elif item.error == _GONE:
                state = "already gone"
            else:
                state = f"FAILED ({item.error})"
            pid = f"pid {item.owner_pid}" if item.owner_pid else "no pid"
            out.append(f"{state}: {_KIND_TEXT.get(item.kind, item.kind)} {item.name} "
                       f"({mib(item.size_bytes)}, {pid}): {item.reason}")
        if self.leftovers:
            count = sum(1 for item in self.leftovers if self.dry_run or item.removed)
            out.append(f"{verb} {count} object(s), {mib(self.bytes_freed)} freed"
                       + (" if run with --yes" if self.dry_run else ""))
        out.extend(f"note: {note}" for note in self.notes)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


# --------------------------------------------------------------------------------------------- reading


def ftok(st: os.stat_result, proj_id: int = MINDSPORE_FTOK_PROJ) -> int:
    """glibc's ``ftok`` from a ``stat`` result, so keys can be matched without calling into libc."""
    return ((proj_id & 0xFF) << 24) | ((st.st_dev & 0xFF) << 16) | (st.st_ino & 0xFFFF)


def read_sysvipc(path: Path, notes: list) -> list:
    """Rows of a ``/proc/sysvipc`` table as dicts keyed by its own header, so column order never matters."""
    try:
        text = path.read_text()
    except OSError as exc:
        notes.append(f"cannot read {path}: {type(exc).__name__}: {exc}")
        return []
    lines = text.splitlines()
    if not lines:
        return []
    header = lines[0].split()
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        cells = line.split()
        if not cells:
            continue
        try:
            rows.append({name: int(cell) for name, cell in zip(header, cells)})
        except ValueError:
            notes.append(f"{path}: line {number} is not numeric, skipped")
    return rows


class _Processes:
    """One snapshot of the live processes and of every file they hold open or mapped.

    Taken once per ``clean()``: scanning ``/proc`` per candidate would be slow on a busy host and would
    give inconsistent answers while processes come and go.
    """

    def __init__(self, root: Path):
        self.root = root
        self.proc = root / "proc"
        self.live: set = set()
        self.held: dict = {}  # path as the process sees it -> one pid that holds it
        self.unreadable_maps = 0
        self.unreadable_fds = 0
        try:
            names = os.listdir(self.proc)
        except OSError as exc:
            self.error: str | None = f"cannot list {self.proc}: {type(exc).__name__}: {exc}"
            return
        self.error = None
        self.live = {int(name) for name in names if name.isdigit() and not self._zombie(name)}
        for pid in self.live:
            self._scan_fds(pid)
            self._scan_maps(pid)

    def _zombie(self, pid: str) -> bool:
        """A killed process its parent has not reaped yet: it holds no fds or mappings, so it counts as dead.

        Seen after ``kill -9`` of a pipeline whose launcher (a shell, a supervisor) does not wait for it.
        Unreadable means alive: the safe answer.
        """
        try:
            text = (self.proc / pid / "stat").read_text(errors="replace")
        except OSError:
            return False
        _, _, rest = text.rpartition(")")
        fields = rest.split()
        return bool(fields) and fields[0] in ("Z", "X")

    def _scan_fds(self, pid: int) -> None:
        fd_dir = self.proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            return  # exited since the listing
        except OSError:
            self.unreadable_fds += 1
            return
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue  # closed since the listing
            self._hold(target, pid)

    def _scan_maps(self, pid: int) -> None:
        try:
            with open(self.proc / str(pid) / "maps", encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        self._hold(parts[5].rstrip("\n"), pid)
        except FileNotFoundError:
            return
        except OSError:
            self.unreadable_maps += 1

    def _hold(self, target: str, pid: int) -> None:
        if target.endswith(" (deleted)"):
            target = target[: -len(" (deleted)")]
        if target.startswith("/"):
            self.held.setdefault(target, pid)

    def alive(self, pid: int | None) -> bool:
        """Whether ``pid`` is running. Zero and None mean "no such pid" (never attached, never sent)."""
        return bool(pid) and pid in self.live

    def holder(self, host_path: str) -> int | None:
        """A live pid that has ``host_path`` open or mapped, or None."""
        return self.held.get(host_path)


def _host_path(root: Path, path: Path) -> str:
    """The path a process under ``root`` would see, for matching against ``/proc/*/fd`` links."""
    return "/" + str(path.relative_to(root)).lstrip("/")


@dataclass
class _IpcFile:
    path: Path
    main_pid: int
    st: os.stat_result


def _ipc_files(root: Path, notes: list) -> list:
    tmp = root / "tmp"
    found = []
    try:
        entries = sorted(os.scandir(tmp), key=lambda entry: entry.name)
    except OSError as exc:
        notes.append(f"cannot list {tmp}: {type(exc).__name__}: {exc}")
        return found
    for entry in entries:
        match = _IPC_FILE.match(entry.name)
        if not match:
            continue
        st = _regular_file(entry.path, notes)
        if st is None:
            continue
        found.append(_IpcFile(Path(entry.path), int(match.group(1)), st))
    return found


def _regular_file(path: str, notes: list) -> os.stat_result | None:
    """``lstat`` of a candidate, or ``None`` (with a note) unless it is a regular file: links are never followed."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        notes.append(f"cannot stat {path}: {type(exc).__name__}")
        return None
    if not stat.S_ISREG(st.st_mode):
        notes.append(f"skipped {path}: not a regular file (symlinks are never followed)")
        return None
    return st


# --------------------------------------------------------------------------------------------- removing


def _libc_rmid(kind: str, ipc_id: int) -> None:
    """``shmctl``/``msgctl(id, IPC_RMID, NULL)``; Python has no binding, so ctypes, then ``ipcrm``."""
    name = "shmctl" if kind == KIND_SHM else "msgctl"
    libc_path = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_path, use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError) as exc:
        ipcrm = shutil.which("ipcrm")
        if ipcrm is None:
            raise OSError(errno.ENOSYS, f"no {name} in libc ({exc}) and no ipcrm") from exc
        flag = "-m" if kind == KIND_SHM else "-q"
        result = subprocess.run([ipcrm, flag, str(ipc_id)], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise OSError(errno.EPERM, f"ipcrm {flag} {ipc_id}: {result.stderr.strip()}") from exc
        return
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    function.restype = ctypes.c_int
    if function(ipc_id, _IPC_RMID, None) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.EIDRM):  # the id no longer names anything: removed meanwhile
            raise FileNotFoundError(code, f"{name}({ipc_id}, IPC_RMID): {os.strerror(code)}")
        raise OSError(code, f"{name}({ipc_id}, IPC_RMID): {os.strerror(code)}")


def _rmid(kind: str, ipc_id: int, root: Path) -> None:
    """Remove a SysV object, but only on the real host: ids read from a fake root mean nothing to the kernel."""
    if root.resolve() != Path("/"):
        raise OSError(errno.EPERM, f"refusing IPC_RMID: SysV ids were read under {root}, not /")
    _libc_rmid(kind, ipc_id)


def _unlink_regular(path: Path, expected: os.stat_result) -> None:
    """Unlink ``path`` only if it is still the same regular file; never through a symlink."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    dir_fd = os.open(path.parent, flags)
    try:
        now = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (expected.st_dev, expected.st_ino):
            raise OSError(errno.ESTALE, "changed since it was examined; left alone")
        os.unlink(path.name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------------------------- deciding


@dataclass
class _Candidate:
    leftover: Leftover
    undo: Callable[[], None]
    key: int | None = None  # the SysV key, so a failed removal can keep its /tmp file


def _fmt_key(key: int) -> str:
    return f"0x{key & 0xFFFFFFFF:08x}"


def _sysv_candidates(root: Path, procs: _Processes, files: list, uid: int, orphan_keys: bool,
                     notes: list) -> tuple:
    """Decide which segments and queues are leftovers. Returns (candidates, keys kept alive)."""
    by_key: dict = {}
    for item in files:
        by_key.setdefault(ftok(item.st), []).append(item)
    shm_rows = read_sysvipc(root / "proc" / "sysvipc" / "shm", notes)
    msg_rows = read_sysvipc(root / "proc" / "sysvipc" / "msg", notes)
    is_root = uid == 0
    kept_keys: set = set()
    maybe: dict = {}  # key -> list of (kind, row, pids) for objects without a /tmp file
    chosen = []
    in_use = 0

    for kind, rows, id_col, pid_cols in ((KIND_SHM, shm_rows, "shmid", ("cpid", "lpid")),
                                         (KIND_MSG, msg_rows, "msqid", ("lspid", "lrpid"))):
        for row in rows:
            key = row.get("key", 0) & 0xFFFFFFFF
            if key == 0 or id_col not in row:  # IPC_PRIVATE is never MindSpore's
                continue
            owners = by_key.get(key)
            if owners is None and ((key >> 24) & 0xFF) != MINDSPORE_FTOK_PROJ:
                continue
            if not is_root and row.get("uid") != uid:
                if owners:
                    kept_keys.add(key)
                continue
            pids = [row.get(col, 0) for col in pid_cols] + [item.main_pid for item in owners or ()]
            live = [pid for pid in pids if procs.alive(pid)]
            attached = kind == KIND_SHM and row.get("nattch", 1) != 0
            if live or attached:
                if owners:
                    kept_keys.add(key)
                    in_use += 1
                continue
            if owners is None:
                maybe.setdefault(key, []).append((kind, row))
                continue
            main_pid = owners[0].main_pid
            reason = (f"key {_fmt_key(key)} = ftok({owners[0].path.name}); "
                      + ("nothing attached, " if kind == KIND_SHM else "")
                      + "pids " + ", ".join(str(p) for p in sorted(set(pids)) if p) + " dead")
            chosen.append(_sysv_leftover(kind, row, id_col, key, main_pid, reason, root))

    orphans = [(key, objs) for key, objs in maybe.items()
               if {kind for kind, _ in objs} == {KIND_SHM, KIND_MSG}]
    if orphans and not orphan_keys:
        notes.append(f"kept {sum(len(objs) for _, objs in orphans)} SysV object(s) that look like MindSpore's "
                     f"(segment and queue under one ftok key, proj_id 0, all pids dead, nothing attached) "
                     f"but whose /tmp/dataset_ipc file is gone: keys "
                     + ", ".join(_fmt_key(key) for key, _ in orphans)
                     + "; pass orphan_keys=True (ms-shm clean --orphan-keys) to remove them")
    elif orphans:
        for key, objs in orphans:
            for kind, row in objs:
                id_col = "shmid" if kind == KIND_SHM else "msqid"
                pid = row.get("cpid") or row.get("lspid") or None
                reason = (f"key {_fmt_key(key)} has MindSpore's shape (segment + queue, proj_id 0), "
                          "all pids dead, nothing attached; its /tmp/dataset_ipc file is gone")
                chosen.append(_sysv_leftover(kind, row, id_col, key, pid, reason, root))
    if in_use:
        log.debug("kept %d MindSpore SysV object(s) used by live processes", in_use)
    return chosen, kept_keys


def _sysv_leftover(kind: str, row: dict, id_col: str, key: int, pid: int | None, reason: str,
                   root: Path) -> _Candidate:
    ipc_id = row[id_col]
    if kind == KIND_SHM:
        if "rss" in row:  # kernels since 4.x: what the segment really holds, not its nominal size
            size = row["rss"] + row.get("swap", 0)
        else:
            size = row.get("size", 0)
        name = f"shmid {ipc_id} key {_fmt_key(key)}"
    else:
        size = row.get("cbytes", 0)
        name = f"msqid {ipc_id} key {_fmt_key(key)}"
    table = root / "proc" / "sysvipc" / ("shm" if kind == KIND_SHM else "msg")

    def undo() -> None:
        # Ids are recycled: make sure the id still names the object we judged, still unattached.
        current = {r.get(id_col): r for r in read_sysvipc(table, [])}.get(ipc_id)
        if current is None:
            raise FileNotFoundError(errno.ENOENT, "already gone")
        if current.get("key") != row.get("key") or current.get("cpid") != row.get("cpid") \
                or current.get("nattch", 0) != 0:
            raise OSError(errno.ESTALE, "changed since it was examined; left alone")
        _rmid(kind, ipc_id, root)

    return _Candidate(Leftover(kind, name, int(size), pid, reason), undo, key)


def _file_candidates(root: Path, procs: _Processes, files: list, uid: int, kept_keys: set,
                     notes: list) -> list:
    chosen = []
    is_root = uid == 0
    for item in files:
        if procs.alive(item.main_pid) or (not is_root and item.st.st_uid != uid):
            continue
        if ftok(item.st) in kept_keys:
            continue  # its key still names an object in use or kept: removing the file loses the match
        holder = procs.holder(_host_path(root, item.path))
        if holder:
            continue
        reason = f"pid {item.main_pid} is dead; MindSpore never deletes this ftok key file"
        chosen.append(_Candidate(Leftover(KIND_IPC_FILE, str(item.path), item.st.st_blocks * 512,
                                          item.main_pid, reason),
                                 _file_undo(item.path, item.st)))

    shm_dir = root / "dev" / "shm"
    try:
        entries = sorted(os.scandir(shm_dir), key=lambda entry: entry.name)
    except OSError as exc:
        notes.append(f"cannot list {shm_dir}: {type(exc).__name__}: {exc}")
        return chosen
    sems_unsafe = procs.unreadable_maps or procs.unreadable_fds
    skipped_sems = 0
    for entry in entries:
        origin, pid = _classify(entry.name)
        if origin is None:
            continue
        st = _regular_file(entry.path, notes)
        if st is None:
            continue
        if not is_root and st.st_uid != uid:
            continue
        if pid is not None and procs.alive(pid):
            continue
        if pid is None and sems_unsafe:
            skipped_sems += 1
            continue
        path = Path(entry.path)
        holder = procs.holder(_host_path(root, path))
        if holder:
            continue
        if pid is None:
            reason = "python multiprocessing semaphore that no live process has open or mapped"
        else:
            reason = f"{origin} file of dead pid {pid}, not open or mapped by any live process"
        chosen.append(_Candidate(Leftover(KIND_DEV_SHM, str(path), st.st_blocks * 512, pid, reason),
                                 _file_undo(path, st)))
    if skipped_sems:
        notes.append(f"kept {skipped_sems} sem.mp-* semaphore(s): the memory maps or fds of "
                     f"{max(procs.unreadable_maps, procs.unreadable_fds)} process(es) could not be read, "
                     "so whether one is in use is unknown")
    return chosen


def _classify(name: str) -> tuple:
    for origin, pattern in _PID_FILES:
        match = pattern.match(name)
        if match:
            return origin, int(match.group(1))
    if _MP_SEM.match(name):
        return "semaphore", None
    return None, None


def _file_undo(path: Path, st: os.stat_result) -> Callable[[], None]:
    return lambda: _unlink_regular(path, st)


# --------------------------------------------------------------------------------------------- public


def clean(dry_run: bool = True, root: Path | str = Path("/"), uid: int | None = None, *,
          orphan_keys: bool = False) -> CleanReport:
    """Find, and unless ``dry_run`` remove, what crashed MindSpore/PyTorch pipelines left behind.

    Safe to call at start-up from local rank 0 before the other ranks start (``tune(clean=True)``): a
    pipeline that is running has a live pid or an attached segment, and those are never touched.

    Args:
        dry_run: Only report. The default, because removal cannot be undone.
        root: Filesystem root to read ``proc``, ``tmp`` and ``dev/shm`` under; tests pass a fake tree.
            SysV objects are only removed when this is ``/``.
        uid: Whose objects to consider; defaults to the effective uid. 0 (root) considers everyone's.
        orphan_keys: Also remove SysV segment+queue pairs with MindSpore's key shape whose
            ``/tmp/dataset_ipc`` file is gone (see the module docstring for why this is opt-in).

    Returns:
        A ``CleanReport``; ``report.lines()`` is the text ``ms-shm clean`` prints. Nothing here raises
        for an unreadable or vanished object: it becomes a note or a leftover's ``error``.

    Examples:
        >>> report = clean()                      # what would go
        >>> report = clean(dry_run=False)         # remove it
    """
    root = Path(root)
    uid = os.geteuid() if uid is None else uid
    notes: list = []
    procs = _Processes(root)
    if procs.error:
        return CleanReport((), 0, dry_run, (procs.error + "; cannot tell live processes from dead ones, "
                                            "nothing was considered",))
    if procs.unreadable_maps or procs.unreadable_fds:
        notes.append(f"could not read the fds or maps of {max(procs.unreadable_maps, procs.unreadable_fds)} "
                     "process(es): files they hold open or mapped cannot be seen")

    files = _ipc_files(root, notes)
    chosen, kept_keys = _sysv_candidates(root, procs, files, uid, orphan_keys, notes)
    leftovers = []
    freed = 0
    for candidate in chosen:
        item = candidate.leftover
        if dry_run:
            leftovers.append(item)
            freed += item.size_bytes
            continue
        outcome = _attempt(candidate)
        leftovers.append(outcome)
        if outcome.removed:
            freed += outcome.size_bytes
        elif candidate.key is not None and outcome.error != _GONE:
            # Its key file must stay, or the next run cannot match the object any more.
            kept_keys.add(candidate.key)

    for candidate in _file_candidates(root, procs, files, uid, kept_keys, notes):
        if dry_run:
            leftovers.append(candidate.leftover)
            freed += candidate.leftover.size_bytes
            continue
        outcome = _attempt(candidate)
        leftovers.append(outcome)
        if outcome.removed:
            freed += outcome.size_bytes
    return CleanReport(tuple(leftovers), freed, dry_run, tuple(notes))


def _attempt(candidate: _Candidate) -> Leftover:
    item = candidate.leftover
    try:
        candidate.undo()
    except FileNotFoundError:
        log.info("%s %s was already gone", item.kind, item.name)
        return _replace(item, removed=False, error=_GONE)
    except OSError as exc:
        log.warning("could not remove %s %s: %s", item.kind, item.name, exc)
        return _replace(item, removed=False, error=f"{type(exc).__name__}: {exc}")
    log.info("removed %s %s (%s, %s)", item.kind, item.name, mib(item.size_bytes), item.reason)
    return _replace(item, removed=True)


def _replace(item: Leftover, **changes) -> Leftover:
    return replace(item, **changes)


__all__ = ["clean", "CleanReport", "Leftover", "ftok", "MINDSPORE_FTOK_PROJ"]
