"""The seam: what every engine provides, so the generic parts (host facts, measurement, budget, ranking,
advice text, sizes) stay framework-free. A ``Protocol``: engines implement it without inheriting from it.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ms_shm._results import record

# The one sentence every engine's kill signature (and ``explain``'s bare SIGKILL lines) gives for a SIGKILL.
OOM_CAUSE = ("SIGKILL ('Killed') is usually the OOM killer: /dev/shm pages count against the memory limit "
             "({memory_limit}).")


@record
class Signature:
    """One failure a framework prints, as ``ms_shm.explain`` recognises and explains it.

    ``cause``, ``fix`` and the snippet texts are ``str.format`` templates. Their fields are the regex's named
    groups (``pid``, ``signal``, ``code``, ``required``, ``available``...), what ``words`` derives from them, and
    the host's words that ``explain`` supplies (``shm_state``, ``size``, ``who``, ``memory_limit``, ``workers``,
    ``prefetch``, ``fds``, ``target``, ``limits``, ``required_mib``, ``available_mib``, ``ratio``, and ``ipc_state``
    / ``ipc_fix``: whether this host's systemd-logind deletes the user's IPC at logout, and how to stop it).

    Attributes:
        kind: the ``Explanation.kind`` it produces (several signatures may share one).
        label: a few words for the list of what ``explain`` knows.
        regex: the pattern, searched in the whole log.
        severity: as ``Advice.severity``.
        cause, fix: templates, as above.
        need: the host resource ``explain`` prices and offers fixes for: ``"shm"`` (a /dev/shm size),
            ``"shm-slots"`` (that, or a prefetch that fits), ``"shm-check"`` (a size that passes a pre-check of
            ``required`` bytes), ``"shm-free"`` (free /dev/shm first), ``"nofile"``, ``"ipc"`` (keep logind from
            deleting IPC objects) or ``""`` (nothing).
        snippets: ``(label, template)`` pairs added after ``explain``'s own.
        near, not_near: the log must contain one of ``near`` (when given) and none of ``not_near``.
        alone: reported only when no other failure was recognised (a consequence, not a cause).
        yields_to: kinds that, when also recognised, make this one redundant.
        signal: the signal this failure is, when the line does not name one.
        words: more template fields computed from the others (the matched ones and the host's words, above:
            the engine's arithmetic).
        engine: the engine the signature belongs to.
    """

    kind: str
    label: str
    regex: str
    severity: str
    cause: str
    fix: str
    need: str = ""
    snippets: tuple = ()
    near: tuple = ()
    not_near: tuple = ()
    alone: bool = False
    yields_to: tuple = ()
    signal: str | None = None
    words: Callable[[dict], dict] | None = field(default=None, compare=False, repr=False)
    engine: str = ""


@runtime_checkable
class Engine(Protocol):
    """One framework's data-pipeline engine.

    Attributes:
        name: the key in ``ms_shm.engines.ENGINES``.
    """

    name: str

    def available(self) -> bool:
        """Whether the framework can be imported here (imports it)."""

    def installed_version(self) -> str | None:
        """The installed release, read without importing the framework where possible."""

    def profile(self, version: str | None = None) -> Any:
        """How ``version`` (default: the installed one) behaves: transports, pre-checks, failure wording."""

    def read_config(self) -> Any:
        """The framework's global pipeline settings now, or ``None`` when it is not importable."""

    def undo(self, changes: Sequence[Any]) -> None:
        """Put back every global setting in ``changes`` (``Change`` records), newest first."""

    def typical_peak(self, row_bytes: int, workers: int, prefetch: int, version: str | None = None) -> int:
        """Peak shared memory of one typical pipeline of this engine (what ``doctor`` sizes /dev/shm for)."""

    def pipeline_fds(self, workers: int, prefetch: int) -> int:
        """File descriptors the main process holds for one typical pipeline."""

    def leftover_patterns(self) -> Any:
        """How ``clean`` recognises what a crashed pipeline of this engine left: ``/dev/shm`` and ``/tmp`` names,
        SysV key shape (a frozen ``LeftoverPatterns``, as in ``engines/mindspore/leftovers.py``)."""

    def signatures(self, version: str | None = None) -> Sequence[Signature]:
        """The failures this engine's pipelines print, worded for ``version`` (``None``: the newest measured
        behaviour), for ``explain``."""

    def outcome(self, row_bytes: int, workers: int, prefetch: int, ranks: int = 1, shm_free: int | None = None,
                version: str | None = None, rows: int | None = None) -> Any:
        """What ``version`` (``None``: the newest measured behaviour) does with a typical pipeline of ``ranks``
        ranks at ``shm_free`` bytes of /dev/shm: peak, fit, failure wording (a frozen result with
        ``to_dict()``). ``doctor``, ``plan`` and ``explain`` all size from it."""


def worker_killed(kind: str, owner: str, loader: str, regex: str, engine: str) -> Signature:
    """A DataLoader worker killed by a signal other than SIGBUS, in ``owner``'s words (``regex`` names ``pid`` and
    ``signal``): the OOM killer's checks, one answer for PyTorch's DataLoader and MindSpore's."""
    return Signature(kind, f"{owner}'s worker-killed line", regex, "crash",
                     f"A {loader} worker {{pid}} was killed by signal {{signal}}. " + OOM_CAUSE,
                     "check `dmesg | grep -i oom`, lower num_workers or batch size, raise the memory limit",
                     snippets=(("shell", "dmesg | grep -i -E 'oom|killed process'"),), engine=engine)


def worker_exited(kind: str, owner: str, loader: str, regex: str, fix: str, engine: str) -> Signature:
    """A DataLoader's 'worker ... exited unexpectedly' (``regex`` names ``pid``): a consequence, told only where
    nothing else in the log explains it."""
    return Signature(kind, f"{owner}'s 'DataLoader worker ... exited unexpectedly'", regex, "crash",
                     f"A {loader} worker ({{pid}}) died without a Python error: usually a signal (bus error when "
                     "/dev/shm filled, SIGKILL from the OOM killer). {shm_state}", fix, need="shm", alone=True,
                     engine=engine)


__all__ = ["Engine", "Signature", "worker_killed", "worker_exited"]
