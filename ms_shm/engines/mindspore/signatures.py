"""The failures MindSpore's dataset engine prints, as ``ms_shm.explain`` recognises them: regexes, kinds and the
causes and fixes in MindSpore's terms, worded for one release's profile. Pure: no MindSpore import.

The patterns are the messages MindSpore really prints (``tests/data/logs`` holds logs captured from failing
runs), matched loosely enough to survive the GLOG prefix, a Python traceback around them or a line wrapped by a
job scheduler. A contributor adding a failure adds one ``Signature`` here and a log (or a line) to
``tests/test_explain.py``; ``explain`` needs no change.
"""

from __future__ import annotations

from dataclasses import replace

from ms_shm._results import mib
from ms_shm.engines.base import OOM_CAUSE, Signature
from ms_shm.engines.mindspore import arithmetic as model
from ms_shm.engines.mindspore import profiles
from ms_shm.engines.mindspore.outcomes import PRECHECK_MESSAGE, release_name
from ms_shm.engines.mindspore.profiles import EngineProfile

# A traceback through these went through multiprocessing's semaphores, which live in /dev/shm.
SEMAPHORE_HINTS = ("SemLock", "synchronize.py", "sem_open", "multiprocessing.Event", "multiprocessing.Value",
                   "Lock()", "Semaphore", "/dev/shm")
# Words a log of a data pipeline's failure carries somewhere (a traceback through MindSpore or torch, a worker)
PIPELINE_HINTS = ("mindspore", "MindSpore", "multiprocessing", "DataLoader", "dataloader", "torch", "worker",
                  "Worker", "GeneratorDataset", "ancdata")
_EMFILE = r"(?<!\bno )Too many open files|\[Errno 24\]|errno:? 24\b|EMFILE|received 0 items of ancdata"
_DF = ("shell", "df -h /dev/shm\nms-shm clean --dry-run")
_DMESG = ("shell", "dmesg | grep -i -E 'oom|killed process'\nipcs -m\nms-shm clean --dry-run")


# Kinds whose message MindSpore prints for a read-only /dev/shm too: GeneratorDataset's launch turns any failure of
# ``multiprocessing.Event()`` (EROFS there) into "insufficient shm ... at least 5 GB", and prints no errno. Where
# the host's /dev/shm is read-only, ``explain`` names the mount instead.
HIDES_READONLY = ("shm-full",)


def _bus_words(fields: dict) -> dict:
    """Who hit the bus error: a GeneratorDataset worker when its SIGCHLD line names one; else the log names no
    pipeline (MindSpore prints the same "Unexpected bus error" line in a DataLoader's worker)."""
    if fields.get("pid"):
        return {"bus_who": f"A MindSpore GeneratorDataset worker ({fields['pid']}) wrote a row into a shared-memory "
                           "slot after /dev/shm was full"}
    return {"bus_who": "A MindSpore dataset worker wrote into /dev/shm after it was full (the log names no "
                       "pipeline: for a mindspore.dataset.dataloader.DataLoader, lower num_workers, prefetch_factor "
                       "or batch_size rather than the fixes below; in a GeneratorDataset, a row was written into "
                       "a shared-memory slot)"}


def _row_words(words: dict) -> dict:
    """The static slot and row sizes of a "rowsize is larger" warning, the smallest max_rowsize above, and the
    /dev/shm its static slots take with the typical workers and prefetch (an audit: 2.0.0's fix "pass
    max_rowsize=9" under 64 MB raised 'Insufficient shared memory' at launch where the pipes had run)."""
    slot, row = float(words["slot_mb"]), float(words["row_mb"])
    better = model.static_rowsize_for(int(row * model.MiB))
    workers, prefetch = max(2, int(words.get("workers") or 2)), int(words.get("prefetch") or model.DEFAULT_PREFETCH)
    need = model.generator_peak(int(row * model.MiB), workers, prefetch, None, better)
    return {"slot_mb": slot, "row_mb": row, "better": better, "static_workers": workers,
            "static_slots": model.slots(prefetch, workers), "static_need": mib(need), "static_prefetch": prefetch}


def _shm_signatures(profile: EngineProfile) -> tuple:
    static = profile.generator_default_max_rowsize_mb
    checked = (f"its default static {static} MiB slots" if static else "a static max_rowsize")
    smaller = (f"lower prefetch or workers ({release_name(profile)} has only static slots, {static} MiB by "
               "default)" if static else
               "lower prefetch or workers; dropping max_rowsize (MindSpore 2.4+ sizes slots to each row) only "
               "skips this check, and rows larger than /dev/shm holds then end in a bus error")
    return (
        Signature(
            "bus-error", "MindSpore's bus error and SIGCHLD lines",
            r"Unexpected bus error encountered in process|"
            r"Dataset worker process (?P<pid>\d+) was killed by signal: (?P<signal>Bus error)\.",
            "crash",
            "{bus_who}; the kernel answers that with SIGBUS, and the main process then terminates itself. "
            "Dynamic slots (the default since 2.4) are not checked in advance. {shm_state}",
            "give the container a /dev/shm of {size}, or lower prefetch/workers (`ms-shm plan --row-mb <row> "
            "--workers <W>` shows what fits)",
            need="shm-slots", signal="Bus error", words=_bus_words,
            yields_to=("msloader-bus-error",)),  # the log shows a DataLoader's frames or lines: its failure
        Signature(
            "insufficient-shm", f"'{PRECHECK_MESSAGE}'",
            PRECHECK_MESSAGE + r"\.\s*Required:\s*(?P<required>\d+),\s*Available:\s*(?P<available>\d+)",
            "crash",
            f"MindSpore's launch check ({profile.precheck_error} on {release_name(profile)}) refused {checked}: "
            "the slots need {required_mib} (workers x (prefetch-based queue + 2) x max_rowsize, x ranks up to "
            "8) but only {available_mib} of /dev/shm was free ({ratio:.1f}x), and it allows at most 80%. "
            "{check_sum} {shm_state}",
            smaller + ", or give the container a /dev/shm of {size}",
            need="shm-check"),
        Signature(
            "shm-full", "'recommended shm size is at least 5 GB'",
            r"recommended shm size is at least\s*(?P<gb>\d+)\s*GB", "crash",
            "/dev/shm had no room left even for multiprocessing's semaphores (one page each), so the pipeline "
            "could not start: something else filled it (another job, or files a crashed run left). MindSpore's "
            "'5 GB' is a rule of thumb. {shm_state} MindSpore prints the same line when /dev/shm is mounted "
            "read-only (it hides the EROFS). {readonly_state}",
            "free /dev/shm (stop whatever holds it; `ms-shm clean` removes MindSpore's leftovers), then give the "
            "container a /dev/shm of {size}",
            need="shm-free", snippets=(_DF,)),
    )


_ENOSPC = r"\[Errno 28\] No space left on device|errno:? 28\b|ENOSPC"


def _os_signatures() -> tuple:
    return (
        Signature(
            "no-space", "'No space left on device' in /dev/shm", _ENOSPC, "crash",
            "/dev/shm had no room left even for multiprocessing's semaphores (one page each), so the pipeline "
            "could not start: something else filled it (another job, or files a crashed run left). MindSpore's "
            "'5 GB' is a rule of thumb. {shm_state}",
            "free /dev/shm (stop whatever holds it; `ms-shm clean` removes MindSpore's leftovers), then give the "
            "container a /dev/shm of {size}",
            need="shm-free", snippets=(_DF,), near=SEMAPHORE_HINTS),
        Signature(
            "no-space", "'No space left on device' elsewhere", _ENOSPC, "info",
            "A filesystem is full (errno 28). The traceback does not go through multiprocessing's semaphores, so "
            "it is probably not /dev/shm: check the disk the job writes to",
            "check with: df -h; df -h /dev/shm", not_near=SEMAPHORE_HINTS),
        Signature(
            "too-many-open-files", "'Too many open files'", _EMFILE, "crash",
            "A process ran out of file descriptors (errno 24, EMFILE). Every MindSpore shared-memory slot is an "
            "fd passed to the main process, so a {workers}-worker pipeline at prefetch {prefetch} holds about "
            "{fds}; {limits}",
            "raise the job's open-files limit to at least {target} (`ulimit -n` before training, or the "
            "container's --ulimit)",
            need="nofile", yields_to=("pytorch-too-many-files", "msloader-too-many-files"), near=PIPELINE_HINTS),
        Signature(  # an audit's bare traceback of open() in a loop was told of MindSpore's slots
            "too-many-open-files", "'Too many open files' outside a data pipeline", _EMFILE, "crash",
            "A process ran out of file descriptors (errno 24, EMFILE). The log shows no data pipeline (no "
            "MindSpore, multiprocessing or DataLoader in it), so the program itself held that many open: files "
            "opened in a loop and never closed, or a limit lower than the job needs; {limits}",
            "close each file when done with it (`with open(...) as f:`), or raise the job's open-files limit to "
            "at least {target} (`ulimit -n` before training, or the container's --ulimit)",
            need="nofile", yields_to=("pytorch-too-many-files", "msloader-too-many-files"), not_near=PIPELINE_HINTS),
    )


def _ipc_signatures() -> tuple:
    """IPC objects deleted under a running pipeline: what systemd-logind's RemoveIPC does at the user's last
    logout. ``explain`` says whether this host's logind would (``ipc_state``) and how to stop it (``ipc_fix``)."""
    return (
        Signature(
            "ipc-removed", "MindSpore's 'Exec msgrcv failed' (a map/batch worker's message queue deleted)",
            r"Exec msgrcv failed\. Msg queue id: -?\d+, mtype: -?\d+, errno: (?:2|22|43)\b", "crash",
            "The SysV message queue between a MindSpore map/batch worker and the main process (one per worker "
            "since 2.7) was deleted while the pipeline ran: msgrcv failed and no queue was left under the "
            "worker's key. {ipc_state}",
            "{ipc_fix}", need="ipc"),
        Signature(
            "ipc-removed", "'Identifier removed' (EIDRM: a SysV object deleted while in use)",
            r"\[Errno 43\]|Identifier removed|\bEIDRM\b", "crash",
            "A SysV message queue, semaphore set or segment was deleted while a process was waiting on it "
            "(errno 43, EIDRM). {ipc_state}",
            "{ipc_fix}", need="ipc"),
        Signature(
            "ipc-removed", "multiprocessing's 'SemLock._rebuild' FileNotFoundError",
            r"SemLock\._rebuild\(\*state\)[\s^]*FileNotFoundError: \[Errno 2\]", "crash",
            "A spawned worker could not reopen one of multiprocessing's semaphores: its /dev/shm/sem.* file was "
            "gone. Either the parent had exited already (a script without `if __name__ == '__main__':`), or "
            "the file was deleted under the job. {ipc_state}",
            "{ipc_fix}", need="ipc"),
    )


def _sysv_signatures() -> tuple:
    """A map/batch worker's SysV segment (2.7+) the kernel's limits refuse: ``shmget`` fails with EINVAL (a
    segment over ``kernel.shmmax``), ENOSPC (``shmmni`` segments or ``shmall`` pages used up) or ENOMEM. ``doctor``
    reads the limits (``sysv-shmmax``, ``sysv-shmall``, ``sysv-shmmni``); an audit's log of it was recognised as
    nothing."""
    return (
        Signature(
            "sysv-limit", "MindSpore's 'shmget key: N error. Errno: E' (a map/batch worker's SysV segment refused)",
            r"shmget key: -?\d+ error\. Errno: (?P<code>22|28|12)\b", "crash",
            "A MindSpore map/batch worker (2.7+: one SysV shared-memory segment per worker, sized for its rows) "
            "could not create its segment: errno {code} (22: larger than kernel.shmmax; 28: kernel.shmmni "
            "segments or kernel.shmall pages used up; 12: no memory for it). It is not /dev/shm",
            "run `ms-shm doctor`, which reads kernel.shmmax / shmall / shmmni and names the values to set, then "
            "raise them (sysctl -w kernel.shmmax=...; docker run --sysctl kernel.shmmax=...), or use smaller rows "
            "or threads for the map (python_multiprocessing=False)",
            snippets=(("shell", "sysctl kernel.shmmax kernel.shmall kernel.shmmni; ipcs -m"),)),
    )


def _worker_signatures(profile: EngineProfile) -> tuple:
    leftovers = (" After a SIGKILL of the whole process group, map/batch workers leave SysV segments behind"
                 if profile.map_transport == "sysv" else "")
    return (
        Signature(
            "worker-killed", "MindSpore's worker-killed line",
            r"Dataset worker process (?P<pid>\d+) was killed by signal: (?!Bus error)(?P<signal>[A-Za-z ]+?)\.",
            "crash",
            "MindSpore's dataset worker {pid} was killed by signal {signal}. " + OOM_CAUSE + leftovers,
            "check `dmesg | grep -i oom`, lower workers or row size, raise the memory limit; `ms-shm clean` "
            "removes leftovers",
            snippets=(_DMESG,)),
        Signature(
            "worker-exited", "MindSpore's worker-exit line",
            r"Dataset worker process (?P<pid>\d+) exited unexpectedly with exit code (?P<code>-?\d+)", "crash",
            "MindSpore's dataset worker {pid} exited with code {code}; its own traceback, printed above this line, "
            "names the cause, and nothing in it matched a known shared-memory or fd failure",
            "read the worker's traceback; run `ms-shm doctor` for the host's limits", alone=True),
        Signature(
            "worker-died", "MindSpore 2.0's 'The subprocess of dataset may exit unexpected or be killed'",
            r"The subprocess of dataset may exit unexpected or be killed", "crash",
            "A dataset worker process went away (killed or exited) and MindSpore stopped the pipeline; MindSpore "
            "2.0's line names no pid or signal. Nothing else in the log matched a known shared-memory or fd "
            "failure. A worker that dies without a traceback of its own was killed by a signal: " + OOM_CAUSE,
            "read the worker's traceback if there is one; check `dmesg | grep -i oom`; run `ms-shm doctor` for the "
            "host's limits",
            snippets=(_DMESG,), alone=True),
    )


def _rowsize_signatures(profile: EngineProfile) -> tuple:
    static = profile.generator_default_max_rowsize_mb
    fix = (f"pass max_rowsize={{better}} ({release_name(profile)} has only static slots, {static} MiB by default) "
           "where /dev/shm holds them: {static_workers} workers x {static_slots} slots x {better} MiB = "
           "{static_need} at prefetch {static_prefetch} (the job's own workers and prefetch decide); where it does "
           f"not, {profile.precheck_error} 'Insufficient shared memory available' at launch, so lower prefetch or "
           "workers with it; or leave it: the rows arrive all the same, through pipes"
           if static else "use max_rowsize=None (dynamic slots, MindSpore 2.4+) or max_rowsize={better}")
    return (
        Signature(
            "row-too-big", "'rowsize is larger than allocated memory max_rowsize'",
            r"rowsize is larger than allocated memory max_rowsize:\s*(?P<slot_mb>[\d.]+)MB,\s*"
            r"current rowsize:\s*(?P<row_mb>[\d.]+)MB",
            "slow",
            "A row of {row_mb:g} MB did not fit the static {slot_mb:g} MB slots (it must be strictly smaller), so "
            "MindSpore pickled it through a pipe instead: measured about 4x slower",
            fix,
            snippets=(("python", "ds.GeneratorDataset(source, column_names, num_parallel_workers=W, "
                                 "max_rowsize={better})"),),
            words=_row_words),
    )


def for_profile(profile: EngineProfile) -> tuple:
    """Every MindSpore signature, worded for ``profile``'s release."""
    found = (_shm_signatures(profile) + _os_signatures() + _worker_signatures(profile)
             + _rowsize_signatures(profile) + _ipc_signatures() + _sysv_signatures())
    return tuple(replace(s, engine="mindspore") for s in found)


def signatures(version: str | None = None) -> tuple:
    """Every MindSpore signature, worded for ``version`` (``None``: the newest measured behaviour)."""
    return for_profile(profiles.profile_for(version))


__all__ = ["HIDES_READONLY", "SEMAPHORE_HINTS", "for_profile", "signatures"]
