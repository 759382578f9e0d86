"""Find the big Python containers a dataset source holds, before workers copy them, and say what it costs.

With the fork start method a worker starts by sharing the parent's pages. Each Python object read by the
worker has its reference count written, and the kernel then copies that object's page into the worker:
a list of a million small dicts ends up copied into every worker, worker by worker and rank by rank
(PyTorch issue 13246). With spawn the copy happens at once, when the source is pickled into each worker.
Numpy arrays, ``bytes``, ``str`` and ``SharedList`` have no per-item objects and are never flagged.

Three steps, kept apart: ``inspect_source`` looks and returns ``CowFinding``s (it never logs a warning
and never raises); ``log_findings`` writes one warning per finding; ``share_lists`` swaps flagged
containers for ``SharedList``/``SharedDict`` when the caller opted in.
"""

from __future__ import annotations

import dis
import functools
import gc
import itertools
import logging
import random
import re
import sys
import types
from collections import OrderedDict, deque
from dataclasses import field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from ms_shm import objects, sites
from ms_shm._results import Result, mib, record

if TYPE_CHECKING:  # imported where a stand-in is made: see _no_objects
    from ms_shm.shared_list import SharedDict, SharedList

log = logging.getLogger(__name__)

__all__ = ["CowFinding", "inspect_source", "findings_in", "for_workers", "code_holders", "log_findings",
           "share_lists"]

PAGE = 4096
#: Objects larger than this come from malloc, not pymalloc's pools: touching one copies about one page.
_SMALL_OBJECT = 512
#: Elements sampled from a flagged container; enough for a stable mean, cheap for any size.
_SAMPLE = 1000
#: Children looked at inside one sampled element, and how deep; the rest is scaled from them.
_CHILD_SAMPLE = 16
_ELEMENT_DEPTH = 2
#: Top-level containers up to this length are looked into (``self.meta = {"captions": [...]}``).
_WRAPPER_MAX = 64
#: How deep the walk goes from the source: small containers are looked into down to this level
#: (``self.coco.dataset["images"]``), plain objects only at the first level (``self.coco``).
_CONTAINER_DEPTH = 3
_OBJECT_DEPTH = 2
#: Attributes read per object; a bound for objects with thousands of attributes.
_MAX_ATTRIBUTES = 1000

_CONTAINERS = (list, tuple, dict, set, frozenset, deque)
_PLAIN = (str, bytes, bytearray, memoryview, range, int, float, complex, bool, type(None))
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.CodeType, types.FrameType, types.GeneratorType)
_DICT_KEY_TYPES = (str, bytes, int)
#: Path steps that reach a value through code rather than through the source: a module global a function
#: names, a variable it closes over. Forked workers read them as they read the source's attributes.
_CODE_STEPS = ("global", "closure")
# Steps into a pandas object's Python objects: ("column", name) of a DataFrame, ("values", None) of a Series or
# an Index, each reached as the numpy object array that holds them.
_PANDAS_STEPS = ("column", "values")
#: The methods through which a worker reads a source: what they name is read in every worker.
_READING_METHODS = ("__getitem__", "__iter__", "__next__", "__call__")
#: How deep into nested code (comprehensions, inner functions) the names a function reads are looked for.
_CODE_DEPTH = 2
#: Containers whose item table is allocated apart from the object header.
_TABLED = (list, dict, set, frozenset, deque)
_GC_HEAD = 16  # bytes CPython puts before every object that the cyclic GC can track

FORK_MECHANISM = "fork: copy-on-read page faults"
PICKLE_MECHANISM = "{method}: pickled into each worker"

# A path step: ("attr", name) for obj.name, ("key", key) for obj[key], ("index", i) for obj[i].
Step = tuple


@record
class CowFinding(Result):
    """One container in a source that every worker will come to hold its own copy of.

    Attributes:
        attribute: Where it is, from the source: ``"annotations"``, ``"meta.captions"``,
            ``"meta['captions']"``, or ``"<source>"`` when the source itself is the container.
        kind: Its type name (``"list"``, ``"dict"``, ``"ndarray[object]"``...).
        items: ``len()`` of the container.
        objects: Estimated Python objects reachable through it (items and what they hold); what costs.
        bytes_per_worker: Estimated bytes one worker comes to copy.
        workers: Worker processes per rank that were assumed.
        ranks: Ranks (training processes) on the host that were assumed, each with its own workers.
        total_bytes: ``bytes_per_worker * workers * ranks``: host memory the copies add.
        start_method: ``"fork"`` or ``"spawn"``; decides the mechanism.
        mechanism: How the copy happens (page faults under fork, pickling otherwise).
        fix: A line of code that removes the copies.
        swappable: Whether ``share_lists`` can do the fix itself.
    """

    attribute: str
    kind: str
    items: int
    objects: int
    bytes_per_worker: int
    workers: int
    ranks: int
    total_bytes: int
    start_method: str
    mechanism: str
    fix: str
    swappable: bool
    path: tuple = field(default=(), repr=False, compare=False)
    container_id: int = field(default=0, repr=False, compare=False)
    #: Other paths from the source to the same container (``self.train_paths = self.paths``).
    aliases: tuple = field(default=(), repr=False, compare=False)
    #: What holds the container, as the warning names it: the source, or a map's operation.
    holder: str = field(default="source", repr=False, compare=False)

    @property
    def message(self) -> str:
        """The one-line warning: what, how many, how it gets copied, how much, and the fix."""
        where = _where(self.path, self.attribute, self.holder)
        if self.start_method == "fork":
            how = (f"{self.mechanism}: each of {self.workers} worker(s) x {self.ranks} rank(s) copies "
                   "the pages it reads as reference counts are touched")
        else:
            how = (f"{self.mechanism}: each of {self.workers} worker(s) x {self.ranks} rank(s) "
                   "unpickles its own full copy at start")
        also = " (or build_dataset(..., share_lists=True))" if self.swappable else ""
        return (f"copy-on-read: {where} is a {self.kind} of {self.items:,} items "
                f"(~{self.objects:,} Python objects, ~{mib(self.bytes_per_worker)} per worker); {how}: "
                f"~{mib(self.total_bytes)} more host memory. Fix: {self.fix}{also}")


def inspect_source(source: Any, workers: int, ranks: int = 1, start_method: str = "fork",
                   min_objects: int = 10_000) -> tuple[CowFinding, ...]:
    """Find containers in ``source`` that every worker will copy, largest total first.

    Looks at the source's attributes (``vars()`` and ``__slots__``; properties are never called), then
    one level deeper: attributes of attribute objects and values of small dict/list/tuple attributes, and
    inside small containers met there (``self.coco.dataset["images"]``). A
    ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``deque`` or object-dtype array is flagged when
    it holds at least ``min_objects`` Python objects, estimated from a sample of up to 1000 elements.
    Anything odd (an attribute that raises, a ``len`` that fails) is skipped and logged at DEBUG: a
    warning helper must never break the pipeline it warns about.

    Args:
        source: The dataset source (any object, or a list used as a source).
        workers: Worker processes per rank that will hold a copy. Pass 0 when no worker process is started
            (threads, in-process reading, MindSpore with one worker or an iterable source): nothing is
            flagged then.
        ranks: Training processes on this host, each with its own workers.
        start_method: ``"fork"`` (copy by page faults as items are read) or ``"spawn"`` (copy by pickling
            when each worker starts). Anything other than ``"fork"`` is treated as pickling.
        min_objects: Flag containers holding at least this many Python objects.

    Returns:
        One ``CowFinding`` per container, sorted by ``total_bytes``, largest first.

    Examples:
        >>> class Source:
        ...     def __init__(self):
        ...         self.names = [f"{i}.jpg" for i in range(20_000)]
        >>> [f.attribute for f in inspect_source(Source(), workers=2)]
        ['names']
    """
    if workers < 1:
        return ()
    fork = start_method == "fork"

    def judge(path: tuple, value: Any, assignable: bool = True) -> CowFinding | None:
        if not fork and _through_code(path):  # a spawned worker builds its globals anew by importing
            return None
        return _finding(path, value, workers, ranks, start_method, fork, min_objects, assignable)

    if _is_container(source):
        return tuple(f for f in (judge((), source),) if f is not None)
    findings = _walk_attributes(source, judge)
    findings.sort(key=lambda f: f.total_bytes, reverse=True)
    return tuple(findings)


def findings_in(holders: Iterable[tuple], workers: int, ranks: int = 1, start_method: str = "fork") -> list:
    """``inspect_source`` of each ``(name, object)`` holder (a source, a DataLoader's dataset, a map's
    operation), each finding named by its holder; a container two holders reach (a module global two map
    operations read) is said and counted once."""
    findings, met = [], set()
    for name, held in holders:
        for finding in inspect_source(held, workers=workers, ranks=ranks, start_method=start_method):
            if finding.container_id not in met:
                met.add(finding.container_id)
                findings.append(replace(finding, holder=name))
    return findings


def for_workers(findings: Iterable[CowFinding], workers: int) -> list:
    """The same findings for ``workers`` worker processes: a pipeline walks its holders once, before its plan
    picks the workers."""
    return [replace(f, workers=workers, total_bytes=f.bytes_per_worker * workers * f.ranks) for f in findings]


def code_holders(callables: Iterable[Any], label: str, frameworks: tuple = ("mindspore", "torch")) -> list:
    """The program's own callables among ``callables`` (a map's operations, a DataLoader's ``collate_fn``) as
    ``(name, object)`` holders for ``findings_in``: a function or bound method (what its code reads), a
    ``functools.partial``'s function, an object (its attributes). Builtins and the frameworks' own transforms
    hold no program data. Looks at types only: an object's own ``__getattr__`` is never asked (MindSpore's
    test_iterator passes one that raises ``KeyError``)."""
    holders = []
    for op in callables:
        run = op.func if issubclass(type(op), functools.partial) else op
        code = issubclass(type(run), (types.FunctionType, types.MethodType))
        module = (run.__module__ if code else type(run).__module__) or ""
        if run is None or issubclass(type(run), types.BuiltinFunctionType) or module.split(".")[0] in frameworks:
            continue
        holders.append((f"{label} {run.__qualname__ if code else type(run).__name__}", run))
    return holders


def _walk_attributes(source: Any, judge: Callable[..., CowFinding | None]) -> list:
    """Findings among the source's attributes and below, each container judged once, with its aliases.

    A container met again under another name is not judged twice, but the other paths are kept
    (``aliases``): swapping only one name would leave the plain list alive through the other, saving nothing.
    """
    seen: dict[int, list] = {id(source): [()]}  # id -> every path the object was met at, first one judged
    findings = _walk(source, (), 1, seen, judge, True)
    findings += _walk_steps(_reading_methods_reads(source), (), 1, seen, judge, False)
    return [replace(f, aliases=tuple(seen[f.container_id][1:])) if len(seen.get(f.container_id, ())) > 1 else f
            for f in findings]


def _walk(value: Any, path: tuple, depth: int, seen: dict, judge: Callable[..., CowFinding | None],
          assignable: bool) -> list:
    """Findings among the children of ``value`` (met at ``path``, ``depth`` levels below the source)."""
    return _walk_steps(_children(value), path, depth, seen, judge, assignable)


def _walk_steps(steps: Iterable[tuple[Step, Any]], path: tuple, depth: int, seen: dict,
                judge: Callable[..., CowFinding | None], assignable: bool) -> list:
    findings: list = []
    for step, child in steps:
        if issubclass(type(child), _no_objects()):
            continue
        child_path, key = (*path, step), id(child.obj if type(child) is _Named else child)
        if key in seen:
            seen[key].append(child_path)
            continue
        seen[key] = [child_path]
        findings.extend(_judge_or_descend(child, child_path, depth, seen, judge, assignable))
    return findings


def _judge_or_descend(child: Any, path: tuple, depth: int, seen: dict, judge: Callable[..., CowFinding | None],
                      assignable: bool) -> list:
    """A large container is judged as a whole. A small one (``self.meta = {"captions": [...]}``) or a plain
    object is looked into first, and a small container is judged as a whole only when nothing inside it was
    flagged: swapping a 2-key dict of two huge lists whole would unpickle a whole list on every access."""
    container = _is_container(child)
    if container and _safe_len(child) > _WRAPPER_MAX:
        return _flagged(judge(path, child, assignable))
    inside = []
    if depth < (_CONTAINER_DEPTH if container else _OBJECT_DEPTH):
        # self.splits = (train, val) cannot be assigned into
        inside = _walk(child, path, depth + 1, seen, judge, assignable and not isinstance(child, tuple))
    if container and not inside and not _holds_met_elsewhere(child, path, seen):  # of medium-sized things
        return _flagged(judge(path, child, assignable))
    return inside


def _holds_met_elsewhere(container: Any, path: tuple, seen: dict) -> bool:
    """Whether a container inside ``container`` was first met at another path (``self.split = {"train":
    self.paths}``): judged there already, so this small wrapper must not be swapped whole around it."""
    return any(_is_container(inner) and seen.get(id(inner), [(*path, step)])[0] != (*path, step)
               for step, inner in _children(container))


def _flagged(finding: CowFinding | None) -> list:
    return [] if finding is None else [finding]


# Copies that add up to less than this are said at INFO: a 10,000-string list copied by 2 workers is ~1.2 MiB,
# noise beside a pipeline's rows, and an audit's scripts met WARNINGs about 3.1 MiB that no one could act on.
WARN_TOTAL_BYTES = 16 * 1024 * 1024


def log_findings(findings: Iterable[CowFinding], effects: Any = None, offer_share_lists: bool = True) -> None:
    """Log one line per finding through the ``ms_shm.cow`` logger (call it from local rank 0 only): a WARNING
    where the copies add up to ``WARN_TOTAL_BYTES`` or more, else INFO. Where the probe saw the source keep
    state as it reads (``effects``), ``share_lists=True`` would refuse the swap (``_kept_state``), so it is not
    offered; nor where the call has no such argument (``offer_share_lists``: a DataLoader)."""
    findings = tuple(findings)
    kept = _kept_state(effects, findings) or not offer_share_lists
    for finding in findings:
        level = logging.WARNING if finding.total_bytes >= WARN_TOTAL_BYTES else logging.INFO
        log.log(level, "ms_shm: %s", (replace(finding, swappable=False) if kept else finding).message)


def share_lists(source: Any, findings: Iterable[CowFinding], shared_memory: bool | None = None,
                effects: Any = None) -> tuple[str, ...]:
    """Replace flagged containers in ``source`` with ``SharedList``/``SharedDict``; return what changed.

    Lists become ``SharedList``; dicts (plain or ``OrderedDict``) with str, bytes or int keys become
    ``SharedDict``. Both are read-only and hand out a fresh copy of an item on every read: code that
    changes them raises ``ms_shm.shared_list.ReadOnlyError`` (a ``TypeError``) naming the attribute and the
    fix, which is why this is opt-in. Each path replaced is logged at INFO, and one INFO line per call names
    them all (the caller asked for it; the error on a change is what must be loud). Every path to a container
    is replaced (``self.train_paths = self.paths``), or the plain one would stay alive.

    Left as they are, each with an INFO line saying why and one WARNING per call naming them all (still
    copied by every worker, though the caller asked for the fix): tuples (a stand-in is neither hashable nor equal to
    a tuple), deques (``maxlen``), sets, subclasses (a ``defaultdict`` would lose its default), object
    arrays, the source itself, containers that cannot be assigned back (inside a tuple, a read-only
    property), and containers inside an object or dict that something outside the source also holds (a
    ``meta`` dict shared by a train and a val dataset: replacing inside it would change the other one).
    Nothing is swapped when the probe saw the source keep state as it reads (``effects``): a cache written
    into an item would be lost, since every read of a stand-in is a new copy.

    Args:
        source: The object ``inspect_source`` looked at.
        findings: Its findings.
        shared_memory: Put the new containers in POSIX shared memory, so spawned workers map one copy
            instead of unpickling one each. ``None`` means: yes under spawn, no under fork (forked
            workers share the pages anyway). Falls back to in-process buffers if ``/dev/shm`` is short.
        effects: What the probe saw reading the source (``sandbox.Effects``), or ``None`` when unknown.

    Returns:
        The path (``attribute``) of every place that was replaced.
    """
    findings = tuple(findings)
    kept = _kept_state(effects, findings)
    if kept:
        log.warning("ms_shm: share_lists=True: left %s as they are: %s, and a SharedList/SharedDict gives a new "
                    "copy of an item on every read, so state kept in an item (a cache, a counter) would be lost "
                    "and rows would differ from MindSpore's. Fix: keep that state outside these lists, or pass "
                    "share_lists=False", ", ".join(f.attribute for f in findings), kept)
        return ()
    swapped: list[str] = []
    left: list[str] = []
    for finding in findings:
        done = _swap(source, finding, shared_memory) if _swappable(finding) else []
        swapped.extend(done)
        if finding.attribute not in done:
            left.append(finding.attribute if _through_code(finding.path) else f"source.{finding.attribute}")
    if left:
        log.warning("ms_shm: share_lists=True left %s as they are (the INFO lines say why): every worker still "
                    "copies them as it reads", ", ".join(left))
    if swapped:  # INFO: asked for; a change to a stand-in raises an error naming it and the fix
        log.info("ms_shm: share_lists=True put read-only shared stand-ins (SharedList/SharedDict) in place "
                    "of %s: reading them gives what the originals gave; changing them raises TypeError, and "
                    "they are not list/dict instances", ", ".join(f"source.{where}" for where in swapped))
    return tuple(swapped)


def _kept_state(effects: Any, findings: tuple) -> str | None:
    """Why the probe says reading keeps state that a stand-in would lose, or ``None``.

    A re-read that differs or attributes that change on every read mean state is kept somewhere, maybe in an
    item (``ann["hits"] += 1``), which a stand-in would silently drop. A change on the first read only (lazy
    set-up, opening a file) blocks the swap only when it names a flagged attribute.
    """
    if effects is None:
        return None
    reason = getattr(effects, "rereads_differ", None) or getattr(effects, "state_per_read", None)
    if reason:
        return f"the probe saw the source keep state as it reads ({reason})"
    lazy = getattr(effects, "mutates_state", None)
    names = {str(f.path[0][1]) for f in findings if f.path}
    if lazy and any(re.search(rf"\b{re.escape(name)}\b", lazy) for name in names):
        return f"the probe saw reading change them ({lazy})"
    return None


def _swappable(finding: CowFinding) -> bool:
    """Whether ``share_lists`` may try this finding; says why not at INFO (the user sees the fix by hand)."""
    if not finding.path:
        log.info("ms_shm: the source itself is a %s; wrap it yourself: %s", finding.kind, finding.fix)
        return False
    if _through_code(finding.path):
        log.info("ms_shm: left %s as is: the source's code reads it, but it is not the source's to replace; by "
                 "hand: %s", finding.attribute, finding.fix)
        return False
    code = [a for a in finding.aliases if _through_code(a)]
    if code:  # the plain one would stay alive there, and be what the code reads
        name = _format_path(code[0])
        log.info("ms_shm: left %s as is: %s holds it too, and the code reads it there; by hand: %s, then "
                 "self.%s = %s", finding.attribute, name, finding.fix.replace(f"self.{finding.attribute}", name),
                 finding.attribute, name)
        return False
    if not finding.swappable:
        log.info("ms_shm: left %s (%s) as is: no read-only shared stand-in fits; by hand: %s",
                 finding.attribute, finding.kind, finding.fix)
        return False
    return True


def _swap(source: Any, finding: CowFinding, shared_memory: bool | None) -> list[str]:
    """Put one shared stand-in at every path to the container; return the paths replaced.

    Every reason to leave a path is logged at INFO, never raised: the source may have changed since it was
    inspected, and a helper must not break the pipeline.
    """
    targets = [(parent, path) for path in (finding.path, *finding.aliases)
               if (parent := _target(source, path, finding)) is not None]
    if not targets:
        return []
    replacement = _stand_in(_get(targets[0][0], targets[0][1][-1]), finding, shared_memory)
    if replacement is None:
        return []
    replacement._named(finding.attribute)
    done = []
    for parent, path in targets:
        where = _format_path(path)
        try:
            _set(parent, path[-1], replacement)
        except Exception as exc:  # frozen dataclass, read-only property, tuple parent
            log.info("ms_shm: left %s as is: cannot assign it (%s: %s)", where, type(exc).__name__, exc)
            continue
        done.append(where)
        block = _block_name(replacement)
        also = f", in shared memory block {block}" if block else ""
        log.info("ms_shm: replaced source.%s (%s of %s items, ~%s of Python objects) with a %s of %s%s",
                 where, finding.kind, f"{finding.items:,}", mib(finding.bytes_per_worker),
                 type(replacement).__name__, mib(replacement.nbytes), also)
    return done


def _target(source: Any, path: tuple, finding: CowFinding) -> Any:
    """The object to assign into for ``path``, or ``None`` (said at INFO) when the path must be left."""
    where = _format_path(path)
    try:
        holders = _holders(source, path)
        current = _get(holders[-1], path[-1])
    except Exception as exc:  # the source changed since it was inspected
        log.info("ms_shm: left %s as is: cannot reach it again (%s)", where, exc)
        return None
    if id(current) != finding.container_id:
        log.info("ms_shm: left %s as is: it is no longer the object that was inspected", where)
        return None
    shared = _held_elsewhere(holders, path, _fix(path, current, True)[0])
    if shared:
        log.info("ms_shm: left %s as is: %s", where, shared)
        return None
    return holders[-1]


def _holders(source: Any, path: tuple) -> list:
    """The source and each object on ``path`` down to the one that holds its last step."""
    holders = [source]
    for step in path[:-1]:
        holders.append(_get(holders[-1], step))
    return holders


def _held_elsewhere(holders: list, path: tuple, fix: str) -> str | None:
    """Why an object on the way (not the source) is also held from outside the source, or ``None``.

    Writing into ``self.meta["train"]`` changes the ``meta`` dict itself: if a val dataset or a module
    global holds the same dict, it would change too. Referrers are found with ``gc.get_referrers`` (one heap
    scan per object on the way; only paths below the source's own attributes need it). References from
    running functions' local variables are not visible to it.
    """
    for level in range(1, len(holders)):
        holder, above = holders[level], holders[level - 1]
        inside = {id(above), id(holders)}
        own = getattr(above, "__dict__", None)
        if isinstance(own, dict):
            inside.add(id(own))
        outside = [r for r in gc.get_referrers(holder) if id(r) not in inside and not isinstance(r, types.FrameType)]
        if outside:
            return (f"{_format_path(path[:level])} is also held outside the source (by a {type(outside[0]).__name__}), "
                    f"so replacing something inside it would change that holder too; wrap it by hand if that is "
                    f"intended: {fix}")
    return None


def _no_objects() -> tuple:
    """Types with no per-item objects: plain values, and ``SharedList``/``SharedDict`` where their module is
    loaded (none exists before). Not imported here: it and ``cleanup`` cost every ``build_dataset`` ~3-5 ms."""
    shared = sys.modules.get("ms_shm.shared_list")
    return _PLAIN + ((shared.SharedList, shared.SharedDict) if shared is not None else ())


def _stand_in(current: Any, finding: CowFinding, shared_memory: bool | None) -> SharedList | SharedDict | None:
    """The ``SharedList``/``SharedDict`` copy of ``current``: in shared memory under spawn (unless told), in a
    process buffer when ``/dev/shm`` is short, ``None`` when an item cannot be stored."""
    use_shm = finding.start_method != "fork" if shared_memory is None else shared_memory
    try:
        return _shared_version(current, use_shm)
    except OSError as exc:
        log.info("ms_shm: %s: no room in shared memory (%s); using an in-process buffer", finding.attribute, exc)
        return _shared_version(current, False)
    except (TypeError, ValueError) as exc:  # unpicklable item, unsupported key
        log.info("ms_shm: left %s as is: %s", finding.attribute, exc)
        return None


# ------------------------------------------------------------------------------------------------ walking
def _is_container(value: Any) -> bool:
    if isinstance(value, _CONTAINERS):
        return True
    return isinstance(value, np.ndarray) and value.dtype == object


def _safe_len(value: Any) -> int:
    try:
        return objects.stored_length(value)
    except Exception as exc:
        log.debug("ms_shm.cow: len() of a %s failed: %s", type(value).__name__, exc)
        return 0


def _children(value: Any) -> Iterator[tuple[Step, Any]]:
    """The (step, child) pairs one level below ``value``; never raises."""
    try:
        if issubclass(type(value), (types.FunctionType, types.MethodType)):
            yield from _code_reads(value)
            return
        if type(value) is _Named:
            own = objects.attribute(value.obj, "__dict__")
            if isinstance(own, dict):
                yield from ((("attr", n), dict.__getitem__(own, n)) for n in sorted(value.names & set(own)))
            return
        if isinstance(value, np.ndarray) or isinstance(value, _no_objects() + _NOT_WALKED):
            return
        if isinstance(value, (dict, list, tuple)) and objects.stored_length(value) > _WRAPPER_MAX:
            return
        if isinstance(value, dict):
            yield from ((("key", k), v) for k, v in list(objects.as_stored(value).items()))
            return
        if isinstance(value, (list, tuple)):
            yield from ((("index", i), v) for i, v in enumerate(objects.as_stored(value)))
            return
        if _is_container(value):
            return
        held = _pandas_objects(value)
        yield from _attributes(value) if held is None else held
    except Exception as exc:
        log.debug("ms_shm.cow: cannot look inside a %s: %s", type(value).__name__, exc)


def _pandas_objects(value: Any) -> list | None:
    """A pandas DataFrame's columns of Python objects (``object``, and strings stored without pyarrow: pandas 3's
    ``str`` then holds a numpy array of ``str``), or a Series' or an Index's values, as the numpy arrays holding
    them; ``None``: not pandas. ``df.loc[i, "path"]`` touches the row's objects as a list's item would, and an
    audit measured 62 MiB per worker for such columns where the attribute walk, four levels short of the
    arrays (``_mgr.blocks[k].values``), estimated nothing. The columns are picked by their dtypes first (a frame
    of 1,000 float columns and one of names); pandas is never imported here."""
    if not _is_pandas(value):
        return None
    dtypes = objects.attribute(value, "dtypes")
    if objects.has(value, "columns") and dtypes is not None:  # a frame: its columns of kind "O", by position
        found = [k for k, dtype in enumerate(dtypes) if objects.attribute(dtype, "kind") == "O"]
        return [(("column", value.columns[k]), held) for k in found[:_MAX_ATTRIBUTES]
                if (held := _object_values(value.iloc[:, k])) is not None]
    held = _object_values(value)
    return [] if held is None else [(("values", None), held)]


def _is_pandas(value: Any) -> bool:
    """A pandas object, or one of a subclass of the program's (``class Table(pd.DataFrame)``)."""
    return any(str(getattr(klass, "__module__", "")).partition(".")[0] == "pandas" for klass in type(value).__mro__)


def _object_values(column: Any) -> np.ndarray | None:
    """The numpy object array holding a column's Python objects: its own, or a categorical's categories (their
    strings are read through the codes)."""
    array = objects.attribute(column, "array")
    categories = objects.attribute(array, "categories")
    if categories is not None:
        array = objects.attribute(categories, "array")
    held = objects.attribute(array, "_ndarray")
    return held if isinstance(held, np.ndarray) and held.dtype == object else None


def _attributes(obj: Any) -> Iterator[tuple[Step, Any]]:
    """Instance attributes from ``__dict__`` and ``__slots__``; properties are never evaluated."""
    names: list[str] = []
    try:
        names.extend(k for k in vars(obj) if isinstance(k, str))
    except TypeError:
        pass  # no __dict__: slots only
    except Exception as exc:
        log.debug("ms_shm.cow: vars() of a %s failed: %s", type(obj).__name__, exc)
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else [s for s in slots if isinstance(s, str)])
    done = set()
    for name in names:
        if name in done or name in ("__dict__", "__weakref__"):
            continue
        done.add(name)
        if len(done) > _MAX_ATTRIBUTES:
            log.debug("ms_shm.cow: a %s has over %d attributes; the rest are not inspected",
                      type(obj).__name__, _MAX_ATTRIBUTES)
            return
        try:
            yield ("attr", name), _raw_attribute(obj, name)
        except Exception as exc:  # unset slot, a __getattr__ that raises
            log.debug("ms_shm.cow: attribute %s of a %s skipped: %s", name, type(obj).__name__, exc)


def _reading_methods_reads(source: Any) -> Iterator[tuple[Step, Any]]:
    """What the methods a worker calls on the source (``__getitem__`` and the like, defined in Python) and the
    methods of its class they call (``self._load(i)``) read through code: ``return load(PATHS[i])`` reads a
    module-level ``PATHS`` in every worker."""
    if issubclass(type(source), (types.FunctionType, types.MethodType)):
        return  # its own reads are its children
    cls = type(source)
    reading = [f for name in _READING_METHODS if (f := _function(_class_attribute(cls, name))) is not None]
    functions = _with_methods_called(cls, reading)
    named = frozenset(n for f in functions for n in _names(f.__code__, _CODE_DEPTH))
    own = objects.attribute(source, "__dict__")
    for name in sorted(named - (set(own) if isinstance(own, dict) else set())):  # ``self.TABLE`` of the class
        value = _class_attribute(cls, name)
        if issubclass(type(value), _CONTAINERS):
            yield ("attr", name), value
    for function in functions:
        yield from _globals_and_cells(function, named)


def objects_read_by_code(source: Any, callables: Iterable[Any] = ()) -> list:
    """The objects of the module globals and closure variables that ``source``'s reading methods and
    ``callables`` read (as the copy-on-read walk finds them: one call deep), whole; never raises."""
    try:
        found = [value for _, value in _reading_methods_reads(source)]
        for function in callables:
            found += [value for _, value in _code_reads(function)]
    except Exception as exc:  # noqa: BLE001 - a source whose class cannot be read: nothing found
        log.debug("ms_shm.cow: the code of %s not read: %s", type(source).__name__, exc)
        return []
    return [value.obj if isinstance(value, _Named) else value for value in found]


def _with_methods_called(cls: type, functions: list) -> list:
    """``functions``, and the functions of ``cls`` their code names (``self._load(i)``; one call deep)."""
    called = [f for function in functions for name in function.__code__.co_names
              if (f := _function(_class_attribute(cls, name))) is not None]
    return list(dict.fromkeys(functions + called))


def _class_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:  # the class dicts, as a static lookup: no metaclass __getattr__, no descriptor run
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _function(value: Any) -> types.FunctionType | None:
    """The Python function a method, static or class method, or a decorated function (``functools.wraps``:
    ``torch.no_grad()``) runs, or ``None``."""
    for _ in range(4):
        if issubclass(type(value), (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif issubclass(type(value), types.FunctionType):
            wrapped = vars(value).get("__wrapped__")
            if not issubclass(type(wrapped), types.FunctionType):
                return value
            value = wrapped
        else:
            return None
    return value if issubclass(type(value), types.FunctionType) else None


class _Named:
    """An object reached through code, to be walked only as far as the code names its attributes: a map
    function reading a global ``SRC.scale`` does not copy ``SRC.paths`` (an audit: the source's paths were said
    twice, once as "module global 'SRC.paths'", and counted for map workers that never read them)."""

    __slots__ = ("obj", "names")

    def __init__(self, obj: Any, names: frozenset) -> None:
        self.obj, self.names = obj, names


def _code_reads(func: Any) -> Iterator[tuple[Step, Any]]:
    """The module globals ``func`` (or a function nested in it) loads and the variables it closes over, and for
    a bound method the attributes of its object the code names (and the methods it calls); never raises. An
    object among them (not a container, module, class or function) is looked into only as far as the code names
    its attributes. Modules and classes are yielded too: the walk skips them."""
    method_self = func.__self__ if issubclass(type(func), types.MethodType) else None
    function = _function(func)
    if function is None:
        return
    try:
        functions = [function] if method_self is None else _with_methods_called(type(method_self), [function])
        named = frozenset(n for f in functions for n in _names(f.__code__, _CODE_DEPTH))
        if method_self is not None:
            own = objects.attribute(method_self, "__dict__")
            for name in sorted(named & set(own) if isinstance(own, dict) else ()):
                yield ("attr", name), dict.__getitem__(own, name)
        for f in functions:
            yield from _globals_and_cells(f, named)
    except Exception as exc:
        log.debug("ms_shm.cow: cannot read the names %r uses: %s", func, exc)


def _globals_and_cells(function: types.FunctionType, named: frozenset | None) -> Iterator[tuple[Step, Any]]:
    code, namespace = function.__code__, function.__globals__
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            yield ("closure", name), _narrowed(cell.cell_contents, named)
        except ValueError:  # a cell not filled yet
            continue
    if not any(_worth_walking(dict.get(namespace, name)) or _programs_module(dict.get(namespace, name))
               for name in _names(code, _CODE_DEPTH)):
        return  # only libraries and classes (np, Image): no need to tell global loads from attribute names
    for name in _globals_loaded(code):
        if dict.__contains__(namespace, name):
            yield ("global", name), _narrowed(dict.__getitem__(namespace, name), named)


def _narrowed(value: Any, named: frozenset | None) -> Any:
    """``value``, or a plain object's or a program's module's stand-in that the walk reads only ``named``
    attributes of (``config.PATHS[i]`` copies ``config``'s ``PATHS``, and nothing else of it)."""
    plain = not issubclass(type(value), _CONTAINERS + _PLAIN + _NOT_WALKED + (np.ndarray, _Named)) and \
        not _is_pandas(value)  # its columns are read through its methods (``DF.iloc[i]``), never named
    walked = (plain and _worth_walking(value)) or _programs_module(value)
    return _Named(value, named) if named is not None and walked else value


def _programs_module(value: Any) -> bool:
    """A module of the program's own, from a file outside the interpreter's libraries: a ``config`` module's
    ``PATHS`` is the program's data, read in every worker; a library's attributes are not the dataset's."""
    if not issubclass(type(value), types.ModuleType):
        return False
    path = objects.attribute(value, "__file__")
    return isinstance(path, str) and not sites.installed(path)


def _worth_walking(value: Any) -> bool:
    return value is not None and not issubclass(type(value), (types.ModuleType, type, types.BuiltinFunctionType))


def _names(code: types.CodeType, depth: int) -> Iterator[str]:
    """Every name ``code`` and the code nested in it use: globals, and attribute names too."""
    yield from code.co_names
    if depth > 1:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from _names(const, depth - 1)


@functools.lru_cache(maxsize=256)
def _globals_loaded(code: types.CodeType, depth: int = _CODE_DEPTH) -> tuple:
    """The global names ``code`` (and the code nested in it) loads, once each."""
    loaded = [instruction.argval for instruction in dis.get_instructions(code)
              if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(instruction.argval, str)]
    if depth > 1:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                loaded.extend(_globals_loaded(const, depth - 1))
    return tuple(dict.fromkeys(loaded))


def _through_code(path: tuple) -> bool:
    return any(kind in _CODE_STEPS for kind, _ in path)


def _where(path: tuple, attribute: str, holder: str) -> str:
    """What holds a container, as a warning names it: the holder, an attribute of it, or what its code reads."""
    if not path:
        return f"the {holder} itself"
    at = next((i for i in range(len(path) - 1, -1, -1) if path[i][0] in _CODE_STEPS), None)
    if at is None:
        return f"{holder} attribute {attribute!r}"
    kind, name = path[at]
    what = (f"module global {name!r} read by the {holder}" if kind == "global" else
            f"variable {name!r} closed over by the {holder}")
    return what if at == len(path) - 1 else f"attribute {_format_path(path[at + 1:])!r} of {what}"


def _raw_attribute(obj: Any, name: str) -> Any:
    try:
        return vars(obj)[name]
    except (TypeError, KeyError):
        return object.__getattribute__(obj, name)  # a slot: its descriptor, not __getattr__


def _format_path(path: tuple) -> str:
    if not path:
        return "<source>"
    text = ""
    for kind, key in path:
        if kind in _CODE_STEPS:  # a name of its own, wherever it was reached from
            text = key
        elif kind == "attr":
            text += f".{key}" if text else key
        elif kind in ("key", "column"):
            text += f"[{key!r}]"
        elif kind == "values":
            continue
        else:
            text += f"[{key}]"
    return text


def _resolve(source: Any, path: tuple) -> Any:
    value = source
    for step in path:
        value = _get(value, step)
    return value


def _get(parent: Any, step: Step) -> Any:
    kind, key = step
    return _raw_attribute(parent, key) if kind == "attr" else parent[key]


def _set(parent: Any, step: Step, value: Any) -> None:
    kind, key = step
    if kind == "attr":
        setattr(parent, key, value)
    else:
        parent[key] = value


# ----------------------------------------------------------------------------------------------- estimating
def _footprint(obj: Any, depth: int, seen: set[int], fork: bool) -> tuple[float, float]:
    """(bytes, objects) one worker copies for ``obj`` and what it holds, from a bounded sample.

    Under fork a touched object costs its size if small (pymalloc packs small objects, so every page
    holding them gets copied) and about one page if large (only the header's page is written); a numpy
    array and a container cost their header. Every reachable object is assumed read, so this is an upper
    bound when the source reads only some fields. Under spawn everything is pickled, data included. Shared singletons (None,
    small ints, bools) cost nothing, and an object met twice in the sample counts once (interned keys).
    """
    if obj is None or isinstance(obj, bool) or (type(obj) is int and -5 <= obj <= 256):
        return 0.0, 0.0
    if id(obj) in seen:
        return 0.0, 0.0
    seen.add(id(obj))
    size = float(_own_size(obj, fork))
    if isinstance(obj, np.ndarray):
        header = size - (obj.nbytes if obj.flags.owndata else 0)
        if not fork or obj.dtype == object:
            size = header + obj.nbytes
        else:
            size = header
    elif fork and size > _SMALL_OBJECT:
        size = float(PAGE)
    elif fork:
        size = float(_pymalloc_block(int(size)))
    count = 1.0
    if depth <= 0 or isinstance(obj, _no_objects()):
        return size, count
    obj = objects.as_stored(obj)
    if isinstance(obj, dict) or (fork and isinstance(obj, (set, frozenset))):
        total, children = _read_items(obj, _CHILD_SAMPLE, fork)
    elif _is_container(obj):
        total = len(obj)
        children = list(itertools.islice(iter(obj), _CHILD_SAMPLE))
    elif isinstance(objects.attribute(obj, "__dict__"), dict) and not isinstance(obj, _NOT_WALKED):
        attributes = vars(obj)
        total = len(attributes) + 1
        children = [attributes, *itertools.islice(attributes.values(), _CHILD_SAMPLE)]
    else:
        return size, count
    if children:
        sub_bytes = sub_count = 0.0
        for child in children:
            b, n = _footprint(child, depth - 1, seen, fork)
            sub_bytes += b
            sub_count += n
        scale = max(1.0, total / len(children))
        size += sub_bytes * scale
        count += sub_count * scale
    return size, count


def _pymalloc_block(size: int) -> int:
    """The block pymalloc gives an object of ``size`` bytes: sizes round up to 16 (an audit measured a forked
    worker's copy of 500k token lists at 30.8 MiB, 64 B a list header of 56, and of 500k path strings at 46.0 MiB,
    96 B a string of 81; the estimate without it was 13-16% low, and a plan admitted on it was OOM-killed)."""
    return (size + 15) & ~15


def _own_size(obj: Any, fork: bool) -> int:
    """Bytes of ``obj`` itself that a worker copies.

    Under fork a list, dict, set or deque costs only its header: the refcount write lands there, and the
    item table is a separate allocation that reading never writes. Under spawn it is all rebuilt.
    """
    if fork and isinstance(obj, _TABLED):
        return type(obj).__basicsize__ + _GC_HEAD
    return sys.getsizeof(obj, 64)


def _sample(container: Any) -> list[Any]:
    """Up to ``_SAMPLE`` elements, drawn at random positions (fixed seed) for sequences (values and keys alike
    for dicts).

    Never a fixed stride: ``[i % 1000 for i in range(1_000_000)]`` sampled every 1000th item reads only 0,
    a shared small int, and would hide a million separate ints.
    """
    n = len(container)
    if isinstance(container, (list, tuple, np.ndarray)):
        if n <= _SAMPLE:
            return list(container)
        return [container[i] for i in sorted(random.Random(0).sample(range(n), _SAMPLE))]
    return list(itertools.islice(iter(container), _SAMPLE))


def _read_items(container: Any, sample: int, fork: bool) -> tuple[int, list]:
    """``(how many, a sample)`` of the objects reading a dict or set hands out. Under fork a lookup by a ``str``
    key compares it without writing, and writes only the value's reference count; ``in`` on ``str`` elements
    writes nothing: an audit's 2M ``{path: class id}`` counted at 152.6 MiB per worker was refused in 500 MB,
    where raw torch ran, and workers copied about 0 of it. Any other key or element is held (its reference count
    written) while it is compared: an int-keyed dict read by key measured 33.5-35.6 MiB per worker, estimated 24.4
    from its values alone. Under spawn keys and elements are unpickled with the rest."""
    n = len(container)
    if isinstance(container, dict):
        pairs = _spread(container.items(), n, sample // 2 if not fork else sample)
        if fork and all(type(k) is str for k, _ in pairs):
            return n, [v for _, v in pairs]
        return 2 * n, [x for kv in pairs for x in kv]
    elements = list(itertools.islice(iter(container), sample))
    if fork and all(type(e) is str for e in elements):
        return 0, []
    return n, elements


def _spread(items: Iterable[Any], n: int, k: int) -> list:
    """Up to ``k`` of ``n`` items at random positions (fixed seed), for what has no index: a dict's first values
    are often its smallest (``{token: id}`` built in order: the first 1000 ids include 257 shared small ints, and
    the estimate came out 26% low)."""
    if n <= k:
        return list(items)
    iterator, at, out = iter(items), 0, []
    for position in sorted(random.Random(0).sample(range(n), k)):
        out.append(next(itertools.islice(iterator, position - at, None)))  # the skipping runs in C
        at = position + 1
    return out


def _estimate(container: Any, fork: bool) -> tuple[int, int]:
    """(bytes, objects) a worker copies for the whole container: a sample scaled to its length."""
    container = objects.as_stored(container)
    if isinstance(container, (dict, set, frozenset)):
        elements, sample = _read_items(container, _SAMPLE, fork)
    else:
        elements, sample = len(container), _sample(container)
    seen: set[int] = {id(container)}
    total_bytes = total_objects = 0.0
    for element in sample:
        b, n = _footprint(element, _ELEMENT_DEPTH, seen, fork)
        total_bytes += b
        total_objects += n
    scale = elements / len(sample) if sample else 0.0
    own = _own_size(container, fork)
    if fork and isinstance(container, np.ndarray):  # object array: pointers are read, never written
        own -= container.nbytes if container.flags.owndata else 0
    return int(own + total_bytes * scale), int(round(total_objects * scale))


def _fix(path: tuple, value: Any, assignable: bool, shared_memory: bool = False) -> tuple[str, bool]:
    """The code line that removes the copies, and whether ``share_lists`` can apply it itself. Under spawn or
    forkserver (``shared_memory``) the stand-in's buffer travels through one shared-memory block, or each worker
    still unpickles a compact copy of it (the README's measurement: 20,000 items under spawn, 151.8 MiB added per
    worker with a plain ``SharedList``, none with ``shared_memory=True``)."""
    fix, swappable = _plain_fix(path, value, assignable)
    if shared_memory:
        code, comment = fix.split("  #", 1) if "  #" in fix else (fix, None)
        fix = code[:-1] + ", shared_memory=True)" + ("" if comment is None else "  #" + comment)
    return fix, swappable


def _plain_fix(path: tuple, value: Any, assignable: bool) -> tuple[str, bool]:
    target = "source" if not path else _format_path(path) if _through_code(path) else "self." + _format_path(path)
    if path and path[-1][0] in _PANDAS_STEPS:
        return _pandas_fix(target, value), False
    swappable = bool(path) and assignable
    if type(value) is list:
        return f"{target} = ms_shm.SharedList({target})", swappable
    if type(value) in (tuple, deque):  # a stand-in is no tuple (hash, ==) and has no maxlen: by hand only
        return f"{target} = ms_shm.SharedList({target})", False
    if type(value) in (dict, OrderedDict) and all(isinstance(k, _DICT_KEY_TYPES) for k in _sample_keys(value)):
        return f"{target} = ms_shm.SharedDict({target})", swappable
    if isinstance(value, (set, frozenset)):
        return f"{target} = ms_shm.SharedDict.fromkeys({target})  # keeps `in` and iteration", False
    if isinstance(value, np.ndarray):
        return f"{target} = ms_shm.SharedList({target}.tolist())", False
    if isinstance(value, dict):
        return f"{target} = ms_shm.SharedList(list({target}.items()))  # and look items up by index", False
    return f"{target} = ms_shm.SharedList({target})", False


def _pandas_fix(target: str, value: np.ndarray) -> str:
    """Strings go to Arrow buffers, which hold no Python object per row; other objects to a stand-in read in
    place of the column (pandas turns a list put back into a column into objects again)."""
    if all(isinstance(item, str) or item is None or item != item for item in value[:_SAMPLE]):  # NaN != NaN
        return f'{target} = {target}.astype("string[pyarrow]")  # pip install pyarrow'
    return f"rows = ms_shm.SharedList({target}.tolist())  # and read rows[i] in place of the column"


def _sample_keys(value: dict) -> list[Any]:
    return list(itertools.islice(iter(objects.as_stored(value)), _SAMPLE))


def _finding(path: tuple, value: Any, workers: int, ranks: int, start_method: str, fork: bool,
             min_objects: int, assignable: bool) -> CowFinding | None:
    try:
        per_worker, objects = _estimate(value, fork)
        if objects < min_objects:
            return None
        fix, swappable = _fix(path, value, assignable, shared_memory=not fork)
        kind = ("pandas column of Python objects" if path and path[-1][0] in _PANDAS_STEPS else
                "ndarray[object]" if isinstance(value, np.ndarray) else type(value).__name__)
    except Exception as exc:  # a container subclass with a broken __len__/__iter__, a huge odd object
        log.debug("ms_shm.cow: %s skipped: %s: %s", _format_path(path), type(exc).__name__, exc)
        return None
    mechanism = FORK_MECHANISM if fork else PICKLE_MECHANISM.format(method=start_method)
    return CowFinding(
        attribute=_format_path(path), kind=kind, items=_safe_len(value), objects=objects,
        bytes_per_worker=per_worker, workers=workers, ranks=ranks, total_bytes=per_worker * workers * ranks,
        start_method=start_method, mechanism=mechanism, fix=fix, swappable=swappable, path=path,
        container_id=id(value),
    )


def _block_name(value: SharedList | SharedDict) -> str | None:
    from ms_shm.shared_list import SharedDict

    return (value._keys if isinstance(value, SharedDict) else value).shared_memory_name


def _shared_version(value: Any, shared_memory: bool) -> SharedList | SharedDict:
    from ms_shm.shared_list import SharedDict, SharedList

    if isinstance(value, dict):
        return SharedDict(value, shared_memory=shared_memory)
    return SharedList(value, shared_memory=shared_memory)
