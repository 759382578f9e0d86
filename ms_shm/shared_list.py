"""Read-only list and dict whose items live in two numpy arrays, so forked workers stop copying them.

A Python list of a million small dicts is a million objects, each with a reference count in its header.
Every worker that reads an item writes that count, and the kernel copies the whole page into the worker
(copy-on-read; PyTorch issue 13246). ``SharedList`` pickles each item once into one ``np.uint8`` buffer
plus an ``np.int64`` offsets array: two objects with no per-item headers, so reads never write and the
pages stay shared. Reading ``lst[i]`` unpickles a fresh copy of item ``i`` (detectron2's
``DatasetFromList(serialize=True)`` does the same).

Under the spawn start method workers receive the source by pickling. By default a ``SharedList`` pickles
its two arrays (compact, works everywhere). With ``shared_memory=True`` the arrays live in one POSIX shared
memory block and a pickle carries only its name, so every spawned worker maps the same pages.

Lifetime of a shared memory block (the one rule to remember): the process that created it owns it and
unlinks it when the ``SharedList`` is garbage collected or the interpreter exits; if that process is
killed, multiprocessing's resource tracker unlinks it. Processes that attach (workers) never unlink, and
mappings they already hold stay valid after the unlink. A block cannot be unlinked as soon as workers
attach: MindSpore starts them lazily, when the first row is fetched, and nothing tells the owner that the
last one has attached. So a pickle carrying a block's name can only be loaded while its owner is alive.
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import operator
import os
import pickle
import reprlib
import secrets
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from multiprocessing import resource_tracker
from typing import Any

import numpy as np

from ms_shm import procfs
from ms_shm._results import mib

log = logging.getLogger(__name__)

__all__ = ["SharedList", "SharedDict"]

#: Where POSIX shared memory lives on Linux (``shm_open`` creates files here). Tests point it at tmp_path.
_SHM_DIR = "/dev/shm"
#: Prefix of every block this module creates: ``ms_shm_list_<owner pid>_<random>``; the pid lets a
#: cleaner tell an orphan (owner gone) from a live block.
SHM_PREFIX = "ms_shm_list_"
_PROTOCOL = 5
_CHUNK = 65536  # items pickled per batch while building: bounds the transient list of bytes objects
_EMPTY_BUF = np.zeros(0, np.uint8)
_REPR = reprlib.Repr()  # short reprs of the first items, so repr() of a million items stays one line


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _pickle_items(items: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Pickle every item into (buffer, offsets), a chunk at a time so the transient bytes stay bounded."""
    dumps = pickle.dumps
    chunks: list[bytes] = []
    lengths: list[np.ndarray] = []
    iterator = iter(items)
    done = 0
    while True:
        chunk = list(islice(iterator, _CHUNK))
        if not chunk:
            break
        try:
            blobs = [dumps(item, _PROTOCOL) for item in chunk]
        except Exception:  # pickling raises many types; re-run one by one to name the item that failed
            for position, item in enumerate(chunk):
                try:
                    dumps(item, _PROTOCOL)
                except Exception as exc:
                    raise TypeError(f"SharedList item {done + position} cannot be pickled "
                                    f"({type(item).__name__}): {exc}") from exc
            raise
        lengths.append(np.fromiter(map(len, blobs), np.int64, count=len(blobs)))
        chunks.append(b"".join(blobs))
        done += len(chunk)
    offsets = np.zeros(done + 1, np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    joined = b"".join(chunks) if len(chunks) != 1 else chunks[0]
    return np.frombuffer(joined, np.uint8), offsets


# ---------------------------------------------------------------------------------------------- shm blocks
def _block_path(name: str) -> str:
    return os.path.join(_SHM_DIR, name)


def _release_block(name: str, owner_pid: int) -> None:
    """Unlink a block, but only from the process that created it (forked copies run finalizers too)."""
    if os.getpid() != owner_pid:
        return
    try:
        os.unlink(_block_path(name))
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - permissions changed under us
        log.warning("ms_shm: could not unlink shared memory block %s: %s", name, exc)
    try:
        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception as exc:  # pragma: no cover - tracker already gone at interpreter exit
        log.debug("ms_shm: resource tracker unregister %s: %s", name, exc)


def _reserve(fd: int, size: int) -> None:
    """Commit ``size`` bytes of tmpfs now, or raise ``OSError`` saying how much room there was."""
    free = procfs.statvfs(_SHM_DIR).free
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(exc.errno, f"cannot reserve {mib(size)} in {_SHM_DIR} for a SharedList "
                                     f"({mib(free)} free): {exc.strerror}") from exc
    if size > free:  # no fallocate on this filesystem: refuse rather than risk SIGBUS on a later write
        raise OSError(errno.ENOSPC, f"cannot reserve {mib(size)} in {_SHM_DIR} for a SharedList "
                                    f"({mib(free)} free)")
    os.ftruncate(fd, size)


def _create_block(buf: np.ndarray, offsets: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """Copy offsets then buffer into a new block; return its name and read-only views of both.

    ``posix_fallocate`` reserves every page up front: a full tmpfs then fails here with ``OSError`` instead
    of killing a process with SIGBUS later, when a page is first written.
    """
    size = offsets.nbytes + buf.nbytes
    name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    path = _block_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, size)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    # Registered like multiprocessing.shared_memory does, so a SIGKILLed owner still gets it unlinked.
    resource_tracker.register("/" + name, "shared_memory")
    new_offsets = np.frombuffer(mapping, np.int64, count=offsets.size)
    new_offsets[:] = offsets
    new_buf = np.frombuffer(mapping, np.uint8, count=buf.size, offset=offsets.nbytes)
    new_buf[:] = buf
    return name, _readonly(new_buf), _readonly(new_offsets)


def _attach_block(name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Map an existing block read-only; the owner stays responsible for unlinking it."""
    try:
        fd = os.open(_block_path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"SharedList shared memory block {name!r} is gone: the process that created it has released it "
            "(a pickle of a shared-memory SharedList is only valid while its owner is alive)") from None
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    offsets = np.frombuffer(mapping, np.int64, count=count + 1)
    buf = np.frombuffer(mapping, np.uint8, offset=offsets.nbytes)
    return buf, offsets


def _attach_list(name: str, count: int) -> SharedList:
    buf, offsets = _attach_block(name, count)
    return SharedList._from_arrays(buf, offsets, shm_name=name)


def _rebuild_list(buf: np.ndarray, offsets: np.ndarray) -> SharedList:
    return SharedList._from_arrays(buf, offsets)


def _rebuild_dict(keys: SharedList, values: SharedList, hashes: np.ndarray, order: np.ndarray) -> SharedDict:
    return SharedDict._from_parts(keys, values, hashes, order)


# -------------------------------------------------------------------------------------------------- list
class SharedList(Sequence):
    """An immutable list stored as pickled bytes in one numpy buffer; safe to share with forked workers.

    Use it for the big Python lists a dataset source keeps (file names, annotations, captions): forked
    workers then share its pages instead of each copying them as reference counts are touched.

    Items are copies: ``lst[i]`` unpickles item ``i`` each time, so mutating what it returns changes
    nothing stored, and objects shared between items come back as separate objects. Reading costs one
    ``pickle.loads`` (about 0.5 µs for a small dict, against 0.03 µs for a plain list); that is small next
    to the tens of microseconds MindSpore spends moving each row.

    Args:
        items: Any iterable of picklable objects. Another ``SharedList`` is copied without re-pickling.
        shared_memory: Put the arrays in a POSIX shared memory block so pickling (the spawn start method)
            sends only the block's name and every worker maps the same pages. The creating process owns
            the block (see the module docstring). Raises ``OSError`` when ``/dev/shm`` has no room.

    Raises:
        TypeError: An item cannot be pickled; the message names its index.

    Examples:
        >>> names = SharedList(f"img_{i}.jpg" for i in range(3))
        >>> names[-1], len(names), names[:2] == ["img_0.jpg", "img_1.jpg"]
        ('img_2.jpg', 3, True)
    """

    __slots__ = ("_buf", "_offsets", "_bview", "_oview", "_len", "_shm_name", "__weakref__")

    def __init__(self, items: Iterable[Any] = (), *, shared_memory: bool = False) -> None:
        if isinstance(items, SharedList):
            buf, offsets = items._buf, items._offsets
        else:
            buf, offsets = _pickle_items(items)
        name = None
        if shared_memory:
            name, buf, offsets = _create_block(buf, offsets)
            weakref.finalize(self, _release_block, name, os.getpid())
        elif isinstance(items, SharedList) and items._shm_name is not None:
            buf, offsets = buf.copy(), offsets.copy()  # do not depend on another owner's block
        self._set(buf, offsets, name)

    def _set(self, buf: np.ndarray, offsets: np.ndarray, shm_name: str | None) -> None:
        self._buf = _readonly(buf)
        self._offsets = _readonly(offsets)
        # memoryviews index to plain ints and slice without copying: the fast path of __getitem__.
        self._bview = memoryview(buf)
        self._oview = memoryview(offsets)
        self._len = offsets.size - 1
        self._shm_name = shm_name

    @classmethod
    def _from_arrays(cls, buf: np.ndarray, offsets: np.ndarray, shm_name: str | None = None) -> SharedList:
        self = cls.__new__(cls)
        self._set(buf, offsets, shm_name)
        return self

    # -- size and identity ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffer and the offsets: what stands in for the list's Python objects."""
        return int(self._buf.nbytes + self._offsets.nbytes)

    @property
    def shared_memory_name(self) -> str | None:
        """Name of the POSIX shared memory block holding the data (under ``/dev/shm``), or ``None``."""
        return self._shm_name

    def __repr__(self) -> str:
        where = f", shared memory {self._shm_name!r}" if self._shm_name else ""
        shown = [_REPR.repr(item) for item in islice(self, 3)] + (["..."] if self._len > 3 else [])
        return f"SharedList([{', '.join(shown)}], {self._len:,} items, {mib(self.nbytes)}{where})"

    # -- reading ------------------------------------------------------------------------------------------
    def __getitem__(self, index):
        """Item ``index`` (negative counts from the end), or a new ``SharedList`` for a slice.

        A slice returns a ``SharedList`` (not a ``list``), so taking a large part of a large list does not
        bring the copy-on-read problem back. It is an in-process copy of the bytes, never in shared memory.
        """
        if isinstance(index, slice):
            return self._slice(index)
        i = operator.index(index)
        if i < 0:
            i += self._len
        if i < 0 or i >= self._len:
            raise IndexError("SharedList index out of range")
        offsets = self._oview
        return pickle.loads(self._bview[offsets[i]:offsets[i + 1]])

    def __iter__(self) -> Iterator[Any]:
        loads, view, offsets = pickle.loads, self._bview, self._oview
        start = offsets[0]
        for i in range(1, self._len + 1):
            end = offsets[i]
            yield loads(view[start:end])
            start = end

    def __reversed__(self) -> Iterator[Any]:
        for i in range(self._len - 1, -1, -1):
            yield self[i]

    def tolist(self) -> list:
        """A plain list of every item (brings back one Python object per item)."""
        return list(self)

    def _slice(self, index: slice) -> SharedList:
        start, stop, step = index.indices(self._len)
        offsets = self._offsets
        if step == 1:
            stop = max(start, stop)
            new_offsets = offsets[start:stop + 1] - offsets[start]
            new_buf = self._buf[offsets[start]:offsets[stop]].copy()
            return SharedList._from_arrays(new_buf, new_offsets)
        picked = np.arange(start, stop, step, dtype=np.int64)
        lengths = offsets[picked + 1] - offsets[picked]
        new_offsets = np.zeros(picked.size + 1, np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        # Byte k of new item j comes from offsets[picked[j]] + k: one vectorised gather, no Python loop.
        shift = np.repeat(offsets[picked] - new_offsets[:-1], lengths)
        new_buf = self._buf[shift + np.arange(new_offsets[-1], dtype=np.int64)] if picked.size else _EMPTY_BUF
        return SharedList._from_arrays(new_buf, new_offsets)

    # -- comparison ---------------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        """Equal, item by item, to another ``SharedList``, a list, a tuple or any non-string sequence."""
        if isinstance(other, SharedList):
            if other._len != self._len:
                return False
            if np.array_equal(self._offsets, other._offsets) and np.array_equal(self._buf, other._buf):
                return True
        elif not isinstance(other, Sequence) or isinstance(other, (str, bytes, bytearray, memoryview)):
            return NotImplemented
        elif len(other) != self._len:
            return False
        return all(mine == theirs for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    # -- copying and pickling -----------------------------------------------------------------------------
    def __copy__(self) -> SharedList:
        return self  # immutable: a copy could never differ

    def __deepcopy__(self, memo: dict) -> SharedList:
        return self

    def __reduce__(self):
        """Pickle the two arrays, or only the block's name when the data is in shared memory."""
        if self._shm_name is not None:
            return _attach_list, (self._shm_name, self._len)
        return _rebuild_list, (self._buf, self._offsets)


# -------------------------------------------------------------------------------------------------- dict
def _stable_hash(key: Any) -> int | None:
    """A hash that is the same in every process (``hash(str)`` is randomised per interpreter under spawn).

    Equal keys must hash alike, so ``True``, ``1`` and ``1.0`` share the int path. ``None`` means "a key
    type SharedDict does not store".
    """
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8", "surrogatepass"), 1)
    if isinstance(key, bytes):
        return zlib.crc32(key, 2)
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    if isinstance(key, int):
        return zlib.crc32(str(int(key)).encode(), 3)
    return None


class SharedDict(Mapping):
    """An immutable dict (str, bytes or int keys) kept in ``SharedList`` buffers; read like a dict.

    Keys and values are two ``SharedList``; lookups go through a sorted array of 32-bit CRC hashes that
    is the same in every process, so no Python dict of keys has to exist in the workers. A lookup costs a
    CRC, a bisection and two unpickles (about 1 µs). Values are copies, as with ``SharedList``.

    Args:
        data: A mapping, or an iterable of ``(key, value)`` pairs (the last of equal keys wins).
        shared_memory: As for ``SharedList``: keys and values live in shared memory blocks.

    Raises:
        TypeError: A key is not a str, bytes or int (``bool`` and integral floats count as ints), or a key
            or value cannot be pickled.

    Examples:
        >>> captions = SharedDict({"a.jpg": "a cat", "b.jpg": "a dog"})
        >>> captions["b.jpg"], "c.jpg" in captions, len(captions)
        ('a dog', False, 2)
    """

    __slots__ = ("_keys", "_values", "_hashes", "_hview", "_order", "_oview")

    def __init__(self, data: Mapping | Iterable[tuple[Any, Any]] = (), *, shared_memory: bool = False) -> None:
        if not isinstance(data, Mapping):
            data = dict(data)
        hashes = np.empty(len(data), np.uint32)
        for position, key in enumerate(data):
            value = _stable_hash(key)
            if value is None:
                raise TypeError(f"SharedDict keys must be str, bytes or int, not {type(key).__name__}")
            hashes[position] = value
        keys = SharedList(data.keys(), shared_memory=shared_memory)
        values = SharedList(data.values(), shared_memory=shared_memory)
        order = np.argsort(hashes, kind="stable")
        self._set(keys, values, hashes[order], order)

    def _set(self, keys: SharedList, values: SharedList, hashes: np.ndarray, order: np.ndarray) -> None:
        self._keys, self._values = keys, values
        self._hashes, self._order = _readonly(hashes), _readonly(order)
        self._hview = memoryview(self._hashes)  # bisect works on it directly, in C
        self._oview = memoryview(self._order)

    @classmethod
    def _from_parts(cls, keys: SharedList, values: SharedList, hashes: np.ndarray,
                    order: np.ndarray) -> SharedDict:
        self = cls.__new__(cls)
        self._set(keys, values, hashes, order)
        return self

    @classmethod
    def fromkeys(cls, iterable: Iterable[Any], value: Any = None, *, shared_memory: bool = False) -> SharedDict:
        """Like ``dict.fromkeys``; a shared stand-in for a big ``set`` used for membership tests."""
        return cls(dict.fromkeys(iterable, value), shared_memory=shared_memory)

    def _position(self, key: Any) -> int:
        digest = _stable_hash(key)
        if digest is not None:
            hashes = self._hview
            j = bisect.bisect_left(hashes, digest)
            while j < len(hashes) and hashes[j] == digest:
                position = self._oview[j]
                if self._keys[position] == key:
                    return position
                j += 1
        raise KeyError(key)

    def __getitem__(self, key: Any) -> Any:
        return self._values[self._position(key)]

    def __contains__(self, key: object) -> bool:
        try:
            self._position(key)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys, values and the hash index together."""
        return self._keys.nbytes + self._values.nbytes + int(self._hashes.nbytes + self._order.nbytes)

    def __repr__(self) -> str:
        shown = [f"{_REPR.repr(key)}: {_REPR.repr(value)}"
                 for key, value in zip(islice(self._keys, 3), islice(self._values, 3))]
        shown += ["..."] if len(self) > 3 else []
        return f"SharedDict({{{', '.join(shown)}}}, {len(self):,} items, {mib(self.nbytes)})"

    __hash__ = None  # type: ignore[assignment]

    def __copy__(self) -> SharedDict:
        return self

    def __deepcopy__(self, memo: dict) -> SharedDict:
        return self

    def __reduce__(self):
        return _rebuild_dict, (self._keys, self._values, self._hashes, self._order)
