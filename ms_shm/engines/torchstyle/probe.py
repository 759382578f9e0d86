"""The probe batch of a PyTorch-style DataLoader, read in a forked child: what one batch weighs, how many tensor
storages (shared-memory files, and fds) it carries, and what a sample costs.

The child reads the samples the caller's sampler or batch sampler gives first (iterated there, so the parent's
generators do not move), or, where the framework makes the sampler (``shuffle``), samples spread over the dataset
(first, last, middle: ``rows``'s rule, as ``build_dataset`` reads rows), collates each alone and the first two
together with the loader's ``collate_fn`` (the framework's default where none was passed), and extrapolates to
``batch_size``: a default collate stacks each field into one storage, a ``collate_fn`` that keeps samples apart
carries one storage per sample and field, and the two sizes tell which. Where the samples weigh differently, the
batch of the largest is the one planned (``planning.planned_batch`` adds the margin). A storage the dataset holds
that the batch sends views of (a preloaded tensor, a ``TensorDataset``'s under a collate that keeps samples) is
priced once per worker, not per batch (``storages.once_per_worker``: torch shares it once and sends it again by
reference). Nothing read there reaches the loader.

What the samples depend on is watched (``sandbox.watch_effects``) over the dataset's reads and the collates only:
the sampler's first indices are taken before (a ``RandomSampler`` draws from torch's generator, which says
nothing of the samples), and the first sample of a map-style dataset is read once more and compared byte for
byte, for a generator the watch does not see. The child's descriptors are guarded (``fdguard``): a file the
dataset reads is rewound after, a pipe reads as empty, so the program's own reads find every byte.

Where ``num_workers`` was passed, the samples' time decides nothing (the plan keeps the workers and picks the
largest prefetch and the strategy that fit, by bytes and fds), so two samples are read, untimed, and collated
alone and together: the first and the last where the loader makes its own order (a dataset sorted by length
holds its largest last: an audit's samples of 8-32 MiB by index, planned from sample 0 alone, met the guard
mid-epoch under 64 MB where no workers would have delivered them), and the program is spared the probe's other
reads (measured: torch 2.13, 8 MiB samples of 25-60 ms each in the fork, ``DataLoader(...)`` under
``ms_shm.patch`` 162-225 ms with three samples timed and one read again). A dataset of one sample is weighed
beside its twin (the engine's ``twin``: the storages a second sample would bring).

A sample's time is the fastest of the samples after the first: the first in a fresh fork pays for the child's
first touches (its copied-on-write pages, the allocator growing), 2-3x a warm one (measured: 22 ms vs 11-12 ms
with MindSpore 2.8's DataLoader, 35-44 ms vs 12-20 ms with torch 2.13, on ~8 ms of numpy work), which priced
workers as if samples were slow. The parent's ``os.fork()`` call for the child is what a worker's fork costs
(``sandbox.Outcome.fork_seconds``), and the machine's idle CPUs while the child ran are what the workers could
share.
"""

from __future__ import annotations

import io
import itertools
import operator
import pickle
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from ms_shm import cow, procfs, rows, sandbox
from ms_shm.engines.torchstyle import aliases, storages
from ms_shm.engines.torchstyle.compat import UnreadableSamples
from ms_shm.engines.torchstyle.planning import BatchStats

PROBE_SAMPLES = 3  # the first one cold, then two warm ones: the faster of those is the sample's time
# ... but the third only while the first two took less than this: a slow sample is timed well enough by one warm
# reading, and a third would cost the epoch another sample's time (measured: torch 2.13, ~8 ms of numpy work per
# sample, 15-24 ms each in the probe's fork, the probe 100 ms -> ~80 ms)
PROBE_SECONDS = 0.03
UNTIMED_SAMPLES = 2  # where num_workers was passed: the batch's weight only, from the first and the last
# Samples read once the probe's batches are dropped, timed as the main process reads them with num_workers=0
# (``inline_seconds``): the faster of two, the first paying what the allocator's change of state left to fault in
INLINE_SAMPLES = 2
# ... read where they cost at most this share of the epoch's samples, up to INLINE_SECONDS, or PROBE_SECONDS: slow
# samples (an audit: 500 ms each, the build 1.5 s -> 2.5 s) would cost the start-up what cannot change its plan
INLINE_SHARE = 0.02
INLINE_SECONDS = 0.1
AHEAD = 2 * INLINE_SAMPLES + 2  # indices the caller's sampler gives after the probe's (it may repeat some)


def spread_indices(length: int | None, count: int) -> list | None:
    """Up to ``count`` indices spread over a map-style dataset of ``length`` samples (first, last, middle, ...:
    ``rows``'s rule for ``build_dataset``'s probe), or ``None`` where its length is unknown. Where the loader
    draws its own order (``shuffle``, or none), its first indices are ``0, 1, 2``, neighbours that say nothing
    of the samples further on: 4 MiB ones planned an epoch of 4-8 MiB ones (4 ranks under 64-128 MB died of
    ``RowTooLargeError``, "7.0 MiB (planned 4.0 MiB)")."""
    if length is None or length <= 0:
        return None
    return rows._spread(length, count)  # one rule for both probes


def dataset_length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # no ``__len__``: read as the loader would, from the start
        return None


def first_batch(batch_size: int | None, sampler: Any, batch_sampler: Any, count: int,
                length: int | None = None, ahead: list | None = None) -> tuple:
    """``(indices, size)``: the indices the probe reads (at most ``count``) and the batch's size. From the
    caller's sampler or batch sampler, their first ones (what they choose is theirs: a subset, a bucket whose
    samples collate together); without either, ``count`` spread over the dataset's ``length`` (its sampler
    is the framework's, made later from ``shuffle``). Taken in the child before its reads are watched: a
    ``RandomSampler`` draws from torch's global generator (or its own), which says nothing of the samples.
    ``ahead``: filled, from the same draw, with up to ``AHEAD`` indices the caller's sampler gives next."""
    batches = iter(batch_sampler) if batch_sampler is not None else None
    first = next(batches, None) if batches is not None else None
    size = len(first) if first is not None else (batch_size or 1)
    spread = spread_indices(length, count) if first is None and sampler is None else None
    if spread is not None:
        return spread, size
    order = (itertools.chain(first, itertools.chain.from_iterable(batches)) if first is not None else
             iter(sampler) if sampler is not None else itertools.count())  # no length: read from the start
    indices = list(itertools.islice(order, min(count, len(first)) if first is not None else min(count, size)))
    if ahead is not None:
        ahead.extend(itertools.islice(order, AHEAD))
    return indices, size


def sampler_ahead(sampler: Any, batch_sampler: Any) -> list | None:
    """The list ``first_batch`` fills with the caller's sampler's next indices, or ``None`` where the framework
    makes the sampler (every index is one it reads)."""
    return [] if sampler is not None or batch_sampler is not None else None


def _first_samples(dataset: Any, iterable: bool, indices: list, count: int, read: Callable = operator.getitem,
                   after_first: Callable[[Any], None] = lambda sample: None) -> tuple:
    """The first ``count`` samples the loader would read (``indices``: its first ones, for a map-style
    dataset, each read with ``read(dataset, index)``: the engine's ``sample_reader``); ``after_first(sample)``
    runs between the first read and the next, untimed."""
    if iterable:
        return _samples(dataset, True, [], count, read, after_first)
    return _samples(dataset, False, indices, min(count, len(indices)), read, after_first)


def _samples(dataset: Any, iterable: bool, indices: list, count: int, read: Callable,
             after_first: Callable[[Any], None]) -> tuple:
    """``(samples, (wall, CPU) seconds each)``: the first ``count`` of an iterable dataset, else ``read(dataset,
    i)``; after two, none more once they took ``PROBE_SECONDS``."""
    out, walls = [], []
    source = iter(dataset) if iterable else None
    for k in range(count):
        if k >= 2 and sum(wall for wall, _ in walls) >= PROBE_SECONDS:
            break
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            sample = next(source) if iterable else read(dataset, indices[k])
        except (StopIteration, IndexError):
            break
        walls.append((time.perf_counter() - w0, time.process_time() - c0))
        out.append(sample)
        if k == 0:
            after_first(sample)
    return out, walls


def measure_batch(dataset: Any, batch_size: int | None, collate: Callable, weigh: Callable[[Any], tuple],
                  iterable: bool, sampler: Any = None, batch_sampler: Any = None,
                  twin: Callable[[Any], Any] | None = None, first: tuple | None = None,
                  keep: list | None = None, read: Callable = operator.getitem,
                  ahead: list | None = None, no_workers: Callable[[BatchStats], str | None] | None = None) -> BatchStats | str:
    """In the probe child: the batch's stats, or why there are none (an empty dataset, samples that cannot be
    read one by one). With ``twin`` (the framework's second sample made from a first) the samples are not timed:
    ``UNTIMED_SAMPLES`` are read (the twin stands for a second one the dataset lacks), and ``seconds_per_sample``
    is ``None``. ``first``: ``first_batch``'s ``(indices, size)``, taken beforehand (else here); ``keep``: the
    first sample read is appended to it (for ``reread_differs``); ``read``: how the loader reads a sample of a
    map-style dataset (``sample_reader``); ``ahead``: ``first_batch``'s, the indices the caller's sampler gives
    next (``None``: the framework's sampler, any index); ``no_workers``: the planner's ``why_no_workers`` on the
    samples weighed and timed, asked before the samples a loop's timing needs are read (a reason: they are not, and
    ``BatchStats.workers_ruled_out`` holds it)."""
    try:
        return _measure_batch(dataset, batch_size, collate, weigh, iterable, sampler, batch_sampler, twin, first,
                              keep, read, ahead, no_workers)
    except UnreadableSamples as exc:
        return str(exc)


def _measure_batch(dataset: Any, batch_size: int | None, collate: Callable, weigh: Callable[[Any], tuple],
                   iterable: bool, sampler: Any, batch_sampler: Any, twin: Callable[[Any], Any] | None,
                   first: tuple | None, keep: list | None, read: Callable, ahead: list | None,
                   no_workers: Callable[[BatchStats], str | None] | None = None) -> BatchStats | str:
    timed = twin is None
    held = storages.dataset_storages(dataset)  # shared once per worker where batches send views of them
    weigh = storages.per_batch_weigh(weigh, held)
    if first is None:
        ahead = sampler_ahead(sampler, batch_sampler)
        first = first_batch(batch_size, sampler, batch_sampler, PROBE_SAMPLES,
                            None if iterable else dataset_length(dataset), ahead)
    indices, size = first
    want = PROBE_SAMPLES if timed else UNTIMED_SAMPLES  # a map-style dataset's indices are capped already
    batched = batch_size is not None or batch_sampler is not None
    first_made: list = []
    samples, walls = _first_samples(dataset, iterable, indices, min(want, size) if iterable else want, read,
                                    lambda sample: first_made.append(_first_collated(collate, sample, batched)))
    if not samples:
        return "the dataset gave no sample to measure"
    if keep is not None:
        keep.append(samples[0])
    reads = len(samples)
    if not timed and size > 1 and reads == 1:  # the dataset has no second sample: its twin stands for one
        try:
            samples.append(twin(samples[0]))
        except Exception:  # a sample the framework's copy cannot make: the one sample is weighed alone
            pass
    batch, first_collate = first_made[0]
    by_code = cow.objects_read_by_code(dataset, [collate])  # a module global the reads index, a collate's buffer
    own = aliases.own_in(batch, aliases.held(dataset, collate, *by_code, at=tuple(indices[:1])))
    singles = [first_collate]  # seconds of each sample collated alone
    one, shared = weigh(batch), storages.once_per_worker(batch, held)
    alone, made = [one[0]], None
    for k in range(1, reads):
        c0 = time.perf_counter()
        made = collate(samples[k:k + 1]) if batched else collate(samples[k])
        singles.append(time.perf_counter() - c0)
        alone.append(weigh(made)[0])
    two = pair = paired = None
    if len(samples) > 1 and batched:
        c0 = time.perf_counter()
        batch, pair = _pair(collate, samples)
        paired = time.perf_counter() - c0
        two, shared = weigh(batch), max(shared, storages.once_per_worker(batch, held))
    second = alone[1] if two is not None and pair[1] is not samples[0] and reads > 1 else one[0]
    largest, smallest = batch_bytes_at(alone, two[0] if two else None, second, size)
    count = one[1] + max(0, (two[1] - one[1]) if two else 0) * (size - 1)  # storages per batch
    length = None if iterable else epoch_samples(dataset, sampler, batch_sampler, size)
    unsent = why_not_sent(batch)
    low = int(smallest) if smallest != largest else None
    if not timed:
        return BatchStats(int(largest), int(max(1, count)), None, length, size, unsent=unsent,
                          batch_bytes_min=low, shared_bytes=shared, own=own)
    wall, cpu = sample_seconds(walls)
    collated = collate_share(singles, paired, size)
    batch = pair = made = None  # the main process's loop drops each batch and its samples before the next samples
    first_made.clear()
    samples.clear()
    stats = BatchStats(int(largest), int(max(1, count)), wall + collated, length, size,
                       cpu_seconds_per_sample=min(cpu, wall) + collated, unsent=unsent, batch_bytes_min=low,
                       shared_bytes=shared, own=own)
    ruled_out = no_workers(stats) if no_workers is not None else None
    if ruled_out:
        return replace(stats, workers_ruled_out=ruled_out)
    inline = None if iterable else inline_seconds(dataset, read, indices[:reads], wall, length, ahead)
    return stats if inline is None else replace(stats, inline_seconds_per_sample=inline + collated)


def collate_share(singles: list, paired: float | None, size: int) -> float:
    """A sample's share of collating a batch of ``size``: a collate costs a part per call and a part per sample,
    read from the samples collated alone (``singles``: the first ran cold, the fastest counts) and the first two
    together (``paired``; ``None``: not batched). Counting the call's part per sample priced trivial samples
    (one float each, batches of 256) at 0.1 ms each where an epoch without workers read 3.4 us, and chose 2
    workers, 3-6x slower (an audit)."""
    one = min(singles)
    if paired is None or size <= 1:
        return one
    step = max(0.0, paired - one)  # what the second sample added
    return min(one, (one + step * (size - 1)) / size)


def inline_seconds(dataset: Any, read: Callable, seen: list, warm: float, epoch: int | None,
                   ahead: list | None = None) -> float | None:
    """A sample's seconds in the main process (``num_workers=0``), or ``None`` where not read: the faster of up to
    ``INLINE_SAMPLES`` fresh samples (``_fresh_indices``) read after the probe's batches were collated and dropped,
    as the loop does. Not the probe's own warm reads: the main process's loop frees a batch of its own memory at
    every step, and its samples read faster after, from pages its allocator already has (measured: torch 2.13, 2 MiB
    numpy samples: 4.7 ms each in a ``num_workers=0`` epoch with no page fault, 5.6-6.4 ms in the probe and in a
    fork, where a sample faulted in ~2,976 new pages). Read only where ``INLINE_SAMPLES`` at ``warm`` seconds each
    cost at most ``INLINE_SHARE`` of the epoch, up to ``INLINE_SECONDS`` (or ``PROBE_SECONDS``), and no more once
    they cost that (a fresh index read cold)."""
    allowed = max(PROBE_SECONDS, min(INLINE_SHARE * (epoch or 0) * warm, INLINE_SECONDS))
    fresh = _fresh_indices(dataset, seen, ahead)
    if fresh is None or INLINE_SAMPLES * warm > allowed:
        return None
    walls: list = []
    for index in itertools.islice(fresh, INLINE_SAMPLES):
        if sum(walls) > allowed:  # a fresh index read cold (a shard opened, a file fetched): no more of those
            return None
        try:
            began = time.perf_counter()
            read(dataset, index)
            walls.append(time.perf_counter() - began)
        except Exception:  # an index the loop may never read: nothing measured
            return None
    return min(walls) if walls else None


def _fresh_indices(dataset: Any, seen: list, ahead: list | None) -> Any:
    """Indices the loader reads that the probe has not: the caller's sampler's next ones (``ahead``: a dataset may
    fail or hang at an index its sampler never gives), else the neighbours after the last one read (the
    framework's sampler reads every index; a dataset that caches would time a cache hit on one read before);
    ``None``: none to read."""
    if ahead is not None:
        try:
            return iter([i for k, i in enumerate(ahead) if i not in seen and i not in ahead[:k]])
        except Exception:  # indices that do not compare (arrays): none told apart
            return None
    length = dataset_length(dataset)
    if not seen or not length:
        return None
    try:
        last = operator.index(seen[-1])
    except TypeError:  # keys, not positions: no neighbour to read
        return None
    return (i % length for i in range(last + 1, last + 1 + length) if i % length not in seen)


def _first_collated(collate: Callable, sample: Any, batched: bool) -> tuple:
    """``(the first sample's batch, seconds)``, made before the next sample is read, and then the watch told the
    first read is done (``sandbox.first_read_done``): what the dataset or the ``collate_fn`` changes from here on
    is state kept per read (a cache, a vocabulary growing, a count of batches), not lazy set-up. A re-read of
    the first sample could not tell: the cache held it, the vocabulary knew its words (an audit: workers each
    numbered the words anew, and every batch differed from raw's)."""
    c0 = time.perf_counter()
    batch = collate([sample]) if batched else collate(sample)
    seconds = time.perf_counter() - c0
    sandbox.first_read_done()
    return batch, seconds


def _pair(collate: Callable, samples: list) -> tuple:
    """``(batch of two, samples)``: the first two samples collated; where they do not collate together (spread
    over the dataset, their shapes may differ, and a stacking collate refuses them), the first beside itself,
    as a batch of samples alike would weigh. What the first pair raises is raised where both refuse."""
    try:
        return collate(samples[:2]), samples[:2]
    except Exception:
        try:
            return collate([samples[0], samples[0]]), [samples[0], samples[0]]
        except Exception:
            pass
        raise


def batch_bytes_at(alone: list, two: int | None, second: int, size: int) -> tuple:
    """``(largest, smallest)``: a batch of ``size`` samples' bytes, extrapolated from the probe's. ``alone``:
    each sample read, collated alone; ``two``: the first two collated together (``None``: not batched, or one
    sample), ``second`` the second of those alone. A sample adds what the second added to the first (``two -
    alone[0]``, with a collate's own bytes, a padded collate's growth), more or less by how much more or less it
    weighs alone than the second; the largest batch is made of the largest sample's, the smallest of the
    smallest's. Samples alike give the one extrapolation ``one + (two - one) * (size - 1)``."""
    one = alone[0]
    step = (two - one) if two is not None else one

    def at(sample: int) -> int:
        return sample + max(0, step + sample - second) * (size - 1)

    return at(max(alone)), at(min(alone))


class _Outline(pickle.Pickler):
    """Pickles an object's structure, not its arrays' bytes: what must pickle for a worker to send it (its
    containers, classes, functions), at a few microseconds for a batch of any size. A tensor is refused where
    the framework refuses it (requires grad, not a leaf)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return "array"
        if type(obj).__module__.split(".")[0] in ("torch", "mindspore") and hasattr(obj, "shape"):
            if getattr(obj, "requires_grad", False) and not getattr(obj, "is_leaf", True):
                raise RuntimeError("a tensor that requires grad and is not a leaf (a result of autograd) cannot be "
                                   "sent between processes")
            return "tensor"
        return None


def why_not_sent(value: Any, what: str = "the probe batch") -> str | None:
    """Why ``value`` cannot go to another process (pickled, as a worker sends a batch and as spawn sends the
    dataset), or ``None``."""
    try:
        _Outline(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:  # whatever pickling raises is what the worker would raise
        return f"{what} cannot be pickled ({type(exc).__name__}: {str(exc)[:200]}), so no worker could send it"
    return None


def sample_seconds(walls: list) -> tuple:
    """One sample's ``(wall, CPU)`` seconds from the probe's: the fastest after the first (which ran cold), else
    the first."""
    return min(walls[1:]) if len(walls) > 1 else walls[0]


def epoch_samples(dataset: Any, sampler: Any, batch_sampler: Any, size: int) -> int | None:
    """Samples one epoch reads: the batch sampler's batches, the sampler's or the dataset's length."""
    try:
        if batch_sampler is not None:
            return len(batch_sampler) * size
        return len(sampler) if sampler is not None else len(dataset)
    except TypeError:
        return None


def probe_loader(dataset: Any, batch_size: int | None, collate: Callable, weigh: Callable[[Any], tuple],
                 iterable: bool, sampler: Any = None, batch_sampler: Any = None,
                 worker_pages: bool = False, twin: Callable[[Any], Any] | None = None,
                 tensor_bytes: Callable[[Any], tuple | None] = lambda value: None, reread: bool = True,
                 read: Callable = operator.getitem, shares: Callable[[Callable, list], bool | None] | None = None,
                 by_threads: Callable[[Callable[[], Any]], tuple] | None = None,
                 no_workers: Callable[[BatchStats], str | None] | None = None) -> tuple:
    """``(BatchStats or None, Effects, why not measured)``, measured in a forked child, with the child's
    ``os.fork()`` call and the CPUs free while it ran. The child's reads cannot move what the parent reads
    through shared descriptors (``sandbox``'s ``fdguard``), and with ``reread`` the first sample of a map-style
    dataset is read twice (``tensor_bytes``: a tensor's dtype, shape and bytes) to tell samples that draw from a
    generator the watch cannot see. ``read``: how the loader reads a sample (``sample_reader``). ``shares``: the
    framework's test whether a ``collate_fn`` of the caller's builds its batch in shared memory in a worker
    (``BatchStats.collate_shares``), run on the first sample. ``by_threads``: the framework's watch of what the
    reads and the collate compute whose result depends on the thread count (``BatchStats.thread_bound``).
    ``no_workers``: ``measure_batch``'s; where it rules workers out, the first sample is not read again either."""
    shared = sandbox.shared_with_processes([dataset, collate]) or (sandbox.stream_blocker([dataset]) if iterable
                                                                   else None)
    if shared:
        return None, sandbox.Effects(), shared
    batched = batch_size is not None or batch_sampler is not None

    def in_child():
        ahead = sampler_ahead(sampler, batch_sampler)
        first = first_batch(batch_size, sampler, batch_sampler, PROBE_SAMPLES,  # unwatched: the sampler's draws
                            None if iterable else dataset_length(dataset), ahead)
        kept: list = []
        ruled_out: list = []  # measure_batch's stats, where workers were ruled out: no worker reads a sample again
        again = None if iterable or not reread else \
            lambda: None if ruled_out else reread_differs(dataset, first[0], kept, tensor_bytes, read)
        bound: list = []

        def measured():
            def measure():
                stats = measure_batch(dataset, batch_size, collate, weigh, iterable, sampler, batch_sampler, twin,
                                      first, kept, read, ahead, no_workers)
                if isinstance(stats, BatchStats) and stats.workers_ruled_out:
                    ruled_out.append(stats)
                return stats
            if by_threads is None:
                return measure()
            value, why = by_threads(measure)
            bound.append(why)
            return value

        stats, effects = sandbox.watch_effects(measured, [dataset, collate], again)
        if isinstance(stats, BatchStats):  # the CPU the child kept busy since its fork (a collate may use threads)
            stats = replace(stats, free_cpus=time.process_time(),
                            collate_shares=shares(collate, kept[:1]) if shares and kept and batched else None,
                            thread_bound=bound[0] if bound else None)
        elif sandbox.blinded():
            stats += f" (the probe reads no pipe or terminal the program holds: {', '.join(sandbox.blinded())})"
        return stats, effects

    ticks, began, own = procfs.cpu_ticks(), time.perf_counter(), time.process_time()
    outcome = sandbox.run_in_fork(in_child, worker_pages=worker_pages, watched=[dataset, collate])
    idle, window = procfs.idle_cpus(ticks, procfs.cpu_ticks()), time.perf_counter() - began
    own = time.process_time() - own  # this process's part of the probe: the fork, reading the result
    if outcome.unavailable:
        return None, sandbox.Effects(), outcome.unavailable
    if outcome.error is not None:
        return None, sandbox.Effects(), f"{RAISED} {type(outcome.error).__name__}: {outcome.error}{WILL_RAISE}"
    stats, effects = outcome.value
    if isinstance(stats, str):
        return None, effects, stats
    free = free_cpus(idle, stats.free_cpus + own, window)
    return replace(stats, worker_bytes=outcome.private_bytes, free_cpus=free, fork_seconds=outcome.fork_seconds), \
        effects, None


def reread_differs(dataset: Any, indices: list, kept: list, tensor_bytes: Callable[[Any], tuple | None],
                   read: Callable = operator.getitem) -> str | None:
    """In the child, after the probe's reads: the first sample read again, compared byte for byte with the
    first read; why they differ, or ``None``. One more read: a sample that draws from a generator held where the
    watch does not look (a transform's, a module's, a ``torch.Generator``) changes between reads, and workers,
    each with its own copy of that generator, would give other samples than the main process."""
    if not kept or not indices:
        return None
    try:
        again = read(dataset, indices[0])
    except Exception as exc:  # it read once: a second read that fails cannot be what a worker would see
        return f"sample {indices[0]!r} read again raised {type(exc).__name__}"
    where = rows.difference(kept[0], again, "sample", tensor_bytes)
    return None if where is None else f"sample {indices[0]!r} read twice came back different ({where})"


def free_cpus(idle: float | None, probe_cpu_seconds: float, window: float) -> float | None:
    """CPUs the loader's processes could share: the idle ones plus the ones the probe kept busy itself, the child
    and this process (its fork): on an idle host, all of them. Counting the child alone read 1.3-1.5 of 2 idle CPUs
    (torch 2.13, ~80 ms windows), which priced two workers on 2 CPUs as if on one and a half."""
    if idle is None or window <= 0:
        return None
    return idle + probe_cpu_seconds / window


RAISED = "the probe batch raised"  # how a probe's error begins (``loaders`` tells one read outside a worker)
WILL_RAISE = " (the DataLoader will raise it where it reads that sample)"

__all__ = ["RAISED", "WILL_RAISE", "epoch_samples", "measure_batch", "probe_loader", "first_batch", "spread_indices", "batch_bytes_at", "reread_differs", "sample_seconds", "why_not_sent",
           "inline_seconds", "INLINE_SAMPLES",
           "free_cpus", "PROBE_SAMPLES", "PROBE_SECONDS"]
