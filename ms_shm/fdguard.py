"""Keep a forked probe child from taking what its parent reads through inherited file descriptors.

A forked child shares each open file description with its parent, offset included: a probe that reads a file
the dataset opened earlier (an attribute, a closure, a module global, ``sys.stdin``) moves the parent's
position, and a pipe read there is gone for the parent (measured: an ``IterableDataset`` over a file opened in
``__init__``, torch 2.13: 140 of 2000 samples arrived). Which objects hold a file cannot be told statically in
general, so the guard works on the child's descriptors, whoever holds them:

- a seekable descriptor open for reading: its offset is recorded before the probe reads and, where the child
  moved it, set back after (the offset is the parent's too, so this restores the parent's position; the parent's
  own buffers are its own memory, untouched), through a duplicate taken before, which shares the offset: a probe
  that reads a file to its end and closes it (PIL's ``Image.open`` then ``load()``, a lazy loader) left the
  parent's position at the end, and its reads found nothing (an audit: "image file is truncated" where raw ran,
  and a source's rows silently read from 4 KiB of a 75 KiB file, even with MindSpore's mode passed explicitly);
- a pipe or terminal open for reading cannot be rewound: it is replaced in the child by ``/dev/null`` before
  the probe reads, so the child reads end-of-file there and the parent keeps every byte (a probe that needed
  those bytes finds no sample, and the caller keeps the framework's defaults);
- write-only descriptors (the child's report pipe, logs) and sockets are left alone: a socket's request and
  reply are whole in the child (a database client), and rewinding a written file would let the parent's writes
  overwrite its own.

Linux only (``/proc/self/fd``); elsewhere the guard does nothing. Meant for the child only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import stat
from typing import Iterator

FD_DIR = "/proc/self/fd"
SPARE_FDS = 16  # of the soft open-files limit, left to the probe's own reads by the guard's duplicates


def _open_fds() -> list:
    try:
        return sorted(int(name) for name in os.listdir(FD_DIR) if name.isdigit())
    except OSError:  # no /proc: nothing is guarded
        return []


def _readable(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
    except OSError:  # closed meanwhile (the listing's own descriptor)
        return False


def _stream(fd: int) -> str | None:
    """What a descriptor that cannot be rewound is, where the guard blinds it: a pipe or a terminal."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a pipe"
    return "a terminal" if stat.S_ISCHR(mode) and os.isatty(fd) else None


def _blind(fd: int) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, fd, inheritable=os.get_inheritable(fd))
    finally:
        os.close(null)


def _duplicates_allowed(open_fds: int) -> int:
    """How many descriptors the guard may add for its duplicates, leaving ``SPARE_FDS`` of the soft limit to the
    probe's own reads (a starved ``ulimit -n`` must not make the probe fail where the program reads on)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 0
    return open_fds if soft == resource.RLIM_INFINITY else max(0, soft - SPARE_FDS - open_fds)


def _duplicate(fd: int) -> int | None:
    try:
        return os.dup(fd)  # the same open file description: its offset is the parent's
    except OSError:  # the limit reached meanwhile: rewound through ``fd`` itself, while the probe keeps it open
        return None


@contextlib.contextmanager
def kept(spare: tuple = ()) -> Iterator[list]:
    """In a forked child: readable files rewound on exit, pipes and terminals read as empty meanwhile, but for
    the descriptors in ``spare`` (the child's own). Yields the blinded descriptors, described
    (``"fd 0 (a pipe)"``), for the caller's log."""
    fds = _open_fds()
    offsets, blinded, room = {}, [], _duplicates_allowed(len(fds))
    for fd in fds:
        if fd in spare or not _readable(fd):
            continue
        try:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # not seekable: a pipe, a terminal, a socket
            what = _stream(fd)
            if what is not None:
                _blind(fd)
                blinded.append(f"fd {fd} ({what})")
            continue
        held = _duplicate(fd) if len(offsets) < room else None
        offsets[fd] = (held, offset)
    try:
        yield blinded
    finally:
        for fd, (held, offset) in offsets.items():
            _rewind(fd if held is None else held, offset)
            if held is not None:
                os.close(held)


def _rewind(fd: int, offset: int) -> None:
    with contextlib.suppress(OSError):  # closed by the probe, with no duplicate: nothing left to restore
        if os.lseek(fd, 0, os.SEEK_CUR) != offset:
            os.lseek(fd, offset, os.SEEK_SET)


__all__ = ["kept"]
