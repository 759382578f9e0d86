"""Other ranks of this job on this host, looked for when ``/dev/shm`` filled up after planning.

Ranks started without launcher variables each plan as if alone, and the first to outgrow its share meets a full
``/dev/shm``. The error said "where more ranks run here, tell each how many" whatever the cause; an audit's user
had to guess. Here the guess is replaced by a reading: processes running this very command line outside this
process's tree (a launcher starts every rank with the same one), and the ``/dev/shm`` they and their workers hold.
Read only on the error path: it scans every process's command line.
"""

from __future__ import annotations

import os
from pathlib import Path

from ms_shm import procfs
from ms_shm._results import Result, record

_SPAWNED = b"--multiprocessing-fork"  # a spawn/forkserver worker's own command line, not its program's


@record
class Siblings(Result):
    """Processes running this program's command line outside this process's tree.

    Attributes:
        pids: the top process of each (its workers, forked with the same command line, are counted with it).
        shm_bytes: bytes of ``/dev/shm`` they and their workers hold open or mapped (allocated blocks).
    """

    pids: tuple
    shm_bytes: int


def find(shm_path: str | os.PathLike = "/dev/shm", root: str | os.PathLike = "/",
         me: int | None = None) -> Siblings | None:
    """The other copies of this program running here, or ``None`` where ``/proc`` cannot be read."""
    try:
        top, command = _program_top(me or os.getpid(), root)
        if command is None:
            return None
        ours = {top, *procfs.descendants(top, root)}
        others = [pid for pid in procfs.pids(root) if pid not in ours and _is_top_of(pid, command, root)]
    except OSError:
        return None
    return Siblings(tuple(sorted(others)), _held_bytes(others, str(shm_path), root))


def _program_top(pid: int, root: str | os.PathLike) -> tuple:
    """The highest ancestor of ``pid`` (itself included) running its program's command line, and that line: a
    forked worker shares its main process's line; a spawned one's names multiprocessing, so its parent's counts."""
    command = procfs.cmdline(pid, root)
    if command is not None and _SPAWNED in command:
        pid = procfs.parent_of(pid, root) or pid
        command = procfs.cmdline(pid, root)
    parent = procfs.parent_of(pid, root)
    while parent and parent != pid and procfs.cmdline(parent, root) == command:
        pid, parent = parent, procfs.parent_of(parent, root)
    return pid, command


def _is_top_of(pid: int, command: bytes, root: str | os.PathLike) -> bool:
    """Whether ``pid`` runs ``command`` and its parent does not (a sibling's forked workers are not ranks)."""
    if procfs.cmdline(pid, root) != command or procfs.is_zombie(pid, root):
        return False
    parent = procfs.parent_of(pid, root)
    return not parent or procfs.cmdline(parent, root) != command


def _held_bytes(tops: list, shm_path: str, root: str | os.PathLike) -> int:
    """Bytes of the files under ``shm_path`` that ``tops`` or their descendants hold open or mapped. Counted by
    inode, deleted ones too: multiprocessing's heap (MindSpore's slots) unlinks its file right after mapping it."""
    prefix = shm_path.rstrip("/") + "/"
    sizes: dict = {}
    for top in tops:
        for pid in (top, *procfs.descendants(top, root)):
            for inode, size in (*_open_files(pid, prefix, root), *_mapped_files(pid, prefix, root)):
                sizes[inode] = max(sizes.get(inode, 0), size)
    return sum(sizes.values())


def _open_files(pid: int, prefix: str, root: str | os.PathLike) -> list:
    """(inode, allocated bytes) of ``pid``'s fds under ``prefix``, read through the fd: it outlives the name."""
    fd_dir = Path(root, "proc", str(pid), "fd")
    found = []
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return found  # exited, or not ours to read: what it holds stays uncounted
    for fd in fds:
        try:
            if os.readlink(fd_dir / fd).startswith(prefix):
                st = os.stat(fd_dir / fd)
                found.append(((st.st_dev, st.st_ino), st.st_blocks * 512))
        except OSError:
            continue
    return found


def _mapped_files(pid: int, prefix: str, root: str | os.PathLike) -> list:
    """(inode, mapped bytes) of ``pid``'s mappings of files under ``prefix``."""
    try:
        return [(inode, size) for path, inode, size in procfs.mapped_files(pid, root) if path.startswith(prefix)]
    except (OSError, ValueError):
        return []
