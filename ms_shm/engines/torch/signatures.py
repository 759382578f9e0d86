"""The failures PyTorch's DataLoader prints, as ``ms_shm.explain`` recognises them (written from torch 2.13's
``torch/csrc/DataLoader.cpp``, ``torch/utils/data/dataloader.py`` and ``c10/core/impl/alloc_cpu.cpp`` /
``aten/src/ATen/MapAllocator.cpp``, and checked against logs of failing runs in ``tests/test_explain.py``).
Pure: no torch import.
"""

from __future__ import annotations

from ms_shm.engines.base import Signature, worker_exited, worker_killed

_SHM_CAUSE = ("A PyTorch DataLoader moves every batch tensor from its workers through a shared-memory file in "
              "/dev/shm: (num_workers x prefetch_factor + 1) batches at once, one more from the second epoch on. {shm_state}")
_SHM_FIX = ("give the container a /dev/shm of {size} (docker run --shm-size, or --ipc=host), or lower num_workers "
            "/ prefetch_factor / batch_size; `ms_shm.build_dataloader(...)` sizes them to fit")
_FD_CAUSE = ("PyTorch's default sharing strategy (file_descriptor) passes one file descriptor per tensor storage "
             "of every batch in flight, and this process hit its open-files limit: a batch of many small tensors "
             "(a collate_fn that keeps samples apart) needs one fd each. It is not a /dev/shm size problem")
_FD_FIX = ("raise the soft open-files limit (`ulimit -n {target}`, or tune() does it up to the hard limit), or "
           "torch.multiprocessing.set_sharing_strategy('file_system') (no fd per storage; `ms-shm clean` removes "
           "the /dev/shm/torch_* files a killed run leaves), or fewer tensors per batch")

# A GeneratorDataset's worker processes pass each shared-memory slot's fd through Python's own ``recv_fds`` too,
# and run out of fds in the same words ("received 0 items of ancdata"), with no torch in the log (an audit).
_MINDSPORE_QUEUE = ("mindspore/dataset/engine/",)

SIGNATURES = (
    Signature("pytorch-bus-error", "PyTorch's DataLoader bus error",
              r"DataLoader worker \(pid (?P<pid>\d+)\) is killed by signal: (?P<signal>Bus error)\.|"
              r"Unexpected bus error encountered in worker\. This might be caused by insufficient shared memory",
              "crash", _SHM_CAUSE, _SHM_FIX, need="shm", signal="Bus error", engine="torch"),
    Signature("pytorch-no-space", "PyTorch's 'unable to allocate shared memory(shm)' (ENOSPC)",
              r"unable to allocate shared memory\(shm\) for file <?/?torch_[^\n]*No space left on device|"
              r"unable to (?:write to|mmap)[^\n]*</?torch_[^\n]*(?:No space left on device|\(28\))",
              "crash", _SHM_CAUSE + " /dev/shm filled ('No space left on device', errno 28)", _SHM_FIX, need="shm",
              yields_to=("pytorch-bus-error",), engine="torch"),
    Signature("pytorch-too-many-files", "PyTorch's 'Too many open files' (EMFILE) and lost fds",
              r"unable to open shared memory object </?torch_[^\n]*Too many open files|"
              r"received 0 items of ancdata|Too many open files \(24\)|"
              r"Too many open files\. Communication with the workers is no longer possible",
              "crash", _FD_CAUSE, _FD_FIX, need="nofile", engine="torch",
              not_near=_MINDSPORE_QUEUE),  # its fd hand-off fails in the same words: MindSpore's generic one's
    worker_killed("worker-killed", "PyTorch", "PyTorch DataLoader",
                  r"DataLoader worker \(pid (?P<pid>\d+)\) is killed by signal: (?!Bus error)(?P<signal>[A-Za-z ]+?)\.",
                  "torch"),
    worker_exited("pytorch-worker-exited", "PyTorch", "PyTorch DataLoader",
                  r"DataLoader worker \(pid\(s\) (?P<pid>[\d, ]+)\) exited unexpectedly", _SHM_FIX, "torch"),
    Signature("pytorch-shm", "PyTorch's shared-memory file errors",
              r"unable to (?:write to|open shared memory object|mmap|allocate shared memory)[^\n]*</?torch_",
              "crash", _SHM_CAUSE, _SHM_FIX, need="shm",
              yields_to=("pytorch-bus-error", "ipc-removed", "pytorch-no-space", "pytorch-too-many-files",
                         "shm-readonly"),
              engine="torch"),
    Signature("ipc-removed", "PyTorch's /dev/shm/torch_* file gone ('No such file or directory')",
              r"(?:could not unlink the shared memory file |unable to open shared memory object <)/torch_"
              r"[^\n]*No such file or directory", "crash",
              "A PyTorch DataLoader batch's /dev/shm/torch_* file was deleted while the batch was in flight: it "
              "could not be opened or unlinked. {ipc_state}", "{ipc_fix}", need="ipc", engine="torch"),
)


__all__ = ["SIGNATURES"]
