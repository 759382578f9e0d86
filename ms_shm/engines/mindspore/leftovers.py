"""What a crashed MindSpore pipeline leaves behind, and how ``ms_shm.clean`` tells it is MindSpore's.

Pure data and functions (no MindSpore import), so ``clean`` runs on a host where MindSpore is gone.

Measured on MindSpore 2.10:

* ``map``/``batch`` with ``python_multiprocessing=True`` talk to each worker through one SysV segment and one
  SysV message queue, both under ``ftok("/tmp/dataset_ipc_<mainpid>_<threadptr>_<worker>", 0)``. A ``map``
  pipeline with two workers showed ``/tmp/dataset_ipc_4770_..._0`` with ``st_dev=0x29, st_ino=0x3`` and
  both objects under key ``0x00290003``: glibc's ftok with ``proj_id`` 0, so the top byte of every key is 0
  (``ipcs`` shows ``0x0000c0xx`` where ``/tmp`` sits on device 0). The main process never deletes these
  files (strace shows no unlink), so they outlive even clean runs.
* When the process group dies at once (OOM killer, ``kill -9 -PGID``) nobody calls ``IPC_RMID``: the
  row-sized segments stay until ``ipcrm``, a reboot, or the end of the IPC namespace.
* Dynamic ``GeneratorDataset`` slots are ``/dev/shm/mindspore_<pid>_...`` files, named after the process
  that created them.
"""

from __future__ import annotations

import re

from ms_shm._results import record

#: ``proj_id`` MindSpore passes to ``ftok`` (found by experiment, see the module docstring).
FTOK_PROJ = 0

#: ``/tmp`` files whose ``ftok`` is the key of a map/batch worker's segment and queue; group 1 is the main pid.
IPC_FILE = re.compile(r"^dataset_ipc_(\d+)_(\d+)_(\d+)$")
#: ``/dev/shm`` files of dynamic Generator slots; group 1 is the pid that created them.
DEV_SHM_FILE = re.compile(r"^mindspore_(\d+)_")


@record
class LeftoverPatterns:
    """How one engine's leftovers are recognised: what every engine's ``leftover_patterns()`` returns.

    Attributes:
        label: The engine's name in the reasons ``clean`` prints ("MindSpore").
        dev_shm: ``(origin, pattern)`` pairs for ``/dev/shm`` names; group 1 of the pattern is the creating
            pid, whose death makes the file a leftover.
        ipc_files: Patterns for ``/tmp`` names whose group 1 is the pipeline's main pid and whose
            ``ftok(file, ftok_proj)`` is the key of its SysV objects.
        ipc_file_text: How such a file is named in notes.
        ftok_proj: The ``proj_id`` in the top byte of the engine's SysV keys; ``None`` when it uses no SysV IPC.
        sysv_pair: Its SysV objects come as a segment and a queue under one key. Only then may objects whose
            key file is gone be recognised by their shape alone (``orphan_keys=True``).
    """

    label: str
    dev_shm: tuple = ()
    ipc_files: tuple = ()
    ipc_file_text: str = ""
    ftok_proj: int | None = None
    sysv_pair: bool = False

    def dev_shm_owner(self, name: str) -> tuple | None:
        """``(origin, pid)`` when ``name`` in ``/dev/shm`` is one of this engine's files, else ``None``."""
        return _first_pid(name, self.dev_shm)

    def ipc_file_pid(self, name: str) -> int | None:
        """The main pid when ``name`` in ``/tmp`` is one of this engine's ftok key files, else ``None``."""
        found = _first_pid(name, (("", pattern) for pattern in self.ipc_files))
        return found[1] if found else None

    def has_key_shape(self, key: int) -> bool:
        """Whether a SysV ``key`` could be this engine's: its top byte is the ``proj_id`` the engine uses."""
        return self.ftok_proj is not None and ((key >> 24) & 0xFF) == self.ftok_proj


def _first_pid(name: str, patterns) -> tuple | None:
    for origin, pattern in patterns:
        match = pattern.match(name)
        if match:
            return origin, int(match.group(1))
    return None


PATTERNS = LeftoverPatterns(
    label="MindSpore",
    dev_shm=(("mindspore", DEV_SHM_FILE),),
    ipc_files=(IPC_FILE,),
    ipc_file_text="/tmp/dataset_ipc file",
    ftok_proj=FTOK_PROJ,
    sysv_pair=True,
)


def leftover_patterns() -> LeftoverPatterns:
    """MindSpore's leftovers as ``ms_shm.clean`` looks for them."""
    return PATTERNS


__all__ = ["LeftoverPatterns", "PATTERNS", "leftover_patterns", "FTOK_PROJ", "IPC_FILE", "DEV_SHM_FILE"]
