"""Whether a DataLoader's samples (or a MindSpore stage's rows) can depend on the worker that reads them, read
from the code alone (no call).

A dataset or ``collate_fn`` that calls ``get_worker_info()`` gives other samples in a worker than in the main
process (a per-worker shard, a tag, a per-worker cache), and one that seeds from ``torch.initial_seed()`` other
random streams (each worker's is the loader's base seed plus its id): ``num_workers`` chosen by ms_shm would
change what arrives. The probe cannot see it (its child is not a worker), so the code is read instead: the names
each code object uses (``co_names``: globals, attributes and imports alike, so ``get_worker_info()``,
``torch.utils.data.get_worker_info()`` and a local ``from ... import get_worker_info`` all show), through nested
code (lambdas, comprehensions, inner functions), the methods and module functions it names, and the objects the
dataset holds (a ``Subset``'s dataset, a transform's ``__call__``, an ``nn.Module``'s ``forward``). Framework and
standard-library code is not read: torch's own collate asks for the worker only to place a batch in shared
memory, not to change it.

The same walk answers a second question, ``global_draw``: whether that code, or a custom sampler's
``__iter__``, draws from a *global* random generator (``random``'s, ``numpy.random``'s legacy one, torch's
default). The probe sees a dataset that moves a global generator on each of the samples it reads, but not one
that draws for some samples only (a random crop of the images larger than the crop: 1 in 4 in the audit's
``sometimes_auto``), nor a sampler that draws per index (a class-balanced ``yield random.randrange(n)``): with
workers the sampler runs ``prefetch_factor * num_workers`` batches ahead of the training loop, so when the loop
draws from the same generator (CPU ``nn.Dropout``, ``random.random()``) both sequences change. ``stage_draw``
asks the same of a MindSpore ``GeneratorDataset`` source, ``map`` operations and ``per_batch_map``, whose rows
change with the mode MindSpore reads them in. Here the bytecode is read: attribute chains
(``np.random.randint``, ``random.randint``, a ``from random import randint``) are resolved against the
function's globals and closure at scan time and compared by identity with the global generators' bound methods
and torch's sampling functions.

Cheap: a bounded walk over code objects (``MAX_CODES``), no sample read, nothing imported; ``global_draw`` took
0.7-1.5 ms on 3.11 (first call in a fresh process) for an image dataset with a 4-transform Compose, and 0.7-1.1
ms for one holding a 50-layer ``nn.Sequential``. A reference that is
never called only keeps the framework's default ``num_workers``, which cannot change what arrives.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import inspect
import itertools
import os
import sys
import types
from typing import Any, Callable, Iterator, NamedTuple

from ms_shm import objects, sandbox
from ms_shm.engines.mindspore.profiles import random_mindspore_base

NAMES = ("get_worker_info", "initial_seed")  # what a worker answers apart from the main process
# ``forward``: a held ``nn.Module`` transform is called through torch's ``Module.__call__``, which is not read
ENTRY_POINTS = ("__getitem__", "__getitems__", "__iter__", "__call__", "forward")
MAX_CODES = 300  # code objects read at most: a dataset's own code is tens
# objects held by the dataset, and by those, down to a transform in a ``Compose`` in a dataset wrapped by
# ``random_split``'s ``Subset`` or a ``ConcatDataset`` (an audit: at 2 levels and 8 items, a crop drawing for some
# samples only was missed there, and in a 9-transform ``Compose``, and workers changed the batches)
HELD_DEPTH = 5
HELD_ITEMS = 64  # of a held list, tuple or dict, the first ones only
MAX_HELD = 2000  # objects looked at per walk, at most: a dataset holding many small objects stays cheap

# torch's functions that draw from its default generator unless passed ``generator=``
TORCH_DRAWS = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "rand_like",
               "randn_like", "randint_like", "poisson")
# ... and those that take no ``generator=`` at all, by module: dropout and its kin (the audit's sample augmented
# with ``F.dropout`` one time in four: the probe's three samples did not draw, and 2 workers changed the batches)
TORCH_DRAWS_ALWAYS = (
    ("torch", ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout", "feature_dropout_",
               "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout", "rrelu", "rrelu_")),
    ("torch.nn.functional", ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                             "feature_alpha_dropout", "rrelu", "rrelu_", "gumbel_softmax")),
)
# MindSpore's random functions: they draw from its global seed in the process that calls them (an audit's sample
# added ``ms.ops.rand(1)``: the probe's re-read in one process cannot tell it from a seeded constant)
MINDSPORE_DRAWS = (
    ("mindspore.ops", ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "uniform",
                       "standard_normal", "normal", "bernoulli", "multinomial", "multinomial_with_replacement",
                       "randperm", "shuffle", "dropout", "dropout1d", "dropout2d", "dropout3d", "gamma", "poisson",
                       "random_gamma", "random_poisson", "random_categorical", "laplace", "standard_laplace",
                       "choice_with_mask", "rrelu", "gumbel_softmax")),
    ("mindspore.mint", ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like",
                        "randn_like", "randint_like")),
)
# torch's objects whose call or ``sample()`` draws from the default generator: modules in training mode (their
# ``forward`` is torch's code, not read) and distributions, held by the dataset or made in its code
RANDOM_CLASSES = (("torch.nn.modules.dropout", "_DropoutNd", "nn"),  # (module, base class, label prefix)
                  ("torch.nn.modules.activation", "RReLU", "nn"),
                  ("torch.distributions.distribution", "Distribution", "torch.distributions"))
MAX_SUBMODULES = 2000  # of a held nn.Module, the submodules looked at for a random one
# tensor methods that draw from the default generator unless passed ``generator=``: those that fill in place, and
# ``bernoulli`` / ``multinomial``, which return new tensors (an audit: ``torch.full_like(x, .5).bernoulli()`` on
# 2 samples of 16 went unseen, and 2 workers drew them from their own seeds); read on any object, since the
# tensor's type is not known before the call (numpy's ``Generator.multinomial`` is a held generator's draw anyway)
TENSOR_DRAWS = frozenset({"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_",
                          "log_normal_", "geometric_", "bernoulli", "multinomial"})
STATE_READS = frozenset({"getstate", "get_state", "get_bit_generator"})  # read the global state, do not move it
_CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD", "CALL_FUNCTION_EX"})
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_DEREF", "STORE_GLOBAL", "STORE_FAST_STORE_FAST",
                      "STORE_FAST_LOAD_FAST"})
_UNKNOWN = object()  # a value the scan cannot know without running the code
# numpy's legacy functions, bound to its global ``RandomState``: numpy 2 imports ``numpy.random`` lazily, on first
# use, so a dataset's ``np.random.rand`` is read by name while it is not yet imported (no generator exists yet)
NUMPY_LEGACY = frozenset({
    "beta", "binomial", "bytes", "chisquare", "choice", "dirichlet", "exponential", "f", "gamma", "geometric",
    "gumbel", "hypergeometric", "laplace", "logistic", "lognormal", "logseries", "multinomial",
    "multivariate_normal", "negative_binomial", "noncentral_chisquare", "noncentral_f", "normal", "pareto",
    "permutation", "poisson", "power", "rand", "randint", "randn", "random", "random_integers", "random_sample",
    "ranf", "rayleigh", "sample", "seed", "set_state", "shuffle", "standard_cauchy", "standard_exponential",
    "standard_gamma", "standard_normal", "standard_t", "triangular", "uniform", "vonmises", "wald", "weibull",
    "zipf"})


class _NotImported(NamedTuple):
    """A submodule (or its attribute) of an imported package, named but not imported yet: ``numpy.random``."""

    path: str


def worker_info_use(dataset: Any, collate_fn: Any = None) -> str | None:
    """Where ``dataset`` or ``collate_fn`` refers to one of ``NAMES``, named for the log, or ``None``."""
    where, _, found = _per_sample(dataset, (collate_fn,), set(), _name_look)
    return f"{where} calls {found}() (what it returns depends on the worker that reads it)" if found else None


def _per_sample(dataset: Any, callables: tuple, held: set, look: Callable, prefix: str = "collate_fn ") -> tuple:
    """``(where, function, found)`` for the first entry point of ``dataset`` (and the objects it holds, each in
    ``held`` once) or of ``callables`` (a ``collate_fn``, a map's operations; named with ``prefix``) where
    ``_walk`` finds something with ``look``; ``(None, None, None)``."""
    entries = itertools.chain(_held_entries(dataset, held), *(_callable_entries(c, prefix) for c in callables))
    for where, fn, owner in entries:
        found = _walk(fn, owner, set(), [0], look)
        if found:
            return where, fn, found
    return None, None, None


def global_draw(dataset: Any, collate_fn: Any = None, sampler: Any = None, batch_sampler: Any = None,
                batch_size: Any = 1) -> str | None:
    """Where the code a DataLoader runs per sample or per index draws from a global random generator, or ``None``.

    Per sample (the dataset's entry points and ``collate_fn``): each worker's generators are seeded apart (the
    loader's base seed plus the worker's id), so the draws differ from the main process's. Per index (a custom
    ``sampler``'s or ``batch_sampler``'s ``__iter__``): with workers it runs ahead of the training loop, so a
    loop that draws from the same generator sees other numbers, and so does the sampler. torch's own samplers
    are framework code and draw once per epoch, when the epoch starts, as without workers; a custom generator
    ``__iter__`` that draws before its first loop is read the same way. A plain ``__iter__`` (one that returns
    an iterator) that draws counts when it is the loader's index sampler (``batch_sampler``, or ``sampler``
    with ``batch_size=None``): with workers the framework calls it twice per epoch, so it draws twice (torch's
    ``BatchSampler`` wrapping a ``sampler`` is a generator, started once).

    Seeded generators are not global: ``np.random.default_rng(i)``, a held ``self.rng``, ``random.Random(s)``,
    and a torch call whose call site passes ``generator=`` (read from the bytecode's keyword names: a
    ``**kwargs`` call is counted as a draw).

    Args:
        dataset: the map-style dataset (its ``__getitem__`` / ``__getitems__``, and the objects it holds).
        collate_fn: as passed to the DataLoader (``None``: the framework's, not read).
        sampler: as passed (``None`` or torch's own: nothing to read).
        batch_sampler: as passed (torch's ``BatchSampler`` is not read, a custom sampler it holds is).
        batch_size: as passed (``None``: ``sampler`` gives the loader's indices itself).

    Returns:
        A one-line reason naming the entry point and the call, or ``None``.

    Examples:
        >>> import random
        >>> class Crops:
        ...     def __getitem__(self, i):
        ...         return i + (random.randint(0, 3) if i % 4 == 1 else 0)
        >>> global_draw(Crops())  # doctest: +ELLIPSIS
        'Crops.__getitem__ calls random.randint (draws from the global generator; ...)'
    """
    targets = _Targets.now()
    held: set = set()
    found = _sample_draw(dataset, (collate_fn,), held, targets, "collate_fn ")
    if found:
        return f"{found[0]} (draws from {found[1]}; workers are seeded apart)"
    index_sampler = batch_sampler if batch_sampler is not None else sampler if batch_size is None else None
    for arg, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        for where, fn, owner in _held_entries(value, held):
            plain = value is index_sampler and owner is value and not _generator(fn)
            draw = _walk(fn, owner, set(), [0], functools.partial(_draw_look, targets, None if plain else fn))
            if draw:
                return f"the {arg}'s {where} calls {_named_draw(draw, fn)} {_sampler_why(draw, plain)}"
            generators = sandbox.held_generators([value]) if plain else ()
            if generators:  # an audit's batch sampler shuffled with its own default_rng: epoch 1 came first
                return (f"the {arg}'s {where} returns a new iterator each call and {type(value).__name__} holds a "
                        f"random generator ({generators[0][0]}): with workers the framework calls it twice per "
                        f"epoch, so each epoch gets the indices of the next")
    return None


def sampler_writes(sampler: Any = None, batch_sampler: Any = None) -> str | None:
    """Where a custom ``sampler``'s or ``batch_sampler``'s ``__iter__`` (and what it calls of its own) writes
    state that outlives the call (``self.epoch += 1``), or ``None``. With workers the framework runs the sampler
    ahead of the loop, as far as the workers read, and calls a plain ``__iter__`` twice per epoch, so such state
    moves on other than without workers (an audit's batch sampler counting epochs in ``__iter__``: epoch 0 got
    the batches raw gave epoch 1). torch's own samplers are framework code, not read."""
    held: set = set()
    for arg, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        for where, fn, owner in _held_entries(value, held):
            look = functools.partial(_store_look, entry=fn)
            found = _walk(fn, owner, set(), [0], look) if fn.__name__ == "__iter__" else None
            if found:
                return f"the {arg}'s {where} writes {found}"
    return None


def draws_once_per_epoch(sampler: Any, held: list) -> bool:
    """Whether ``sampler`` draws from the generators it holds (``held``: ``sandbox.held_generators``' ``(where,
    generator)``) only in its generator ``__iter__``, before the loop that yields: once per epoch, as its first
    index is asked for, with or without workers (the over-locking audit: a bucketing batch sampler drawing one
    permutation per epoch from its ``default_rng`` kept 0 workers). Anything else may draw ahead of the loop with
    workers: a plain ``__iter__``, a draw in the loop, a generator held deeper or used through a helper."""
    prefix = f"{type(sampler).__name__}."
    names = {where[len(prefix):] for where, _ in held if where.startswith(prefix)}
    entries = [fn for _, fn, _ in _entries(sampler) if fn.__name__ == "__iter__"]
    if not entries or not _generator(entries[0]) or len(names) != len(held) or any(
            not name.isidentifier() for name in names):
        return False
    code = entries[0].__code__
    reads = [instr.offset for instr in dis.get_instructions(code)
             if instr.opname in ("LOAD_ATTR", "LOAD_METHOD") and instr.argval in names]
    inner = any(not names.isdisjoint(each.co_names) for each in itertools.islice(_codes(code), 1, None))
    return bool(reads) and not inner and all(_before_loop(code, offset) for offset in reads)


def stage_draw(source: Any = None, operations: Any = ()) -> str | None:
    """Where a ``GeneratorDataset`` source (its ``__getitem__``, and the objects it holds), a ``map``'s Python
    operations or a ``per_batch_map`` draws from a global random generator in its code, or ``None``.

    MindSpore reads rows in its own thread (one worker), in threads that share the global generators (their
    draws interleave as the threads run) or in processes seeded apart (``seed + worker_id``): rows that draw give
    other values in another mode. The probe child sees a source that draws on the rows it reads, not one that
    draws for some rows only (an audit's source drew for 2 rows in 5, none of them among the probe's spread
    rows, and 2 threads changed the rows in 2 runs of 3)."""
    ops = tuple(operations) if isinstance(operations, (list, tuple)) else (operations,)
    found = _sample_draw(source, ops, set(), _Targets.now(), "")
    return f"{found[0]} (draws from {found[1]})" if found else None


# ``os`` functions that read at, or move, a descriptor's offset, which every reader of it shares: threads, and worker
# processes forked after it was opened (``os.pread`` / ``os.pwrite`` take their own offset)
OFFSET_CALLS = ("read", "readv", "readinto", "lseek", "write", "writev")


def stage_offsets(source: Any = None, operations: Any = ()) -> str | None:
    """Where a ``GeneratorDataset`` source's reading code (a ``map``'s operations, a DataLoader's dataset and
    ``collate_fn``) reads through a raw descriptor's offset (``os.lseek(self.fd, off)`` then ``os.read(self.fd,
    n)``), or ``None``. Every reader shares that offset, so rows read by two at once come from the other's
    position: an audit's record-file source, read by raw in its one thread, always right, gave wrong or
    reordered rows in 6 runs of 11 in the 2 threads ms_shm chose. An open file object is seen as held
    (``sandbox.held_handles``); a descriptor held as an ``int`` only through the code that uses it."""
    ops = tuple(operations) if isinstance(operations, (list, tuple)) else (operations,)
    functions = {id(fn): (fn, f"os.{name}", False) for name in OFFSET_CALLS
                 for fn in (getattr(os, name, None),) if fn is not None}
    look = functools.partial(_draw_look, _Targets({}, functions, (), draws=False), None)
    where, fn, found = _per_sample(source, ops, set(), look, "")
    return (f"{where} calls {_named_draw(found, fn)}: a descriptor's offset belongs to the reader that uses it, "
            f"and other readers would race on it") if found else None


# Methods that change a container in place: called on an attribute of ``self``, they keep state past the read
MUTATORS = frozenset({"append", "appendleft", "extend", "add", "update", "insert", "pop", "popleft", "popitem",
                      "remove", "discard", "clear", "setdefault"})


def stage_writes(source: Any = None, operations: Any = ()) -> str | None:
    """Where a ``GeneratorDataset`` source's reading code (and what it calls of its own), a ``map``'s Python
    operations or a ``per_batch_map`` writes state that outlives the read: an attribute of its object
    (``self.failed = True``, ``self.skipped.append(i)``, ``self.cache[k] = v``, ``self.n += 1``) or a module
    global; or ``None``. Such state stays in the program where rows are read in it, and in each worker's copy
    where worker processes read them, so a program that reads it back (a retry that skips a row that failed
    once, a list of bad samples) sees other values in another mode. The probe sees the writes its rows make;
    these are the writes on rows it did not read (an audit's source failed once on row 7: ms_shm's worker
    processes kept the flag in a worker, and every retry failed where raw's second attempt ran)."""
    ops = tuple(operations) if isinstance(operations, (list, tuple)) else (operations,)
    where, _, found = _per_sample(source, ops, set(), _store_look, "")
    return f"{where} writes {found}" if found else None


def stage_grows(source: Any = None, operations: Any = ()) -> str | None:
    """Where the same code (``stage_writes``') adds to state rather than sets it: ``self.n += 1``,
    ``self.bad[k] = v``, ``self.bad.append(i)``, ``self.bad = self.bad + (i,)``. Lazy set-up only ever sets, so
    such a write is state kept per read even where the probe saw the state set up (a GeneratorDataset audit: a
    count of bad rows created by ``hasattr`` on the first read, and grown on rows the probe did not read, got
    threads and other rows)."""
    ops = tuple(operations) if isinstance(operations, (list, tuple)) else (operations,)
    where, _, found = _per_sample(source, ops, set(), functools.partial(_store_look, growing=True), "")
    return f"{where} adds to {found}" if found else None


def _store_look(fn: Any, owner: Any = None, entry: Any = None, growing: bool = False) -> tuple:
    """The first write of ``self``'s state (where ``fn`` is a method of ``owner``) or of a module global in
    ``fn``'s code, named; nothing to resolve further (``_walk`` follows the methods and functions it names).

    Not counted: lazy set-up, an assignment that the code makes only where the attribute is not set yet (``if
    self.f is None: self.f = open(...)``, ``if not hasattr(self, "index"): ...``, ``if self.f is not None: return
    self.f`` before it), which a read made in the program before the probe has done already (an audit: a dataset
    peeked at with ``ds[0]`` kept its loader's workers at 0); a guard with another condition (``... is None and
    i % 61 == 60``) or another write of the attribute still counts. And, where ``fn`` is ``entry``, a sampler's
    generator ``__iter__``, what it writes before the loop that yields, once per epoch with or without workers
    (``self.epoch += 1``, as ``_before_loop`` counts draws)."""
    code = fn.__code__
    this = code.co_varnames[0] if owner is not None and code.co_argcount else None
    per_epoch = fn is entry and _generator(fn)
    for each in _codes(code):
        ins = list(dis.get_instructions(each))
        own = this if each is code or this in each.co_freevars else None  # a comprehension's, a lambda's ``self``
        set_up = _set_up_once(ins, own) if own is not None else set()
        for i, instr in enumerate(ins):
            if instr.opname == "STORE_GLOBAL":
                found = f"the global {instr.argval}" if not growing or _reads_before(ins, i, "LOAD_GLOBAL") else None
            elif instr.opname == "LOAD_GLOBAL":
                found = _global_content_write(ins, i, getattr(fn, "__globals__", {}))
            else:
                found = _self_write(ins, i, own) if own is not None and i not in set_up else None
                found = None if found and growing and not _grows(ins, i, own, found) else found
            if found and not (per_epoch and each is code and _before_loop(code, instr.offset)):
                return found, ()
    return None, ()


def _set_up_once(ins: list, this: str) -> set:
    """The indices in ``ins`` of the assignments ``self.x = v`` made only where ``x`` is not set yet: in the
    body of ``if self.x is None:`` or ``if not hasattr(self, "x"):`` before any other condition, or right after
    ``if self.x is not None: return ...``."""
    at = {instr.offset: k for k, instr in enumerate(ins)}
    lazy = set()
    for k in range(len(ins)):
        guard = _none_guard(ins, k, this)
        if guard is None:
            continue
        name, jump, runs_when_unset = guard
        end = at.get(ins[jump].argval)
        if end is None or end <= jump:
            continue
        body = range(jump + 1, end) if runs_when_unset else \
            range(end, len(ins)) if ins[end - 1].opname.startswith("RETURN") else range(0)
        for b in body:
            if _conditional(ins[b]) or ins[b].opname.startswith("RETURN"):
                break
            if ins[b].opname == "STORE_ATTR" and ins[b].argval == name and _loads(ins[b - 1], this):
                lazy.add(b)
    return lazy


def _none_guard(ins: list, k: int, this: str) -> tuple | None:
    """``(attribute, index of the jump, whether the code after the jump runs where it is unset)`` for a test
    of ``self.x`` against ``None`` or ``hasattr(self, "x")`` starting at ``ins[k]``, else ``None``."""
    instr, after = ins[k], ins[k + 1:k + 7]  # hasattr's call is 2-4 instructions long, by release
    if instr.opname == "LOAD_ATTR" and k and _loads(ins[k - 1], this) and after:
        if "NONE" in after[0].opname and _conditional(after[0]):  # 3.11+: POP_JUMP_IF_NOT_NONE and kin
            return instr.argval, k + 1, "NOT_NONE" in after[0].opname
        if len(after) > 2 and after[0].opname == "LOAD_CONST" and after[0].argval is None and \
                after[1].opname == "IS_OP" and _conditional(after[2]):  # 3.9-3.10: is None, then a jump if false
            return instr.argval, k + 3, (after[1].arg == 0) == ("FALSE" in after[2].opname)
    if instr.opname == "LOAD_GLOBAL" and instr.argval == "hasattr" and len(after) > 2 and \
            _loads(after[0], this) and after[1].opname == "LOAD_CONST" and isinstance(after[1].argval, str):
        jump = next((k + 1 + j for j, a in enumerate(after) if _conditional(a)), None)
        if jump is not None:
            return after[1].argval, jump, "TRUE" in ins[jump].opname  # ``if not hasattr``: jumps where it is set
    return None


def _conditional(instr: Any) -> bool:
    return "_IF_" in instr.opname or instr.opname.startswith("JUMP_IF")


def _loads(instr: Any, name: str) -> bool:
    """``instr`` pushes the local (or the cell) ``name``."""
    return (instr.opname.startswith("LOAD_FAST") or instr.opname == "LOAD_DEREF") and instr.argval in (name, (name,))


def _self_write(ins: list, i: int, this: str) -> str | None:
    """``self.x = v``, ``self.x.y = v``, ``self.x += v``, ``self.x[k] = v`` or ``self.x.append(v)`` at ``ins[i]``."""
    op, name = ins[i].opname, ins[i].argval

    def loads_self(k: int) -> bool:  # a local, or a cell where inner code (a comprehension in 3.11) uses it too
        return 0 <= k and _loads(ins[k], this)

    if op == "STORE_ATTR":
        if loads_self(i - 1):
            return f"self.{name}"
        if i >= 2 and ins[i - 1].opname == "LOAD_ATTR" and loads_self(i - 2):
            return f"self.{ins[i - 1].argval}.{name}"
        if i >= 1 and ins[i - 1].opname in ("SWAP", "ROT_TWO"):  # ``self.x += v``: self copied, then stored to
            back = range(max(0, i - 10), i - 1)
            if any(loads_self(k) and ins[k + 1].opname in ("COPY", "DUP_TOP") for k in back):
                return f"self.{name}"
    if op == "STORE_SUBSCR" and i >= 3 and ins[i - 2].opname == "LOAD_ATTR" and loads_self(i - 3):
        return f"self.{ins[i - 2].argval}[...]"
    if op == "LOAD_ATTR" and loads_self(i - 1) and i + 1 < len(ins) and \
            ins[i + 1].opname in ("LOAD_METHOD", "LOAD_ATTR") and ins[i + 1].argval in MUTATORS:
        return f"self.{name}.{ins[i + 1].argval}()"
    return None


def _global_content_write(ins: list, i: int, globals_: dict) -> str | None:
    """``X[k] = v``, ``X[k] += v``, ``X.items[k] = v`` or ``X.append(v)`` (a ``MUTATORS`` method) on the module
    global ``X`` loaded at ``ins[i]``, where ``X`` holds data (not a module, a class or a function: ``os.remove``
    is no write), named, or ``None``. The stack is followed from the load: ``X`` (or an attribute of it) must
    stay below its key until the store, so ``out[j] = X[k]`` and ``out[X[k]] += 1`` read ``X`` and write nothing
    of it. What a row adds there stays in the program where rows are read in it, in each worker's copy where
    processes read them (an audit: a visit count in a global array, ``BIG[int(x[0])] += 1``, and a list of bad
    samples, ``BAD.append(i)``, read back by the program: raw's 150 and 16, ms_shm's worker processes 0)."""
    name = ins[i].argval
    value = globals_.get(name, _UNKNOWN)
    if value is _UNKNOWN or isinstance(value, (types.ModuleType, type)) or callable(value):
        return None
    depth, keyed = 1, False  # values on the stack from ``X`` up; whether a key is on it
    for instr in ins[i + 1:i + 48]:
        op = instr.opname
        if depth == 1 and op in ("LOAD_METHOD", "LOAD_ATTR") and instr.argval in MUTATORS:
            return f"the global {name}.{instr.argval}()"
        if op in ("STORE_SUBSCR", "STORE_SLICE"):  # ``X[k] = v``: 2 from X; ``X[k] += v``: 3, the sum on top
            return f"the global {name}[...]" if keyed and depth in ((2, 3) if op == "STORE_SUBSCR" else (3, 4)) \
                else None
        if op.startswith(("STORE_", "RETURN", "POP_TOP")) or _conditional(instr):
            return None
        try:
            depth += dis.stack_effect(instr.opcode, instr.arg, jump=False)
        except (ValueError, TypeError):  # an instruction whose effect is not told: nothing judged
            return None
        if depth >= 2:
            keyed = True
        elif keyed or depth < 1:  # ``X[k]`` read (the key and ``X`` taken), or ``X`` passed on (``f(X)``)
            return None
    return None


def _grows(ins: list, i: int, this: str, found: str) -> bool:
    """Whether the write ``_self_write`` found at ``ins[i]`` adds to what is there: an item stored or a mutator
    called, ``self.x += v``, or ``self.x = ...`` reading ``self.x`` in the same statement."""
    if found.endswith(("[...]", "()")):  # an item stored, a mutator called
        return True
    # else ``_self_write`` found a STORE_ATTR: ``self.x += v`` swaps first, ``self.x = self.x + v`` reads first
    return ins[i - 1].opname in ("SWAP", "ROT_TWO") or _reads_before(ins, i, "LOAD_ATTR", this)


def _reads_before(ins: list, i: int, load: str, this: str | None = None) -> bool:
    """Whether the statement storing at ``ins[i]`` reads the same name first (``load``: of ``self`` where
    ``this`` is given): ``COUNT = COUNT + 1``, ``self.bad = self.bad + (i,)``, ``global X; X += 1``."""
    for k in range(i - 1, max(0, i - 16), -1):
        if ins[k].opname.startswith(("STORE_", "POP_TOP", "RETURN")) or _conditional(ins[k]):
            return False
        if ins[k].opname == load and ins[k].argval == ins[i].argval and (this is None or _loads(ins[k - 1], this)):
            return True
    return False


def _sample_draw(dataset: Any, callables: tuple, held: set, targets: _Targets, prefix: str) -> tuple | None:
    """What ``global_draw`` and ``stage_draw`` read per sample (or row): ``(where it draws, what from)`` for a
    draw in the code of ``dataset`` or ``callables``, else for a random object one of them holds; or ``None``."""
    where, fn, draw = _per_sample(dataset, callables, held, functools.partial(_draw_look, targets, None), prefix)
    if draw:
        return f"{where} calls {_named_draw(draw, fn)}", "the global generator"
    held_draw = _held_random((dataset, *callables), targets)
    if held_draw:
        owner, how = held_draw
        return f"{type(owner).__name__} holds {how}", _drawn_from(how)
    return None


class _Draw(NamedTuple):
    label: str  # "random.randint", "torch.rand", "Tensor.uniform_"
    fn: Any  # the function whose code draws
    offset: int | None  # in ``fn``'s own code; None: in code nested in it (a comprehension, a lambda)


class _Targets(NamedTuple):
    """The global generators of the modules already imported (none is imported here: a module not yet imported
    has not drawn), and torch's sampling functions by identity."""

    instances: dict  # id(global generator instance) -> (instance, label prefix)
    functions: dict  # id(torch function) -> (function, label, whether it takes ``generator=``)
    classes: tuple  # (class, label prefix) of torch's random objects (``RANDOM_CLASSES``) already imported
    draws: bool = True  # random objects and in-place draws count; False: only ``functions`` (``stage_offsets``)

    @classmethod
    def now(cls) -> _Targets:
        instances = {}
        for module, attr, prefix in (("random", "_inst", "random"), ("numpy.random.mtrand", "_rand",
                                                                    "numpy.random")):
            inst = getattr(sys.modules.get(module), attr, None)
            if inst is not None:
                instances[id(inst)] = (inst, prefix)
        functions = {}
        for path, names, takes in (("torch", TORCH_DRAWS, True),
                                   *((path, names, False) for path, names in TORCH_DRAWS_ALWAYS + MINDSPORE_DRAWS)):
            space = vars(sys.modules[path]) if path in sys.modules else {}
            for name in names:
                fn = space.get(name)
                if fn is not None:
                    functions.setdefault(id(fn), (fn, f"{path}.{name}", takes))
        classes = tuple((getattr(sys.modules[path], name), prefix) for path, name, prefix in RANDOM_CLASSES
                        if isinstance(getattr(sys.modules.get(path), name, None), type))
        return cls(instances, functions, classes)

    def label(self, value: Any) -> tuple[str, bool] | None:
        """``(label, takes a generator)`` when ``value`` is a global draw, else ``None``."""
        fn = self.functions.get(id(value))
        if fn is not None and fn[0] is value:
            return fn[1], fn[2]
        made = self.random_class(value) if isinstance(value, type) else self.random_object(value)
        if made:  # a random object made in the code (``Normal(mu, s).sample()``, ``nn.Dropout(p)(x)``) or a
            return made, False  # module-level one it calls (``DROP(x)``)
        if isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            inst = self.instances.get(id(getattr(value, "__self__", None)))
            name = getattr(value, "__name__", "?")
            if inst is not None and inst[0] is value.__self__ and name not in STATE_READS:
                return f"{inst[1]}.{name}", False
        return None

    def random_class(self, cls: type) -> str | None:
        """The label of ``cls`` where it is one of torch's random objects' classes, else ``None``."""
        return next((f"{prefix}.{cls.__name__}" for base, prefix in self.classes if issubclass(cls, base)), None)

    def random_object(self, obj: Any) -> str | None:
        """How ``obj`` draws where it is one of torch's random objects (a module only in training mode, the mode
        every module starts in; an ``nn.Module`` through its submodules too) or one of MindSpore's random
        transforms, else ``None``."""
        if isinstance(obj, type) or not self.draws:
            return None
        transform = _mindspore_random(obj)
        if transform is not None or not self.classes:
            return transform
        made = self.random_class(type(obj))
        if made is not None:
            if not made.startswith("nn."):
                return f"{made} (sampled)"
            return f"{made} (in training mode)" if _training(obj) else None
        module = sys.modules.get("torch.nn.modules.module")
        if module is None or not isinstance(obj, module.Module) or not _training(obj):
            return None
        for sub in itertools.islice(obj.modules(), 1, MAX_SUBMODULES):
            made = self.random_class(type(sub))
            if made and _training(sub):
                return f"{made} inside {type(obj).__name__} (in training mode)"
        return None


def _mindspore_random(obj: Any) -> str | None:
    """MindSpore's random transforms (``vision.RandomCrop``, ``transforms.RandomApply``), called eagerly in a
    dataset's code: each draws from MindSpore's seed in the process that calls it (an audit's dataset cropped
    with a held ``RandomCrop``: 2 workers gave other batches than raw's main process, and others each run)."""
    base = random_mindspore_base(type(obj))
    if base is None or not base.__module__.startswith("mindspore.dataset."):
        return None
    named = f"{base.__module__.rsplit('.', 1)[0]}.{base.__name__}"
    return named if base is type(obj) else f"{named} (as {type(obj).__name__})"  # ``_drawn_from`` reads the head


def _drawn_from(how: str) -> str:
    if how.startswith("mindspore."):
        return "MindSpore's seed"
    return next((f"{owner} global generator" for prefix, owner in (("numpy.random", "numpy's"), ("random.", "random's"))
                 if how.startswith(prefix)), "torch's global generator")


def _training(module: Any) -> bool:
    return getattr(module, "training", False) is True


def _named_draw(draw: _Draw, entry: Any) -> str:
    return draw.label if draw.fn is entry else f"{draw.label} through {draw.fn.__qualname__}"


def _sampler_why(draw: _Draw, plain: bool) -> str:
    if plain and draw.offset is not None:
        return ("(with workers the framework calls this __iter__ twice per epoch, and it runs ahead of the "
                "training loop, which may draw from the same generator)")
    return "per index (with workers it runs ahead of the training loop, which may draw from the same generator)"


def _user(fn: Any) -> bool:
    """Python code of the program (not a framework's, a data library's or the standard library's)."""
    return isinstance(fn, types.FunctionType) and _programs(fn)


def _programs(thing: Any) -> bool:
    """Whether ``thing`` (a function, a class) was defined in the program's code (``objects.of_program``)."""
    return objects.of_program(getattr(thing, "__module__", None) or "")


def _function(value: Any) -> Any:
    """The Python function behind a function, method, ``functools.partial``, static or class method."""
    for _ in range(4):
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        else:
            break
    return value


def _entries(obj: Any) -> Iterator:
    """``(where, function, owner)`` for the entry points ``obj``'s class defines in the program's code."""
    cls = type(obj)
    defined = set().union(*(vars(k) for k in cls.__mro__))  # one pass: getattr_static per name is slower
    for name in ENTRY_POINTS:
        if name not in defined:
            continue
        try:
            fn = _function(inspect.getattr_static(cls, name))
        except AttributeError:
            continue
        if _user(fn):
            yield f"{cls.__name__}.{name}", fn, obj


def _held_entries(obj: Any, seen: set) -> Iterator:
    """The entry points of ``obj`` and of the objects it holds as attributes (``HELD_DEPTH`` levels down)."""
    for each in _held(obj, seen):
        yield from _entries(each)


def _held(obj: Any, seen: set, depth: int = 0) -> Iterator:
    """``obj`` and the objects it holds as attributes, ``HELD_DEPTH`` levels down, each once (``seen``)."""
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))) or len(seen) >= MAX_HELD:
        return
    seen.add(id(obj))
    yield obj
    if depth >= HELD_DEPTH:
        return
    for value in _attribute_values(obj):
        items = (value[:HELD_ITEMS] if isinstance(value, (list, tuple)) else
                 list(itertools.islice(value.values(), HELD_ITEMS)) if isinstance(value, dict) else (value,))
        for item in items:
            if getattr(item, "__dict__", None) is not None and not isinstance(item, _NOT_HELD):
                yield from _held(item, seen, depth + 1)


_NOT_HELD = (type, types.FunctionType, staticmethod, classmethod, property)  # code, read where it is called


def _attribute_values(obj: Any) -> list:
    """What ``obj`` holds as attributes: its own, then its classes' in the program's code (``jitter =
    staticmethod(np.random.random_sample)`` on the class, called as ``self.jitter()``: an audit's dataset drew
    for one sample in five, and 2 workers changed every batch where the same attribute set in ``__init__`` was
    found)."""
    attrs = getattr(obj, "__dict__", None)
    found = dict(attrs) if isinstance(attrs, dict) else {}
    if not isinstance(obj, type):
        for cls in type(obj).__mro__:  # the first class to define a name holds it: a subclass's shadows its base's
            if cls is not object and _programs(cls):
                for name, value in vars(cls).items():
                    if not (name.startswith("__") and name.endswith("__")):
                        found.setdefault(name, value)
    return list(found.values())


def _held_random(roots: tuple, targets: _Targets) -> tuple | None:
    """``(owner, how it draws)`` for the first random object (torch's, or a MindSpore random transform) one of
    ``roots`` (the dataset, a ``collate_fn`` object, a map's operations) holds (an ``nn.Dropout`` the code calls
    as ``self.drop(x)``, where the bytecode cannot know ``self``; a held ``Normal`` it samples), or ``None``: held
    in training mode is taken as used, the safe side (the framework's default ``num_workers`` is kept)."""
    for root in roots:
        for obj in _held(root, set()) if root is not None else ():
            found = targets.random_object(obj) or _held_draw(obj, targets)
            if found:
                return root, found
    return None


def _held_draw(obj: Any, targets: _Targets) -> str | None:
    """How ``obj`` draws through a global generator's method or a sampling function it holds as an attribute
    (``self.noise = np.random.normal``, called as ``self.noise()``, where the bytecode cannot know ``self``)."""
    for value in _attribute_values(obj):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, (types.MethodType, types.BuiltinMethodType, types.BuiltinFunctionType)):
            found = targets.label(value)
            if found:
                return f"{found[0]} (held)"
    return None


def _callable_entries(value: Any, prefix: str = "") -> Iterator:
    """The entry points of a function or callable object (its ``__call__``, and what it holds), named with
    ``prefix``."""
    fn = _function(value)
    if fn is None:
        return
    if isinstance(fn, types.FunctionType):
        if _user(fn):
            yield f"{prefix}{getattr(fn, '__qualname__', fn)}", fn, None
    else:  # a callable object: its __call__, and what it holds
        yield from ((f"{prefix}{where}", f, owner) for where, f, owner in _held_entries(fn, set()))


def _codes(code: types.CodeType) -> Iterator:
    """``code`` and the code nested in it (lambdas, comprehensions, inner functions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names(code: types.CodeType) -> Iterator:
    for each in _codes(code):
        yield from each.co_names


def _walk(fn: Any, owner: Any, seen: set, count: list, look: Callable) -> Any:
    """What ``look(fn)`` finds in ``fn`` or in what it names (its owner's methods, its module's functions) or
    resolves to (``(function, owner)`` pairs: a function reached through a module or a closure)."""
    code = getattr(fn, "__code__", None)
    if code is None or code in seen or count[0] >= MAX_CODES:
        return None
    seen.add(code)
    count[0] += 1
    found, resolved = look(fn, owner)
    if found:
        return found
    names = set(_names(code))
    held = _held_named(owner, names)
    of_modules = functools.cache(lambda: _module_attributes_only(code, fn))  # read where a name matches only
    named = (pair for name in names for pair in _named(name, fn, owner, held) if name not in of_modules())
    for target, target_owner in itertools.chain(resolved, named):
        found = _walk(target, target_owner, seen, count, look)
        if found:
            return found
    return None


def _module_attributes_only(code: types.CodeType, fn: Any) -> set:
    """The names ``code`` reads only as an attribute of a module it names (``load`` of ``torch.load(path)``):
    never its owner's method nor a module function, though one of the program's has the name (an audit: a
    dataset's own ``load()``, which builds its index, was taken for what ``torch.load`` called, and its write of
    ``self.files`` kept the loader's workers at 0)."""
    globals_ = getattr(fn, "__globals__", {})
    only, elsewhere = set(), set()
    for each in _codes(code):
        before = None
        for instr in dis.get_instructions(each):
            if instr.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                of_module = before is not None and before.opname == "LOAD_GLOBAL" and \
                    isinstance(globals_.get(before.argval), types.ModuleType)
                (only if of_module else elsewhere).add(instr.argval)
            elif instr.opname.startswith("LOAD_") and isinstance(instr.argval, str):  # super().x on 3.12 too
                elsewhere.add(instr.argval)
            before = instr
    return only - elsewhere


def _name_look(fn: Any, owner: Any = None) -> tuple:
    names = set(_names(fn.__code__))
    return next((name for name in NAMES if name in names), None), ()


def _held_named(owner: Any, names: set) -> list:
    """The objects of the program's classes ``owner`` holds under a name the code reads (``self.crop`` of
    ``self.crop.random_crop(x)``): their methods are what such names may call."""
    attrs = getattr(owner, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    return [value for key, value in attrs.items() if key in names and not isinstance(value, type)
            and getattr(value, "__dict__", None) is not None and _programs(type(value))]


def _named(name: str, fn: Any, owner: Any, held: list = ()) -> Iterator:
    """The program's functions ``name`` may stand for in ``fn``: a method of its owner or of an object it holds
    under a name the code reads (an audit's ``self.crop.random_crop(x)`` drew ``random.randint`` for the images
    larger than the crop only, none of the probe's: ms_shm added workers and every run's crops differed), a
    module function."""
    for obj in ((owner,) if owner is not None else ()) + tuple(held):
        if any(name in vars(cls) for cls in type(obj).__mro__):  # getattr_static is slower
            try:
                method = _function(inspect.getattr_static(type(obj), name))
            except AttributeError:
                method = None
            if _user(method):
                yield method, obj
    value = getattr(fn, "__globals__", {}).get(name)
    if _user(_function(value)):
        yield _function(value), None
    elif isinstance(value, (dict, list, tuple)):
        yield from _registered(value)


def _registered(registry: Any) -> Iterator:
    """``(function, owner)`` for the program's functions and bound methods a global dict, list or tuple holds,
    the first ``HELD_ITEMS``: a registry the code calls into by key (``AUGS[name](x)``; an audit's drew
    ``np.random.normal`` for 2 samples of 16, unseen, and 2 workers drew them from their own seeds)."""
    stored = objects.as_stored(registry)  # never a subclass's own reads: the program's code
    for value in itertools.islice(stored.values() if isinstance(stored, dict) else stored, HELD_ITEMS):
        function = _function(value)
        if _user(function):
            yield function, value.__self__ if isinstance(value, types.MethodType) else None


# --- global draws, read from the bytecode ------------------------------------------------------------------


def _draw_look(targets: _Targets, entry: Any, fn: Any, owner: Any = None) -> tuple:
    """The first global draw in ``fn``'s code (or code nested in it), and the program's functions it resolves.

    ``entry``: a sampler's generator ``__iter__``, whose draws before the loop that yields are per epoch, as
    torch's ``RandomSampler``'s are, and not counted (the audit's samplers draw inside the loop); ``None`` for the
    dataset, the collate and a plain ``__iter__`` of the index sampler, where every draw counts."""
    cells = _cells(fn)
    resolved: list = []
    for code in _codes(fn.__code__):
        if not _worth_reading(code, fn.__globals__, cells):
            continue
        mine = owner if code is fn.__code__ else None  # ``self`` is its first argument there
        for label, offset, value in _scan(code, fn.__globals__, cells, targets, mine):
            if value is not None:
                resolved.append(value)
                continue
            own = offset if code is fn.__code__ else None
            if fn is entry and own is not None and _before_loop(code, own):
                continue
            return _Draw(label, fn, own), ()
    return None, resolved


def _worth_reading(code: types.CodeType, globals_: dict, cells: dict) -> bool:
    """Whether ``code`` can reach a global draw or a function through a chain: it names a tensor method's draw, an
    import, or a global or closure value that is a module, a class, a draw, a function or a program's object.

    Most of a dataset's methods do not (``self.transform(self._load(i))``), and disassembling is the walk's main
    cost: skipping those halved it on an image dataset with a 4-transform Compose (1.4 to 0.7 ms on 3.11)."""
    if not TENSOR_DRAWS.isdisjoint(code.co_names):
        return True
    values = itertools.chain((globals_.get(name) for name in code.co_names),
                             (cells.get(name) for name in code.co_freevars))
    if any(isinstance(value, (types.ModuleType, type, types.FunctionType, types.MethodType,
                              types.BuiltinMethodType, functools.partial)) or _program_object(value)
           for value in values):
        return True
    return any(name.partition(".")[0] in sys.modules for name in code.co_names)  # an import inside the function


def _program_object(value: Any) -> bool:
    """An instance of a class of the program (a module-level transform object), whose methods may draw."""
    return _programs(type(value)) and getattr(value, "__dict__", None) is not None


def _cells(fn: Any) -> dict:
    """``fn``'s closure by name (an empty cell, not yet assigned, is left out)."""
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:
            continue
    return cells


def _scan(code: types.CodeType, globals_: dict, cells: dict, targets: _Targets, owner: Any = None) -> Iterator:
    """``(label, offset, None)`` for each global draw in ``code`` and ``(None, None, (function, owner))`` for
    each program function an attribute chain resolves to (with its object: a bound method, a held transform).

    A chain starts at a global, a closure cell, a local bound by an import or by another chain, or an import,
    and goes on through ``LOAD_ATTR`` / ``LOAD_METHOD`` (3.12's method form included: ``argval`` is the name).
    Any other instruction ends it, so ``np.random.default_rng(i).random`` is a chain ended by the call. What a
    chain ends on is judged then, unless it is stored: ``from torch import randint`` is judged where the local
    is loaded, at the call that may pass ``generator=``. ``owner``: the object ``code``'s first argument is
    bound to (a method's ``self``), whose attribute passed as ``generator=`` may be ``None``."""
    ins = list(dis.get_instructions(code))
    local: dict = {}
    module: Any = _UNKNOWN
    pending = None  # (value, index where its load started) of the chain on top of the stack
    for i, instr in enumerate(ins):
        op, name = instr.opname, instr.argval
        if op in ("LOAD_ATTR", "LOAD_METHOD"):
            parent, start, depth = pending + (0,) if pending else (_UNKNOWN, i, 1)  # 1: a result is below
            if targets.draws and name in TENSOR_DRAWS and not _foreign_module(parent) \
                    and not _passes_generator(ins, start, code, depth, owner):
                yield f"Tensor.{name}", instr.offset, None
            drawn = targets.random_object(parent) if parent is not _UNKNOWN else None
            if drawn:  # a method of a module-level random object: ``NOISE.sample()``
                yield drawn, instr.offset, None
            pending = (_attr(parent, name, targets), start)
            continue
        if pending and not (op in _STORES and isinstance(name, str)):
            yield from _judge(pending[0], targets, ins, pending[1], code, ins[i - 1].offset, owner)
        value = _loaded(op, name, globals_, cells, local, module, targets)
        if op in _STORES:
            for each in (name,) if isinstance(name, str) else name if isinstance(name, tuple) else ():
                local[each] = pending[0] if pending and isinstance(name, str) else _UNKNOWN
        if op == "IMPORT_NAME":
            value = module = _imported(name, ins, i, globals_)
        pending = (value, i) if value is not None else None
    if pending:
        yield from _judge(pending[0], targets, ins, pending[1], code, ins[-1].offset, owner)


def _loaded(op: str, name: Any, globals_: dict, cells: dict, local: dict, module: Any, targets: _Targets) -> Any:
    """What a chain-starting instruction loads (``_UNKNOWN`` when it cannot be known), ``None`` for any other
    instruction. 3.13's paired ``LOAD_FAST_LOAD_FAST`` / ``STORE_FAST_LOAD_FAST`` load their second name."""
    if op in ("LOAD_GLOBAL", "LOAD_NAME"):
        return _global(globals_, name)
    if op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
        return cells.get(name, _UNKNOWN)
    if op.startswith("LOAD_FAST") or op == "STORE_FAST_LOAD_FAST":
        name = name[-1] if isinstance(name, tuple) and name else name
        return local.get(name, _UNKNOWN) if isinstance(name, str) else _UNKNOWN
    if op == "IMPORT_FROM":
        return _attr(module, name, targets)
    return _UNKNOWN if op == "IMPORT_NAME" else None


def _judge(value: Any, targets: _Targets, ins: list, start: int, code: types.CodeType, offset: int,
           owner: Any = None) -> Iterator:
    if value is _UNKNOWN:
        return
    if isinstance(value, _NotImported):
        package, _, name = value.path.rpartition(".")
        if package == "numpy.random" and name in NUMPY_LEGACY:
            yield value.path, offset, None
        return
    label = targets.label(value)
    if label is not None:
        if not (label[1] and _passes_generator(ins, start, code, 0, owner)):
            yield label[0], offset, None
        return
    fn = _function(value)
    if _user(fn):
        yield None, None, (fn, getattr(value, "__self__", None) if isinstance(value, types.MethodType) else None)
    elif not isinstance(value, (types.ModuleType, type)) and getattr(value, "__dict__", None) is not None:
        for _, method, owner in _entries(value):  # a module-level transform object: ``AUG(x)``
            yield None, None, (method, owner)


def _global(globals_: dict, name: str) -> Any:
    if name in globals_:
        return globals_[name]
    builtins = globals_.get("__builtins__")
    space = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
    return space.get(name, _UNKNOWN) if isinstance(space, dict) else _UNKNOWN


def _imported(name: str, ins: list, i: int, globals_: dict) -> Any:
    """The module ``IMPORT_NAME`` pushes: the named one with a ``from`` list, else the top package (``import
    numpy.random`` binds ``numpy``); its name if its package is imported but it is not yet. Nothing is imported
    here."""
    fromlist = ins[i - 1].argval if i >= 1 else None
    level = ins[i - 2].argval if i >= 2 else 0
    if isinstance(level, int) and level > 0:
        try:
            name = importlib.util.resolve_name("." * level + (name or ""), globals_.get("__package__"))
        except (ImportError, ValueError):
            return _UNKNOWN
    name = name if fromlist else name.split(".")[0]
    if name in sys.modules:
        return sys.modules[name]
    return _NotImported(name) if name.split(".")[0] in sys.modules else _UNKNOWN


def _attr(obj: Any, name: str, targets: _Targets) -> Any:
    """``obj.name`` as far as it can be known without running code: a module's own attribute, an imported
    submodule or the name of one not imported yet (a module's ``__getattr__`` is not called: it may import), a
    global generator's bound method, or what the class defines (``getattr_static``: no property runs)."""
    if obj is _UNKNOWN:
        return _UNKNOWN
    if isinstance(obj, _NotImported):
        return _NotImported(f"{obj.path}.{name}")
    if isinstance(obj, types.ModuleType):
        value = vars(obj).get(name, _UNKNOWN)
        if value is _UNKNOWN:
            path = f"{getattr(obj, '__name__', '')}.{name}"
            value = sys.modules.get(path, _NotImported(path))
        return value
    if id(obj) in targets.instances:
        return getattr(obj, name, _UNKNOWN)
    try:
        return inspect.getattr_static(obj, name)
    except AttributeError:
        return _UNKNOWN


def _foreign_module(obj: Any) -> bool:
    """A module other than torch's: its ``normal_`` is not a tensor's (``torch.nn.init.normal_`` is)."""
    return isinstance(obj, types.ModuleType) and not getattr(obj, "__name__", "").startswith("torch")


def _passes_generator(ins: list, start: int, code: types.CodeType, depth: int, owner: Any = None) -> bool:
    """Whether the call that consumes the callable loaded from ``ins[start]`` passes a ``generator`` keyword that
    is not ``None``: ``generator=None``, or ``generator=self.g`` where ``owner`` (``self``) holds ``None`` there,
    draws from the default generator (an audit's ``torch.rand(3, generator=self.g)``, ``g`` a seed left unset).

    Approximation: the stack depth is followed linearly from ``start`` (``dis.stack_effect``, not taking
    jumps), and the call is the first one after which only its result is left; a conditional expression among
    the arguments can miss it, which counts as a draw (the safe side: the default ``num_workers`` is kept)."""
    for j in range(start, len(ins)):
        instr = ins[j]
        depth += _effect(instr)
        if instr.opname in _CALLS and depth <= 1:
            names = _keywords(ins, j, code)
            return "generator" in names and not _none_argument(
                _argument(ins, j, len(names) - 1 - names.index("generator")), code, owner)
        if depth < 1 and j > start:
            return False
    return False


def _argument(ins: list, j: int, later: int) -> list:
    """The instructions that push the argument of the call at ``ins[j]`` that has ``later`` arguments after it
    (the keyword names' ``KW_NAMES`` / ``PRECALL`` / ``LOAD_CONST`` skipped); each argument is the shortest run
    of instructions, read backwards, that pushes one value. Empty where that cannot be told."""
    end = j - 1
    while end >= 0 and (ins[end].opname in ("KW_NAMES", "PRECALL") or (
            ins[end].opname == "LOAD_CONST" and isinstance(ins[end].argval, tuple) and end == j - 1
            and ins[j].opname in ("CALL_FUNCTION_KW", "CALL_KW"))):
        end -= 1
    span: list = []
    for _ in range(later + 1):
        pushed, k = 0, end
        while k >= 0 and pushed < 1:
            pushed += _effect(ins[k])
            k -= 1
        if pushed != 1:
            return []
        span, end = ins[k + 1:end + 1], k
    return span


def _none_argument(span: list, code: types.CodeType, owner: Any) -> bool:
    """Whether the argument ``span`` pushes is ``None`` or the default generator as far as can be told: a constant
    ``None``, ``torch.default_generator`` (the global one: an audit's ``generator=torch.default_generator``, 2
    workers, other batches than raw's), or an attribute of ``self`` that ``owner`` holds as ``None`` now."""
    if span and span[-1].opname in _LOADS and span[-1].argval == "default_generator":
        return True
    if len(span) == 1:
        return span[0].opname == "LOAD_CONST" and span[0].argval is None
    if len(span) != 2 or owner is None or not code.co_argcount:
        return False
    this, attr = span
    if not (this.opname == "LOAD_FAST" and this.argval == code.co_varnames[0] and attr.opname == "LOAD_ATTR"
            and isinstance(attr.argval, str)):
        return False
    try:
        return inspect.getattr_static(owner, attr.argval) is None
    except AttributeError:
        return False


_LOADS = ("LOAD_ATTR", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_METHOD")


def _effect(instr: dis.Instruction) -> int:
    try:
        if instr.opcode < dis.HAVE_ARGUMENT:
            return dis.stack_effect(instr.opcode)
        return dis.stack_effect(instr.opcode, instr.arg or 0, jump=False)
    except (ValueError, TypeError):
        return 0


def _keywords(ins: list, j: int, code: types.CodeType) -> tuple:
    """The keyword names of the call at ``ins[j]``: a ``LOAD_CONST`` tuple before ``CALL_FUNCTION_KW`` (3.9) or
    ``CALL_KW`` (3.13), a ``KW_NAMES`` before ``CALL`` (3.11, with ``PRECALL`` between; 3.12), whose
    ``argval`` 3.11 leaves unresolved, hence ``co_consts``."""
    for back in ins[max(0, j - 2):j][::-1]:
        if back.opname == "KW_NAMES" and back.arg is not None and back.arg < len(code.co_consts):
            names = code.co_consts[back.arg]
            return names if isinstance(names, tuple) else ()
        if back.opname == "LOAD_CONST" and ins[j].opname in ("CALL_FUNCTION_KW", "CALL_KW"):
            return back.argval if isinstance(back.argval, tuple) else ()
    return ()


def _generator(fn: Any) -> bool:
    return bool(fn.__code__.co_flags & inspect.CO_GENERATOR)


def _before_loop(code: types.CodeType, offset: int) -> bool:
    """A draw in a generator ``__iter__`` outside every loop that yields: it runs once, when the epoch's first
    index is asked for, which with and without workers comes before the loop's first batch; in a plain
    ``__iter__`` (not a generator) it runs once per call: ``_draw_look``'s caller decides. A loop is a backward
    jump's range (``JUMP_ABSOLUTE`` on 3.9, ``JUMP_BACKWARD`` on 3.11+); ``yield from``'s own ``SEND`` loop
    starts after what it is given, so a ``yield from torch.randperm(n).tolist()`` is per epoch."""
    ins = list(dis.get_instructions(code))
    yields = [i.offset for i in ins if i.opname in ("YIELD_VALUE", "YIELD_FROM")]
    for instr in ins:
        target = instr.argval
        if (instr.opcode in dis.hasjrel or instr.opcode in dis.hasjabs) and isinstance(target, int) \
                and target < instr.offset and target <= offset <= instr.offset \
                and any(target <= y <= instr.offset for y in yields):
            return False
    return True


__all__ = ["worker_info_use", "global_draw", "stage_draw", "stage_writes", "NAMES", "MAX_CODES"]
