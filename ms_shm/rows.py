"""Take a few rows from the user's source, check them, and measure their size and cost.

Rows are measured as MindSpore will carry them: each column converted the way ``_convert_row`` does, and the
row's shared-memory size is the sum of ``nbytes`` of its ndarray columns. Bad rows are rejected here, with the
column, the row and the fix, before any worker exists. The reading itself happens in a probe child
(``sandbox``), so nothing here may assume its side effects survive.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
import traceback
import zlib
from collections.abc import Iterator
from dataclasses import field
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import parallel, sandbox
from ms_shm._results import Result, record
from ms_shm.engines.mindspore.profiles import CARRIED_KINDS, DICT_DTYPES
from ms_shm.errors import RowError, RowTypeError
from ms_shm.host import NUMPY1_INSTALL

log = logging.getLogger(__name__)


@record
class ColumnStats(Result):
    name: str
    dtype: str
    shape: tuple
    max_bytes: int
    varies: bool  # shape changed between probe rows


@record
class RowStats(Result):
    """What the probe rows showed. Timing fields are ``None`` when nothing was timed (a what-if plan)."""

    random_access: bool
    length: int | None
    probed: int
    indices: tuple
    columns: tuple
    row_bytes_max: int
    row_bytes_min: int
    seconds_per_row: float | None  # median over the probe rows: a cold first call (lazy init) is not an epoch's
    cpu_fraction: float | None  # thread CPU time / wall time while fetching: low means I/O-bound
    probe_seconds: float
    notes: tuple = field(default_factory=tuple)
    framework_tensors: bool = False  # a column was a framework tensor (``asnumpy``), not a numpy array
    worker_bytes: int | None = None  # memory the probe child held alone when it finished (copied-on-write
    # pages and what reading allocated): what each forked worker adds to the memory cgroup
    parallel_fraction: float | None = None  # of the CPU work, what ran outside the GIL (``ms_shm.parallel``)
    reread_differs: str | None = None  # the first probe row read again came back different (None: same or unread)
    threads_started: int | None = None  # native threads reading left running (a BLAS/OpenMP pool: ``sandbox``)
    cores_busy: float | None = None  # process CPU time / wall time of rows read alone: above ``cpu_fraction``
    rows_one_column: str | None = None  # rows of this type (a list) reach MindSpore's worker-process queue whole
    # and arrive as one column (``one_column``): read in this process, they are MindSpore's columns
    # where the rows' library ran a thread pool of its own (``pooled``)
    sampled: int | None = None  # rows the caller's sampler draws an epoch, where it limits them and says how many
    raised: str | None = None  # a probe row after the first raised this (the rows read before it were measured)
    dict_bytes_max: int = 0  # the arrays and strings in a probe row's dict columns, at most: no slot carries them
    # (pickled through a pipe), but they are held in memory as any row is
    held_fraction: float | None = None  # of the first row's bytes, those its second read returned at the same
    # address, contiguous: arrays the source holds (``self.rows[i]``, ``self.x[i]``), not made by the read
    reused_buffer: str | None = None  # the first row's arrays changed in place as later rows were read

    @property
    def ragged(self) -> bool:
        return self.row_bytes_max != self.row_bytes_min or any(c.varies for c in self.columns)

    @property
    def pooled(self) -> bool:
        """The rows' library ran a thread pool of its own (``parallel.POOLED_FROM``)."""
        return parallel.pooled(self.cpu_fraction, self.cores_busy)

    @classmethod
    def synthetic(cls, row_bytes: int, length: int | None = None) -> "RowStats":
        """Stats for a what-if plan: a known row size, no timing."""
        col = ColumnStats("data", "uint8", (row_bytes,), row_bytes, False)
        return cls(True, length, 0, (), (col,), row_bytes, row_bytes, None, None, 0.0,
                   ("row size given, not measured",))


def _column_name(names: Sequence[str] | None, i: int) -> str:
    return names[i] if names and i < len(names) else f"#{i}"


def convert_row(row: Any, index: Any, names: Sequence[str] | None) -> tuple:
    """The row as a tuple of ndarrays, as MindSpore's ``_convert_row`` makes it, or a ``RowError``.

    A whole-row dict is MindSpore's dict column: kept as a dict (values converted) when there is exactly one
    column name, since that is the only way MindSpore 2.10 carries it.
    """
    where = f"row {index}"
    if row is None:
        raise RowError(f"{where} is None: the source returned nothing. Fix: return a tuple of numpy arrays, "
                       f"one per column{_names_hint(names)}.", None, index)
    if isinstance(row, dict):
        if names is not None and len(names) == 1:
            return (_convert_dict(row, index, names[0]),)
        raise RowError(f"{where} is a dict with keys {sorted(map(str, row))[:6]}: GeneratorDataset rows are "
                       f"tuples (a dict is carried whole only as the single column of a one-column dataset). "
                       f"Fix: return a tuple of arrays in column order, e.g. "
                       f"`return (d['image'], d['label'])`, and pass column_names.", None, index)
    if isinstance(row, ONE_COLUMN) or hasattr(row, "asnumpy"):
        values = [row]
    else:
        values = _columns(row)
        if values is None:
            raise RowError(f"{where} is a {type(row).__name__}: GeneratorDataset rows are tuples of numpy "
                           f"arrays. Fix: return a tuple of numpy arrays{_names_hint(names)}.", None, index)
    if names is not None and len(values) != len(names):
        raise RowError(f"{where} has {len(values)} column(s) but column_names has {len(names)} "
                       f"({list(names)}): the 'source' of 'GeneratorDataset' should return same number of NumPy "
                       f"arrays as specified in column_names, the size of column_names is:{len(names)} and number "
                       f"of returned NumPy array is:{len(values)}. Fix: make __getitem__ return exactly "
                       f"{len(names)} values, or change column_names.", None, index)
    return tuple(_convert_column(v, index, _column_name(names, i)) for i, v in enumerate(values))


# What MindSpore's ``_convert_row`` reads as one column (its ``prim_type``, and Tensors); anything else it iterates
ONE_COLUMN = (np.ndarray, int, float, str, bytes, np.number, np.bool_)


def one_column(row: Any) -> str | None:
    """The type of ``row`` where MindSpore's worker processes would carry it as one column, else ``None``: their
    queue (``_SharedQueue.put``) wraps a row that is not a tuple as ``(row,)``, and the main process converts that,
    so a list, a deque or a generator of columns arrives as one stacked column or fails ("Cannot pickle
    <class 'generator'>"), where MindSpore's own thread iterates it for its columns (2.10, measured: a source of
    ``[image, label]`` rows in the 2 worker processes ms_shm chose, where raw's default read it)."""
    if isinstance(row, (tuple, dict, *ONE_COLUMN)) or hasattr(row, "asnumpy"):
        return None
    return type(row).__name__


def materialized(row: Any) -> Any:
    """``row``, or, where it is a one-shot iterator MindSpore would iterate for its columns (a generator), a tuple
    of what it yields: read once, then checked and measured as often as needed."""
    if isinstance(row, Iterator) and not isinstance(row, (ONE_COLUMN, tuple, list, dict)):
        return tuple(row)
    return row


def _columns(row: Any) -> list | None:
    """The columns of a row MindSpore iterates (``for x in row``: a tuple, a deque, a generator, a record's
    fields), or ``None`` where it cannot be iterated."""
    if isinstance(row, (tuple, list)):
        return list(row)
    try:
        iterator = iter(row)
    except TypeError:
        return None
    return list(iterator)


def _convert_dict(row: dict, index: Any, name: str) -> dict:
    """A dict column, carried whole: MindSpore converts its values only as the iterator yields them
    (``__convert_python``), and refuses there only arrays of a dtype it has no tensor type for; ``None``, lists
    and other objects come out as they went in (2.10, measured by an audit)."""
    return {key: _dict_value(value, index, f"{name}['{key}']") for key, value in row.items()}


_DICT_DTYPES = tuple(np.dtype(t) for t in DICT_DTYPES)


def _dict_value(value: Any, index: Any, name: str) -> Any:
    if isinstance(value, dict):
        return _convert_dict(value, index, name)
    if isinstance(value, (tuple, list)):
        return type(value)(_dict_value(v, index, f"{name}[{i}]") for i, v in enumerate(value))
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "US" and value.dtype not in _DICT_DTYPES:
            raise RowTypeError(f"column '{name}' of row {index} has dtype {value.dtype}: MindSpore's iterator "
                               f"refuses it inside a dict column ('A NumPy array of unsupported type detected: "
                               f"{value.dtype}'). Fix: convert it to a numeric, bool or string dtype in native "
                               f"byte order (x.astype(np.int64) for datetimes, x.astype(x.dtype.newbyteorder('=')) "
                               f"for big-endian, np.asarray(list(x), dtype=...) for objects).", name, index)
        return value
    if isinstance(value, (int, float, str, bytes, np.generic)):
        return np.asarray(value)
    return value  # None, or an object MindSpore hands back as it is


def _names_hint(names: Sequence[str] | None) -> str:
    return f" ({', '.join(names)})" if names else ""


def dtype_refused(dtype: np.dtype) -> str | None:
    """Why MindSpore cannot carry an array of ``dtype``, with the fix (to follow "column 'x' of row 3"), or
    ``None``: one rule for a source's rows and an operation's outputs (an audit: a map returning complex,
    big-endian or longdouble arrays passed ``map()`` and died mid-epoch, "data type is unknown")."""
    if dtype.kind == "c":
        return (f"has dtype {dtype}: MindSpore's dataset engine cannot carry complex numbers. Fix: return "
                f"np.stack([x.real, x.imag], axis=-1) and rebuild the complex value after the pipeline.")
    if dtype.kind in "iufc" and not dtype.isnative:
        return (f"has byte order {dtype.str}: MindSpore's dataset engine cannot carry non-native byte order ('data "
                f"type is unknown'). Fix: return x.astype(x.dtype.newbyteorder('=')).")
    if dtype.kind == "f" and dtype.itemsize > 8:
        return (f"has dtype {dtype} (numpy's longdouble): MindSpore's dataset engine carries floats of 16, 32 and "
                f"64 bits only ('data type is unknown'). Fix: return x.astype(np.float64).")
    if dtype.kind not in CARRIED_KINDS:
        return (f"has dtype {dtype} which MindSpore cannot carry. Fix: convert it (e.g. x.astype(np.int64) for "
                f"datetimes, np.asarray(list(x), dtype=...) for objects, or split structured fields into columns).")
    return None


def _convert_column(value: Any, index: Any, name: str) -> np.ndarray | dict:
    """One column as MindSpore carries it: an array, or a dict of them (a dict column, nested or not, is carried
    by every release from 2.0 to 2.10: measured, beside other columns too)."""
    where = f"column '{name}' of row {index}"
    if value is None:
        raise RowError(f"{where} is None. Fix: return a value for every column (e.g. an empty "
                       f"np.zeros(0) or a sentinel like -1), or drop the column.", name, index)
    if isinstance(value, dict):
        return _convert_dict(value, index, name)
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    try:
        array = np.asarray(value)
    except ValueError as exc:  # numpy >= 1.24 refuses ragged nested lists
        raise RowError(f"{where} is a ragged list ({exc}). Fix: pad it to one shape, or return it as "
                       f"separate columns.", name, index) from exc
    if array.dtype.kind == "O":
        kind = "ragged list" if isinstance(value, (list, tuple)) else "object array"
        raise RowError(f"{where} is an {kind} (dtype=object, {type(value).__name__}). MindSpore carries only "
                       f"numeric, bool and string arrays. Fix: convert it with np.asarray(x, dtype=...) to one "
                       f"dtype and shape, or pickle it to bytes.", name, index)
    refused = dtype_refused(array.dtype)
    if refused:
        raise RowError(f"{where} {refused}", name, index)
    if array.dtype.kind in "US" and not (array.flags.c_contiguous or array.flags.f_contiguous):
        text = "str" if array.dtype.kind == "U" else "bytes"
        raise RowError(f"{where} is a strided view of a {text} array (shape {array.shape}, strides "
                       f"{array.strides}): MindSpore's conversion of text arrays refuses it mid-epoch (\"resize only "
                       f"works on single-segment arrays\", measured on 2.0 and 2.10; numeric views are copied). Fix: "
                       f"return np.ascontiguousarray(x).", name, index)
    return array


_COMPARE_CHUNK = 64 << 10  # bytes compared per step: the temporary stays in memory the process already has


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` hold the same bytes. Compared in small steps because one ``a == b`` over a large row
    allocates a temporary as large as the row, and in the probe child (a fresh fork) every page of it is a
    page fault: 11 ms for an 8 MiB row, measured, against 0.8 ms in a warm process. A row that is a strided
    view (a transposed array) is compared a block of its first axis at a time, never copied whole: a plain
    list's rows are read in the program's own process (``measure._read_here``), where two copies of four 384 MB
    transposed rows raised its peak memory by 735 MB (an audit)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous) and a.ndim > 0 and a.nbytes > _COMPARE_CHUNK:
        step = max(1, _COMPARE_CHUNK // max(1, a[0].nbytes))
        return all(_same_bytes(a[i:i + step], b[i:i + step]) if step > 1 else _same_bytes(a[i], b[i])
                   for i in range(0, len(a), step))
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    return all(np.array_equal(x[i:i + _COMPARE_CHUNK], y[i:i + _COMPARE_CHUNK])
               for i in range(0, x.size, _COMPARE_CHUNK))


def _arrays(columns: tuple) -> list:
    """A row's arrays in a fixed order: its array columns, then those in its dict columns (``_dict_leaves``)."""
    return [c for c in columns if isinstance(c, np.ndarray)] + \
        [v for v in _dict_leaves(columns) if isinstance(v, np.ndarray)]


def _dict_leaves(columns: tuple) -> Iterator:
    """The values in a row's dict columns, at any depth through dicts, lists and tuples, in a fixed order."""
    stack = [c for c in columns if isinstance(c, dict)][::-1]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        else:
            yield value


def held_fraction(first: tuple, again: tuple) -> float | None:
    """Of ``first``'s array bytes, the share ``again`` (the same row read a second time, ``first`` still alive)
    holds at the same address, C-contiguous: memory the source held before either read, which MindSpore 2.7+
    carries in its own process without a copy (2.10, 300 MiB rows: peak RSS the same iterated or not; a strided
    view is copied). ``None`` for a row of no array bytes."""
    pairs = [(a, b) for a, b in zip(_arrays(first), _arrays(again))]
    total = sum(a.nbytes for a, _ in pairs)
    if total == 0:
        return None
    same = sum(a.nbytes for a, b in pairs if a.nbytes == b.nbytes and a.flags.c_contiguous and b.flags.c_contiguous
               and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
    return same / total


FINGERPRINT_WINDOW = 1 << 20  # bytes of each array checksummed at its start, middle and end (``fingerprint``)


def fingerprint(columns: tuple) -> int | None:
    """A checksum of a row's contiguous array bytes, ``FINGERPRINT_WINDOW`` at the start, middle and end of each:
    enough to see a buffer refilled with another row's values, at well under a millisecond whatever its size.
    ``None``: no such bytes."""
    arrays = [a for a in _arrays(columns) if a.nbytes and a.flags.c_contiguous and not a.dtype.hasobject]
    if not arrays:
        return None
    crc = 0
    for a in arrays:
        flat, last = a.reshape(-1).view(np.uint8), max(0, a.nbytes - FINGERPRINT_WINDOW)  # any dtype's bytes
        for start in sorted({0, last // 2, last}):
            crc = zlib.crc32(flat[start:start + FINGERPRINT_WINDOW], crc)
    return crc


def reused_buffer(first: tuple, printed: int | None, index: int) -> str | None:
    """Why the source is seen to fill one buffer for every row: the first row's arrays, ``(index, row)``, kept
    alive and untouched by the probe, no longer hold what they held when read (``printed``, their
    ``fingerprint`` then), now that row ``index`` was read; or ``None``. In MindSpore's own process such rows are
    carried without a copy (2.7+), and the next read overwrites the rows still queued; a worker process copies each
    into its slot or pipe as it returns it: ``np.copyto(self.out, ...); return self.out`` with 2 workers gave 63
    wrong rows of 64 in threads, none in processes (an audit; a 4 MiB buffer changes beyond what the watch of the
    source's state checksums). Rows the source holds and hands out again unchanged (a constant mask, a dataset
    repeated by ``i % n``) are not such a buffer."""
    if printed is None or fingerprint(first[1]) == printed:
        return None
    return (f"source[{first[0]}]'s row changed in place as source[{index}] was read: the source fills one buffer "
            f"for every row, which rows carried without a copy would share")


def row_bytes(columns: tuple) -> int:
    """Bytes a row takes in a dynamic shared-memory slot: every ndarray column, contiguous.

    A dict column is pickled through the pipe, as in MindSpore's ``get_total_size``, so it counts 0.
    """
    total = 0
    for c in columns:
        if isinstance(c, np.ndarray):
            total += c.nbytes
    return total


def dict_bytes(columns: tuple) -> int:
    """Bytes of the arrays, strings and bytes in a row's dict columns (at any depth), which ``row_bytes`` counts
    0 for: mindyolo's eval rows of 8 MiB images in a dict were priced at 80 MiB of memory where they held ~500
    (an audit)."""
    return sum(v.nbytes if isinstance(v, np.ndarray) else len(v) for v in _dict_leaves(columns)
               if isinstance(v, (np.ndarray, str, bytes)))


def same_row(a: Any, b: Any) -> bool:
    """``a`` and ``b``, one row (or operation output) computed twice, are the same (``difference``)."""
    return difference(a, b) is None


def difference(a: Any, b: Any, where: str = "row", tensor_bytes: Callable[[Any], tuple | None] | None = None
               ) -> str | None:
    """Where ``a`` and ``b``, one row or sample read twice, differ (``where`` extended: ``sample['img'][0]``),
    or ``None`` when they are the same to the byte: the one rule for every surface.

    Arrays, and tensors (``tensor_bytes``: an engine's view of its framework's tensor as ``(dtype, shape,
    array)``, ``None`` for anything else), by dtype, shape and bytes (a NaN read twice is the same; 0.0 and -0.0
    are not); object arrays by their objects; dicts key by key; lists and tuples (namedtuples too) by type and
    item by item; a float NaN equals a NaN; other values by ``==``. A value ``==`` gives no answer for (a tensor
    no engine reads, a table) and a tensor that cannot be read differ: not known to be the same, so the rows
    are read in one place, as the program would read them."""
    try:
        ta = tb = None
        if tensor_bytes is not None:
            ta, tb = tensor_bytes(a), tensor_bytes(b)
    except Exception:  # a tensor the framework cannot show as bytes: not known to be the same
        return where
    if ta is not None or tb is not None:
        same = ta is not None and tb is not None and ta[:2] == tb[:2] and _same_array(ta[2], tb[2], None)
        return None if same else where
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return None if _same_array(a, b, tensor_bytes) else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return where
        return next((d for k in a if (d := difference(a[k], b[k], f"{where}[{k!r}]", tensor_bytes))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # a per_batch_map returns lists of rows
        if type(a) is not type(b) or len(a) != len(b):
            return where
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := difference(x, y, f"{where}[{i}]", tensor_bytes))), None)
    return None if _same_value(a, b) else where


def _same_array(a: Any, b: Any, tensor_bytes: Callable | None) -> bool:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:  # the bytes are pointers: compare the objects
        return difference(a.tolist(), b.tolist(), "", tensor_bytes) is None
    return _same_bytes(a, b)


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    try:
        return bool(a == b)
    except Exception:  # no truth value (a framework's tensor, a table): not known to be the same
        return False


def _spread(length: int, count: int) -> list:
    """Probe indices spread over the dataset, in probing order: rows often grow along it.

    First, last and middle come first, so a probe stopped early still sees both ends of the dataset.
    """
    if length <= count:
        spread = list(range(length))
    elif count <= 1:
        spread = [0] if count == 1 else []
    else:
        step = (length - 1) / (count - 1)
        spread = sorted({round(i * step) for i in range(count)})
    if not spread:
        return []
    head = list(dict.fromkeys([spread[0], spread[-1], spread[len(spread) // 2]]))
    return head + [i for i in spread if i not in head]


def _skeleton(column: Any) -> tuple | None:
    """What the stats need of a converted column, so the row itself can be dropped at once."""
    if not isinstance(column, np.ndarray):  # a dict column: pickled, not in shm
        return None
    return column.shape, str(column.dtype), column.nbytes


@record(frozen=False)
class _Probe:
    """The probe's account: each row is checked and reduced to its skeleton at once, so beside the first row
    (kept to compare its second read with) no two large rows are alive together (fresh pages for each would cost
    more than the row)."""

    names: Sequence[str] | None
    check: Callable[[Any], Any] | None = None  # the framework's own row conversion, to refuse what it refuses
    column_dtypes: tuple | None = None  # ``column_types`` as ``(numpy dtype or None, name)``: rows must match
    indices: list = field(default_factory=list)
    skeletons: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    walls: list = field(default_factory=list)  # seconds each fetch took, in probing order
    cpus: list = field(default_factory=list)  # CPU seconds of each, in the same order
    tensors: bool = False
    whole_rows: str | None = None  # the type of rows worker processes would carry as one column (``one_column``)
    parallel: float | None = None  # fraction of the rows' CPU work that ran outside the GIL (two at once)
    pair_seconds: float = 0.0  # wall time of the last pair read at once
    gil_watched: bool = False  # a pair's fraction came from watching the GIL (``parallel.GilWatch``)
    pair_cpu: float = 0.0  # CPU seconds per row of that pair
    first_kernel: float = 0.0  # system CPU seconds of the first read (its page faults, mostly)
    first: tuple | None = None  # (index, converted row) of the first row: kept to compare a second read with
    reread: str | None = None  # why the first row read again differs
    compared: bool = False  # the first row was read again
    alone_wall: float = 0.0  # wall seconds of the reads made alone (not in a pair)
    alone_process_cpu: float = 0.0  # the process's CPU seconds over those reads (its library's threads too)
    sampled: int | None = None  # rows the caller's sampler draws an epoch (``RowStats.sampled``)
    raised: str | None = None  # what a later probe row raised (``RowStats.raised``)
    held: float | None = None  # ``RowStats.held_fraction``
    reused: str | None = None  # ``RowStats.reused_buffer``
    first_print: int | None = None  # the first row's ``fingerprint`` as read
    first_growth: int | None = None  # bytes the first read allocated and kept (``sandbox.allocated_bytes``)
    dict_sizes: list = field(default_factory=list)  # ``dict_bytes`` of each row kept

    @property
    def wall(self) -> float:
        return sum(self.walls)

    def pair_due(self) -> bool:
        """Whether the next read is made in a pair (``parallel.pair_now``), on the rows read so far."""
        return parallel.pair_now(self.walls, self.first_kernel, self.share, max(self.sizes, default=0))

    def fetch(self, fetch: Callable, *args: Any) -> Any:
        """Call ``fetch(*args)`` and add its wall and CPU time to the probe's account (and for the first read,
        the kernel's share of it: ``first_kernel``)."""
        before = sandbox.allocated_bytes() if not self.walls else None
        row, took = parallel.timed_call(fetch, *args)
        if not self.walls:
            self.first_kernel = took.kernel
            after = sandbox.allocated_bytes()
            self.first_growth = None if before is None or after is None else after - before
        self.walls.append(took.wall)
        self.cpus.append(took.cpu)
        self.alone(took)
        return row

    def alone(self, took: parallel.Timing) -> None:
        """Account a read made alone for ``cores_busy``: the process's CPU beside the read's wall time."""
        self.alone_wall += took.wall
        self.alone_process_cpu += took.process_cpu

    @property
    def cores_busy(self) -> float | None:
        """CPUs the reads made alone kept busy: their process CPU time over their wall time."""
        return self.alone_process_cpu / self.alone_wall if self.alone_wall > 0 else None

    @property
    def share(self) -> float | None:
        """CPU seconds over wall seconds of the rows read alone."""
        return sum(self.cpus) / self.wall if self.wall > 0 else None

    def fetch_pair(self, source: Any, index: int, keep: bool = True) -> None:
        """Read the first row again and row ``index`` at once, on two threads: the pair gives the parallel
        fraction, and the second read of the first row the fidelity check (does a row read twice come back the
        same?) at no extra row's time. With ``keep``, the new row is accounted at the time it would take alone
        (its CPU time over the CPU share of the rows read alone); without, the pair only times the rows' overlap."""
        share = self.share
        pair = [self.first[0], index]
        try:
            rows, walls, cpus, together, gil_busy = parallel.run_pair(lambda i: source[np.int64(i)], pair)
        except Exception:  # a source that is not safe on two threads: read it as MindSpore's workers would
            if keep:
                self.keep(index, self.fetch(operator.getitem, source, np.int64(index)))
            return
        self.compare_first(rows[0])
        self.first_again(parallel.time_alone(walls[0], cpus[0], share), cpus[0])
        self.pair_seconds, self.pair_cpu = together, sum(cpus) / 2
        if keep:
            self.walls.append(parallel.time_alone(walls[1], cpus[1], share))
            self.cpus.append(cpus[1])
            self.keep(index, rows[1])
        fraction = parallel.parallel_fraction(cpus, together, share, parallel.usable_cpus(), gil_busy)
        self.gil_watched = self.gil_watched or parallel.watch_decides(cpus, gil_busy)
        self.parallel = fraction if self.parallel is None or fraction is None else max(self.parallel, fraction)

    def reread_first(self, source: Any) -> None:
        """The fidelity check on its own (rows too cheap to time a pair, or a source unsafe on two threads).

        Timed: where the second read of the first row is the faster, it stands for that row (a first read in a
        fresh process also pays for the pages and lazy set-up a worker pays once: ``parallel.PAIR_AT_ONCE_FROM``)."""
        if self.first is not None and not self.compared:
            row, took = parallel.timed_call(operator.getitem, source, np.int64(self.first[0]))
            self.compare_first(row)
            self.first_again(took.wall, took.cpu)
            self.alone(took)

    def first_again(self, wall: float, cpu: float) -> None:
        """Another read of the first row (alone, or its time alone in a pair): the fastest stands for the row."""
        if self.walls and wall < self.walls[0]:
            self.walls[0], self.cpus[0] = wall, cpu

    def compare_first(self, row: Any) -> None:
        index, before = self.first
        self.compared = True
        again = convert_row(row, index, self.names)
        if not same_row(before, again):
            self.reread = f"source[{index}] read twice differs"
        made = self.first_growth is None or self.first_growth > (row_bytes(before) + dict_bytes(before)) // 2
        self.held = 0.0 if made else held_fraction(before, again)  # made by the first read, then kept (a cache)

    def keep(self, index: Any, row: Any) -> None:
        self.whole_rows = self.whole_rows or one_column(row)
        row = materialized(row)
        converted = checked_row(row, index, self.names, self.check)
        refuse_column_types(converted, index, self.names, self.column_dtypes)
        if self.first is None:
            self.first, self.first_print = (int(index), converted), fingerprint(converted)
            sandbox.first_read_done()
        elif self.reused is None and int(index) != self.first[0]:
            self.reused = reused_buffer(self.first, self.first_print, int(index))
        columns = row if isinstance(row, (tuple, list)) else (row,)
        self.tensors = self.tensors or any(hasattr(c, "asnumpy") for c in columns)
        self.indices.append(int(index))
        self.sizes.append(row_bytes(converted))
        self.dict_sizes.append(dict_bytes(converted))
        self.skeletons.append(tuple(_skeleton(c) for c in converted))

    def stats(self, random_access: bool, length: int | None, started: float, notes: list) -> RowStats:
        columns = []
        if self.skeletons:
            width = max(len(r) for r in self.skeletons)
            for i in range(width):
                cells = [r[i] for r in self.skeletons if i < len(r)]
                if any(c is None for c in cells):
                    columns.append(ColumnStats(_column_name(self.names, i), "dict", (), 0, False))
                    continue
                shapes = {shape for shape, _, _ in cells}
                dtypes = {dtype for _, dtype, _ in cells}
                columns.append(ColumnStats(_column_name(self.names, i), "|".join(sorted(dtypes)),
                                           max(shapes, key=lambda s: int(np.prod(s))),
                                           max(nbytes for _, _, nbytes in cells), len(shapes) > 1))
        n = len(self.indices)
        return RowStats(random_access, length, n, tuple(self.indices), tuple(columns),
                        max(self.sizes, default=0), min(self.sizes, default=0),
                        float(np.median(self.walls)) if self.walls else None,
                        self.share,
                        time.perf_counter() - started, tuple(notes), self.tensors,
                        parallel_fraction=self.parallel, reread_differs=self.reread, cores_busy=self.cores_busy,
                        rows_one_column=self.whole_rows, sampled=self.sampled, raised=self.raised,
                        held_fraction=self.held, dict_bytes_max=max(self.dict_sizes, default=0),
                        reused_buffer=self.reused)


LEN_HINT = "the probe reads the last index len(source)-1: if the data has fewer rows, __len__ is wrong"


def is_random_access(source: Any) -> bool:
    """MindSpore takes the multiprocess path only for sources with both ``__getitem__`` and ``__len__``."""
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


def measure_random_access(source: Any, names: Sequence[str] | None, max_rows: int = 8, min_rows: int = 3,
                          time_fraction: float = 0.02, check: Callable[[Any], Any] | None = None,
                          column_dtypes: tuple | None = None,
                          sampled: Callable[[int], tuple] | None = None) -> RowStats:
    """Fetch a few rows spread over the rows the pipeline reads; stop early once probing would cost a visible
    part of an epoch.

    Meant for a probe child (``sandbox.run_in_fork``): a source's ``__getitem__`` may have side effects. Each
    index is passed as ``numpy.int64``, as MindSpore's sampler passes it, so the rows' dtypes are the ones the
    pipeline will see.

    Args:
        check: the framework's own conversion of a row (MindSpore's ``_convert_row``): what it refuses is
            refused here, with the column and the fix.
        column_dtypes: ``GeneratorDataset``'s ``column_types`` as numpy dtypes (``compat.column_dtypes``).
        sampled: ``length -> (rows, draws)``, the rows the caller's sampler may draw (``None``: any) and how
            many it draws an epoch (the engine's ``sampled_rows``): rows it never draws are not read (a header
            row that ``SequentialSampler(start_index=1)`` skips was refused as a bad row, where raw ran).

    Raises:
        RowError: a row the framework cannot carry.
        Exception: whatever ``source[i]`` raised, unchanged.
    """
    started = time.perf_counter()
    notes: list = []
    length = len(source)
    probe = _Probe(names, check, column_dtypes)
    if length == 0:
        notes.append("source is empty")
        return probe.stats(True, 0, started, notes)
    pool, probe.sampled = _sampled(sampled, length, notes)
    order = [pool[k] for k in _spread(len(pool), max_rows)] if pool else _spread(length, max_rows)
    epoch, done, reads = probe.sampled or (len(pool) if pool else length), 0, 0
    while done < len(order):
        try:
            done, reads = _read_next(probe, source, order, done, reads, notes)
        except RowError:
            raise
        except Exception as exc:  # noqa: BLE001 - the source's own error, MindSpore's to raise at that row
            if not probe.indices:
                raise
            failed = next((i for i in order[done:] if i not in probe.indices), order[done])  # a second pair's
            probe.raised = raised_at(f"row {failed}", exc, LEN_HINT)
            notes.append(f"row {failed} raised {type(exc).__name__}: planned from the {len(probe.indices)} "
                         f"row(s) read before it")
            break
        # Rows cost about alike, so the share of an epoch is the share of its reads; reads, not distinct rows:
        # the pair's second read of row 0 costs a row's time too (all of it where rows hold the GIL), so a
        # source of 100 slow rows stops after the pair, its first and last rows read.
        if reads >= min_rows and reads > time_fraction * epoch:
            notes.append(f"stopped after {done} rows ({reads} reads): probing is capped at {time_fraction:.0%} "
                         f"of an epoch")
            break
    if probe.pair_seconds == 0 and len(order) == 2 and probe.raised is None and probe.pair_due():
        probe.fetch_pair(source, order[1], keep=False)  # two rows, both read and counted already: the late rule
    probe.reread_first(source)  # where no pair re-read the first row
    return probe.stats(True, length, started, notes)


def _read_next(probe: _Probe, source: Any, order: list, done: int, reads: int, notes: list) -> tuple:
    """Read ``order[done]`` (alone, or beside row 0 again where a pair is due); ``(done, reads)`` after it."""
    if probe.pair_seconds == 0 and probe.pair_due():
        # As cold as the pair: the first read for a pair at once (the pair's faster read of row 0 replaces it),
        # the warm reads for a late one.
        alone = (probe.walls[0], probe.cpus[0]) if done == 1 else \
            (float(np.median(probe.walls[1:])), float(np.median(probe.cpus[1:])))
        probe.fetch_pair(source, order[done])  # row 0 again beside a new row: the GIL's share and the re-read
        done, reads = done + 1, reads + 2
        if len(order) > done and _second_pair_if_cold(probe, source, order[done], alone, True, notes):
            done, reads = done + 1, reads + 2
        return done, reads
    row = probe.fetch(operator.getitem, source, np.int64(order[done]))
    probe.keep(order[done], row)
    del row  # freed before the next fetch, which can then reuse its pages
    return done + 1, reads + 1


def raised_at(row: str, exc: BaseException, index_error_hint: str | None = None) -> str:
    """A later probe row's error in a line, with the code line that raised it: planned from the rows read
    before it, as MindSpore raises it when the pipeline reaches that row (an audit: a source whose last rows
    raise went unplanned, and its unplanned slots filled a 64 MB /dev/shm before that row was reached)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    hint = f" ({index_error_hint})" if index_error_hint and isinstance(exc, IndexError) else ""
    return f"{row} raised {type(exc).__name__}: {str(exc)[:200]}{where}{hint}"



def _sampled(sampled: Callable[[int], tuple] | None, length: int, notes: list) -> tuple:
    """``(rows, draws)`` of the caller's sampler (``measure_random_access``), or ``(None, None)``."""
    if sampled is None:
        return None, None
    try:
        pool, draws = sampled(length)
    except Exception as exc:  # the sampler's own code: MindSpore meets it when it iterates
        notes.append(f"the sampler's rows could not be read ahead ({type(exc).__name__}): rows spread over the "
                     f"source read instead")
        return None, None
    if pool:
        notes.append(f"rows read among the {len(pool)} the sampler may draw")
    return (pool or None), draws


def _second_pair_if_cold(probe: _Probe, source: Any, index: int, alone: tuple, keep: bool, notes: list) -> bool:
    """Read a second pair where the first read low yet overlapped or burned more CPU than a row alone
    (``parallel.may_have_run_cold``; ``alone``: the wall and CPU seconds of the reads it is judged against): the
    larger of the two fractions is the warm one. The same rule for a pair read at once and a late one: JPEG rows of
    6.5-9 ms (bench_core) fall on either side of ``PAIR_AT_ONCE_FROM``; their pairs read 5-87% outside the GIL
    across builds."""
    if probe.gil_watched:  # the GIL's own busy time: a cold pair's kernel contention does not read as the GIL
        return False
    wall, cpu = alone
    busy = cpu > 0 and cpu >= parallel.MIN_CPU_SHARE * wall  # CPU-bound reads: their CPU is the row's work
    if not parallel.may_have_run_cold(probe.parallel, probe.pair_seconds, wall, probe.pair_cpu / cpu if busy
                                      else None):
        return False
    first = probe.parallel
    probe.fetch_pair(source, index, keep=keep)
    notes.append(f"the first pair overlapped but read {first:.0%} of the work outside the GIL (a cold fork): a "
                 f"second pair read, {probe.parallel:.0%} kept")
    return True


def checked_row(row: Any, index: Any, names: Sequence[str] | None, check: Callable[[Any], Any] | None) -> tuple:
    """The converted row, or a ``RowError`` naming the column where possible and keeping the framework's own
    message where its conversion (``check``) refuses the row too."""
    refused = None
    if check is not None:
        try:
            check(row)
        except Exception as exc:  # MindSpore's own refusal: kept, and explained below
            refused = exc
    try:
        converted = convert_row(row, index, names)
    except RowError as ours:
        if refused is None:
            raise
        raise RowError(f"{ours} (MindSpore's row conversion: {type(refused).__name__}: {refused})", ours.column,
                       ours.row) from refused
    if refused is not None:
        column = _refused_column(row, names, check)
        framework_check(refused, index, column, _tensor_in(row, names, column))
    return converted


def _tensor_in(row: Any, names: Sequence[str] | None, column: str | None) -> bool:
    """Whether the refused column (or, unnamed, any column) is a torch tensor: its fix is ``x.numpy()``."""
    columns = _columns(row) if not isinstance(row, (ONE_COLUMN, dict)) else [row]
    values = [v for i, v in enumerate(columns or []) if column is None or _column_name(names, i) == column]
    return any(type(v).__module__.split(".")[0] == "torch" for v in values)


def _refused_column(row: Any, names: Sequence[str] | None, check: Callable[[Any], Any]) -> str | None:
    """The first column of ``row`` (as the source returned it) the framework's conversion refuses alone
    (``check((value,))``), or ``None``."""
    columns = [row] if isinstance(row, (ONE_COLUMN, dict)) or hasattr(row, "asnumpy") else _columns(row) or []
    for i, value in enumerate(columns):
        try:
            check((value,))
        except Exception:  # noqa: BLE001  (the column it refuses)
            return _column_name(names, i)
    return None


def refuse_column_types(converted: tuple, index: Any, names: Sequence[str] | None,
                        column_dtypes: tuple | None) -> None:
    """A ``RowError`` for a column whose dtype is not its ``column_types`` entry: MindSpore refuses such a row
    while iterating, in every release from 2.0 to 2.10 (measured: int32 for Int64, float64 for Float32, uint8 for
    Bool), with "type of returned data in 'GeneratorDataset' should be same with specified column_types, but the
    type of returned data: <class 'numpy.ndarray'>", which names neither the column nor the dtype; and for a
    column ``column_types`` gives no type ("specified column type: unknown", 2.0 and 2.10, an audit)."""
    given = [c for c in column_dtypes or () if len(c) == 2]  # from column_types, not a schema
    if given and len(given) == len(column_dtypes) and len(converted) > len(given):
        name = _column_name(names, len(given))
        raise RowError(f"column '{name}' of row {index} has no type in column_types, which gives {len(given)} for "
                       f"{len(converted)} columns: MindSpore refuses every row ('specified column type: "
                       f"unknown'). Fix: give one type per column in column_types, or leave column_types out.",
                       name, index)
    for i, (value, (expected, type_name, *declared_in)) in enumerate(zip(converted, column_dtypes or ())):
        if expected is None or not isinstance(value, np.ndarray) or value.dtype == expected or \
                value.dtype.kind == expected.kind == "U":
            continue
        name = _column_name(names, i)
        text = expected.kind == "U"
        fix = (f"return a str (or x.decode() of bytes) for column '{name}'" if text else
               f"return x.astype(np.{expected.name}) for column '{name}'")
        given = "string" if value.dtype.kind == "U" else "bool_" if value.dtype == bool else \
            value.dtype.name if value.dtype.kind in "iuf" else None  # bytes: no MindSpore type takes them
        where = declared_in[0] if declared_in else "column_types"  # or "its schema" (``compat.column_dtypes``)
        other = f", or give it mindspore.{given} in {where}" if given else ""
        raise RowError(f"column '{name}' of row {index} is {value.dtype}, but {where} gives it {type_name}: "
                       f"MindSpore refuses a row whose dtype differs from its column_types (\"type of returned data "
                       f"in 'GeneratorDataset' should be same with specified column_types\"). Fix: {fix}{other}.",
                       name, index)


def framework_check(exc: Exception, index: Any, column: str | None = None, tensor: bool = False) -> None:
    """Refuse a row the framework's own conversion refused with ``exc``, keeping its message; ``column``: the one
    it refuses, where known; ``tensor``: it is a torch tensor (an audit was told of scalars and lists)."""
    hint = ""
    if "copy" in str(exc):
        hint = (" (NumPy 2 refuses np.array(x, copy=False) for scalars, Python's or numpy's such as np.int64(i), "
                "for lists and for torch tensors, which MindSpore's conversion calls)")
    where = f"column '{column}' of row {index}" if column is not None else f"row {index}"
    how = "x.numpy() for a torch tensor, x.detach().cpu().numpy() for one on a device or with grad" if tensor \
        else "np.asarray(x) for scalars and lists"
    raise RowError(f"{where}: MindSpore's row conversion raises {type(exc).__name__}: {exc}{hint}. Fix: "
                   f"return {'it' if column is not None else 'every column'} as a numpy array ({how}), or install "
                   f"NumPy 1.x ({NUMPY1_INSTALL}).", column, index) from exc


def read_head(source: Any, count: int) -> list:
    """The first ``count`` rows of an iterable or generator-function source, as MindSpore's ``_iter_fn`` /
    ``_generator_fn`` would start an epoch. Only for a probe child: reading consumes the iterator."""
    iterator = iter(source) if hasattr(source, "__iter__") else iter(source())
    return list(itertools.islice(iterator, count))
