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
import functools
import logging
import mmap
import operator
import os
import pickle
import reprlib
import secrets
import sys
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from multiprocessing import resource_tracker
from typing import Any

import numpy as np

from ms_shm import procfs
from ms_shm._results import mib
from ms_shm.cleanup import SHARE_LISTS_PREFIX
from ms_shm.errors import ReadOnlyError

log = logging.getLogger(__name__)

__all__ = ["SharedList", "SharedDict", "ReadOnlyError"]

#: Where POSIX shared memory lives on Linux (``shm_open`` creates files here). Tests point it at tmp_path.
_SHM_DIR = "/dev/shm"
#: Prefix of every block this module creates: ``ms_shm_list_<owner pid>_<random>``; the pid lets a
#: cleaner tell an orphan (owner gone) from a live block.
SHM_PREFIX = SHARE_LISTS_PREFIX  # ms_shm_list_<pid>_<random>: the pid tells `ms-shm clean` whose it was
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


def _refuse(stand_in: Any, operation: str) -> ReadOnlyError:
    """The error for a change to a read-only stand-in: what was attempted, what the object is, and the fix.

    A swap made by ``build_dataset(..., share_lists=True)`` records the attribute it replaced (``_origin``), so
    the message can name it: code that appends to ``self.paths`` then learns why ``self.paths`` is read-only.
    """
    kind = type(stand_in).__name__
    plain = "dict" if isinstance(stand_in, SharedDict) else "list"
    origin = stand_in._origin
    if origin:
        message = (f"cannot {operation}: source attribute {origin!r} is ms_shm's read-only shared stand-in ({kind}) "
                   f"for the {plain} that was there, swapped in because build_dataset(..., share_lists=True) was "
                   f"asked for. Fix: build the dataset without share_lists=True, or do not modify self.{origin} "
                   f"after building (keep changes in a separate {plain})")
        fix = f"build_dataset(..., share_lists=False), or do not modify self.{origin}"
    else:
        message = (f"cannot {operation}: a {kind} is read-only (its items live in one shared byte buffer). "
                   f"Fix: change a plain copy (x.copy()) and build a new {kind} from it")
        fix = f"change x.copy() and build a new {kind}"
    return ReadOnlyError(message, fix=fix)


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


def _attach_list(name: str, count: int, origin: str | None = None) -> SharedList:
    buf, offsets = _attach_block(name, count)
    return SharedList._from_arrays(buf, offsets, shm_name=name)._named(origin)


def _rebuild_list(buf: np.ndarray, offsets: np.ndarray, origin: str | None = None) -> SharedList:
    return SharedList._from_arrays(buf, offsets)._named(origin)


def _rebuild_dict(keys: SharedList, values: SharedList, hashes: np.ndarray, order: np.ndarray,
                  origin: str | None = None) -> SharedDict:
    return SharedDict._from_parts(keys, values, hashes, order)._named(origin)


# ------------------------------------------------------------------------------------------- read-only
class _ReadOnly:
    """What both stand-ins share: the source attribute each replaced (``_named``, for the refusal's message),
    and the refusal of the changes a list and a dict both have. The rest are each class's own."""

    __slots__ = ()
    _ITEM = "an item"  # what ``x[k] = v`` assigns, in the refusal's words

    def _named(self, origin: str | None):
        """Record the source attribute this stands in for, so an attempt to change it can name it."""
        self._origin = origin
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        raise _refuse(self, f"assign {self._ITEM}")

    def __delitem__(self, key: Any) -> None:
        raise _refuse(self, f"delete {self._ITEM}")

    def pop(self, *args: Any) -> Any:
        raise _refuse(self, "pop")

    def clear(self) -> None:
        raise _refuse(self, "clear")


# -------------------------------------------------------------------------------------------------- list
class SharedList(_ReadOnly, Sequence):
    """An immutable list stored as pickled bytes in one numpy buffer; safe to share with forked workers.

    Use it for the big Python lists a dataset source keeps (file names, annotations, captions): forked
    workers then share its pages instead of each copying them as reference counts are touched.

    Items are copies: ``lst[i]`` unpickles item ``i`` each time, so mutating what it returns changes
    nothing stored, and objects shared between items come back as separate objects (so ``x in lst`` and
    ``count`` find a NaN only where ``==`` does: a list also matches the very same object). It behaves as a
    ``list`` that cannot change: equal to lists (never to tuples), slices, ``copy()``, ``+`` and ``*`` give
    plain lists, and every changing method (``append``, ``lst[i] = x``, ``sort``...) raises ``ReadOnlyError``,
    a ``TypeError``. ``isinstance(lst, list)`` is ``False``. Reading costs one
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
        >>> names[-1], len(names), names[:2]
        ('img_2.jpg', 3, ['img_0.jpg', 'img_1.jpg'])
    """

    __slots__ = ("_buf", "_offsets", "_bview", "_oview", "_len", "_shm_name", "_origin", "__weakref__")

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
        self._origin = None

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
        """Item ``index`` (negative counts from the end), or a plain ``list`` for a slice.

        A slice is a ``list``, as a list's slice is, so ``json.dumps(x[:2])`` and ``x[:2] + [y]`` behave as
        they did before the swap. Its items are new objects of the process that sliced.
        """
        if isinstance(index, slice):
            return list(self._slice(index))
        try:
            i = operator.index(index)
        except TypeError:
            if hasattr(type(index), "__index__"):
                raise  # its own words, as a list gives them (a numpy array of several items)
            raise TypeError(f"list indices must be integers or slices, not {type(index).__name__}") from None
        if i < 0:
            i += self._len
        if i < 0 or i >= self._len:
            raise IndexError("list index out of range")
        offsets = self._oview
        return pickle.loads(self._bview[offsets[i]:offsets[i + 1]])

    def __iter__(self) -> Iterator[Any]:
        return self._items(0, self._len)

    def _items(self, first: int, stop: int) -> Iterator[Any]:
        """Items ``first`` to ``stop - 1`` (both within bounds), unpickled one by one."""
        loads, view, offsets = pickle.loads, self._bview, self._oview
        start = offsets[first]
        for i in range(first + 1, stop + 1):
            end = offsets[i]
            yield loads(view[start:end])
            start = end

    def __reversed__(self) -> Iterator[Any]:
        for i in range(self._len - 1, -1, -1):
            yield self[i]

    def tolist(self) -> list:
        """A plain list of every item (brings back one Python object per item)."""
        return list(self)

    def copy(self) -> list:
        """A plain list, as ``list.copy`` gives: the copy is the caller's to change."""
        return list(self)

    def index(self, value: Any, start: int = 0, stop: int = sys.maxsize) -> int:
        """As ``list.index``, with its message: ``ValueError: 'x' is not in list``."""
        start, stop, _ = slice(start, stop).indices(self._len)
        for i, item in enumerate(self._items(start, max(start, stop)), start):
            if item is value or item == value:
                return i
        raise ValueError(f"{value!r} is not in list")

    def __add__(self, other: Any) -> list:
        if isinstance(other, (list, SharedList)):
            return list(self) + list(other)
        return NotImplemented

    def __radd__(self, other: Any) -> list:
        if isinstance(other, list):
            return other + list(self)
        return NotImplemented

    def __mul__(self, times: Any) -> list:
        try:
            times = operator.index(times)
        except TypeError:
            return NotImplemented
        return list(self) * times

    __rmul__ = __mul__

    # -- changing: refused with the reason and the fix (and ``_ReadOnly``'s) -----------------------------------
    def __iadd__(self, other: Any) -> SharedList:
        raise _refuse(self, "extend it with +=")

    def __imul__(self, times: Any) -> SharedList:
        raise _refuse(self, "repeat it with *=")

    def append(self, value: Any) -> None:
        raise _refuse(self, "append")

    def extend(self, values: Iterable[Any]) -> None:
        raise _refuse(self, "extend")

    def insert(self, index: int, value: Any) -> None:
        raise _refuse(self, "insert")

    def remove(self, value: Any) -> None:
        raise _refuse(self, "remove an item")

    def sort(self, *, key: Any = None, reverse: bool = False) -> None:
        raise _refuse(self, "sort in place (sorted(x) gives a new list)")

    def reverse(self) -> None:
        raise _refuse(self, "reverse in place (x[::-1] gives a new list)")

    def _slice(self, index: slice) -> SharedList:
        """The items of a slice, still as bytes: one copy of the buffer, no unpickling yet."""
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
        """Equal, item by item, to a list or another ``SharedList``, as a list is: never to a tuple."""
        if isinstance(other, SharedList):
            if other._len != self._len:
                return False
            if np.array_equal(self._offsets, other._offsets) and np.array_equal(self._buf, other._buf):
                return True
        elif not isinstance(other, list):
            return NotImplemented
        elif len(other) != self._len:
            return False
        return all(mine is theirs or mine == theirs for mine, theirs in zip(self, other))

    def _compare(self, other: object, op: Callable[[list, list], bool]) -> bool:
        """Ordered as lists are, against a list or another ``SharedList`` only."""
        return op(list(self), list(other)) if isinstance(other, (list, SharedList)) else NotImplemented

    __lt__ = functools.partialmethod(_compare, op=operator.lt)
    __le__ = functools.partialmethod(_compare, op=operator.le)
    __gt__ = functools.partialmethod(_compare, op=operator.gt)
    __ge__ = functools.partialmethod(_compare, op=operator.ge)

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    # -- copying and pickling -----------------------------------------------------------------------------
    def __copy__(self) -> SharedList:
        return self  # immutable: a copy could never differ

    def __deepcopy__(self, memo: dict) -> SharedList:
        return self

    def __reduce__(self):
        """Pickle the two arrays, or only the block's name when the data is in shared memory."""
        if self._shm_name is not None:
            return _attach_list, (self._shm_name, self._len, self._origin)
        return _rebuild_list, (self._buf, self._offsets, self._origin)


# -------------------------------------------------------------------------------------------------- dict
def _stable_hash(key: Any) -> int | None:
    """A hash that is the same in every process (``hash(str)`` is randomised per interpreter under spawn).

    A dict treats keys that are equal and hash alike as one key, so every key equal to an int (``True``,
    ``5.0``, ``numpy.int64(5)``: MindSpore hands workers numpy indices) takes the int path. ``None`` means
    "no stored key can be equal to this one" (or a key type SharedDict does not store).

    Raises:
        TypeError: The key is unhashable, as a dict lookup raises.
    """
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8", "surrogatepass"), 1)
    if isinstance(key, bytes):
        return zlib.crc32(key, 2)
    integer = int(key) if isinstance(key, int) else _integer_key(key)
    if integer is None:
        return None
    return zlib.crc32(str(integer).encode(), 3)


def _integer_key(key: Any) -> int | None:
    """The int a dict would take for the same key as ``key`` (equal and the same ``hash``), else ``None``."""
    digest = hash(key)  # unhashable: the TypeError a dict raises
    if isinstance(key, (float, np.floating)) and not float(key).is_integer():
        return None  # 1.5, nan, inf: equal to no int
    try:
        integer = operator.index(key)  # numpy integers
    except TypeError:
        try:
            integer = int(key)  # integral floats, numpy bools, Decimal, Fraction
        except (TypeError, ValueError, OverflowError):
            return None
    try:
        same = digest == hash(integer) and bool(key == integer)
    except Exception:  # an odd __eq__: then it is not the same key as any int
        return None
    return integer if same else None


class SharedDict(_ReadOnly, Mapping):
    """An immutable dict (str, bytes or int keys) kept in ``SharedList`` buffers; read like a dict.

    Keys and values are two ``SharedList``; lookups go through a sorted array of 32-bit CRC hashes that
    is the same in every process, so no Python dict of keys has to exist in the workers. A lookup costs a
    CRC, a bisection and two unpickles (about 1 µs). Values are copies, as with ``SharedList``. As in a
    dict, any key equal to a stored one finds it (``numpy.int64(5)``, ``5.0`` and ``True`` find ``5``, ``1``).
    ``copy()`` and ``|`` give plain dicts; every changing method raises ``ReadOnlyError`` (a ``TypeError``);
    ``isinstance(d, dict)`` is ``False``.

    Args:
        data: A mapping, or an iterable of ``(key, value)`` pairs (the last of equal keys wins).
        shared_memory: As for ``SharedList``: keys and values live in shared memory blocks.

    Raises:
        TypeError: A key is not a str, bytes or int (a key a dict holds as the same key as an int counts as
            one: ``True``, ``5.0``, ``numpy.int64(5)``), or a key or value cannot be pickled.

    Examples:
        >>> captions = SharedDict({"a.jpg": "a cat", "b.jpg": "a dog"})
        >>> captions["b.jpg"], "c.jpg" in captions, len(captions)
        ('a dog', False, 2)
    """

    __slots__ = ("_keys", "_values", "_hashes", "_hview", "_order", "_oview", "_origin")
    _ITEM = "a key"

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
        self._origin = None

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

    def copy(self) -> dict:
        """A plain dict, as ``dict.copy`` gives: the copy is the caller's to change."""
        return dict(zip(self._keys, self._values))

    def __or__(self, other: Any) -> dict:
        if not isinstance(other, (dict, SharedDict)):
            return NotImplemented
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other: Any) -> dict:
        if not isinstance(other, dict):
            return NotImplemented
        merged = dict(other)
        merged.update(self.copy())
        return merged

    # -- changing: refused with the reason and the fix (and ``_ReadOnly``'s) -----------------------------------
    def __ior__(self, other: Any) -> SharedDict:
        raise _refuse(self, "update it with |=")

    def setdefault(self, key: Any, default: Any = None) -> Any:
        raise _refuse(self, "setdefault")

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(self, "update")

    def popitem(self) -> tuple:
        raise _refuse(self, "popitem")

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
        return _rebuild_dict, (self._keys, self._values, self._hashes, self._order, self._origin)
