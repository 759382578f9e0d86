"""DataLoader pipelines run in a private namespace by ``tests/test_loaders_torch.py`` and
``tests/test_loaders_mindspore.py``: raw (the framework's DataLoader as a user writes it), through
``ms_shm.build_dataloader``, or the user's own call under ``ms_shm.patch()``. Each prints one ``RESULT {json}``
line: every batch's digest in order, and the plan.

    python -m tests.loader_scenarios FRAMEWORK SCENARIO raw|ms_shm|patch
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time

import numpy as np

SAMPLES = 32


def sample_array(i: int, mib: float = 8.0) -> np.ndarray:
    """Sample ``i``: ``mib`` MiB of float32 that differ per sample (cheap to make again)."""
    n = int(mib * (1 << 20)) // 4
    return (np.arange(n, dtype=np.float32) % 251) + np.float32(i)


def _framework(name: str):
    if name == "torch":
        import torch
        from torch.utils.data import Dataset, IterableDataset

        return torch, Dataset, IterableDataset, torch.utils.data.DataLoader, lambda a: torch.from_numpy(a)
    from mindspore import Tensor
    from mindspore.dataset.dataloader import DataLoader, Dataset, IterableDataset

    return None, Dataset, IterableDataset, DataLoader, lambda a: Tensor(a)


def ragged_array(i: int, mib: int | None = None) -> np.ndarray:
    """Sample ``i`` of ``mib`` MiB (default 4-8 MiB, by ``i``) of bytes that differ per sample."""
    n = (mib if mib is not None else 4 + (i * 37 % 5)) << 20
    return ((np.arange(n, dtype=np.uint32) * (2 * i + 1) + i * 7) & 0xFF).astype(np.uint8)


_MADE: dict = {}


def datasets(name: str) -> dict:
    """The scenario datasets on ``name``'s Dataset classes, made once (pickle finds them by name)."""
    if name not in _MADE:
        _MADE[name] = _make(name)
    return _MADE[name]


def _make(name: str) -> dict:
    torch, base, iterable_base, _, tensor = _framework(name)

    class Big(base):
        """32 samples of 8 MiB: batches of 4 are 32 MiB, two workers need 160 MiB of /dev/shm."""

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return tensor(sample_array(i)), i

    class ManySmall(base):
        """Samples of 8 small tensors, kept apart by ``keep_apart``: 512 storages per batch of 64."""

        def __len__(self):
            return 256

        def __getitem__(self, i):
            return [tensor(np.full(16, i * 8 + k, dtype=np.float32)) for k in range(8)]

    class Growing(base):
        """1 MiB samples, but 24 MiB ones from sample 16 to 27 (whole batches of 4): with explicit workers the
        probe reads the first and the last, and the batch outgrows its plan mid-epoch."""

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return tensor(sample_array(i, 24.0 if 16 <= i < SAMPLES - 4 else 1.0))

    class Rising(base):
        """Samples that grow with their index, batch by batch (a dataset sorted by length): 1 MiB in the first
        batch of 4, 22 MiB in the last, 88 MiB."""

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return tensor(sample_array(i, 1.0 + 3 * (i // 4)))

    class Ragged(base):
        """24 samples of 4-8 MiB in no order of size (the 4-rank audit's), 60 ms each, mostly waiting: worth
        workers (at 30 ms, making the sample's 4-8 MiB took 14-38 ms of CPU by how its pages faulted in, and the
        dearer readings made no workers the faster estimate)."""

        def __len__(self):
            return 24

        def __getitem__(self, i):
            time.sleep(0.06)
            return tensor(ragged_array(i))

    class Quarter(base):
        """24 samples of 4 MiB, as a list collate sends them (each written to /dev/shm by the worker)."""

        def __len__(self):
            return 24

        def __getitem__(self, i):
            return tensor(ragged_array(i, 4))

    class Outlier(base):
        """40 samples of 1 MiB but sample 17, a 16 MiB panorama (the audit's ragged.py): the probe's spread
        samples miss it, and its batch is 19 MiB among 4 MiB ones."""

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return tensor(sample_array(i, 16.0 if i == 17 else 1.0))

    class Stream(iterable_base):
        """An iterable dataset: each worker iterates its own copy (so num_workers must not change)."""

        def __iter__(self):
            for i in range(SAMPLES):
                yield tensor(sample_array(i, 0.5))

    class Drawn(base):
        """``Big``'s samples plus a draw from the generator each worker seeds apart (torch's; NumPy's global one on
        MindSpore): the batches depend on the number of workers."""

        def __len__(self):
            return 24

        def __getitem__(self, i):
            if torch is not None:
                return tensor(sample_array(i)) + torch.rand(1), i
            return tensor(sample_array(i) + np.float32(np.random.rand())), i

    made = {"big": Big, "many_small": ManySmall, "growing": Growing, "rising": Rising, "stream": Stream, "ragged": Ragged,
            "quarter": Quarter, "outlier": Outlier, "drawn": Drawn}
    prefix = _PREFIX[name]
    for cls in made.values():  # importable by name, so spawn workers can unpickle them
        cls.__name__ = cls.__qualname__ = prefix + cls.__name__
        globals()[cls.__name__] = cls
    return made


_PREFIX = {"torch": "Torch", "mindspore": "Mindspore"}


def __getattr__(name: str):
    """``TorchBig``, ``MindsporeStream``...: made on first use (a spawn worker unpickling a dataset)."""
    for framework, prefix in _PREFIX.items():
        if name.startswith(prefix):
            made = datasets(framework)
            return next(c for c in made.values() if c.__name__ == name)
    raise AttributeError(name)


def tensor_dataset(mib: int = 96):
    """torch's ``TensorDataset`` of ``mib`` MiB of float32 rows of 32 KiB, and int labels: each sample a view of
    the one tensor (the audit's ``repro_tensords.py``)."""
    import torch

    rows = (mib << 20) // (8192 * 4)
    x = (torch.arange(rows * 8192) % 251).float().reshape(rows, 8192) + torch.arange(rows)[:, None]
    return torch.utils.data.TensorDataset(x, torch.arange(rows))


def preloaded_dataset(mib: int = 20):
    """A dataset preloaded into one tensor of ``mib`` MiB, its samples views of it (the audit's
    ``repro_preloaded.py``)."""
    import torch

    class Preloaded(torch.utils.data.Dataset):
        def __init__(self):
            rows = (mib << 20) // (32768 * 4)
            self.x = (torch.arange(rows * 32768) % 251).float().reshape(rows, 32768) + torch.arange(rows)[:, None]
            self.y = torch.arange(rows)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    return Preloaded()


FACTORIES = {"tensords": tensor_dataset, "preloaded": preloaded_dataset}  # torch only; fork workers only


def zip_collate(samples):
    """Detection-style: the samples' fields side by side, each sample's tensors kept (views, sent as they are)."""
    return tuple(zip(*samples))


def keep_apart(samples):
    return [t for s in samples for t in s]


def as_list(samples):
    """A collate that keeps the samples' tensors: each is written to /dev/shm when the worker sends the batch."""
    return list(samples)


class Batch:
    """A batch class of the user's own (detection code returns one): fields, not a list, tuple or dict."""

    def __init__(self, data, index):
        self.data, self.index = data, index


def as_batch(samples):
    return Batch([s[0] for s in samples], [s[1] for s in samples])


def stacked_dict(samples):
    """A ``collate_fn`` of the user's own that stacks with ``torch.stack`` itself: its batch is built in the
    worker's own memory, never in /dev/shm."""
    import torch

    return {"data": torch.stack([s[0] for s in samples]), "index": torch.tensor([int(s[1]) for s in samples])}


def fill_dev_shm(leave: int) -> None:
    """Another process takes all of /dev/shm but ``leave`` bytes (a rank planned as if alone)."""
    import os
    import subprocess

    st = os.statvfs("/dev/shm")
    take = st.f_bavail * st.f_frsize - leave
    subprocess.run(["fallocate", "-l", str(take), "/dev/shm/another_process"], check=True, timeout=60)


def _digest(batch) -> str:
    h = hashlib.sha256()
    stack = [batch]
    while stack:
        value = stack.pop(0)
        if isinstance(value, (list, tuple)):
            stack[:0] = list(value)
        elif isinstance(value, Batch):
            stack[:0] = [value.data, value.index]
        elif hasattr(value, "numpy") or hasattr(value, "asnumpy"):
            h.update(np.ascontiguousarray(value.asnumpy() if hasattr(value, "asnumpy") else value.numpy()).tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


SCENARIOS = {  # scenario: (dataset, DataLoader arguments a user writes, what ms_shm gets)
    "big": ("big", dict(batch_size=4, num_workers=2), dict(batch_size=4)),
    "big_spawn": ("big", dict(batch_size=4, num_workers=2, multiprocessing_context="spawn"),
                  dict(batch_size=4, num_workers=2, multiprocessing_context="spawn")),
    "many_small": ("many_small", dict(batch_size=64, num_workers=2, collate_fn=keep_apart),
                   dict(batch_size=64, num_workers=2, collate_fn=keep_apart)),
    "persistent": ("big", dict(batch_size=2, num_workers=2, persistent_workers=True, prefetch_factor=1),
                   dict(batch_size=2, num_workers=2, persistent_workers=True, prefetch_factor=1)),
    "stream": ("stream", dict(batch_size=4, num_workers=2), dict(batch_size=4, num_workers=2)),
    "growing": ("growing", dict(batch_size=4, num_workers=2), dict(batch_size=4, num_workers=2)),
    "rising": ("rising", dict(batch_size=4, num_workers=2), dict(batch_size=4, num_workers=2)),
    # shuffled by torch's global generator, seeded in ``run``: the same order raw and through ms_shm
    "ragged": ("ragged", dict(batch_size=1, shuffle=True, num_workers=2, collate_fn=as_list),
               dict(batch_size=1, shuffle=True, collate_fn=as_list)),
    "filled": ("quarter", dict(batch_size=1, num_workers=2, collate_fn=as_list),
               dict(batch_size=1, num_workers=2, collate_fn=as_list)),
    "outlier": ("outlier", dict(batch_size=4, num_workers=2, collate_fn=as_list),
                dict(batch_size=4, num_workers=2, collate_fn=as_list)),
    "tensords": ("tensords", dict(batch_size=32, num_workers=2), dict(batch_size=32, num_workers=2)),
    # 16 MiB batches, 3 epochs, the loop's name still holding the last batch as each epoch forks its workers
    "epochs_held": ("big", dict(batch_size=2, num_workers=2, prefetch_factor=1), dict(batch_size=2)),
    # 32 MiB batches whose samples draw from each worker's seed: the workers must stay (MindSpore's workers seed
    # from the loader's generator, given in ``run``)
    "drawn": ("drawn", dict(batch_size=4, num_workers=2), dict(batch_size=4, num_workers=2)),
    "drawn_persistent": ("drawn", dict(batch_size=4, num_workers=2, persistent_workers=True),
                         dict(batch_size=4, num_workers=2, persistent_workers=True)),
    # the same, each epoch left after 2 batches (a ``break``: validation steps, ``max_steps``)
    "drawn_break": ("drawn", dict(batch_size=4, num_workers=2), dict(batch_size=4, num_workers=2)),
    # the same samples in batches of 3 (24 MiB) as a batch class of the user's own
    "drawn_class": ("drawn", dict(batch_size=3, num_workers=2, collate_fn=as_batch),
                    dict(batch_size=3, num_workers=2, collate_fn=as_batch)),
    # the same samples in batches of 4 (32 MiB: two workers' would not fit 64 MB) through a stacking collate
    "drawn_dict": ("drawn", dict(batch_size=4, num_workers=2, collate_fn=stacked_dict),
                   dict(batch_size=4, num_workers=2, collate_fn=stacked_dict)),
    "preloaded": ("preloaded", dict(batch_size=8, num_workers=2, collate_fn=zip_collate),
                  dict(batch_size=8, num_workers=2, collate_fn=zip_collate)),
    # every batch kept by the program (``list(loader)``): 256 batches of 8 storages, each holding its fds
    "kept": ("many_small", dict(batch_size=1, num_workers=1), dict(batch_size=1, num_workers=1)),
    "kept_spawn": ("many_small", dict(batch_size=1, num_workers=1, multiprocessing_context="spawn"),
                   dict(batch_size=1, num_workers=1, multiprocessing_context="spawn")),
}
PEAK = ("tensords", "preloaded", "drawn", "drawn_class", "drawn_dict")  # scenarios whose /dev/shm peak is measured (sampled every 2 ms)
FILL = {"filled": 2 << 20}  # scenario: bytes another process leaves free in /dev/shm once the loader is built
EPOCHS = {"epochs_held": 3, "drawn": 2, "drawn_persistent": 2, "drawn_class": 2, "drawn_dict": 2,
          "drawn_break": 2}  # scenario: epochs iterated (1 where not named)
LEFT_AFTER = {"drawn_break": 2}  # scenario: batches each epoch reads before the loop leaves it (all where not named)
KEPT = ("kept", "kept_spawn")  # scenarios whose program keeps every batch until the epoch ends
SEEDED = ("drawn", "drawn_persistent", "drawn_class", "drawn_dict", "drawn_break")  # scenarios whose MindSpore loader is given a seeded generator


def run(framework: str, scenario: str, mode: str) -> None:
    import ms_shm

    kind, raw_args, ours = SCENARIOS[scenario]
    dataset = (FACTORIES.get(kind) or datasets(framework)[kind])()
    torch, _, _, loader_cls, _ = _framework(framework)
    if torch is not None:
        torch.manual_seed(0)
    elif scenario in SEEDED:  # MindSpore's workers seed from the loader's generator, unseeded by default
        raw_args, ours = (dict(args, generator=np.random.default_rng(0)) for args in (raw_args, ours))
    if mode == "raw":
        loader = loader_cls(dataset, **raw_args)
    elif mode == "patch":  # the user's own call, unchanged, as ``ms-shm run`` sees it
        ms_shm.tune()
        with ms_shm.patched():
            loader = loader_cls(dataset, **raw_args)
    else:
        ms_shm.tune()
        loader = ms_shm.build_dataloader(dataset, **ours)
    if scenario in FILL:
        fill_dev_shm(FILL[scenario])
    with ShmPeak(scenario in PEAK) as peak:
        # ``batch`` stays bound to an epoch's last batch while the next epoch's iterator starts, as in a training loop
        if scenario in KEPT:
            digests = [_digest(batch) for batch in list(loader)]
        else:
            digests = [_digest(batch) for _ in range(EPOCHS.get(scenario, 1))
                       for batch in itertools.islice(loader, LEFT_AFTER.get(scenario))]
    p = ms_shm.plan_of(loader)
    plan = None if p is None else {"workers": p.workers, "prefetch": p.prefetch, "shm": p.predicted_shm,
                                   "fds": p.predicted_fds, "decisions": [str(d) for d in p.decisions]}
    torch = sys.modules.get("torch")
    strategy = torch.multiprocessing.get_sharing_strategy() if torch is not None else None
    print("RESULT " + json.dumps({"digests": digests, "plan": plan, "strategy": strategy, "peak": peak.bytes}),
          flush=True)


class ShmPeak:
    """The most ``/dev/shm`` held (``statvfs``, every process's files) above what it held on entry, sampled every
    2 ms by a thread while the block runs; ``bytes`` is ``None`` when not ``measured``."""

    def __init__(self, measured: bool = True) -> None:
        import threading

        self.measured, self.bytes, self.stop = measured, None, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _used() -> int:
        import os

        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.bytes = max(self.bytes, self._used() - self.base)
            time.sleep(0.002)

    def __enter__(self) -> "ShmPeak":
        if self.measured:
            self.base, self.bytes = self._used(), 0
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.measured:
            self.stop.set()
            self.thread.join()


def run_batch_sampler(framework: str, mode: str, batches: list | None = None, persistent: bool = False) -> None:
    """A batch_sampler of uneven batches of 8 MiB samples (default: 2, 3, 1 and 2 of them), one worker per batch
    index parity; ``persistent``: workers forked once (no batch of a former epoch held in them)."""
    import ms_shm

    dataset = datasets(framework)["big"]()
    batches = batches or [[0, 1], [2, 3, 4], [5], [6, 7]]
    loader_cls = _framework(framework)[3]
    args = dict(batch_sampler=batches, num_workers=2, persistent_workers=persistent)
    loader = loader_cls(dataset, **args) if mode == "raw" else ms_shm.build_dataloader(dataset, **args)
    digests = [_digest(b) for b in loader]
    p = ms_shm.plan_of(loader)
    plan = None if p is None else {"workers": p.workers, "prefetch": p.prefetch, "shm": p.predicted_shm}
    print("RESULT " + json.dumps({"digests": digests, "plan": plan}), flush=True)


def run_epochs(mode: str, batch_size: int = 3, epochs: int = 3) -> None:
    """Torch: persistent workers over ``epochs`` shuffled epochs of the 8 MiB samples; after each epoch the loop
    draws from torch's global generator, as a training loop's dropout would (a persistent iterator draws its base
    seed once, a loader without workers every epoch)."""
    import torch

    import ms_shm

    torch.manual_seed(0)
    args = dict(batch_size=batch_size, shuffle=True, num_workers=2, persistent_workers=True, prefetch_factor=1)
    dataset = datasets("torch")["big"]()
    if mode == "raw":
        loader = torch.utils.data.DataLoader(dataset, **args)
    else:
        ms_shm.tune()
        with ms_shm.patched():
            loader = torch.utils.data.DataLoader(dataset, **args)
    digests, draws = [], []
    for _ in range(epochs):
        digests += [_digest(b) for b in loader]
        draws.append(torch.rand(1).item())
    p = ms_shm.plan_of(loader)
    print("RESULT " + json.dumps({"digests": digests, "draws": draws, "workers": getattr(p, "workers", None)}),
          flush=True)


def run_two(framework: str, mode: str, together: bool) -> None:
    """Train and val built up front, 40 MiB of batches in flight each (8 MiB batches, 2 workers, prefetch 2):
    two epochs of train then val, or (``together``) both iterated at once, zipped."""
    import ms_shm

    quarter = datasets(framework)["quarter"]
    make = _framework(framework)[3] if mode == "raw" else ms_shm.build_dataloader
    args = dict(batch_size=2, num_workers=2, collate_fn=as_list)
    train, val = make(quarter(), **args), make(quarter(), **args)
    if together:
        digests = [_digest(a) + _digest(b) for a, b in zip(train, val)]
    else:
        digests = [_digest(b) for _ in range(2) for loader in (train, val) for b in loader]
    plans = [ms_shm.plan_of(loader) for loader in (train, val)]
    print("RESULT " + json.dumps({"digests": digests, "workers": [getattr(p, "workers", None) for p in plans]}),
          flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "epochs":
        run_epochs(sys.argv[3])
    elif sys.argv[2] in ("sequential", "together"):
        run_two(sys.argv[1], sys.argv[3], sys.argv[2] == "together")
    elif sys.argv[2] == "batch_sampler":
        run_batch_sampler(sys.argv[1], sys.argv[3])
    else:
        run(sys.argv[1], sys.argv[2], sys.argv[3])
