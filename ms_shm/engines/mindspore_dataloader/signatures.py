"""The failures MindSpore 2.8+'s ``mindspore.dataset.dataloader.DataLoader`` prints (measured on 2.10.0: see
``../shared/MINDSPORE_SHM_FACTS.md`` section 9). Pure: no MindSpore import. Kept apart from GeneratorDataset's:
the same bus error means a different pipeline and a different fix.
"""

from __future__ import annotations

from ms_shm.engines.base import Signature, worker_exited, worker_killed
from ms_shm.host import NUMPY1_INSTALL

_SHM_CAUSE = ("MindSpore's DataLoader (PyTorch's design) moves every batch tensor from its workers through a "
              "shared-memory file in /dev/shm: (num_workers x prefetch_factor + 1) batches at once, one more from the second epoch on. {shm_state}")
_SHM_FIX = ("give the container a /dev/shm of {size}, or lower num_workers / prefetch_factor / batch_size; "
            "`ms_shm.build_dataloader(...)` sizes them to fit")

# What only a log of this DataLoader holds: its lines ("pid: N" with a colon; PyTorch's has none) and its source
# files, in a traceback's frames or MindSpore's log prefix (the dotted module name is not one: ms-shm doctor's own
# DataLoader finding prints it). MindSpore's "Unexpected bus error encountered in process" line, printed in any
# of its workers, is the DataLoader's where these are in the log; its main process may then end in an EOFError
# with no kill line at all (tests/data/logs/msloader_bus_error_eof.log).
HINTS = ("DataLoader worker (pid: ", "DataLoader worker (pid(s): ", "mindspore/dataset/dataloader/",
         "mindspore\\dataset\\dataloader\\")


def _who(fields: dict) -> dict:
    """The worker the kill line names; the EOFError ending names none."""
    return {"loader_worker": f"worker ({fields['pid']})" if fields.get("pid") else "worker"}


SIGNATURES = (
    # One signature for both lines, so one kill is one explanation (at its first line; the kill line's pid).
    Signature("msloader-bus-error", "MindSpore DataLoader's bus error",
              r"DataLoader worker \(pid: (?P<pid>\d+)\) was killed by signal: (?P<signal>Bus error)\.|"
              r"Unexpected bus error encountered in process",
              "crash", "A MindSpore DataLoader (mindspore.dataset.dataloader) {loader_worker} was killed by SIGBUS: "
              "it wrote a batch into /dev/shm after /dev/shm was full. " + _SHM_CAUSE, _SHM_FIX, need="shm",
              signal="Bus error", near=HINTS, words=_who, engine="mindspore-dataloader"),
    worker_killed("msloader-worker-killed", "MindSpore DataLoader", "MindSpore DataLoader",
                  r"DataLoader worker \(pid: (?P<pid>\d+)\) was killed by signal: (?!Bus error)(?P<signal>[A-Za-z ]+?)\.",
                  "mindspore-dataloader"),
    worker_exited("msloader-worker-exited", "MindSpore DataLoader", "MindSpore DataLoader",
                  r"DataLoader worker \(pid\(s\): (?P<pid>[\d, ]+)\) exited unexpectedly", _SHM_FIX,
                  "mindspore-dataloader"),
    Signature("msloader-too-many-files", "MindSpore DataLoader's 'shm_open failed with errno: 24'",
              r"MapAllocator: shm_open failed with errno: 24", "crash",
              "MindSpore's DataLoader passes one file descriptor per tensor storage of every batch in flight, and "
              "this process hit its open-files limit (EMFILE): a batch of many small tensors needs one fd each. "
              "It is not a /dev/shm size problem",
              "raise the soft open-files limit (`ulimit -n {target}`; tune() does it up to the hard limit), or "
              "fewer tensors per batch / a lower prefetch_factor", need="nofile", engine="mindspore-dataloader"),
    Signature("msloader-numpy2", "MindSpore DataLoader under NumPy 2 ('returned a result with an exception set')",
              r"[^\n]*returned a result with an exception set", "crash",
              "MindSpore's DataLoader restores each batch from a worker with code built against NumPy 1.x; under "
              "NumPy 2 a batch from a worker can fail there, in the main process (SystemError; measured: 2 of 3 runs "
              "of one loader, the first batch a worker sent). It is not a memory problem",
              f"{NUMPY1_INSTALL} (MindSpore imports SciPy, whose 1.18 wheels need NumPy 2), or num_workers=0",
              near=("restore_tensor",), engine="mindspore-dataloader"),  # the error's line quoted, not a frame's
)


__all__ = ["HINTS", "SIGNATURES"]
