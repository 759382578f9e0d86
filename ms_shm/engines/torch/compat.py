"""The only module that imports torch: PyTorch's DataLoader, its collate functions, its tensors' storages, its
sharing strategy (what the two DataLoaders share is ``torchstyle.compat.DataModule``, given torch's path). Imported
on first use; ``torch`` itself only when a function is called.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import sys
from collections.abc import Iterator
from typing import Any, Callable

from ms_shm.changes import Change
from ms_shm.engines.torchstyle.compat import DataModule, by_value, rebuilt
from ms_shm.engines.torchstyle.storages import tensors

log = logging.getLogger(__name__)
SHARING_STRATEGY = "sharing_strategy"

_DATA = DataModule("torch.utils.data", batched_reads=True)  # DataLoader, datasets, collates, worker info: shared
available, loader_class, owns, loaded = _DATA.available, _DATA.loader_class, _DATA.owns, _DATA.loaded
is_iterable, default_collate, worker_info = _DATA.is_iterable, _DATA.default_collate, _DATA.worker_info
warn_as_asked, sample_reader = _DATA.warn_as_asked, _DATA.sample_reader

# torch draws its iterators' base seed from the global generator (or the loader's ``generator``) in every
# iterator, with workers or without (2.13: ``_BaseDataLoaderIter.__init__``); a loader with persistent workers
# makes one iterator for all its epochs. MindSpore 2.8 draws it with workers only.
EVERY_ITERATOR_DRAWS_SEED = True


def weigh(batch: Any) -> tuple:
    """``(bytes, storages)`` of every tensor in ``batch`` (nested lists, tuples, dicts, and the attributes of the
    objects a ``collate_fn`` returns: a worker pickles those whole, each tensor through shared memory), each
    storage once."""
    seen = _storages(batch)
    return sum(s.nbytes() for s in seen.values()), len(seen)


def unshared_bytes(batch: Any) -> int:
    """Bytes of ``batch``'s storages a worker has yet to write to shared memory when it sends the batch: torch's
    default collate builds its batch there already (``_new_shared``), a ``collate_fn`` that keeps the samples'
    tensors (``list``) does not."""
    return sum(s.nbytes() for s in _storages(batch).values() if not s.is_shared())


def share(batch: Any) -> None:
    """Moves ``batch``'s storages into shared memory, in a worker, as torch's queue does when it sends the batch
    (``reduce_storage``: the same copy, the same strategy), but in the worker's own loop: a ``/dev/shm`` that
    filled up meanwhile raises there, and reaches the program, instead of in the queue's feeder thread, where
    the batch is lost and the loader waits for it forever."""
    for storage in _storages(batch).values():
        if not storage.is_shared():
            storage.share_memory_()


def _storages(batch: Any) -> dict:
    """Every tensor storage in ``batch``, once each, by address (``storages.tensors``' walk)."""
    seen: dict = {}
    for tensor in tensors(batch):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage
    return seen


def twin(sample: Any) -> Any:
    """A second sample as a batch would carry it, made from ``sample`` without reading one: each tensor that owns
    its storage copied (a second sample has storages of its own), each view into a larger storage kept (a
    ``TensorDataset``'s samples share the dataset's storage, sent once; copying it would copy the dataset)."""
    import torch

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            owns = value.untyped_storage().nbytes() <= value.numel() * value.element_size()
            return value.clone() if owns else value
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(copy(v) for v in value))
        if isinstance(value, (list, tuple)):
            return [copy(v) for v in value] if isinstance(value, list) else tuple(copy(v) for v in value)
        return value

    return copy(sample)


def tensor_bytes(value: Any) -> tuple | None:
    """``(dtype, shape, bytes as a uint8 array)`` of a tensor (what the probe compares two reads of a sample by),
    else ``None``: any dtype, bfloat16 included, viewed (not copied, where contiguous on the CPU) as bytes."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    flat = value.detach().cpu().contiguous().reshape(-1)
    return str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy()


def sharing_strategy() -> str:
    import torch.multiprocessing as mp

    return mp.get_sharing_strategy()


def set_sharing_strategy(value: str, reason: str) -> Change | None:
    old = sharing_strategy()
    if old == value:
        return None
    import torch.multiprocessing as mp

    mp.set_sharing_strategy(value)
    return Change(SHARING_STRATEGY, old, value, reason)


class StrategyInWorker:
    """A loader's ``worker_init_fn`` that sets the sharing strategy in a worker started by spawn or forkserver,
    then calls the caller's own: the process that sends a storage picks how it travels, and such a worker starts
    at torch's default, ``file_descriptor``, whatever the main process set (an audit: ``ulimit -n 256``, 300
    batches kept by ``list(loader)``, spawn workers: "Too many open files" after ms_shm had switched the main
    process to ``file_system``). Picklable: spawn sends it to each worker."""

    def __init__(self, strategy: str, worker_init_fn: Callable[[int], Any] | None = None) -> None:
        self.strategy, self.worker_init_fn = strategy, worker_init_fn

    def __call__(self, worker_id: int) -> None:
        import torch.multiprocessing as mp

        mp.set_sharing_strategy(self.strategy)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


def undo(changes: Any) -> None:
    for change in reversed(list(changes)):
        if change.setting == SHARING_STRATEGY:
            import torch.multiprocessing as mp

            mp.set_sharing_strategy(change.old)


def numpy_problem() -> str | None:
    return None  # torch 2.13's wheels run under NumPy 1 and 2


def piped(collate: Any, samples: Any, default: bool) -> Any:
    """``collate(samples)`` in a worker, made to travel through the worker's result pipe instead of ``/dev/shm``
    (``plan.PIPES``): each CPU tensor of the batch is pickled by value, its storage once however many views share
    it, and rebuilt in the main process as a plain tensor of the same dtype, shape, strides and offset. For
    batches that do not fit ``/dev/shm`` beside the others in flight where the workers asked must stay (samples
    drawn from each worker's own seed). ``default``: ``collate`` is torch's own, which builds its batch in shared
    memory when it runs in a worker; it runs here as in the main process, so the batch never touches
    ``/dev/shm``."""
    batch = _as_in_main(collate, samples) if default else collate(samples)
    return _piped(batch, {})


def collate_shares(collate: Any, samples: list) -> bool | None:
    """Whether ``collate(samples)``, run as in a worker (``get_worker_info()`` set), builds any of its batch in
    shared memory: torch's default collate does (``_new_shared``), so does a ``collate_fn`` that calls it; one
    that stacks with ``torch.stack`` itself does not, and its batch, sent through a pipe, never touches
    ``/dev/shm`` (an audit: a dict-returning ``collate_fn`` was charged a batch per worker there and refused under
    64 MB, where its pipes fitted). For the probe child only; ``None`` where it cannot tell."""
    try:
        with _worker_info_reads(lambda worker: worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)) as set_:
            if not set_:
                return None
            batch = collate(samples)
    except Exception:  # a collate that wants more of a worker than this stand-in: priced as sharing
        return None
    return any(s.is_shared() for s in _storages(batch).values())


def _as_in_main(collate: Any, samples: Any) -> Any:
    """``collate(samples)`` with ``get_worker_info()`` reading ``None``: torch's default collate then stacks into
    ordinary memory (``collate_tensor_fn``'s ``_new_shared`` is for a worker only), the same values."""
    with _worker_info_reads(lambda worker: None):
        return collate(samples)


@contextlib.contextmanager
def _worker_info_reads(info: Callable[[Any], Any]) -> Iterator[bool]:
    """``get_worker_info()`` reads ``info(torch's worker module)`` inside the block, and what it read before
    after it; yields whether it could be set (``False``: torch's worker module is not loaded, nothing changed)."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    if worker is None or not hasattr(worker, "_worker_info"):
        yield False
        return
    saved = worker._worker_info
    try:
        worker._worker_info = info(worker)
        yield True
    finally:
        worker._worker_info = saved


def _piped(value: Any, storages: dict) -> Any:
    """``value`` with its plain CPU tensors as ``_PipedTensor`` (``rebuilt``'s containers); a tensor subclass or a
    batch class holding tensors pickled by value (``by_value``); anything else left to torch's own pickling."""
    return rebuilt(value, functools.partial(_piped_tensor, storages=storages))


def _piped_tensor(value: Any, storages: dict) -> Any:
    import torch

    if type(value) is not torch.Tensor:
        return by_value(value, _is_tensor)
    if value.device.type != "cpu" or value.layout != torch.strided or value.requires_grad or value.is_quantized \
            or value.is_shared():
        return value
    storage = value.untyped_storage()
    key = storage.data_ptr() or id(storage)
    if key not in storages:
        storages[key] = _PipedStorage(storage)
    return _PipedTensor(storages[key], value)


class _PipedStorage:
    """A storage sent by value: pickled once per batch (pickle's memo), rebuilt once, shared by its views."""

    __slots__ = ("storage",)

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple:
        import torch

        raw = torch.empty(0, dtype=torch.uint8).set_(self.storage).numpy()
        return _bytes_tensor, (bytearray(raw.data),)


class _PipedTensor:
    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, storage: _PipedStorage, tensor: Any) -> None:
        self.storage, self.dtype = storage, tensor.dtype
        self.size, self.stride, self.offset = tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()

    def __reduce__(self) -> tuple:
        return _view, (self.storage, self.dtype, self.size, self.stride, self.offset)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _bytes_tensor(data: bytearray) -> Any:
    """A uint8 tensor over ``data`` (no copy; the tensor keeps it alive)."""
    import torch

    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _view(base: Any, dtype: Any, size: tuple, stride: tuple, offset: int) -> Any:
    import torch

    typed = base.view(dtype) if base.numel() else torch.empty(0, dtype=dtype)
    return torch.as_strided(typed, size, stride, offset)


# torch splits an op over its intra-op threads only from this many elements (``at::internal::GRAIN_SIZE``);
# its FFTs (MKL's, pocketfft's) split by their own rule: a 16,000-sample ``rfft`` gave other bits on 2 threads
# (an audit), so they count from this many.
GRAIN_SIZE = 32768
FFT_SPLIT_FROM = 1024
# What computes each element apart from the others (or copies, makes, reshapes, compares, picks): its result is
# the same however many threads split it. Anything else over a floating tensor of GRAIN_SIZE elements or more is
# taken to depend on the count (measured, torch 2.13 at 1 and 2 threads: ``mean`` and ``sum`` of 2**17 floats,
# ``prod``, ``dot`` and a bilinear ``interpolate`` came out with other last bits; elementwise arithmetic,
# ``sqrt`` / ``exp`` / ``log`` / ``tanh``, ``clamp``, casts and ``max`` / ``sort`` with the same).
_SAME_ON_ANY_THREADS = frozenset("""
__get__ __getitem__ __setitem__ __len__ __iter__ __repr__ __format__ __hash__ __bool__ __index__ __int__ __float__
__array__ __contains__ __reduce_ex__ __deepcopy__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __and__ __or__ __xor__
__invert__ __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __floordiv__ __rfloordiv__ __mod__ __rmod__ __neg__ __abs__ __pow__ __rpow__ __ipow__ __lshift__
__rshift__ tensor as_tensor from_numpy asarray zeros ones full empty arange zeros_like ones_like full_like empty_like
new_tensor new_zeros new_ones new_full new_empty to type type_as float double half bfloat16 int long short bool byte
char cpu contiguous clone detach detach_ numpy tolist item permute view view_as reshape reshape_as transpose t
flatten unflatten squeeze unsqueeze expand expand_as repeat flip fliplr flipud roll narrow select index_select gather
masked_select take cat concat concatenate stack hstack vstack split chunk unbind movedim moveaxis add sub subtract
mul multiply div divide true_divide floor_divide remainder fmod neg negative abs absolute sqrt rsqrt square exp exp2
expm1 log log2 log10 log1p sin cos tan asin acos atan atan2 sinh cosh tanh sigmoid relu clamp clip clamp_min clamp_max
pow floor ceil round trunc frac sign where eq ne lt le gt ge isnan isinf isfinite nan_to_num logical_and logical_or
logical_not logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor fill_ zero_ copy_ add_ sub_ mul_ div_ clamp_
pow_ masked_fill masked_fill_ index_put_ index_fill_ scatter_ max min maximum minimum argmax argmin amax amin sort
argsort topk unique nonzero any all numel size dim stride storage_offset element_size is_contiguous is_floating_point
is_complex untyped_storage data_ptr requires_grad_ lerp addcmul addcdiv reciprocal erf real imag conj
__rdiv__ __idiv__ __div__ __rand__ __ror__ __rxor__ rot90 tile swapaxes swapdims unfold repeat_interleave hardtanh
index_copy scatter masked_scatter pad relu6 leaky_relu elu gelu silu hardsigmoid hardswish softplus threshold
""".split())


def main_threads() -> int:
    """torch's intra-op threads in this process (1 where torch is not loaded: nothing to split)."""
    torch = sys.modules.get("torch")
    try:
        return int(torch.get_num_threads()) if torch is not None else 1
    except Exception:  # a partial or foreign module named torch
        return 1


def thread_bound(run: Callable[[], Any], threads: int) -> tuple:
    """``(run(), what of it depends on the thread count, or None)``: the first torch op ``run`` calls outside
    ``_SAME_ON_ANY_THREADS`` over a floating tensor of ``GRAIN_SIZE`` elements or more. Without workers the main
    process runs it on its ``threads``; a torch worker runs it on 1 (``set_num_threads(1)``, first thing in its
    loop), so the batches come out with other last bits (an audit: per-sample ``mean`` / ``sum`` over 2**17
    floats, 5 runs of 5, where ms_shm had added workers). For the probe child only (it runs torch on 1 thread,
    as a worker does)."""
    try:
        from torch.overrides import TorchFunctionMode
    except ImportError:
        return run(), None
    found: list = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if not found and not _same_on_any_threads(name, kwargs):
                elements = _elements_split(args, kwargs, result)
                if elements >= (FFT_SPLIT_FROM if name.startswith(("fft", "ifft", "rfft", "irfft", "stft", "istft"))
                                else GRAIN_SIZE):
                    found.append(f"torch's `{name}` over {elements:,} elements, whose result depends on how many "
                                 f"threads split it: {threads} in the main process, 1 in each worker (torch sets "
                                 f"it there), so the batches would differ in their last bits")
            return result

    with Watch():
        value = run()
    return value, (found[0] if found else None)


def _same_on_any_threads(name: str, kwargs: dict) -> bool:
    """An op of ``_SAME_ON_ANY_THREADS``, its in-place form (``sqrt_``), or a nearest-neighbour ``interpolate``
    (a copy of picked elements)."""
    if name in _SAME_ON_ANY_THREADS or name.endswith("_") and name[:-1] in _SAME_ON_ANY_THREADS:
        return True
    return name == "interpolate" and kwargs.get("mode", "nearest") in ("nearest", "nearest-exact")


def _elements_split(args: tuple, kwargs: dict, result: Any) -> int:
    """Elements of the largest tensor an op reads or makes that has floating results: its floating inputs and
    outputs, and any input where the result is floating (``u8.mean(dtype=torch.float32)``); an upscale reads
    few elements and makes many (a 64x64 image resized to 224, 12,288 read)."""
    outputs = [t for t in (result if isinstance(result, (list, tuple)) else (result,)) if _is_tensor(t)]
    floating = any(t.is_floating_point() or t.is_complex() for t in outputs)
    largest = max((t.numel() for t in outputs if t.is_floating_point() or t.is_complex()), default=0)
    for value in itertools.chain(args, kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if _is_tensor(item) and (floating or item.is_floating_point() or item.is_complex()):
                largest = max(largest, item.numel())
    return largest
