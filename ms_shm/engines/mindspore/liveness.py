"""Which MindSpore iterators this process holds, and which pipelines have run to their end: what the runtime
guard names when an earlier iterator keeps its slots, and what a pipeline's reservation lasts for. ``compat``
notes each iterator as MindSpore makes and ends it; nothing here imports MindSpore.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

_ITERATORS: Any = weakref.WeakSet()  # this process's MindSpore iterators still alive (stopped ones included)
_FINISHED: Any = weakref.WeakSet()  # every stage of a tree an iterator ran to its end on
_CHANGED: Any = weakref.WeakSet()  # iterators made with a ``before_made`` change in place (no worker processes)


_BEFORE_MADE: list = []  # what sees a tree before MindSpore copies and parses it for a new iterator


def before_made(check: Callable[[Any], Callable[[], None] | None]) -> None:
    """Have ``check(top)`` run before each new iterator is made on ``top``: it may change stage settings for
    that iterator only, and returns what puts them back (or ``None``)."""
    if check not in _BEFORE_MADE:
        _BEFORE_MADE.append(check)


@contextlib.contextmanager
def making(top: Any) -> Iterator[list]:
    """Around ``Iterator.__init__``, which copies the tree and parses the copy: the ``before_made`` checks'
    changes hold for that copy and are put back after. A failing check changes nothing. Yields the changes'
    undo functions (empty where nothing changed), for ``note_made``."""
    undo = []
    for check in list(_BEFORE_MADE):
        try:
            put_back = check(top)
        except Exception as exc:  # noqa: BLE001  (the iterator is made as the program asked)
            log.debug("ms_shm: a check before a new iterator failed (%s: %s)", type(exc).__name__, exc)
            continue
        if put_back is not None:
            undo.append(put_back)
    try:
        yield undo
    finally:
        for put_back in reversed(undo):
            put_back()


def note_made(iterator: Any, changed: bool = False) -> None:
    """``changed``: a ``before_made`` check set its tree's copy to read rows in MindSpore's own way, so it
    holds no worker slots and ``iterators_reading`` does not count it."""
    _noting(_ITERATORS.add, iterator)
    if changed:
        _noting(_CHANGED.add, iterator)


def note_finished(iterator: Any) -> None:
    _noting(lambda it: _FINISHED.update(stages(_tree(it))), iterator)


def _noting(note: Callable[[Any], Any], iterator: Any) -> None:
    try:
        note(iterator)
    except Exception as exc:  # noqa: BLE001  (only bookkeeping: the pipeline stays counted as in use)
        log.debug("ms_shm: an iterator was not noted (%s: %s)", type(exc).__name__, exc)


def _tree(iterator: Any) -> Any:
    """The dataset an iterator was made on (MindSpore's private ``__ori_dataset``, kept after ``stop()``)."""
    return getattr(iterator, "_Iterator__ori_dataset", None)


def stages(top: Any) -> list:
    """``top`` and every stage below it (``children``), each once."""
    out, todo, seen = [], [top], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        todo.extend(getattr(node, "children", None) or ())
    return out


def pipeline_of(stage: Any) -> tuple:
    """What tells ``stage``'s pipeline from others: its leaf stages (a map and the source below it are one
    pipeline; two built from different sources are two). Unreadable: ``()``, a pipeline of its own."""
    try:
        return tuple(sorted(id(s) for s in stages(stage) if not getattr(s, "children", None)))
    except Exception as exc:  # noqa: BLE001  (only a grouping of reservations)
        log.debug("ms_shm: a pipeline's stages not read (%s: %s)", type(exc).__name__, exc)
        return ()


def guard_of(stage: Any) -> Any:
    """The runtime guard a ``GeneratorDataset`` stage's source reads through (under the thread cap's wrapper),
    or ``None``."""
    source = getattr(stage, "source", None)
    for _ in range(4):
        guard = getattr(source, "_ms_shm_guard", None)
        if guard is not None:
            return guard
        source = getattr(source, "_ms_shm_wrapped", None)
    return None


def iterators_reading(guard: Any) -> int:
    """Live iterators on a tree whose ``GeneratorDataset`` reads through the runtime ``guard`` (a worker's fork
    sees them as the program held them when it started its workers: its own iterator among them, since
    MindSpore starts them after ``Iterator.__init__``, measured on 2.10). An earlier iterator kept alive (``it =
    ds.create_tuple_iterator(...)`` run to its end, then another made) keeps its workers and their slots; one made
    reading in MindSpore's own way (``note_made(changed=True)``) has none: counted, it kept every later iterator
    of ``it = ds.create_tuple_iterator()`` per epoch out of worker processes (an audit: 10 epochs in 11.7 s
    against 9.75 s, the earlier iterators holding 4 KiB of ``/dev/shm``)."""
    return _live_iterators_holding(lambda s: guard_of(s) is guard)


def iterators_on(stage: Any) -> int:
    """Live iterators, as ``iterators_reading`` counts them, on a tree holding ``stage`` itself or a stage reading
    through its runtime guard (there is none where MindSpore's slots are static, as on 2.0)."""
    guard = guard_of(stage)
    return _live_iterators_holding(lambda s: s is stage or (guard is not None and guard_of(s) is guard))


def _live_iterators_holding(match: Callable[[Any], bool]) -> int:
    try:
        return sum(1 for it in list(_ITERATORS) if it not in _CHANGED and any(match(s) for s in stages(_tree(it))))
    except Exception as exc:  # noqa: BLE001  (only an error message's detail, or the new iterator made as planned)
        log.debug("ms_shm: live iterators not read (%s: %s)", type(exc).__name__, exc)
        return 0


def follows_prefetch(dataset: Any) -> Callable[[], bool]:
    """Whether ``dataset``'s next iterator would run at MindSpore's global prefetch as it is then: no iterator
    made on a tree holding it is alive (a live one, stopped or not, keeps the prefetch it was made with: its
    ``GeneratorDataset`` reads ``get_prefetch_size()`` as the iterator is made). Unreadable: it does not."""
    ref = weakref.ref(dataset)

    def check() -> bool:
        stage = ref()
        return stage is not None and not _iterated_now(stage)

    return check


def _iterated_now(stage: Any) -> bool:
    """Whether an iterator alive now (stopped or not) was made on a tree holding ``stage``."""
    return any(any(s is stage for s in stages(_tree(it))) for it in list(_ITERATORS))


def in_use(dataset: Any) -> Callable[[], bool]:
    """Whether ``dataset``'s pipeline may hold ``/dev/shm`` now: until an iterator has run to its end on it
    (train and eval built up front may run at once, as ``Model.train`` with an eval callback does; a train only
    peeked at, ``next(train.create_dict_iterator())``, runs again later), and while an iterator on a tree holding
    it is alive (a stopped one keeps its workers and slots until it is gone, measured on 2.7.2-2.10). A pipeline
    run to its end whose iterators are gone (an eval built after a finished train) holds nothing: its workers
    are gone. Unreadable: in use. Not seen: a finished pipeline run again beside one planned while it was idle
    (a warm-up epoch, then ``fit`` with a validation set built after it); the guard meets that."""
    ref = weakref.ref(dataset)

    def check() -> bool:
        stage = ref()
        if stage is None:
            return False
        try:
            return stage not in _FINISHED or _iterated_now(stage)
        except Exception as exc:  # noqa: BLE001  (the safe answer: it keeps its reservation)
            log.debug("ms_shm: live iterators not read (%s: %s)", type(exc).__name__, exc)
            return True

    return check
