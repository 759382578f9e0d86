"""What one MindSpore release does with a GeneratorDataset pipeline at a given /dev/shm size: the rows of
``ms-shm plan``'s table, the figure ``doctor`` sizes /dev/shm for, and the words for how it fails. Pure: the
release's profile (``profiles``) and the arithmetic (``arithmetic``) in, frozen results out; no MindSpore import.

How a release fails is worded here once, from its profile: static slots (<= 2.3) are committed when the iterator
starts and refused by MindSpore's pre-check (``profile.precheck_error``); dynamic slots (2.4+) are checked by
nothing and die when /dev/shm fills (``profile.dynamic_failure``). A contributor adding a release changes its
profile, not this module.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from ms_shm._results import Result, mib, record
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import profiles
from ms_shm.engines.mindspore.profiles import EngineProfile
from ms_shm.errors import Error
from ms_shm.sizes import HEADROOM, shm_size_flag, with_headroom

# The first words of MindSpore's static pre-check message, on every release that has one.
PRECHECK_MESSAGE = "Insufficient shared memory available"


def release_name(profile: EngineProfile) -> str:
    """``MindSpore 2.3.0``, or ``MindSpore`` when the release is unknown."""
    return f"MindSpore {profile.version}" if profile.version else "MindSpore"


def failure(profile: EngineProfile) -> str:
    """How a GeneratorDataset whose slots do not fit /dev/shm fails on this release, in MindSpore's words."""
    if profile.generator_default_max_rowsize_mb:
        return f"{profile.precheck_error} at launch: '{PRECHECK_MESSAGE}'"
    return profile.dynamic_failure


def why_it_fails(profile: EngineProfile) -> str:
    """One sentence for ``doctor``: what this release does when a typical pipeline's slots do not fit."""
    static = profile.generator_default_max_rowsize_mb
    if static:
        return (f"{release_name(profile)} commits its static {static} MiB slots when the iterator starts, and "
                f"its pre-check refuses what does not fit 80% of the free /dev/shm ({failure(profile)})")
    return (f"{release_name(profile)} sizes each slot to its row and checks nothing in advance (dynamic slots, "
            f"the default since 2.4), so the first worker that writes past the end dies ({failure(profile)})")


@record
class MapOutcome(Result):
    """What ``map(python_multiprocessing=True)`` with the same workers and rows needs, by where it lives."""

    dev_shm: int
    sysv: int
    sysv_segment: int
    transport: str  # the profile's ``map_transport``: "sysv" or "shm-pool"

    @property
    def where(self) -> str:
        if self.transport == "sysv":
            return (f"SysV {mib(self.sysv)} (one {mib(self.sysv_segment)} segment per worker) + /dev/shm "
                    f"{mib(self.dev_shm)}")
        return f"/dev/shm {mib(self.dev_shm)} (6 slots per worker)"


@record
class Outcome(Result):
    """One release's outcome for a GeneratorDataset pipeline at a /dev/shm size (a row of ``ms-shm plan``).

    Attributes:
        version: the release asked about, as given (``"2.3"``, ``"2.10.0"``).
        profile: the release profile's note.
        transport: how rows reach the main process.
        per_rank, all_ranks: peak /dev/shm bytes of one rank, and of every rank on the host.
        outcome: what happens at ``shm_free`` bytes of free /dev/shm, in words.
        fits: whether the pipeline runs there (on static releases: passes MindSpore's pre-check and fits).
        map: a map/batch pool with the same workers and rows.
        need: ``all_ranks`` with ms_shm's headroom; ``size`` the same as a ``--shm-size`` value.
        slots: shared-memory slots per worker; ``slot_mb`` their static size (``None``: sized to the row).
        failure: how the pipeline fails on this release when its slots do not fit.
    """

    version: str | None
    profile: str
    transport: str
    per_rank: int
    all_ranks: int
    outcome: str
    fits: bool
    map: MapOutcome
    need: int
    size: str | None
    slots: int
    slot_mb: int | None
    failure: str
    release: EngineProfile | None = field(default=None, repr=False, compare=False)

    @property
    def why(self) -> str:
        """Why a pipeline that does not fit fails, as a sentence (``why_it_fails``)."""
        return why_it_fails(self._profile)

    @property
    def release_name(self) -> str:
        """``MindSpore 2.3.0``: the release in words."""
        return release_name(self._profile)

    @property
    def _profile(self) -> EngineProfile:
        return self.release or profiles.profile_for(self.version)


def _static_verdict(profile: EngineProfile, row_bytes: int, workers: int, prefetch: int, ranks: int,
                    all_ranks: int, shm_free: int | None) -> tuple:
    static = profile.generator_default_max_rowsize_mb
    if shm_free is None:
        verdict, fits = "unknown: /dev/shm could not be read", False
    elif model.static_precheck_fails(workers, prefetch, static, shm_free, min(ranks, 8)):
        verdict, fits = failure(profile), False
    elif all_ranks > shm_free:
        verdict, fits = "fails: slots do not fit the free /dev/shm", False
    else:
        verdict, fits = "fits", True
    if not model.static_row_fits(row_bytes, static):
        verdict += f"; rows >= {static} MiB are pickled through pipes (slow)"
    return f"static {static} MiB slots (default max_rowsize)", verdict, fits


def _dynamic_verdict(profile: EngineProfile, all_ranks: int, shm_free: int | None) -> tuple:
    if shm_free is None:
        verdict, fits = "unknown: /dev/shm could not be read", False
    elif all_ranks > shm_free:
        verdict, fits = failure(profile), False
    elif all_ranks > shm_free * HEADROOM:
        verdict, fits = "fits, but without the 20% headroom ms_shm keeps", True
    else:
        verdict, fits = "fits", True
    return "dynamic slots, sized to the row", verdict, fits


def outcome(row_bytes: int, workers: int, prefetch: int, ranks: int = 1, shm_free: int | None = None,
            version: str | None = None, rows: int | None = None) -> Outcome:
    """What ``version`` does with a GeneratorDataset of ``workers`` workers, ``row_bytes`` rows and ``prefetch``
    on each of ``ranks`` ranks sharing ``shm_free`` bytes of /dev/shm (``None``: unknown).

    ``version=None`` is the newest measured behaviour (``profiles.profile_for``); pass the installed release
    (``HostFacts.mindspore_version``) to judge a host.
    """
    profile = profiles.profile_for(version)
    static = profile.generator_default_max_rowsize_mb
    ranks = max(1, int(ranks))
    per_rank = model.generator_peak(row_bytes, workers, prefetch, rows, static)
    total = per_rank * ranks
    if workers <= 1:
        transport, verdict, fits = "in the main process (1 worker)", "fits: no shared memory", True
    elif static:
        transport, verdict, fits = _static_verdict(profile, row_bytes, workers, prefetch, ranks, total, shm_free)
    else:
        transport, verdict, fits = _dynamic_verdict(profile, total, shm_free)
    cost = model.map_pool_cost(profile, workers, row_bytes, row_bytes)
    need = with_headroom(total)
    return Outcome(version, profile.note, transport, per_rank, total, verdict, fits,
                   MapOutcome(cost.dev_shm, cost.sysv, cost.sysv_segment, profile.map_transport),
                   need, shm_size_flag(need) if need else None,
                   model.slots_made(prefetch, workers, rows, bool(static)), static,
                   failure(profile), profile)


def table_versions(asked: str | None) -> tuple:
    """The releases ``ms-shm plan`` prints: every known one, and the one asked about when it is not among them."""
    known = tuple(profiles.KNOWN_VERSIONS)
    if asked is None or profiles.parse_version(asked) in [profiles.parse_version(v) for v in known]:
        return known
    return known + (asked,)


# ------------------------------------------------------------------------------------------- ms-shm plan


@record
class PlanInput(Result):
    """The pipeline ``ms-shm plan`` was asked about."""

    row_bytes: int
    workers: int
    prefetch: int
    ranks: int
    mindspore: str
    rows: int | None = None


@record
class ShmSeen(Result):
    """The /dev/shm the what-if is judged against, and where its numbers came from."""

    total: int | None
    free: int | None
    source: str


@record
class WhatIf(Result):
    """``ms-shm plan``'s answer: each release's outcome, and the plan ms_shm would build for the asked one."""

    input: PlanInput
    shm: ShmSeen
    versions: tuple
    plan: Any
    plan_note: str | None
    fits: bool

    @property
    def asked(self) -> Outcome:
        """The table row of the release asked about."""
        return _row_of(self.versions, self.input.mindspore)


def _row_of(table: tuple, version: str) -> Outcome:
    want = profiles.parse_version(version)
    return next(o for o in table if profiles.parse_version(o.version) == want)


def what_if(facts: Any, row_bytes: int, workers: int, prefetch: int = model.DEFAULT_PREFETCH,
            ranks: int | None = None, version: str | None = None, shm: int | None = None,
            rows: int | None = None, memory: int | None = None) -> WhatIf:
    """``ms-shm plan``: a hypothetical pipeline on this host (``facts``), or on a /dev/shm of ``shm`` bytes and
    ``memory`` bytes of memory left (default: this host's, ``HostFacts.memory_left``).

    ``ranks`` defaults to the launcher's count, ``version`` to the installed release (else the newest known).
    """
    from ms_shm.engines.mindspore import planning

    ranks_source = "given" if ranks else facts.ranks.source
    ranks = ranks or facts.ranks.local_size
    version = version or facts.mindspore_version or profiles.KNOWN_VERSIONS[-1]
    if shm is not None:
        seen = ShmSeen(shm, shm, "given with --shm")
    else:
        seen = ShmSeen(facts.shm_total, facts.shm_free, f"this host's {facts.shm_path}")
    memory_left, memory_source = (memory, "given with --memory") if memory is not None else facts.memory_left
    table = tuple(outcome(row_bytes, workers, prefetch, ranks, seen.free, v, rows) for v in table_versions(version))
    inp = PlanInput(row_bytes, workers, prefetch, ranks, version, rows)
    try:
        chosen, note = planning.what_if(row_bytes=row_bytes, workers=workers, prefetch=prefetch, ranks=ranks,
                                        version=version, shm_free=seen.free, cpu_count=facts.cpu_count,
                                        nofile_soft=facts.nofile_soft, open_fds=facts.open_fds,
                                        ranks_source=ranks_source, memory_left=memory_left,
                                        memory_source=memory_source), None
    except Error as exc:  # the planner answers misfits with fits=False; anything else is worth a note
        chosen, note = None, f"{type(exc).__name__}: {exc}"
    fits = chosen.fits if chosen is not None else _row_of(table, version).fits
    return WhatIf(inp, seen, table, chosen, note, fits)


__all__ = ["PRECHECK_MESSAGE", "Outcome", "MapOutcome", "PlanInput", "ShmSeen", "WhatIf", "outcome", "failure",
           "why_it_fails", "release_name", "table_versions", "what_if"]
