"""Measure a pipeline stage without touching what the pipeline will yield.

``build_dataset`` and ``map`` must know how big and how costly rows are before they choose a transport, but
reading rows has side effects (a source that counts calls, draws random numbers, advances an iterator). So
every read happens in a probe child (``sandbox.run_in_fork``): the parent's source, operations, RNG states
and iterators stay exactly as raw MindSpore will find them.

A stage remembers how to make its rows again (its *lineage*): a ``map`` after ``build_dataset`` measures its
operations on rows the child re-reads from the source and passes through the earlier stages, so no stage
holds rows in the parent for a later one. Where rows cannot be made without side effects (an iterator that
is not a fresh one, an open file, a foreign Python pipeline), the stage is planned without a measurement,
and the log says why.
"""

from __future__ import annotations

import copy
import inspect
import logging
import traceback
import types
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from ms_shm import codescan, objects, parallel, rows, sandbox
from ms_shm._results import Result, record
from ms_shm.engines.mindspore.profiles import is_random_transform, random_mindspore_base

log = logging.getLogger(__name__)

RAISES_AT_ROW = "MindSpore will raise it when the pipeline reaches that row"  # a failing row's fate by default

PROBE_ROWS_FOR_MAP = 3


@record
class OperationStats(Result):
    """A map stage's operations on a few rows: the largest input and output row, median seconds per row."""

    rows: int
    in_bytes: int
    out_bytes: int
    seconds_per_row: float | None
    cpu_fraction: float | None
    worker_bytes: int | None = None  # what the probe child held alone at the end: a forked worker's growth
    parallel_fraction: float | None = None  # of the CPU work, what ran outside the GIL (``ms_shm.parallel``)
    threads_started: int | None = None  # native threads the operations left running (``sandbox.Outcome``)
    cores_busy: float | None = None  # process CPU time / wall time of runs made alone (``RowStats.cores_busy``)
    raised: str | None = None  # a probe row after the first raised this (the rows run before it were measured)


@record
class StageProbe(Result):
    """What the probe child saw of one stage, or why it saw nothing.

    Attributes:
        stats: ``RowStats`` of a source or ``OperationStats`` of a map (``None`` when not measured).
        effects: what reading changed (global RNG, the source's or the operations' own state).
        unmeasured: why there is no measurement (``None`` when there is one).
    """

    stats: Any
    effects: sandbox.Effects = sandbox.Effects()
    unmeasured: str | None = None


# --- lineage: how a stage's rows can be made again, inside a probe child -----------------------------------

class Lineage:
    """Makes a few of a stage's rows as ``{column: [values]}``; only ever called in a probe child."""

    def rows(self, count: int) -> dict:
        raise NotImplementedError

    def why_not(self) -> str | None:
        """Why this stage's rows cannot be made without side effects, or ``None``."""
        return None

    def code_objects(self) -> list:
        """The program's objects whose code making these rows runs (``sandbox.run_in_fork``'s ``watched``)."""
        return []

    def row_name(self, k: int) -> str:
        """The ``k``-th row ``rows`` makes, as the user knows it (a source's probe rows are spread over it)."""
        return f"row {k}"


@record
class SourceLineage(Lineage):
    source: Any
    names: tuple
    indices: tuple

    def rows(self, count: int) -> dict:
        return _by_column([rows.convert_row(self.source[np.int64(i)], i, self.names)
                           for i in self.indices[:count]], self.names)

    def why_not(self) -> str | None:
        return sandbox.shared_with_processes([self.source])

    def code_objects(self) -> list:
        return [self.source]

    def row_name(self, k: int) -> str:
        return f"source row {self.indices[k]}"


@record
class IterableLineage(Lineage):
    source: Any
    names: tuple

    def rows(self, count: int) -> dict:
        head = rows.read_head(self.source, count)
        return _by_column([rows.convert_row(r, i, self.names) for i, r in enumerate(head)], self.names)

    def why_not(self) -> str | None:
        return fresh_iteration_blocker(self.source) or sandbox.stream_blocker([self.source]) or \
            sandbox.shared_with_processes([self.source])

    def code_objects(self) -> list:
        return [self.source]


@record
class TakenRows(Lineage):
    """Rows already read in the parent (from a pipeline with no Python code, which has no side effects)."""

    columns: Any  # dict

    def rows(self, count: int) -> dict:
        return {k: v[:count] for k, v in self.columns.items()}


@record
class MapLineage(Lineage):
    parent: Lineage
    operations: Any
    input_columns: tuple
    output_columns: tuple

    def rows(self, count: int) -> dict:
        available = self.parent.rows(count)
        out = {k: v for k, v in available.items() if k not in self.input_columns}
        results = _rows_until_one_raises(self.operations, [[available[c][i] for c in self.input_columns]
                                                           for i in range(_count(available))])
        out = {k: v[:len(results)] for k, v in out.items()}
        for n, name in enumerate(self.output_columns):
            out[name] = [r[n] for r in results if n < len(r)]
        return out

    def why_not(self) -> str | None:
        return self.parent.why_not() or sandbox.shared_with_processes(_operation_objects(self.operations))

    def code_objects(self) -> list:
        return self.parent.code_objects() + _operation_objects(self.operations)

    def row_name(self, k: int) -> str:
        return self.parent.row_name(k)


@record
class JoinedLineage(Lineage):
    """Rows of pipelines joined: ``concat`` (``a + b``, the same columns: rows of each part, the first's first)
    or ``zip`` (each part's columns side by side)."""

    kind: str
    parts: tuple

    def rows(self, count: int) -> dict:
        if self.kind == "zip":
            out: dict = {}
            for part in self.parts:
                out.update(part.rows(count))
            n = _count(out)
            return {k: v[:n] for k, v in out.items()}
        each, out = max(1, -(-count // len(self.parts))), {}
        for part in self.parts:  # rows of every part: the row sizes of one may differ from the others'
            for k, v in part.rows(each).items():
                out.setdefault(k, []).extend(v)
        n = min(count, _count(out))
        return {k: v[:n] for k, v in out.items()}

    def why_not(self) -> str | None:
        return next((why for why in (part.why_not() for part in self.parts) if why), None)

    def code_objects(self) -> list:
        return [obj for part in self.parts for obj in part.code_objects()]

    def row_name(self, k: int) -> str:
        return f"row {k} of the {self.kind}"


def _rows_until_one_raises(operations: Any, inputs: list) -> list:
    """The operations' outputs for ``inputs`` up to the first row they raise on (the next stage is measured on
    the rows before it, as the stage itself is: ``time_operations``); the error where the first row raises."""
    results: list = []
    for args in inputs:
        try:
            results.append(run_operations(operations, args))
        except rows.RowError:
            raise
        except Exception:  # noqa: BLE001 - said by this map's own probe, which ran the same rows
            if not results:
                raise
            break
    return results


@record
class Unavailable(Lineage):
    reason: str

    def why_not(self) -> str | None:
        return self.reason


def fresh_iteration_blocker(source: Any) -> str | None:
    """Why reading the head of an iterable source in a child could change what the parent later reads."""
    if isinstance(source, types.GeneratorType):
        if inspect.getgeneratorstate(source) != inspect.GEN_CREATED:
            return "the source is a generator that has already started"
        return None
    if not objects.has(source, "__iter__"):
        return None  # a generator function: each call starts afresh (a file it reads is rewound: ``fdguard``)
    if objects.has(source, "__next__"):  # told without calling ``__iter__`` here, which may draw or count
        return "the source is its own iterator (it has __next__): reading ahead would consume it"
    return None


def _by_column(converted: list, names: Sequence[str]) -> dict:
    out: dict = {n: [] for n in names}
    for row in converted:
        for n, value in zip(names, row):
            out[n].append(value)
    return out


def _count(columns: dict) -> int:
    return min((len(v) for v in columns.values()), default=0)


# --- the registry: plans and lineages by dataset, without attributes MindSpore would deep-copy -------------

_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LINEAGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def remember(dataset: Any, plan: Any, lineage: Lineage) -> None:
    """Keep the plan and lineage beside the dataset, not on it: MindSpore deep-copies every attribute of a
    dataset (but its source) for each iterator, and a lineage holds the source."""
    try:
        _PLANS[dataset] = plan
        _LINEAGES[dataset] = lineage
    except TypeError as exc:  # not weak-referenceable: the plan is only logged
        log.debug("ms_shm cannot remember the plan of %r: %s", type(dataset).__name__, exc)


def plan_of(dataset: Any) -> Any:
    try:
        return _PLANS.get(dataset)
    except TypeError:
        return None


def lineage_of(dataset: Any) -> Lineage | None:
    try:
        return _LINEAGES.get(dataset)
    except TypeError:
        return None


# --- probing ---------------------------------------------------------------------------------------------

def probe_random_access(source: Any, names: Sequence[str] | None, check: Callable | None,
                        worker_pages: bool = False, defer_row_errors: bool = False,
                        column_dtypes: tuple | None = None, beside: bool = False,
                        sampled: Callable[[int], tuple] | None = None) -> StageProbe:
    """Measure a random-access source in a probe child, on rows the caller's sampler may draw (``sampled``:
    ``rows.measure_random_access``).

    Raises:
        rows.RowError: a probe row the framework cannot carry (an earlier, clearer error than a worker's),
            unless ``defer_row_errors`` (``ms_shm.patch``: MindSpore raises it while iterating, so must the
            patched code): then it is logged and the stage is left unmeasured.
    """
    shared = sandbox.shared_with_processes([source])
    if shared:
        return _with_code_read(StageProbe(None, unmeasured=shared), source)
    here = _read_here(source, names, check, column_dtypes, sampled) if not worker_pages else None
    if here is not None:
        return _with_code_read(_source_probe(here, defer_row_errors), source)

    def in_child():
        stats: list = []
        try:
            len(source)
        except Exception as exc:  # MindSpore calls it when the dataset is built, and raises it there
            return (f"len(source) raised {type(exc).__name__}: {str(exc)[:200]} (MindSpore raises it when the "
                    f"dataset is built)"), None

        def measured():
            stats.append(rows.measure_random_access(source, names, check=check, column_dtypes=column_dtypes,
                                                    sampled=sampled))
            return stats[0]

        def again():
            if stats[0].indices:
                source[np.int64(stats[0].indices[0])]

        return sandbox.watch_effects(measured, [source], lambda: stats[0].reread_differs, again)

    outcome = _fork(in_child, worker_pages, beside, source)
    return _with_code_read(_source_probe(outcome, defer_row_errors), source, read=outcome.beside)


def _read_here(source: Any, names: Sequence[str] | None, check: Callable | None, column_dtypes: tuple | None,
               sampled: Callable[[int], tuple] | None) -> sandbox.Outcome | None:
    """The probe of a source whose rows are plain data in a list, tuple or array (``sandbox.reads_purely``),
    read in this process: nothing to throw away, no fork. ``None`` where it is not such a source, a row holds
    an object of the program's (converting it may run the program's code), or the rows drawn are asked of the
    program's own sampler (``runs_program_code``: its ``__iter__`` may draw from ``np.random`` or be a one-shot
    iterator; an audit's sampler shuffling with ``np.random.permutation`` gave other epochs than raw's): read in
    a fork then. Where memory may bind the fork is kept too: it measures a forked worker's own pages."""
    if not sandbox.reads_purely(source) or getattr(sampled, "runs_program_code", False):
        return None
    try:
        stats = rows.measure_random_access(sandbox.PlainRows(source), names, check=check,
                                           column_dtypes=column_dtypes, sampled=sampled)
    except sandbox.NotPlainData:
        return None
    except Exception as exc:  # noqa: BLE001 - a row MindSpore refuses, or what converting it raised
        return sandbox.Outcome(error=exc, remote_traceback=traceback.format_exc())
    return sandbox.Outcome(value=(stats, sandbox.Effects()), threads_started=0)  # plain data starts no thread


def _source_probe(outcome: sandbox.Outcome, defer_row_errors: bool) -> StageProbe:
    probe = _outcome(outcome, "source", defer_row_errors)
    if isinstance(probe.stats, str):
        return StageProbe(None, unmeasured=probe.stats)
    if getattr(probe.stats, "raised", None):
        log.warning("ms_shm: the source's probe %s; planned from the %d row(s) read before it (%s)",
                    probe.stats.raised, probe.stats.probed, RAISES_AT_ROW)
    return probe


def probe_operations(lineage: Lineage, operations: Any, input_columns: Sequence[str],
                     output_columns: Sequence[str], worker_pages: bool = False,
                     defer_row_errors: bool = False, beside: bool = False, fate: str | None = None
                     ) -> StageProbe:
    """Run ``operations`` on a few of the input stage's rows, in a probe child, and measure them. ``fate``: what
    the framework does with a row they raise on (the engine's ``failing_row_fate``), for the warning."""
    blocked = lineage.why_not()
    if blocked:
        return StageProbe(None, unmeasured=f"the input rows cannot be read ahead: {blocked}")
    watched = _operation_objects(operations)
    shared = sandbox.shared_with_processes(watched)
    if shared:
        return StageProbe(None, unmeasured=shared)

    def in_child():
        available = lineage.rows(PROBE_ROWS_FOR_MAP)
        missing = [c for c in input_columns if c not in available]
        if missing:
            return f"input column(s) {missing} are not among the input's columns {sorted(available)}", None
        inputs = [[available[c][i] for c in input_columns] for i in range(_count(available))]
        first: list = []
        measured = sandbox.watch_effects(lambda: time_operations(operations, inputs, first, lineage.row_name),
                                         watched,
                                         lambda: _reread(first, lambda: run_operations(operations, inputs[0]),
                                                         "the operations"))
        _check_columns_returned(first, output_columns, "map")
        return measured

    outcome = _fork(in_child, worker_pages, beside, operations=operations, lineage=lineage)
    probe = _outcome(outcome, "operations", defer_row_errors, fate)
    if isinstance(probe.stats, str):  # MindSpore raises on these columns when the pipeline starts
        return StageProbe(None, unmeasured=probe.stats)
    if getattr(probe.stats, "raised", None):
        log.warning("ms_shm: the map's operations on its probe %s; planned from the %d row(s) run before it (%s)",
                    probe.stats.raised, probe.stats.rows, fate or RAISES_AT_ROW)
    return _with_code_read(StageProbe(probe.stats, _random_ops(operations, probe.effects), probe.unmeasured),
                         operations=operations, read=outcome.beside)


class ProbeBatchInfo:
    """What ``per_batch_map`` gets as its last argument in the probe child: the first batch of the first epoch."""

    def get_batch_num(self) -> int:
        return 0

    def get_epoch_num(self) -> int:
        return 0


def probe_batch(lineage: Lineage, per_batch_map: Any, batch_size: int, input_columns: Sequence[str],
                output_columns: Sequence[str], worker_pages: bool = False,
                defer_row_errors: bool = False, beside: bool = False) -> StageProbe:
    """Run ``per_batch_map`` on a probe batch, in a probe child, and measure it as one map row.

    The probe batch holds the few rows the input stage's lineage makes (at most ``batch_size``); bytes in and
    out and the seconds it took are scaled to ``batch_size`` rows (a per_batch_map is per row work)."""
    blocked = lineage.why_not()
    if blocked:
        return StageProbe(None, unmeasured=f"the input rows cannot be read ahead: {blocked}")
    shared = sandbox.shared_with_processes(_operation_objects(per_batch_map))
    if shared:
        return StageProbe(None, unmeasured=shared)

    def in_child():
        available = lineage.rows(min(batch_size, PROBE_ROWS_FOR_MAP + 1))
        missing = [c for c in input_columns if c not in available]
        if missing:
            return f"input column(s) {missing} are not among the input's columns {sorted(available)}", None
        columns, first = [list(available[c]) for c in input_columns], []
        measured = sandbox.watch_effects(lambda: time_batch(per_batch_map, columns, batch_size, first),
                                         _operation_objects(per_batch_map),
                                         lambda: _reread(first, lambda: _call_batch(per_batch_map, columns),
                                                         "per_batch_map"))
        _check_columns_returned(first, output_columns, "per_batch_map")
        return measured

    outcome = _fork(in_child, worker_pages, beside, operations=per_batch_map, lineage=lineage)
    probe = _outcome(outcome, "per_batch_map", defer_row_errors)
    if isinstance(probe.stats, str):
        return StageProbe(None, unmeasured=probe.stats)
    return _with_code_read(probe, operations=per_batch_map, read=outcome.beside)


def time_batch(per_batch_map: Any, columns: list, batch_size: int, keep: list | None = None) -> OperationStats:
    """One call of ``per_batch_map`` on ``columns`` (lists of rows), scaled to a batch of ``batch_size``; its
    output appended to ``keep`` (for ``_reread``)."""
    k = max(1, min((len(c) for c in columns), default=1))
    out, took = parallel.timed_call(_call_batch, per_batch_map, [fresh_inputs(c) for c in columns], True)
    if keep is not None:
        keep.append(kept_for_reread(out))
    scale = batch_size / k
    out = out if isinstance(out, tuple) else (out,)
    return OperationStats(1, int(_nbytes(columns) * scale), int(_nbytes(out) * scale), took.wall * scale,
                          _share([took.wall], [took.cpu]), cores_busy=_share([took.wall], [took.process_cpu]))


def _call_batch(per_batch_map: Any, columns: list, copied: bool = False) -> Any:
    """``per_batch_map`` on copies of ``columns`` (unless the caller made them: ``copied``): one that works in
    place must not alter a later call's input."""
    return per_batch_map(*(columns if copied else [fresh_inputs(c) for c in columns]), ProbeBatchInfo())


def fresh_inputs(values: Sequence[Any]) -> list:
    """``_fresh`` copies of a row's (or a batch column's) values, made before a probe call is timed: a deep
    copy of a 300 MiB dict value, timed as the operation's, made an audit's ``per_batch_map`` look 200 times
    slower and worker processes faster (OOM-killed in 8000 MB where raw ran in 2265 MiB)."""
    return [_fresh(v) for v in values]


def _fresh(value: Any) -> Any:
    """A copy of one input the probe passes to the program's code, for each call: MindSpore passes every row
    once, and the probe runs the first again (the fidelity check). A dict column (a ``dict`` or a list of them)
    is copied too: mindyolo's ``test_collate_fn`` pops ``'img'`` from its rows, so the second call raised
    ``KeyError`` and the batch was built unmeasured, with a warning of an error MindSpore never raises (an
    audit). Other objects are passed as they are."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (dict, list)):
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that refuses a copy: passed as it is, as before
            return value
    return value


def _reread(first: list, call: Callable[[], Any], what: str) -> str | None:
    """Why ``call()``, the first probe input computed again, differs from the first result, or ``None``: a
    counter or a generator the probe could not see (a closure's, a C library's) gives each worker other
    outputs."""
    if not first:
        return None
    again = first[1] if len(first) > 1 else kept_for_reread(call())  # a pair may have computed it again
    if rows.same_row(first[0], again):
        return None
    return f"{what} gave another output for the same input row computed again"


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(np.asarray(value), "nbytes", 0))


@record
class Printed:
    """An array of an operation's output as the probe keeps it to compare a second computation with, where the
    output is too large to hold twice (``kept_for_reread``)."""

    dtype: str
    shape: tuple
    crc: int


def kept_for_reread(output: Any) -> Any:
    """An operation's output (a map's row, a ``per_batch_map``'s batch) as the probe keeps it for the re-run
    ``_reread`` compares: whole, or where it weighs more than ``parallel.PAIR_ROWS_UP_TO`` (``_nbytes``), each
    contiguous array as its dtype, shape and ``rows.fingerprint``, so the probe holds one such output at a time,
    as a worker does (MindSpore's UT map of 0.95 GB rows: 1979 MiB in the probe child with the first kept whole,
    where a fresh 0.95 GB row beside it took 3.3 s on this VM against 0.16 s alone)."""
    if _nbytes(output) <= parallel.PAIR_ROWS_UP_TO:
        return output
    return _printed(output)


def _printed(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.flags.c_contiguous and not value.dtype.hasobject and value.nbytes:
        return Printed(value.dtype.str, value.shape, rows.fingerprint((value,)))
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_printed(v) for v in value)
    return value


def _outcome(outcome: sandbox.Outcome, what: str, defer_row_errors: bool = False,
             fate: str | None = None) -> StageProbe:
    if outcome.unavailable:
        return StageProbe(None, unmeasured=outcome.unavailable)
    if isinstance(outcome.error, rows.RowError) and not defer_row_errors and fate is None:
        raise outcome.error  # where the framework skips or replaces a failing row, said as a warning below
    if outcome.error is not None:
        why = _error_text(outcome.error, outcome.remote_traceback, what, fate)
        log.warning("ms_shm: %s", why)
        return StageProbe(None, unmeasured=why)
    stats, effects = outcome.value
    if isinstance(stats, (rows.RowStats, OperationStats)):
        stats = replace(stats, worker_bytes=outcome.private_bytes, threads_started=outcome.threads_started)
    return StageProbe(stats, effects or sandbox.Effects())


def _error_text(exc: BaseException, remote_traceback: str, what: str, fate: str | None = None) -> str:
    """The user's exception, where it was raised, and what it means (``fate``: what the framework does with
    that row; ``None``: it raises it mid-epoch). A ``RowError`` is ms_shm's own finding, deferred under
    ``ms_shm.patch`` or where the call's sampler or shard may never draw that row: said as such, not as the
    source's."""
    if isinstance(exc, rows.RowError):
        return (f"a probe row of the {what} is one MindSpore refuses: {exc} (MindSpore raises its own error if the "
                f"pipeline reaches that row: under ms_shm.patch, or where the call's sampler or shard may never "
                f"draw it), so the pipeline is built as asked, without a measurement")
    lines = [line.strip() for line in remote_traceback.strip().splitlines() if line.strip().startswith("File ")]
    where = f" ({lines[-1]})" if lines else ""
    hint = ""
    if isinstance(exc, IndexError) and what == "source":
        hint = f" ({rows.LEN_HINT})"
    return (f"the {what} raised {type(exc).__name__}: {exc} on a probe row{where}{hint}; "
            f"{fate or RAISES_AT_ROW}, so the pipeline is built as asked, without a measurement")


def _operation_objects(operations: Any) -> list:
    """The objects whose state an operation may keep: callable instances, bound methods' owners and functions,
    and functions (their closures and globals may hold a generator or a counter: ``sandbox._reach``)."""
    ops = operations if isinstance(operations, (list, tuple)) else [operations]
    out = []
    for op in ops:
        owner = objects.attribute(op, "__self__")
        if owner is not None and not isinstance(owner, types.ModuleType):
            function = objects.attribute(op, "__func__")
            out += [owner] + ([function] if isinstance(function, types.FunctionType) else [])
        elif not isinstance(op, types.BuiltinFunctionType):
            out.append(op)
    return out


def _with_code_read(probe: StageProbe, source: Any = None, operations: Any = (), read: Any = None) -> StageProbe:
    """``probe``, with the draws and writes its rows did not make but the code makes for other rows
    (``codescan.stage_draw``, ``codescan.stage_writes``): rows that draw for some indices only lock the mode as
    rows that always draw, and state written on some rows only (a flag set when a read fails) as state kept on
    every read. Where the probe saw the state change (lazy set-up, told apart on its rows) it decides alone.
    ``read``: the code's reading made beside the probe child (``CodeRead``), else it is made here."""
    effects = probe.effects
    if effects.draws_random is not None:
        return probe
    read = read if isinstance(read, CodeRead) else _read_code(source, operations)
    if read.draw is not None:
        return replace(probe, effects=replace(effects, draws_random=read.draw))
    effects = effects.with_writes(read.writes, read.grows)
    if read.offsets is not None and effects.holds_handle is None:  # a descriptor held as an int: no object shows it
        effects = replace(effects, holds_handle=read.offsets)
    return replace(probe, effects=effects)


@record
class CodeRead(Result):
    """The code's reading made beside the probe child: the draw, the write of state, the addition to state and
    the read through a descriptor's shared offset it found, or ``None``."""

    draw: str | None
    writes: str | None = None
    grows: str | None = None
    offsets: str | None = None


def _read_code(source: Any, operations: Any) -> CodeRead:
    return CodeRead(codescan.stage_draw(source, operations), codescan.stage_writes(source, operations),
                    codescan.stage_grows(source, operations), codescan.stage_offsets(source, operations))


def _fork(in_child: Callable, worker_pages: bool, beside: bool, source: Any = None,
          operations: Any = (), lineage: Lineage | None = None) -> sandbox.Outcome:
    """``sandbox.run_in_fork``, with the stage's code read beside the child (3-10 ms, ``_with_code_read``'s) where
    ``beside``: this process has a CPU the child leaves idle."""
    meanwhile = (lambda: _read_code(source, operations)) if beside else None
    watched = ([source] if source is not None else []) + (lineage.code_objects() if lineage is not None else []) + \
        _operation_objects(operations)
    return sandbox.run_in_fork(in_child, worker_pages=worker_pages, meanwhile=meanwhile, watched=watched)


def _random_ops(operations: Any, effects: sandbox.Effects) -> sandbox.Effects:
    """MindSpore's random transforms draw from the pipeline's seed per worker, whatever the global RNG shows."""
    named = _random_transform(operations)
    if named and effects.draws_random is None:
        return replace(effects, draws_random=f"{named} draws random numbers")
    return effects


def _random_transform(operations: Any, depth: int = 0) -> str | None:
    """The name of a random transform among ``operations``, inside ``Compose`` / ``RandomApply`` /
    ``RandomChoice`` / ``RandomOrder`` too (their ``transforms``)."""
    ops = operations if isinstance(operations, (list, tuple)) else [operations]
    for op in ops:
        if is_random_transform(type(op).__name__):
            return type(op).__name__
        base = random_mindspore_base(type(op))
        if base is not None:
            return f"{type(op).__name__} (a {base.__name__})"
        inner = objects.attribute(op, "transforms")
        if depth < 4 and isinstance(inner, (list, tuple)):
            named = _random_transform(inner, depth + 1)
            if named:
                return f"{named} (in {type(op).__name__})"
    return None


def run_operations(operations: Any, columns: Sequence[Any], copied: bool = False) -> tuple:
    """Run map operations eagerly on one row's input columns, as MindSpore chains them. Inputs are copied
    (unless the caller did: ``copied``, ``fresh_inputs``): an operation that works in place must not alter rows
    a later operation of the probe reads."""
    ops = operations if isinstance(operations, (list, tuple)) else [operations]
    values = tuple(columns) if copied else fresh_inputs(columns)
    for op in ops:
        out = op(*values)
        if out is None:
            raise rows.RowError(f"the map operation {_name(op)} returns None for a probe row: MindSpore "
                                f"stops the pipeline there (\"Expected pyfunc to return NumPy array(s) or Python "
                                f"dict(s), but got None\"). Fix: return the row's new value(s), a tuple of arrays "
                                f"for several columns")
        values = out if isinstance(out, tuple) else (out,)  # a list is one column, as MindSpore makes it
    return tuple(np.asarray(v.asnumpy() if hasattr(v, "asnumpy") else v) for v in values)


def _name(op: Any) -> str:
    return getattr(op, "__qualname__", None) or type(op).__name__


def _check_columns_returned(first: list, output_columns: Sequence[str], what: str) -> None:
    """A ``RowError`` where the first probe row's output has another number of columns than ``output_columns``
    (the input columns where none are given): MindSpore stops the pipeline at the first row ("Invalid columns,
    the number of columns returned in 'map' operations should match the number of 'output_columns'"), and an
    audit's map and ``per_batch_map`` cases met that only once iterating."""
    if not first:
        return
    out = first[0]
    if out is None:
        raise rows.RowError(f"the {what} returns None for the first probe batch: MindSpore stops the pipeline there. "
                            f"Fix: return a tuple of lists, one per output column", None, 0)
    got = len(out) if isinstance(out, tuple) else 1
    unit = "batch" if what == "per_batch_map" else "row"
    if got != len(output_columns):
        raise rows.RowError(f"the {what} returns {got} column(s) for the first probe {unit}, but its output columns "
                            f"are {len(output_columns)} ({list(output_columns)}): MindSpore stops the pipeline there "
                            f"(\"the number of columns returned in '{what}' ... should match the number of "
                            f"'output_columns'\"). Fix: return a tuple of {len(output_columns)} value(s), one per "
                            f"output column, or pass output_columns with {got} name(s)", None, 0)
    for name, column in zip(output_columns, out if isinstance(out, tuple) else (out,)):
        for value in column if isinstance(column, list) and what == "per_batch_map" else (column,):
            # an array, or its fingerprints (``Printed``); objects are not judged (``run_operations`` made a
            # dict output, which MindSpore carries, one)
            dtype = np.dtype(value.dtype) if isinstance(value, (np.ndarray, Printed)) else None
            refused = rows.dtype_refused(dtype) if dtype is not None and dtype.kind != "O" else None
            if refused:
                raise rows.RowError(f"the {what}'s output column '{name}' for the first probe {unit} {refused}",
                                    name, 0)


def time_operations(operations: Any, inputs: list, keep: list | None = None,
                    row_name: Callable[[int], str] = "input row {}".format) -> OperationStats:
    """Sizes (largest input and output row) and median time per row of ``operations`` over ``inputs``; with
    the GIL's share (``parallel``) where rows are not trivially cheap (``parallel.pair_now``): the first row
    alone and the next two at once on two threads when the first was dear; else the first two alone and, where
    the second still was, the first again beside the third (that second output is the re-run ``_reread``
    compares: no run only for it). ``keep`` gets the first input's output, and its second where a pair made one.
    Rows after the first that raise end the runs: measured on the rows before, the error said (``raised``,
    naming the row by ``row_name``).
    """
    walls, cpus, out_sizes, first, again = [], [], [], [], []
    alone_wall, alone_process_cpu = [], []  # the runs made alone: ``cores_busy``

    def account(result: tuple, wall: float, cpu: float) -> None:
        """Only the first output is kept (``_reread`` compares it), and a large one by its fingerprints
        (``kept_for_reread``): an operation making rows of a GB (MindSpore's UT
        ``test_map_and_generatordataset_with_multiprocessing``: 0.95 GB) must not hold three in the probe."""
        out_sizes.append(sum(int(r.nbytes) for r in result))
        if not first:
            first.append(kept_for_reread(result))
        walls.append(wall)
        cpus.append(cpu)

    def alone(args: Any) -> float:
        result, took = parallel.timed_call(run_operations, operations, fresh_inputs(args), True)  # copies untimed
        account(result, took.wall, took.cpu)
        alone_wall.append(took.wall)
        alone_process_cpu.append(took.process_cpu)
        return took.kernel

    n = min(len(inputs), PROBE_ROWS_FOR_MAP)
    first_kernel = alone(inputs[0]) if n else 0.0
    sandbox.first_read_done()
    fraction, raised = None, None
    try:
        while len(walls) < n and not (n == 3 and parallel.pair_now(walls, first_kernel, _share(walls, cpus),
                                                                  max(out_sizes, default=0))):
            alone(inputs[len(walls)])
        if len(walls) < n:  # a pair: the next two rows at once (after one alone), or the first and the third
            share, late = _share(walls, cpus), len(walls) == 2
            pair, pair_walls, pair_cpus, fraction = _operations_pair(operations, [inputs[0], inputs[2]] if late
                                                                     else inputs[1:3], share)
            if late and pair:
                again, pair, pair_walls, pair_cpus = [kept_for_reread(pair[0])], pair[1:], pair_walls[1:], \
                    pair_cpus[1:]
            for k in range(len(pair)):
                account(pair[k], parallel.time_alone(pair_walls[k], pair_cpus[k], share), pair_cpus[k])
            del pair  # the pair's outputs: freed before any other run
            for args in inputs[len(walls):n]:  # operations not safe on two threads: run alone, as in a worker
                alone(args)
    except rows.RowError:
        raise
    except Exception as exc:  # noqa: BLE001 - the operations' own error, MindSpore's to raise at that row
        raised = rows.raised_at(row_name(len(walls)), exc)  # a failed pair is run alone: that row's position
    if keep is not None:
        keep += first + again  # the first input's output, and its second where a pair made one
    in_bytes = max((sum(int(a.nbytes) for a in args if hasattr(a, "nbytes")) for args in inputs[:len(walls)]),
                   default=0)
    return OperationStats(len(walls), in_bytes, max(out_sizes, default=0),
                          float(np.median(walls)) if walls else None, _share(walls, cpus),
                          parallel_fraction=fraction,
                          cores_busy=_share(alone_wall, alone_process_cpu), raised=raised)


def _share(walls: list, cpus: list) -> float | None:
    return sum(cpus) / sum(walls) if sum(walls) > 0 else None


def _operations_pair(operations: Any, inputs: list, share: float | None) -> tuple:
    """Two rows' operations at once: ``(results, walls, cpus, parallel fraction)``; nothing where the operations
    are not safe on two threads (then measured alone)."""
    try:
        pair, walls, cpus, together, gil_busy = parallel.run_pair(lambda a: run_operations(operations, a, True),
                                                                  [fresh_inputs(a) for a in inputs])
    except Exception:
        return [], [], [], None
    return pair, walls, cpus, parallel.parallel_fraction(cpus, together, share, parallel.usable_cpus(), gil_busy)


__all__ = ["StageProbe", "OperationStats", "Lineage", "SourceLineage", "IterableLineage", "MapLineage", "TakenRows", "Unavailable",
           "remember", "plan_of", "lineage_of", "probe_random_access", "probe_operations", "probe_batch",
           "time_batch", "ProbeBatchInfo"]
