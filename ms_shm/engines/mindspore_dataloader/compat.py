"""The only module that imports MindSpore's DataLoader (``mindspore.dataset.dataloader``, MindSpore 2.8+): its
DataLoader, collate functions and tensors. Imported on first use; MindSpore itself only when a function is called.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ms_shm import host
from ms_shm.changes import Change  # noqa: F401  (undo records, as for the other engines)
from ms_shm.engines.torchstyle.compat import DataModule, by_value, rebuilt
from ms_shm.engines.torchstyle.storages import tensors

log = logging.getLogger("ms_shm.loaders")

_DATA = DataModule("mindspore.dataset.dataloader")  # DataLoader, datasets, collate functions, worker info: shared
available, loader_class, owns, loaded = _DATA.available, _DATA.loader_class, _DATA.owns, _DATA.loaded
is_iterable, default_collate, worker_info = _DATA.is_iterable, _DATA.default_collate, _DATA.worker_info
warn_as_asked, sample_reader = _DATA.warn_as_asked, _DATA.sample_reader


# MindSpore's multi-process iterator draws its workers' base seed from the loader's ``generator``, the one its
# RandomSampler shuffles with (2.8: ``_MultiProcessIterator.__init__``): with workers, a seeded generator gives
# another order from the first epoch on (measured: n2,n11,n25,n21 vs n2,n11,n25,n23). A generator passed keeps the
# workers and prefetch asked (``loaders.DRAWS_AHEAD``), for this and for the draws a sampler makes ahead.


def weigh(batch: Any) -> tuple:
    """``(bytes, storages)`` of every MindSpore Tensor in ``batch`` (through containers and the attributes of a
    ``collate_fn``'s own batch class, as torch's): one shared-memory file each. A numpy array goes through the
    queue's pipe by value (an audit's collate of numpy arrays, 16 MiB batches, 2 workers under 64 MB: 0.1 MiB of
    /dev/shm at the peak, where ms_shm priced 64 MiB and refused it)."""
    found = [int(value.nbytes) for value in tensors(batch, is_tensor=_is_tensor)]
    return sum(found), len(found)


def twin(sample: Any) -> Any:
    """A second sample as ``weigh`` counts a batch: ``sample`` itself, since every tensor is counted where it
    appears (MindSpore's DataLoader sends one shared-memory file per tensor, shared or not)."""
    return sample


def tensor_bytes(value: Any) -> tuple | None:
    """``(dtype, shape, bytes as a uint8 array)`` of a MindSpore Tensor (what the probe compares two reads of a
    sample by), else ``None`` (numpy arrays are compared by the probe itself)."""
    import numpy as np

    if not hasattr(value, "asnumpy"):
        return None
    array = np.ascontiguousarray(value.asnumpy())
    return str(value.dtype), tuple(array.shape), array.reshape(-1).view(np.uint8)


def sharing_strategy() -> str:
    return "file_descriptor"  # MindSpore's reductions always pass a DupFd per storage


def set_sharing_strategy(value: str, reason: str) -> None:
    return None


def undo(changes: Any) -> None:
    return None


def numpy_problem() -> str | None:
    """MindSpore's DataLoader restores every worker's batch with tensors its C++ was compiled for under NumPy 1.x:
    under NumPy 2 batches from a worker can fail in the main process (``SystemError ... returned a result with an
    exception set``, measured with 2.10.0 and NumPy 2.4.6; another run of the same loader got through with only
    NumPy's "compiled using NumPy 1.x" warning), so workers there are a gamble."""
    import numpy as np

    if int(np.__version__.split(".")[0]) < 2:
        return None
    return (f"MindSpore's DataLoader can fail on batches from worker processes under NumPy {np.__version__} "
            f"(SystemError in restore_tensor: its C++ was built against NumPy 1.x). Fix: {host.NUMPY1_INSTALL} "
            f"(or num_workers=0, which reads samples in the main process)")


def collate_shares(collate: Any, samples: list) -> bool | None:
    """MindSpore's DataLoader workers do not build batches in shared memory (``LoaderProfile.collate_in_shm``):
    nothing to tell."""
    return None


def piped(collate: Any, samples: Any, default: bool) -> Any:
    """``collate(samples)`` in a worker, made to travel through the worker's result pipe instead of ``/dev/shm``
    (``plan.PIPES``): MindSpore's queue pickles every ``Tensor`` with its shared-memory reduction (one file per
    storage, ``mindspore.multiprocessing.reductions``); each plain ``Tensor`` of the batch goes instead as
    MindSpore pickles it by value (``Tensor.__getstate__``), rebuilt in the main process as the same ``Tensor``:
    dtype, shape, values, ``requires_grad``. For batches that do not fit ``/dev/shm`` beside the others in flight
    where the workers asked must stay. ``default`` is unused: MindSpore's collates stack in the worker's own memory
    (``np.stack``, then ``Tensor``), never in ``/dev/shm``."""
    _exit_unblocked()
    return rebuilt(collate(samples), _piped_tensor)


_UNBLOCKED: set = set()  # the worker processes whose result queue ``_exit_unblocked`` found


def _exit_unblocked() -> None:
    """In a worker, once: its result queue told not to wait at exit for the batches it still holds
    (``cancel_join_thread``, as torch's worker does). MindSpore's worker closes that queue and joins its feeder
    thread when the loader ends; a batch of MiBs pickled into the pipe, which no one reads any more, held the join
    until ``terminate()`` killed the worker 5 s later: each epoch left early (a ``break``) cost 10 s with 2 workers
    (an audit, MindSpore 2.8; batches through ``/dev/shm`` are a few bytes in the pipe). The worker leaves its loop
    only when the loader ends or its parent dies: nothing held then is waited for."""
    pid = os.getpid()
    if pid in _UNBLOCKED:
        return
    _UNBLOCKED.add(pid)
    frame = sys._getframe(1)
    while frame is not None:
        queue = frame.f_locals.get("data_queue") if frame.f_code.co_name == "data_worker_fn" else None
        if queue is not None:
            try:
                queue.cancel_join_thread()
            except Exception as exc:  # a queue of another kind: its exit waits as it did
                log.debug("ms_shm: the worker's result queue kept its join at exit (%s: %s)", type(exc).__name__, exc)
            return
        frame = frame.f_back


def _piped_tensor(value: Any) -> Any:
    """A plain ``Tensor`` as ``_PipedTensor``; a batch class holding tensors pickled by value (``by_value``);
    anything else (a ``Parameter``, a numpy array, which MindSpore's queue pickles by value already) as it is."""
    from mindspore import Tensor

    if type(value) is Tensor:
        return _PipedTensor(value)
    return value if isinstance(value, Tensor) else by_value(value, _is_tensor)


def _is_tensor(value: Any) -> bool:
    from mindspore import Tensor

    return isinstance(value, Tensor)


class _PipedTensor:
    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple:
        return _tensor, (type(self.tensor), self.tensor.__getstate__())


def _tensor(kind: Any, state: Any) -> Any:
    """What ``pickle.loads`` makes of a ``Tensor`` pickled by value (``copyreg.__newobj__``, then its state)."""
    import copyreg

    value = copyreg.__newobj__(kind)
    value.__setstate__(state)
    return value
