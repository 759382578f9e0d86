"""The state that outlives one call, in one object: the host facts taken before the first pipeline started
(later readings would count our own pipelines' slots as "used by someone else"), the ledger of live pipelines,
the recommendations already logged, and every setting ``tune()``, ``build_dataset`` and ``map`` changed, each
restorable (``ms_shm.session().restore()``).
"""

from __future__ import annotations

import logging
import textwrap
import threading
from dataclasses import field, replace
from typing import Any, Callable, Sequence

from ms_shm import budget as budget_mod
from ms_shm import changes as changes_mod
from ms_shm import host
from ms_shm._results import record

log = logging.getLogger("ms_shm")


@record(frozen=False)
class Session:
    facts: host.HostFacts | None = None
    fraction: float = budget_mod.DEFAULT_FRACTION
    ranks: int | None = None
    ledger: budget_mod.Ledger = field(default_factory=budget_mod.Ledger)
    advised: set = field(default_factory=set)
    changes: list = field(default_factory=list)
    undoers: list = field(default_factory=list)  # beside each change, the function that puts it back
    lock: threading.Lock = field(default_factory=threading.Lock)
    until_pipeline: frozenset = frozenset()  # advice codes held back until the first pipeline (``hold_advice``)
    held: list = field(default_factory=list)  # (facts, advice) held back so far

    def host_facts(self) -> host.HostFacts:
        """The cached facts, with the open-files limit read now (``tune()`` may have raised it since)."""
        with self.lock:
            if self.facts is None:
                self.facts = host.probe(ranks=self.ranks)
            facts = self.facts
        soft, hard = changes_mod.get_nofile()
        return replace(facts, nofile_soft=soft, nofile_hard=hard)

    def start(self, facts: host.HostFacts, fraction: float, ranks: int | None) -> None:
        with self.lock:
            self.facts, self.fraction, self.ranks = facts, fraction, ranks

    def budget(self, facts: host.HostFacts, reserved: tuple | None = None,
               apart: str | None = None, leaned: frozenset = frozenset(), held_now: bool = False,
               excluded: frozenset = frozenset()) -> budget_mod.Budget:
        """This rank's budget: free /dev/shm, memory and fds, less what live pipelines of this process reserved
        (but those of kind ``apart``: ``Ledger``; of theirs only the memory persistent workers keep between
        epochs counts, ``held_apart``: a val loader of 8 x 16 MiB samples was refused in a 450 MB container after
        a train loader with no workers, idle, that held nothing, where raw torch ran both). /dev/shm is as it
        was before the first pipeline (later readings would count our own slots as someone else's); memory is
        that, or what is left now plus what our running pipelines reserved (those an iterator runs; one built and
        not iterated yet holds nothing, and adding its reservation back planned a map on memory that was not
        there: an audit's OOM kill at 650 MB where raw ran), whichever is less. ``leaned``: keys of reservations
        counted as switched to their leanest settings (``Ledger.go_lean``). ``held_now``: the running pipelines'
        memory counted at what they hold now (the memory left now) instead of at their reservations, which are
        their worst case, every queue full (``api._overcommitted``); the others' at their reservations.
        ``excluded``: keys of reservations not counted (``api._beside_the_largest_idle``)."""
        if reserved is not None:
            (shm_used, fds_used, memory_used), pipelines, returned, idle = reserved, 0, (), 0
        else:
            live = self.ledger.live()  # one reading: a pipeline registered meanwhile is in all three or none
            live = tuple(r.leaned() if r.key in leaned else r for r in live if r.key not in excluded)
            counted = budget_mod.but_kind(live, apart)
            shm_used, fds_used, memory_used = budget_mod.sums(counted)
            memory_used += sum(r.held_apart for r in live if r.kind == apart)
            pipelines = sum(1 for r in counted if r.shm_bytes)
            waiting = self.ledger.following(counted)  # no iterator alive on them: they hold nothing now
            returned, idle = budget_mod.returned_at(waiting), sum(r.memory for r in waiting)
        memory_left, memory_source = facts.memory_left
        now_left = host.memory_now(facts).memory_left[0] if memory_left is not None else None
        running = memory_used - idle
        if held_now and now_left is not None:
            memory_left, memory_used = min(memory_left, now_left), idle
            memory_source = f"{memory_source}, read now, running pipelines at what they hold now"
        elif now_left is not None and now_left + running < memory_left:  # the program took some since
            memory_left, memory_source = now_left + running, f"{memory_source}, read now"
        return budget_mod.compute(facts.shm_free, facts.ranks.local_size, facts.nofile_soft, facts.open_fds,
                                  shm_used, fds_used, self.fraction, facts.ranks.source, memory_left,
                                  memory_used, memory_source, pipelines, facts.shm_readonly, returned,
                                  _shm_others(facts))

    def record(self, made: Sequence[Any], undo: Callable[[Sequence[Any]], None]) -> list:
        """Keep the changes that happened (``None`` means nothing changed), each with what undoes it: the
        engine that made it, or the process-limit undo for the open-files limit."""
        made = [c for c in made if c]
        with self.lock:
            for change in made:
                self.changes.append(change)
                self.undoers.append(changes_mod.undo_nofile if change.setting == changes_mod.NOFILE
                                    else (lambda c, undo=undo: undo([c])))
        return made

    def restore(self, only: Sequence[Any] | None = None) -> None:
        """Undo ``only`` (default: every recorded change), newest first, and forget them."""
        with self.lock:
            pairs = list(zip(self.changes, self.undoers))
            chosen = pairs if only is None else [p for p in pairs if any(p[0] is c for c in only)]
            kept = [p for p in pairs if all(p is not c for c in chosen)]
            self.changes, self.undoers = [c for c, _ in kept], [u for _, u in kept]
        for change, undo in reversed(chosen):
            undo(change)

    def hold_advice(self, codes: frozenset) -> None:
        """Hold back advice of ``codes`` until the program builds its first pipeline (``advise_held``): ``ms-shm
        run`` tunes a script that may never build one, and a MindSpore DataLoader script was told, in 27 lines,
        how a typical GeneratorDataset pipeline would not fit and which ``ds.config`` calls would help."""
        self.until_pipeline = frozenset(codes)

    def advise_held(self, binds: bool = True) -> None:
        """A pipeline was planned: what ``hold_advice`` held back is said now, once, where this host's room shaped
        that plan (``binds``). Else it stays held for a later one: the advice is of a typical pipeline, and audits'
        NLP scripts, rows of 100 B read in MindSpore's own thread, were told in 28 lines under 64 MB how 8 MiB rows
        in worker processes would not fit, with fixes that did nothing for them."""
        if not self.until_pipeline or not binds:
            return
        held, self.held, self.until_pipeline = self.held, [], frozenset()
        for facts, item in held:
            self.log_advice_once(facts, [item], PLANNED_BY_MS_SHM)

    def log_advice_once(self, facts: host.HostFacts, items: Sequence[Any], planned: str | None = None) -> None:
        """Recommendations go to the log once per process, and only from local rank 0 of a multi-rank job.
        ``planned``: whose pipelines ms_shm plans around advice of a pipeline that dies (``planned_around``),
        said with each such item logged now (not one held back)."""
        if facts.ranks.local_rank != 0:
            return
        for item in items:
            if getattr(item, "code", None) in self.until_pipeline:
                self.held.append((facts, item))
                continue
            item = planned_around(item, planned) if planned else item
            key = getattr(item, "problem", str(item))
            if key in self.advised:
                continue
            self.advised.add(key)
            level = logging.WARNING if getattr(item, "severity", "") in ("crash", "slow") else logging.INFO
            snippets = "".join(f"\n  {label}:\n" + textwrap.indent(text, "    ")
                               for label, text in getattr(item, "snippets", ()))
            log.log(level, "%s Fix: %s%s", item.problem, item.fix, snippets)

    def reset(self) -> None:
        with self.lock:
            self.facts, self.ranks, self.fraction = None, None, budget_mod.DEFAULT_FRACTION
            self.advised.clear()
            self.until_pipeline, self.held = frozenset(), []
            self.changes.clear()
            self.undoers.clear()
        self.ledger.clear()


PLANNED_BY_MS_SHM = "the pipelines it builds"
BUILT_THROUGH_MS_SHM = ("the pipelines built through it (build_dataset, map, batch, build_dataloader), not those "
                        "MindSpore builds directly,")


def planned_around(item: Any, whose: str) -> Any:
    """Advice of a pipeline that dies (``"crash"``), with what ms_shm does about it: the advice names how raw
    MindSpore fails here, and ``whose`` pipelines will not. Held advice is said so once the program builds a
    pipeline through ms_shm (an audit's ``ms-shm run`` under 64 MB printed the bus error to come, 27 lines, for a
    pipeline it then fitted); ``tune()`` says it so at once (an audit read it, under 64 MB, as the fate of the
    pipelines ``build_dataset`` then fitted)."""
    if getattr(item, "severity", "") != "crash" or not isinstance(getattr(item, "problem", None), str):
        return item
    return replace(item, problem=f"{item.problem.rstrip('.')}. ms_shm plans {whose} to fit this instead (each "
                                 f"change it makes is logged), at some cost in speed; the fix gives them MindSpore's "
                                 f"own settings back.")


SESSION = Session()


__all__ = ["Session", "SESSION"]


def _shm_others(facts: host.HostFacts) -> int:
    """What /dev/shm held when ``tune()`` read it, before this process's pipelines: other processes' files."""
    if facts.shm_total is None or facts.shm_free is None:
        return 0
    return max(0, facts.shm_total - facts.shm_free)
