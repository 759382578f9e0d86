"""Every ``/proc`` and ``statvfs`` fact more than one module needs, read in one place and one way.

Why one module: ``doctor``, ``watch``, ``clean``, the guard and ``SharedList`` each used to parse
``/proc/sysvipc/shm`` or count ``statvfs`` blocks themselves, and the copies drifted (one counted free blocks
as root sees them, another as a user does). Here each fact has one reader, and the callers only decide what
an unreadable fact means to them.

Readers take ``root`` (default ``/``) so tests point them at fake trees under ``tmp_path``, the way psutil's
``PROCFS_PATH`` works. They raise ``OSError`` when the fact cannot be read; the caller turns it into a note.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

SYSVIPC_KINDS = ("shm", "msg", "sem")
_DELETED = " (deleted)"


class Space(NamedTuple):
    """Sizes of one mounted filesystem, in bytes.

    Attributes:
        total: Its size.
        free: What an unprivileged process may still write (``f_bavail``): a MindSpore worker is one, and
            tmpfs reserves nothing for root, so this is the room that decides SIGBUS.
        used: What is written, by anyone (``f_blocks - f_bfree``): what fills the mount.
        out_of_files: No file can be created for want of inodes (a tmpfs's ``nr_inodes``), though bytes may be
            free: a write then fails with "No space left on device" too. A mount without an inode limit reports
            none at all (``f_files == 0``), which is not out of them.
    """

    total: int
    free: int
    used: int
    out_of_files: bool = False


def statvfs(path: str | os.PathLike) -> Space:
    """Total, free and used bytes of the filesystem holding ``path`` (raises ``OSError``).

    Files in ``/dev/shm`` that MindSpore unlinks at once still count here, which ``du`` would miss.
    """
    st = os.statvfs(path)
    return Space(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize,
                 st.f_files > 0 and st.f_favail == 0)


# ------------------------------------------------------------------------------------------------ SysV IPC


def sysvipc_path(root: str | os.PathLike = "/", kind: str = "shm") -> Path:
    """``<root>/proc/sysvipc/<kind>``: the table of this IPC namespace's segments, queues or semaphores."""
    if kind not in SYSVIPC_KINDS:
        raise ValueError(f"kind must be one of {SYSVIPC_KINDS}, got {kind!r}")
    return Path(root) / "proc" / "sysvipc" / kind


def read_sysvipc(source: str | os.PathLike = "/", kind: str | None = None, notes: list | None = None) -> list:
    """Rows of a ``/proc/sysvipc`` table as dicts keyed by its own header, so column order never matters.

    The kernel added columns over the years (``rss`` and ``swap`` in 4.x), and tools that read cells by
    position read the wrong one on another kernel; by name, a missing column is simply absent from the dict.

    Args:
        source: The table's path, or with ``kind`` the filesystem root it lies under.
        kind: ``"shm"``, ``"msg"`` or ``"sem"``; ``None`` when ``source`` is the table itself.
        notes: Gets one line per row that is not all numbers (the row is skipped).

    Raises:
        OSError: The table cannot be read (no ``/proc``, another IPC namespace's view denied).
    """
    path = sysvipc_path(source, kind) if kind is not None else Path(source)
    lines = path.read_text(errors="replace").splitlines()
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
            if notes is not None:
                notes.append(f"{path}: line {number} is not numeric, skipped")
    return rows


def segment_totals(rows: list) -> tuple:
    """(segments, bytes) of ``/proc/sysvipc/shm`` rows: their count and the sum of their nominal sizes."""
    return len(rows), sum(row.get("size", 0) for row in rows)


def detached_totals(rows: list) -> tuple:
    """(segments, bytes) of the rows no process has attached. A running MindSpore map or batch pool keeps its
    segments attached (nattch 2 for 2 workers, measured on 2.10 mid-epoch and between epochs); one whose whole
    process group was SIGKILLed leaves them at 0."""
    return segment_totals([row for row in rows if row.get("nattch", 1) == 0])


# ------------------------------------------------------------------------------------------------ processes


def _proc(root: str | os.PathLike, *parts: object) -> Path:
    return Path(root, "proc", *(str(part) for part in parts))


def pids(root: str | os.PathLike = "/") -> list:
    """Pids listed in ``<root>/proc`` (raises ``OSError`` when it cannot be listed)."""
    return [int(name) for name in os.listdir(_proc(root)) if name.isdigit()]


PROC_PID_INIT_INO = 0xEFFFFFFC  # the inode of the host's (initial) PID namespace, fixed by the kernel


def own_pid_namespace(root: str | os.PathLike = "/") -> bool:
    """Whether this process runs in a PID namespace of its own (a container, a pod, ``unshare -p``), where the
    processes of the host and of other containers are not in its ``/proc``. Unreadable (a fake tree): no."""
    try:
        return os.stat(_proc(root, "self", "ns", "pid")).st_ino != PROC_PID_INIT_INO
    except OSError:
        return False


def hidden_pids_mount(root: str | os.PathLike = "/") -> str | None:
    """The ``hidepid=`` option ``/proc`` is mounted with where it hides other users' processes, else ``None``."""
    try:
        text = _proc(root, "self", "mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/proc" and " - proc " in line:
            for option in line.split(" - ", 1)[1].split()[-1].split(","):
                if option.startswith("hidepid=") and option not in ("hidepid=0", "hidepid=off"):
                    return option
    return None


def is_zombie(pid: int | str, root: str | os.PathLike = "/") -> bool:
    """Whether ``pid`` is a zombie (``Z``) or dead (``X``) process that its parent has not reaped yet.

    Such a process holds no fds or mappings any more. Unreadable means "no": the safe answer for a caller
    that would otherwise treat the process as gone.
    """
    fields = _stat_fields(pid, root)
    return bool(fields) and fields[0] in ("Z", "X")


def _stat_fields(pid: int | str, root: str | os.PathLike) -> list:
    """``/proc/<pid>/stat``'s fields from the 3rd (the state) on; ``[]`` where it cannot be read."""
    try:
        text = _proc(root, pid, "stat").read_text(errors="replace")
    except OSError:
        return []
    return text.rpartition(")")[2].split()  # the command name may itself hold ") "


def exit_status(pid: int | str, root: str | os.PathLike = "/", parent: int | None = None) -> int | None:
    """How ``pid`` ended, in ``waitpid``'s form, while it is a zombie its parent has not reaped (``stat``'s
    ``exit_code`` field, Linux 3.5+); ``None`` while it lives, once reaped, or unread. Read without reaping:
    reaping would take the status from the code that owns the process (MindSpore joins its own workers).
    ``parent``: only a zombie child of that pid counts (a reaped pid may come back as another process's)."""
    fields = _stat_fields(pid, root)  # exit_code, the 52nd field, is the 50th of these; the parent the 2nd
    if len(fields) < 50 or fields[0] not in ("Z", "X") or not fields[49].lstrip("-").isdigit():
        return None
    if parent is not None and fields[1] != str(parent):
        return None
    return int(fields[49])


def cmdline(pid: int | str, root: str | os.PathLike = "/") -> bytes | None:
    """``pid``'s command line as the kernel holds it (NUL-separated), or ``None`` once it exited or is unreadable."""
    try:
        return _proc(root, pid, "cmdline").read_bytes()
    except OSError:
        return None


def parent_of(pid: int | str, root: str | os.PathLike = "/") -> int | None:
    """``pid``'s parent pid (``stat``'s 4th field), or ``None`` where unread."""
    fields = _stat_fields(pid, root)
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def death_signal(pid: int | str, root: str | os.PathLike = "/") -> int | None:
    """The signal that ended ``pid``, an unreaped zombie (``exit_status``); ``None`` while it lives, when it
    exited by itself, or unread."""
    status = exit_status(pid, root)
    if status is None:
        return None
    return (status & 0x7F) or None


def start_ticks(pid: int | str, root: str | os.PathLike = "/") -> int | None:
    """When ``pid`` started, in clock ticks after boot (``stat``'s 22nd field): with the pid, it names one process
    (a pid alone may be reused); ``None`` where unread."""
    fields = _stat_fields(pid, root)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def process_cpu_ticks(pid: int | str, root: str | os.PathLike = "/") -> int | None:
    """User plus system CPU time ``pid`` has used, in clock ticks (``stat``'s 14th and 15th fields); ``None``
    where unread. A process whose threads all wait on a lock uses none."""
    fields = _stat_fields(pid, root)
    if len(fields) < 13 or not (fields[11].isdigit() and fields[12].isdigit()):
        return None
    return int(fields[11]) + int(fields[12])


def private_bytes(pid: int | str = "self", root: str | os.PathLike = "/") -> int | None:
    """Memory only this process holds (``Private_Dirty`` of ``smaps_rollup``): in a forked child, the pages it
    copied on write plus what it allocated, which is what the memory cgroup is charged for it. ``None`` when
    the kernel does not say (no ``smaps_rollup`` before Linux 4.14)."""
    try:
        text = _proc(root, pid, "smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024
    return None


def thread_names(pid: int | str = "self", root: str | os.PathLike = "/") -> set | None:
    """The names (``comm``) of the process's threads, or ``None`` where ``/proc`` does not say."""
    try:
        tasks = os.listdir(_proc(root, pid, "task"))
    except OSError:
        return None
    names = set()
    for tid in tasks:
        try:
            names.add(_proc(root, pid, "task", tid, "comm").read_text().strip())
        except OSError:  # ended since the listing
            continue
    return names


def thread_count(pid: int | str = "self", root: str | os.PathLike = "/") -> int | None:
    """The process's threads (its ``task`` entries), or ``None`` where ``/proc`` does not say."""
    try:
        return len(os.listdir(_proc(root, pid, "task")))
    except OSError:
        return None


def cpu_ticks(root: str | os.PathLike = "/") -> tuple | None:
    """``(idle ticks, all ticks, CPUs)`` of the machine from ``/proc/stat`` (idle and iowait count as idle), or
    ``None`` when unreadable. Not namespaced: other containers' work on the same machine shows, which is the
    point for a caller asking how many CPUs are really free."""
    try:
        lines = _proc(root, "stat").read_text().splitlines()
    except OSError:
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    first = lines[0].split() if lines else []
    if not first or first[0] != "cpu" or len(first) < 6 or not cpus:
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return ticks[3] + ticks[4], sum(ticks), cpus


def idle_cpus(before: tuple | None, after: tuple | None, min_ticks: int = 8) -> float | None:
    """How many CPUs stood idle on average between two ``cpu_ticks`` readings; ``None`` when either is missing
    or fewer than ``min_ticks`` ticks (1/100 s each, summed over CPUs) passed: too coarse to say."""
    if before is None or after is None:
        return None
    idle, total = after[0] - before[0], after[1] - before[1]
    if total < min_ticks or idle < 0:
        return None
    return after[2] * idle / total


def open_fd_count(pid: int | str = "self", root: str | os.PathLike = "/") -> int:
    """How many fds ``pid`` holds (raises ``OSError``).

    Listing one's own ``/proc/self/fd`` opens one more fd for the listing, which shows up in it; that one
    is not counted, so the answer is what the process held before it asked.
    """
    fd_dir = _proc(root, pid, "fd")
    count = len(os.listdir(fd_dir))
    own = str(pid) in ("self", "thread-self", str(os.getpid()))
    return count - 1 if own and count and Path(root).resolve() == Path("/") else count


def nofile_limits(pid: int | str, root: str | os.PathLike = "/") -> tuple:
    """``pid``'s open-files ``(soft, hard)`` limits from ``/proc/<pid>/limits`` (``None`` for unlimited;
    raises ``OSError``, ``ValueError`` where it cannot be read)."""
    for line in _proc(root, pid, "limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line[len("Max open files"):].split()[:2]
            return tuple(None if v == "unlimited" else int(v) for v in (soft, hard))
    raise ValueError(f"no 'Max open files' line in /proc/{pid}/limits")


def fd_targets(pid: int | str, root: str | os.PathLike = "/") -> list:
    """Where each of ``pid``'s fds points, as the process sees it (raises ``OSError`` if the fd directory
    cannot be listed; ``FileNotFoundError`` once the process exited). Fds closed meanwhile are skipped."""
    fd_dir = _proc(root, pid, "fd")
    targets = []
    for fd in os.listdir(fd_dir):
        try:
            targets.append(_undeleted(os.readlink(fd_dir / fd)))
        except OSError:
            continue  # closed since the listing
    return targets


def shared_writable_ranges(pid: int | str = "self", root: str | os.PathLike = "/") -> list:
    """``(start, end)`` of each mapping of ``pid`` that is writable and shared with other processes (``rw-s`` in
    ``/proc/<pid>/maps``: shared memory, ``MAP_SHARED`` files); empty where it cannot be read."""
    ranges = []
    try:
        for parts in _mappings(pid, root):
            if parts[1][1] == "w" and parts[1][3] == "s":
                start, end = parts[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    except (OSError, ValueError, IndexError):
        return []
    return ranges


def mapped_paths(pid: int | str, root: str | os.PathLike = "/") -> Iterator[str]:
    """Paths of the files ``pid`` has mapped, one per mapping, read lazily from ``/proc/<pid>/maps``.

    Raises ``OSError`` (``FileNotFoundError`` once the process exited) while iterating; paths yielded before
    the error stay valid.
    """
    for parts in _file_mappings(pid, root):
        yield _undeleted(parts[5].rstrip("\n"))


def mapped_files(pid: int | str, root: str | os.PathLike = "/") -> Iterator[tuple]:
    """``(path, (device, inode), bytes mapped)`` per file mapping of ``pid``: the inode names a file its path no
    longer does (multiprocessing's heap unlinks its file once mapped). Raises as ``mapped_paths``."""
    for parts in _file_mappings(pid, root):
        start, end = (int(x, 16) for x in parts[0].split("-"))
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        yield _undeleted(parts[5].rstrip("\n")), (os.makedev(major, minor), int(parts[4])), end - start


def _file_mappings(pid: int | str, root: str | os.PathLike) -> Iterator[list]:
    """The fields of each line of ``/proc/<pid>/maps`` that maps a file (six fields: the last is its path)."""
    return (parts for parts in _mappings(pid, root) if len(parts) == 6)


def _mappings(pid: int | str, root: str | os.PathLike) -> Iterator[list]:
    """The fields of each line of ``/proc/<pid>/maps``: range, permissions, offset, device, inode[, path]."""
    with open(_proc(root, pid, "maps"), encoding="utf-8", errors="replace") as handle:
        for line in handle:
            yield line.split(None, 5)


def _undeleted(target: str) -> str:
    """The path without the kernel's `` (deleted)`` suffix: an unlinked file still holds its memory."""
    return target[: -len(_DELETED)] if target.endswith(_DELETED) else target


def children_files_exist(root: str | os.PathLike = "/") -> bool:
    """Whether ``/proc/<pid>/task/<tid>/children`` exists (kernels built with CONFIG_PROC_CHILDREN)."""
    pid = os.getpid()
    return _proc(root, pid, "task", pid, "children").exists()


def descendants(pid: int, root: str | os.PathLike = "/") -> list:
    """All descendants of ``pid``, read from the per-thread children lists.

    Cheaper than ``psutil.Process.children(recursive=True)``, which reads every process's ``stat`` on the
    host (measured 1 ms against 0.14 ms with ~75 processes; hosts with thousands cost far more).
    Children can hang off any thread, so each task's list is read. Processes that exit meanwhile are skipped.
    """
    found = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(_proc(root, parent, "task"))
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(text) for text in _proc(root, parent, "task", tid, "children").read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            stack.extend(kids)
    return found


__all__ = ["Space", "statvfs", "sysvipc_path", "read_sysvipc", "segment_totals", "pids", "is_zombie",
           "exit_status", "parent_of", "death_signal", "process_cpu_ticks", "cpu_ticks", "idle_cpus",
           "open_fd_count", "fd_targets", "mapped_paths", "children_files_exist", "descendants"]
