"""Find and remove what crashed data pipelines (MindSpore, PyTorch, Python multiprocessing) left behind.

Why this exists: when a pipeline's whole process group dies at once (OOM killer, ``kill -9 -PGID``, a cgroup
kill) nobody calls ``IPC_RMID`` or unlinks its ``/dev/shm`` files, and row-sized objects stay in RAM until
``ipcrm``, a reboot, or the end of the IPC namespace. In a Kubernetes pod the IPC namespace outlives container
restarts, so the leak grows with every crash.

What each engine leaves behind, and how it is recognised, the engine says (``Engine.leftover_patterns()``;
MindSpore's, measured, in ``ms_shm/engines/mindspore/leftovers.py``). The rules here hold for every engine:

* A SysV object is removed only when its key is ``ftok`` of one of the engine's key files, nobody is
  attached (``nattch == 0``), and the creator, the last attacher and the pipeline's main process are all
  dead. A queue needs its key to match and its last sender, last receiver and main process dead. Message
  queues have no attach count, so the pids are all we have.
* Without the key file (``/tmp`` was wiped, or a restarted container got a fresh one while the pod's IPC
  namespace lived on) the key alone is weak evidence: any program may call ``ftok(path, proj_id)``. Such
  objects are removed only with ``orphan_keys=True``, and only when they look exactly like the engine's
  pair: a segment and a queue under the same key of its shape, every pid dead, nothing attached.
* ``/dev/shm`` files: regular files whose name carries a dead pid (the engines' names, CPython's
  ``pym-<pid>-*`` heap arenas; the torch engine's ``torch_<pid>_*``), and Python's ``sem.mp-*`` semaphores (they carry
  no pid, so they go only when every live process's memory maps could be read and none maps them). Other
  ``sem.*`` names belong to programs that may keep a named semaphore between runs on purpose; they are left
  alone.
* Every file is skipped when a live process has it open or mapped (one scan of ``/proc/*/fd`` and
  ``/proc/*/maps``), when it is not a regular file (symlinks are never followed), or when it belongs to
  another user (root may clean anyone's).

Limits: liveness is judged in this process's PID namespace, and ``/proc/sysvipc`` shows this process's
IPC namespace. A process in another PID namespace that shares our ``/tmp`` or ``/dev/shm`` would look dead,
and the open-file scan cannot see it either (an audit's ``clean --yes`` in a PID namespace of its own that shared
``/dev/shm`` removed a live torch job's batch file, and the job aborted). So in a PID namespace of our own (a
container), everything whose judgement rests on pids is kept, said in a note, unless the caller says the
container's ``/dev/shm`` and SysV IPC are its own (``private_ipc``); where ``/proc`` hides other users' processes
(``hidepid``), Python's semaphores are kept. Run the cleaner where the pipelines ran.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import field, replace
from pathlib import Path
from typing import Callable

from ms_shm import procfs
from ms_shm._results import Result, mib, record

log = logging.getLogger(__name__)

KIND_SHM = "sysv-shm"
KIND_MSG = "sysv-msg"
KIND_IPC_FILE = "ipc-file"
KIND_DEV_SHM = "dev-shm"

_KIND_TEXT = {
    KIND_SHM: "SysV shared memory segment",
    KIND_MSG: "SysV message queue",
    KIND_IPC_FILE: "/tmp/dataset_ipc file",  # MindSpore's ftok key files, named as in the README
    KIND_DEV_SHM: "/dev/shm file",
}

#: /dev/shm names that carry the creating pid and belong to no engine: CPython's heap arenas
#: (``multiprocessing.heap``), and ms_shm's own ``share_lists`` blocks (``SHARE_LISTS_PREFIX``: a kill -9 of
#: the process group takes Python's resource tracker too, and a 12.6 MiB block stayed, measured). PyTorch's
#: ``torch_<pid>_<rand>[_<n>]`` files are the torch engine's.
SHARE_LISTS_PREFIX = "ms_shm_list_"  # ``shared_list``'s blocks: ms_shm_list_<creating pid>_<random>
_UNOWNED_PID_FILES = (
    ("python multiprocessing heap", re.compile(r"^pym-(\d+)-")),
    ("ms_shm share_lists block", re.compile(rf"^{SHARE_LISTS_PREFIX}(\d+)_")),
)
#: Python's ``multiprocessing`` semaphores: ``sem_open("/mp-XXXXXXXX")`` → ``/dev/shm/sem.mp-XXXXXXXX``.
_MP_SEM = re.compile(r"^sem\.mp-[A-Za-z0-9_]+$")

_IPC_RMID = 0
_KEY_FILES_SHOWN = 3  # /tmp/dataset_ipc files listed one per line before the rest are summed up in one
_GONE = "already gone"  # removed by someone else between the scan and our attempt

# Why an unattached segment was kept (``KeptSegment.why``), and how the tally line names each.
KEPT_ORPHAN = "needs-orphan-keys"
KEPT_UNRECOGNISED = "not-recognised"
KEPT_IN_USE = "in-use"
KEPT_OTHER_USER = "other-user"
KEPT_UNSEEN = "unseen-pids"
_KEPT_TALLY = {KEPT_ORPHAN: "need --orphan-keys", KEPT_UNRECOGNISED: "not recognisably MindSpore's",
               KEPT_IN_USE: "of live processes", KEPT_OTHER_USER: "of other users",
               KEPT_UNSEEN: "of pids this PID namespace may not list"}


@record
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


@record
class KeptSegment(Result):
    """A SysV segment nobody has attached that ``clean()`` leaves in place, and why.

    ``ms-shm doctor`` counts every unattached segment as a possible leftover and points at ``ms-shm clean``; a
    clean that silently skipped some (a lone segment under key 0x0000d149 with no queue beside it) left the
    user with a count it never explained. So each one ``clean()`` does not remove is reported with its reason.

    Attributes:
        name: Its id and key, as a leftover's (``"shmid 3 key 0x0000d149"``).
        size_bytes: Memory it holds (resident plus swapped; its size on kernels without those columns).
        creator_pid: The pid that created it (``cpid``).
        why: ``"needs-orphan-keys"`` (MindSpore's pair whose key file is gone: ``--orphan-keys`` removes it),
            ``"not-recognised"`` (no engine's key, or not its segment + queue pair), ``"in-use"`` (a live
            process created or last attached it, or runs its pipeline), ``"other-user"`` (not ours to remove).
        reason: Why it stays and what would remove it, in one line.
    """

    name: str
    size_bytes: int
    creator_pid: int | None
    why: str
    reason: str


@record
class CleanReport(Result):
    """What ``clean()`` found and did.

    Attributes:
        leftovers: Objects that are (or in a dry run would be) removed, with the outcome of each.
        bytes_freed: Bytes really freed; 0 in a dry run, which removes nothing.
        dry_run: True when nothing was removed on purpose.
        notes: What could not be read or was deliberately kept, so a short list is never mistaken for
            "nothing there".
        bytes_to_free: In a dry run, the bytes a run with ``--yes`` would free (0 after a real run).
        kept: A ``KeptSegment`` for every unattached SysV segment not among ``leftovers``: with them, every
            segment ``ms-shm doctor`` counts as unattached is accounted for.
    """

    leftovers: tuple = ()
    bytes_freed: int = 0
    dry_run: bool = True
    notes: tuple = field(default_factory=tuple)
    bytes_to_free: int = 0
    kept: tuple = field(default_factory=tuple)

    @property
    def failed(self) -> tuple:
        """Leftovers whose removal was attempted and failed (one that vanished meanwhile is no failure)."""
        return tuple(item for item in self.leftovers if item.error and item.error != _GONE)

    def lines(self) -> list:
        """Human lines for ``ms-shm clean``: one per object (key files, which every pipeline leaves by the
        hundred, grouped past a few), a total, then the notes."""
        out = []
        verb = "would remove" if self.dry_run else "removed"
        if not self.leftovers:
            out.append("nothing to clean: no leftovers of dead MindSpore/PyTorch runs found"
                       + (" (but see the notes below)" if self.notes else ""))
        key_files = [item for item in self.leftovers if item.kind == KIND_IPC_FILE]
        shown = key_files if len(key_files) <= _KEY_FILES_SHOWN + 1 else key_files[:_KEY_FILES_SHOWN]
        for item in self.leftovers:
            if item.kind != KIND_IPC_FILE or item in shown:
                out.append(self._line(item))
        if len(shown) < len(key_files):
            out.append(self._key_files_summary(key_files[len(shown):]))
        if self.leftovers:
            count = sum(1 for item in self.leftovers if self.dry_run or item.removed)
            total = self.bytes_to_free if self.dry_run else self.bytes_freed
            out.append(f"{verb} {count} object(s), {mib(total)} freed"
                       + (" if run with --yes" if self.dry_run else ""))
        out.extend(self._kept_line(item) for item in self.kept)
        tally = self._unattached_tally()
        if tally:
            out.append(tally)
        out.extend(f"note: {note}" for note in self.notes)
        return out

    @staticmethod
    def _kept_line(item: KeptSegment) -> str:
        pid = f"pid {item.creator_pid}" if item.creator_pid else "no pid"
        return f"kept: {_KIND_TEXT[KIND_SHM]} {item.name} ({mib(item.size_bytes)}, {pid}): {item.reason}"

    def _unattached_tally(self) -> str | None:
        """One line that adds up to ``ms-shm doctor``'s count of unattached segments: how many go, and how many
        stay for which reason (``None`` when there are none)."""
        segments = [item for item in self.leftovers if item.kind == KIND_SHM]
        if not segments and not self.kept:
            return None
        if self.dry_run:
            gone = f"{len(segments)} would be removed"
        else:
            gone = f"{sum(item.removed for item in segments)} removed"
            failed = sum(not item.removed for item in segments)
            gone += f", {failed} not removed (see above)" if failed else ""
        kept = collections.Counter(item.why for item in self.kept)
        parts = [gone] + [f"{kept[why]} kept ({text})" for why, text in _KEPT_TALLY.items() if kept[why]]
        return (f"unattached SysV segments (what `ms-shm doctor` counts): {len(segments) + len(self.kept)}: "
                + ", ".join(parts))

    def _state(self, item: Leftover) -> str:
        if self.dry_run:
            return "would remove"
        if item.removed:
            return "removed"
        return "already gone" if item.error == _GONE else f"FAILED ({item.error})"

    def _line(self, item: Leftover) -> str:
        pid = f"pid {item.owner_pid}" if item.owner_pid else "no pid"
        return (f"{self._state(item)}: {_KIND_TEXT.get(item.kind, item.kind)} {item.name} "
                f"({mib(item.size_bytes)}, {pid}): {item.reason}")

    def _key_files_summary(self, rest: list) -> str:
        """One line for the key files past the first few: how many, per outcome, and of how many dead pids."""
        states = collections.Counter(self._state(item) for item in rest)
        pids = {item.owner_pid for item in rest if item.owner_pid}
        outcome = ", ".join(f"{state}: {n}" for state, n in states.items())
        return (f"... and {len(rest)} more {_KIND_TEXT[KIND_IPC_FILE]}s ({outcome}; "
                f"{mib(sum(item.size_bytes for item in rest))}, {len(pids)} dead pid(s)); --json lists each")

    def __str__(self) -> str:
        return "\n".join(self.lines())


# --------------------------------------------------------------------------------------------- reading


def ftok(st: os.stat_result, proj_id: int = 0) -> int:
    """glibc's ``ftok`` from a ``stat`` result, so keys can be matched without calling into libc."""
    return ((proj_id & 0xFF) << 24) | ((st.st_dev & 0xFF) << 16) | (st.st_ino & 0xFFFF)


def read_sysvipc(path: Path, notes: list) -> list:
    """Rows of a ``/proc/sysvipc`` table (``procfs.read_sysvipc``); an unreadable table is a note and no rows."""
    try:
        return procfs.read_sysvipc(path, notes=notes)
    except OSError as exc:
        notes.append(f"cannot read {path}: {type(exc).__name__}: {exc}")
        return []


def engine_patterns() -> tuple:
    """Every engine's ``leftover_patterns()``: the generic cleaner asks them rather than knowing any framework.

    Importing an engine's patterns never imports its framework, so ``clean`` works where it is not installed.
    """
    from ms_shm import engines

    return tuple(engine.leftover_patterns() for engine in engines.all_engines())


class _Processes:
    """One snapshot of the live processes and of every file they hold open or mapped.

    Taken once per ``clean()``: scanning ``/proc`` per candidate would be slow on a busy host and would
    give inconsistent answers while processes come and go.
    """

    def __init__(self, root: Path, unseen: str | None = None):
        self.root = root
        self.unseen = unseen  # why processes that use this /dev/shm may be missing from our /proc, or None
        self.hidden: str | None = None  # /proc's hidepid= option, where other users' processes are not listed
        self.live: set = set()
        self.held: dict = {}  # path as the process sees it -> one pid that holds it
        self.unreadable_maps = 0
        self.unreadable_fds = 0
        try:
            listed = procfs.pids(root)
        except OSError as exc:
            self.error: str | None = f"cannot list {root / 'proc'}: {type(exc).__name__}: {exc}"
            return
        self.error = None
        # A zombie (killed, not reaped by a launcher that never waits) holds no fds or mappings: it is dead.
        self.live = {pid for pid in listed if not procfs.is_zombie(pid, root)}
        for pid in self.live:
            self._scan_fds(pid)
            self._scan_maps(pid)

    @property
    def unreadable(self) -> int:
        """Processes whose fds or maps could not be read: what they hold is unknown."""
        return max(self.unreadable_maps, self.unreadable_fds)

    def _scan_fds(self, pid: int) -> None:
        try:
            targets = procfs.fd_targets(pid, self.root)
        except FileNotFoundError:
            return  # exited since the listing
        except OSError:
            self.unreadable_fds += 1
            return
        for target in targets:
            self._hold(target, pid)

    def _scan_maps(self, pid: int) -> None:
        try:
            for path in procfs.mapped_paths(pid, self.root):
                self._hold(path, pid)
        except FileNotFoundError:
            return
        except OSError:
            self.unreadable_maps += 1

    def _hold(self, target: str, pid: int) -> None:
        if target.startswith("/"):
            self.held.setdefault(target, pid)

    def alive(self, pid: int | None) -> bool:
        """Whether ``pid`` is running. Zero and None mean "no such pid" (never attached, never sent)."""
        return bool(pid) and pid in self.live

    def holder(self, host_path: str) -> int | None:
        """A live pid that has ``host_path`` open or mapped, or None."""
        return self.held.get(host_path)


@record(frozen=False)
class _Scan:
    """One ``clean()`` pass: where it reads, whose objects it may touch, the engines asked, what it noted."""

    root: Path
    uid: int
    procs: _Processes
    engines: tuple
    notes: list = field(default_factory=list)
    kept: list = field(default_factory=list)  # KeptSegment per unattached segment left in place
    unseen_kept: int = 0  # objects whose pids are not in our /proc, kept as they may be live outside it

    def mine(self, owner_uid: int | None) -> bool:
        """Whether objects of ``owner_uid`` may be touched: our own, or anyone's when we are root."""
        return self.uid == 0 or owner_uid == self.uid

    def host_path(self, path: Path) -> str:
        """The path a process under ``root`` would see, for matching against ``/proc/*/fd`` links."""
        return "/" + str(path.relative_to(self.root)).lstrip("/")

    def table(self, kind: str) -> list:
        return read_sysvipc(procfs.sysvipc_path(self.root, kind), self.notes)

    def key_shape(self, key: int):
        """The engine whose SysV key shape ``key`` has (for objects whose key file is gone), or None."""
        return next((engine for engine in self.engines if engine.sysv_pair and engine.has_key_shape(key)), None)

    def sysv_owners_text(self) -> str:
        """The engines that use SysV keys, as a kept segment's reason names them ("MindSpore")."""
        return " or ".join(engine.label for engine in self.engines if engine.ftok_proj is not None) or "any engine"

    def keep_segment(self, table: _Table, row: dict, why: str, reason: str) -> None:
        """Say why an unattached segment stays (queues and attached segments: ``ms-shm doctor`` counts neither)."""
        if table.kind != KIND_SHM or row.get("nattch", 1) != 0:
            return
        name = f"{table.id_col} {row[table.id_col]} key {_fmt_key(row.get('key', 0))}"
        hint = "" if why in (KEPT_ORPHAN, KEPT_IN_USE) else \
            f"; `ipcrm -m {row[table.id_col]}` removes it once you know it is garbage"
        self.kept.append(KeptSegment(name, _held_bytes(table, row), row.get("cpid") or None, why, reason + hint))


@record(frozen=False)
class _IpcFile:
    """An engine's ftok key file in ``/tmp``: its key names the pipeline's SysV objects."""

    path: Path
    main_pid: int
    st: os.stat_result
    engine: object  # the LeftoverPatterns it matched

    @property
    def key(self) -> int:
        return ftok(self.st, self.engine.ftok_proj)


def _ipc_files(scan: _Scan) -> list:
    tmp = scan.root / "tmp"
    found = []
    try:
        entries = sorted(os.scandir(tmp), key=lambda entry: entry.name)
    except OSError as exc:
        scan.notes.append(f"cannot list {tmp}: {type(exc).__name__}: {exc}")
        return found
    for entry in entries:
        for engine in scan.engines:
            main_pid = engine.ipc_file_pid(entry.name) if engine.ftok_proj is not None else None
            if main_pid is None:
                continue
            st = _regular_file(entry.path, scan.notes)
            if st is not None:
                found.append(_IpcFile(Path(entry.path), main_pid, st, engine))
            break
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


@record(frozen=False)
class _Candidate:
    leftover: Leftover
    undo: Callable[[], None]
    key: int | None = None  # the SysV key, so a failed removal can keep its /tmp file


@record
class _Table:
    """One ``/proc/sysvipc`` table, and the columns that name the processes that used its objects."""

    kind: str
    name: str
    id_col: str
    pid_cols: tuple


_TABLES = (_Table(KIND_SHM, "shm", "shmid", ("cpid", "lpid")),
           _Table(KIND_MSG, "msg", "msqid", ("lspid", "lrpid")))


@record(frozen=False)
class _SysvVerdicts:
    """What the SysV pass decided: leftovers, keys whose files must stay, objects whose key file is gone."""

    chosen: list = field(default_factory=list)
    kept_keys: set = field(default_factory=set)
    maybe: dict = field(default_factory=dict)  # key -> (engine, [(table, row)])
    in_use: int = 0


def _fmt_key(key: int) -> str:
    return f"0x{key & 0xFFFFFFFF:08x}"


def _sysv_candidates(scan: _Scan, files: list, orphan_keys: bool) -> tuple:
    """Decide which segments and queues are leftovers. Returns (candidates, keys kept alive)."""
    by_key: dict = {}
    for item in files:
        by_key.setdefault(item.key, []).append(item)
    verdicts = _SysvVerdicts()
    for table in _TABLES:
        for row in scan.table(table.name):
            _judge_sysv(scan, table, row, by_key.get(row.get("key", 0) & 0xFFFFFFFF), verdicts)
    _judge_orphans(scan, verdicts, orphan_keys)
    if verdicts.in_use:
        log.debug("kept %d SysV object(s) of pipelines used by live processes", verdicts.in_use)
    return verdicts.chosen, verdicts.kept_keys


def _judge_sysv(scan: _Scan, table: _Table, row: dict, owners: list | None, verdicts: _SysvVerdicts) -> None:
    """One segment or queue: a leftover, in use (its key file must stay), a possible orphan, or no engine's.

    ``owners`` are the key files whose ftok is the object's key; without one only an engine's key shape
    can claim it, and then only as an orphan.
    """
    key = row.get("key", 0) & 0xFFFFFFFF
    if table.id_col not in row:
        return
    if key == 0:  # IPC_PRIVATE is never an engine's
        scan.keep_segment(table, row, KEPT_UNRECOGNISED, f"key IPC_PRIVATE (0): not {scan.sysv_owners_text()}'s, "
                                                         "whose keys are ftok of their key files")
        return
    engine = owners[0].engine if owners else scan.key_shape(key)
    if engine is None:
        scan.keep_segment(table, row, KEPT_UNRECOGNISED,
                          f"key {_fmt_key(key)} is no key file's ftok and not of {scan.sysv_owners_text()}'s shape "
                          f"(proj_id 0x{key >> 24:02x}): not recognisably a pipeline's")
        return
    if not scan.mine(row.get("uid")):
        if owners:
            verdicts.kept_keys.add(key)
        scan.keep_segment(table, row, KEPT_OTHER_USER,
                          f"owned by uid {row.get('uid')}: only that user or root may remove it")
        return
    pids = [row.get(col, 0) for col in table.pid_cols] + [item.main_pid for item in owners or ()]
    attached = table.kind == KIND_SHM and row.get("nattch", 1) != 0
    live = [pid for pid in pids if scan.procs.alive(pid)]
    if not (attached or live) and scan.procs.unseen:  # its pids may be live outside: in use, as far as we know
        if owners:
            verdicts.kept_keys.add(key)
        scan.unseen_kept += 1
        scan.keep_segment(table, row, KEPT_UNSEEN, f"its pids are not in this /proc: {scan.procs.unseen}")
        return
    if attached or live:
        if owners:
            verdicts.kept_keys.add(key)
            verdicts.in_use += 1
        if live:
            scan.keep_segment(table, row, KEPT_IN_USE, f"in use: pid {live[0]} (its creator, last attacher or "
                                                       "pipeline) is alive")
        return
    if not owners:
        verdicts.maybe.setdefault(key, (engine, []))[1].append((table, row))
        return
    reason = (f"key {_fmt_key(key)} = ftok({owners[0].path.name}); "
              + ("nothing attached, " if table.kind == KIND_SHM else "")
              + "pids " + ", ".join(str(p) for p in sorted(set(pids)) if p) + " dead")
    verdicts.chosen.append(_sysv_leftover(scan, table, row, key, owners[0].main_pid, reason))


def _judge_orphans(scan: _Scan, verdicts: _SysvVerdicts, orphan_keys: bool) -> None:
    """Objects of an engine's key shape whose key file is gone: weak evidence, so they go only as the engine's
    whole segment + queue pair, and only when the caller asked (otherwise a note names their keys)."""
    orphans = [(key, engine, objs) for key, (engine, objs) in verdicts.maybe.items()
               if {table.kind for table, _ in objs} == {KIND_SHM, KIND_MSG}]
    for key, (engine, objs) in verdicts.maybe.items():
        if {table.kind for table, _ in objs} != {KIND_SHM, KIND_MSG}:
            for table, row in objs:
                scan.keep_segment(table, row, KEPT_UNRECOGNISED, (
                    f"key {_fmt_key(key)} has {engine.label}'s shape, but no {engine.ipc_file_text} and no message "
                    f"queue under it ({engine.label}'s map/batch workers leave a segment and a queue per key): "
                    f"not recognisably {engine.label}'s"))
    if not orphan_keys:
        scan.notes.extend(_orphan_notes(orphans))
        for key, engine, objs in orphans:
            for table, row in objs:
                scan.keep_segment(table, row, KEPT_ORPHAN, (
                    f"key {_fmt_key(key)} has {engine.label}'s shape (segment + queue, proj_id {engine.ftok_proj}), "
                    f"all pids dead, but its {engine.ipc_file_text} is gone, so the key alone is weak evidence: "
                    "`ms-shm clean --orphan-keys` removes it"))
        return
    for key, engine, objs in orphans:
        reason = (f"key {_fmt_key(key)} has {engine.label}'s shape (segment + queue, proj_id {engine.ftok_proj}), "
                  f"all pids dead, nothing attached; its {engine.ipc_file_text} is gone")
        for table, row in objs:
            pid = row.get("cpid") or row.get("lspid") or None
            verdicts.chosen.append(_sysv_leftover(scan, table, row, key, pid, reason))


def _orphan_notes(orphans: list) -> list:
    """One note per engine whose orphaned pairs were kept, naming their keys and how to remove them."""
    by_engine: dict = {}
    for key, engine, objs in orphans:
        by_engine.setdefault(engine, []).append((key, objs))
    return [f"kept {sum(len(objs) for _, objs in pairs)} SysV object(s) that look like {engine.label}'s "
            f"(segment and queue under one ftok key, proj_id {engine.ftok_proj}, all pids dead, nothing "
            f"attached) but whose {engine.ipc_file_text} is gone: keys "
            + ", ".join(_fmt_key(key) for key, _ in pairs)
            + "; pass orphan_keys=True (ms-shm clean --orphan-keys) to remove them"
            for engine, pairs in by_engine.items()]


def _held_bytes(table: _Table, row: dict) -> int:
    """Memory that comes back when a SysV object goes: a queue's queued bytes, a segment's resident and swapped
    bytes (kernels since 4.x; its nominal size before, or a 16 MiB segment touched for 12 MiB reads 16)."""
    if table.kind != KIND_SHM:
        return int(row.get("cbytes", 0))
    if "rss" in row:
        return int(row["rss"] + row.get("swap", 0))
    return int(row.get("size", 0))


def _sysv_leftover(scan: _Scan, table: _Table, row: dict, key: int, pid: int | None, reason: str) -> _Candidate:
    ipc_id = row[table.id_col]
    size = _held_bytes(table, row)
    path = procfs.sysvipc_path(scan.root, table.name)
    root = scan.root

    def undo() -> None:
        # Ids are recycled: make sure the id still names the object we judged, still unattached.
        current = {r.get(table.id_col): r for r in read_sysvipc(path, [])}.get(ipc_id)
        if current is None:
            raise FileNotFoundError(errno.ENOENT, "already gone")
        if current.get("key") != row.get("key") or current.get("cpid") != row.get("cpid") \
                or current.get("nattch", 0) != 0:
            raise OSError(errno.ESTALE, "changed since it was examined; left alone")
        _rmid(table.kind, ipc_id, root)

    name = f"{table.id_col} {ipc_id} key {_fmt_key(key)}"
    return _Candidate(Leftover(table.kind, name, int(size), pid, reason), undo, key)


def _file_candidates(scan: _Scan, files: list, kept_keys: set, started: float) -> list:
    """Key files of dead pipelines, then ``/dev/shm`` files of dead processes (``_still_left``)."""
    return _ipc_file_candidates(scan, files, kept_keys) + _still_left(scan, _dev_shm_candidates(scan), started)


def _ipc_file_candidates(scan: _Scan, files: list, kept_keys: set) -> list:
    chosen = []
    for item in files:
        if scan.procs.alive(item.main_pid) or not scan.mine(item.st.st_uid):
            continue
        if scan.procs.unseen:
            scan.unseen_kept += 1
            continue
        if item.key in kept_keys:
            continue  # its key still names an object in use or kept: removing the file loses the match
        if scan.procs.holder(scan.host_path(item.path)):
            continue
        reason = f"pid {item.main_pid} is dead; {item.engine.label} never deletes this ftok key file"
        chosen.append(_Candidate(Leftover(KIND_IPC_FILE, str(item.path), item.st.st_blocks * 512,
                                          item.main_pid, reason),
                                 _file_undo(item.path, item.st)))
    return chosen


_SEM_UNKNOWN = object()  # a semaphore kept because some processes' maps could not be read


# A /dev/shm file written this recently may be a running job's in flight: torch's file_system strategy makes
# one per batch in a worker (forked after the process listing, or mapped by the main process after its maps were
# read), so a snapshot taken first saw its pid dead and no holder; an audit's ``ms-shm clean --yes`` beside a
# live torch job unlinked its batches and killed it, 4 runs of 4 ("could not unlink the shared memory file").
YOUNG_SECONDS = 10.0


def _still_left(scan: _Scan, candidates: list, started: float) -> list:
    """The ``/dev/shm`` candidates that are leftovers at a second look, taken after they were listed: not
    written since ``YOUNG_SECONDS`` before the first snapshot began, their pid still dead and no process
    holding them now."""
    if not candidates:
        return []
    again = _Processes(scan.root)
    if again.error:
        scan.notes.append(f"kept {len(candidates)} /dev/shm file(s): {again.error} at the second look")
        return []
    kept_young, out = 0, []
    for candidate in candidates:
        path = Path(candidate.leftover.name)
        try:
            written = path.stat().st_mtime
        except OSError:
            continue  # gone since: its owner took it back
        if written > started - YOUNG_SECONDS:
            kept_young += 1
        elif not (again.alive(candidate.leftover.owner_pid) or again.holder(scan.host_path(path))):
            out.append(candidate)
    if kept_young:
        scan.notes.append(f"kept {kept_young} /dev/shm file(s) written in the last {YOUNG_SECONDS:.0f} s: a running "
                          f"job may be handing them over (run again later to remove a dead run's)")
    return out


def _dev_shm_candidates(scan: _Scan) -> list:
    shm_dir = scan.root / "dev" / "shm"
    try:
        entries = sorted(os.scandir(shm_dir), key=lambda entry: entry.name)
    except OSError as exc:
        scan.notes.append(f"cannot list {shm_dir}: {type(exc).__name__}: {exc}")
        return []
    chosen = []
    skipped_sems = 0
    for entry in entries:
        verdict = _dev_shm_candidate(scan, entry)
        if verdict is _SEM_UNKNOWN:
            skipped_sems += 1
        elif verdict is not None:
            chosen.append(verdict)
    if skipped_sems:
        unknown = (f"/proc is mounted with {scan.procs.hidden}, which hides other users' processes"
                   if scan.procs.hidden else f"the memory maps or fds of {scan.procs.unreadable} process(es) could "
                                             f"not be read")
        scan.notes.append(f"kept {skipped_sems} sem.mp-* semaphore(s): {unknown}, so whether one is in use is "
                          f"unknown")
    return chosen


def _dev_shm_candidate(scan: _Scan, entry: os.DirEntry):
    """A ``_Candidate`` for one ``/dev/shm`` entry, ``None`` to keep it, or ``_SEM_UNKNOWN``.

    A pid-named file rests on its pid; a semaphore carries none, so it rests on every process's maps having
    been read. Neither rests on anything where processes using this ``/dev/shm`` may be missing from our
    ``/proc`` (``_Processes.unseen``): an audit's ``clean --yes`` in a PID namespace of its own, sharing
    ``/dev/shm``, took a live torch job's batch file for a dead pid's, and the job aborted.
    """
    origin, pid = _classify(entry.name, scan.engines)
    if origin is None:
        return None
    st = _regular_file(entry.path, scan.notes)
    if st is None or not scan.mine(st.st_uid) or (pid is not None and scan.procs.alive(pid)):
        return None
    if scan.procs.unseen:
        scan.unseen_kept += 1
        return None
    if pid is None and (scan.procs.unreadable or scan.procs.hidden):  # a semaphore another user's process maps
        return _SEM_UNKNOWN
    path = Path(entry.path)
    if scan.procs.holder(scan.host_path(path)):
        return None
    if pid is None:
        reason = "python multiprocessing semaphore that no live process has open or mapped"
    else:
        reason = f"{origin} file of dead pid {pid}, not open or mapped by any live process"
    return _Candidate(Leftover(KIND_DEV_SHM, str(path), st.st_blocks * 512, pid, reason), _file_undo(path, st))


def _classify(name: str, engines: tuple) -> tuple:
    """``(origin, pid)`` of a ``/dev/shm`` name: an engine's, an unowned pid-named one, a semaphore (no pid)."""
    for engine in engines:
        owner = engine.dev_shm_owner(name)
        if owner:
            return owner
    for origin, pattern in _UNOWNED_PID_FILES:
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
          orphan_keys: bool = False, private_ipc: bool = False) -> CleanReport:
    """Find, and unless ``dry_run`` remove, what crashed MindSpore/PyTorch pipelines left behind.

    Safe to call at start-up from local rank 0 before the other ranks start (``tune(clean=True)``): a
    pipeline that is running has a live pid or an attached segment, and those are never touched.

    Args:
        dry_run: Only report. The default, because removal cannot be undone.
        root: Filesystem root to read ``proc``, ``tmp`` and ``dev/shm`` under; tests pass a fake tree.
            SysV objects are only removed when this is ``/``.
        uid: Whose objects to consider; defaults to the effective uid. 0 (root) considers everyone's.
        orphan_keys: Also remove SysV segment+queue pairs with an engine's key shape (MindSpore's) whose
            key file (``/tmp/dataset_ipc_*``) is gone (see the module docstring for why this is opt-in).
        private_ipc: In a PID namespace of its own (a container), whatever rests on pids is kept unless the
            caller says this container's ``/dev/shm`` and SysV IPC are its own: processes outside it are not in
            its ``/proc``.

    Returns:
        A ``CleanReport``; ``report.lines()`` is the text ``ms-shm clean`` prints. Nothing here raises
        for an unreadable or vanished object: it becomes a note or a leftover's ``error``.

    Examples:
        >>> report = clean()                      # what would go
        >>> report = clean(dry_run=False)         # remove it
    """
    root = Path(root)
    started = time.time()
    uid = os.geteuid() if uid is None else uid
    procs = _Processes(root, None if private_ipc else _unseen_processes(root))
    if uid != 0 and procs.error is None:
        procs.hidden = procfs.hidden_pids_mount(root)
    if procs.error:
        return CleanReport((), 0, dry_run, (procs.error + "; cannot tell live processes from dead ones, "
                                            "nothing was considered",))
    scan = _Scan(root, uid, procs, engine_patterns())
    if procs.unreadable:
        scan.notes.append(f"could not read the fds or maps of {procs.unreadable} "
                          "process(es): files they hold open or mapped cannot be seen")
    files = _ipc_files(scan)
    chosen, kept_keys = _sysv_candidates(scan, files, orphan_keys)
    sysv, sysv_freed, failed_keys = _settle(chosen, dry_run)
    # A SysV object that could not be removed keeps its key file, or the next run cannot match it any more.
    others, files_freed, _ = _settle(_file_candidates(scan, files, kept_keys | failed_keys, started), dry_run)
    if scan.unseen_kept:
        scan.notes.append(f"kept {scan.unseen_kept} object(s) whose processes are not in this /proc: "
                          f"{procs.unseen}, so a live job may hold them. Run `ms-shm clean` where every process "
                          f"using this IPC is visible (on the host, or in a container started with --pid=host); or, "
                          f"where this container's /dev/shm and SysV IPC are its own (Docker's default --ipc, not "
                          f"host, another container's or a pod's), `ms-shm clean --private-ipc`")
    freed = sysv_freed + files_freed
    return CleanReport(tuple(sysv + others), 0 if dry_run else freed, dry_run, tuple(scan.notes),
                       bytes_to_free=freed if dry_run else 0, kept=tuple(scan.kept))


def _unseen_processes(root: Path) -> str | None:
    """Why processes using this ``/dev/shm`` may be missing from our ``/proc``, or ``None``: a PID namespace of
    our own (a container's processes see none outside it, yet ``--ipc=host`` or a pod's shared volume share
    ``/dev/shm``)."""
    if procfs.own_pid_namespace(root):
        return "this process runs in a PID namespace of its own (a container), where processes outside it that " \
               "share /dev/shm are not listed"
    return None


def _settle(candidates: list, dry_run: bool) -> tuple:
    """Report (dry run) or remove each candidate. Returns (leftovers, bytes freed (a dry run: bytes it would
    free), keys of failed removals)."""
    leftovers, freed, failed_keys = [], 0, set()
    for candidate in candidates:
        outcome = candidate.leftover if dry_run else _attempt(candidate)
        leftovers.append(outcome)
        if dry_run or outcome.removed:
            freed += outcome.size_bytes
        elif candidate.key is not None and outcome.error != _GONE:
            failed_keys.add(candidate.key)
    return leftovers, freed, failed_keys


def _attempt(candidate: _Candidate) -> Leftover:
    item = candidate.leftover
    try:
        candidate.undo()
    except FileNotFoundError:
        log.info("%s %s was already gone", item.kind, item.name)
        return replace(item, removed=False, error=_GONE)
    except OSError as exc:
        log.warning("could not remove %s %s: %s", item.kind, item.name, exc)
        return replace(item, removed=False, error=f"{type(exc).__name__}: {exc}")
    log.info("removed %s %s (%s, %s)", item.kind, item.name, mib(item.size_bytes), item.reason)
    return replace(item, removed=True)


def __getattr__(name: str):
    """``MINDSPORE_FTOK_PROJ``, kept for old imports, now asked of the MindSpore engine."""
    if name == "MINDSPORE_FTOK_PROJ":
        from ms_shm import engines

        return engines.get("mindspore").leftover_patterns().ftok_proj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["clean", "CleanReport", "Leftover", "KeptSegment", "ftok", "engine_patterns"]
