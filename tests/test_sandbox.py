"""``ms_shm.sandbox``: what a probe's reads changed in the process. Pure (torch where installed)."""

from __future__ import annotations

import ast
import collections
import functools
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from ms_shm import measure, sandbox
from ms_shm.rows import RowError
from tests import isolated


def draw_random():
    return random.random()


def draw_numpy():
    return np.random.random()


def own_generator():
    return np.random.default_rng(3).random()  # a generator of its own: the same rows in any worker


@pytest.mark.parametrize("run, draws", [(draw_random, True), (draw_numpy, True), (own_generator, False)])
def test_draws_from_the_global_generators_are_seen_and_a_local_generator_is_not(run, draws):
    _, effects = sandbox.watch_effects(run, [])
    assert bool(effects.order_dependent) == draws, effects


def test_draws_from_torchs_global_generator_are_seen():
    torch = pytest.importorskip("torch")
    _, effects = sandbox.watch_effects(lambda: torch.rand(1), [])
    assert effects.order_dependent, effects


def test_numpy_random_is_imported_in_the_parent_once_not_in_every_fork():
    """NumPy 2 imports numpy.random on first use (11-22 ms) and the child reads its state: the parent imports it."""
    code = ("import sys; from ms_shm import sandbox; before = 'numpy.random' in sys.modules; "
            "sandbox.run_in_fork(lambda: 1); print(before, 'numpy.random' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "True", out


def test_the_child_holds_its_pair_until_the_parents_meanwhile_returns():
    """The parent's read of the host runs beside the child's first reads; a pair of threads timed at once must not
    share the CPUs with it, so ``wait_for_parent`` returns only once it is done (one clock: CLOCK_MONOTONIC)."""
    import time

    done = []

    def meanwhile():
        time.sleep(0.2)
        done.append(time.monotonic())

    def child():
        started = time.monotonic()
        sandbox.wait_for_parent()
        return started, time.monotonic()

    outcome = sandbox.run_in_fork(child, meanwhile=meanwhile)
    started, released = outcome.value
    assert done and released >= done[0] > started, (started, released, done)


def test_the_probe_child_is_forked_and_reaped_by_a_thread_of_its_own():
    """The kernel sends a child's SIGCHLD to the thread that forked it: a probe child forked by the main thread
    ended while that thread forked MindSpore's workers, whose SIGCHLD handler deadlocks inside a fork (MindSpore's
    test_reset.py under patch hung 4 runs of 4). The child is forked by ``ms_shm-probe`` and reaped there: no
    zombie is left, and the caller's thread is not its parent."""
    import threading

    outcome = sandbox.run_in_fork(lambda: (threading.current_thread().name, os.getpid()))
    name, pid = outcome.value
    assert name == "ms_shm-probe", name
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # its exit, then the thread's waitpid
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{pid}"), open(f"/proc/{pid}/stat").read()


def test_a_failing_meanwhile_does_not_fail_the_probe_and_without_one_the_child_never_waits():
    import time

    def broken():
        raise OSError("no /proc")

    def child():
        t0 = time.monotonic()
        sandbox.wait_for_parent()
        return time.monotonic() - t0

    outcome = sandbox.run_in_fork(child, meanwhile=broken)
    assert outcome.error is None and outcome.beside is None
    waited = sandbox.run_in_fork(child).value
    assert waited < 1.0, waited  # no gate: at once (GATE_SECONDS is 5)


def test_meanwhile_comes_back_to_the_parent():
    """The code read beside the child is the parent's to keep (``Outcome.beside``)."""
    outcome = sandbox.run_in_fork(lambda: 1, meanwhile=lambda: "code read")
    assert (outcome.value, outcome.beside) == (1, "code read")


# --- generators held at any depth, and state kept per read -------------------------------------------------

MODULE_RNG = np.random.default_rng(7)  # a module-level generator, as a script keeps one


class Flip:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, x):
        return x[::-1] if self.rng.random() < 0.5 else x


class Augmented:
    """A dataset whose generator is two levels down: ``self.transforms[0].rng``."""

    def __init__(self):
        self.transforms = [Flip(1)]

    def __getitem__(self, i):
        return self.transforms[0](np.arange(4) + i)


class Wrapper:  # torch's Subset: the dataset that draws is an attribute of the one the loader holds
    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, i):
        return self.dataset[i]


class ModuleDrawing:
    def __getitem__(self, i):
        return MODULE_RNG.random() + i


def closure_drawing():
    rng = np.random.default_rng(5)

    def op(x):
        return x + rng.random()
    return op


@pytest.mark.parametrize("make, where", [
    (lambda: Augmented(), "transforms"),
    (lambda: Wrapper(Augmented()), "dataset.transforms"),
    (lambda: ModuleDrawing(), "MODULE_RNG"),
    (lambda: closure_drawing(), "rng"),
])
def test_a_generator_held_at_any_depth_is_seen(make, where):
    obj = make()
    read = (lambda: obj(1.0)) if callable(obj) and not hasattr(obj, "__getitem__") else (lambda: obj[1])
    _, effects = sandbox.watch_effects(read, [obj])
    assert effects.draws_random and where in effects.draws_random, effects


def test_a_torch_generator_held_by_the_dataset_is_seen():
    torch = pytest.importorskip("torch")

    class TorchDrawing:
        def __init__(self):
            self.g = torch.Generator().manual_seed(123)

        def __getitem__(self, i):
            return torch.rand(2, generator=self.g)

    obj = TorchDrawing()
    _, effects = sandbox.watch_effects(lambda: obj[0], [obj])
    assert effects.draws_random and ".g" in effects.draws_random, effects


def test_a_generator_the_rows_read_did_not_draw_from_still_counts():
    """A random crop only for images larger than the crop: the rows the probe read drew nothing, others do (an
    audit: ``ms-shm run`` changed a DataLoader's workers, and 3 of 4 batches, on such a dataset)."""

    class CropsSome:
        def __init__(self):
            self.rng = np.random.default_rng(0)

        def __getitem__(self, i):
            return i + (self.rng.random() if i % 4 in (1, 2) else 0.0)

    obj = CropsSome()
    _, effects = sandbox.watch_effects(lambda: [obj[0], obj[3]], [obj])
    assert effects.draws_random and "rng" in effects.draws_random and effects.order_dependent, effects


class _Part:
    def __init__(self, **held):
        self.__dict__.update(held)


def test_a_generator_and_a_file_held_six_levels_down_are_seen(tmp_path):
    """Composed objects hold theirs deep: an audit's ``src.sub.base.datasets[0].reader.fh`` and
    ``src.cfg.transform.transforms[0].t.rng`` went unseen at 4 levels (2 threads raced on the file's offset, and
    drew in another order)."""
    path = tmp_path / "records"
    path.write_bytes(b"x" * 64)
    with open(path, "rb") as handle:
        reader = _Part(fh=handle)
        source = _Part(sub=_Part(base=_Part(datasets=[_Part(reader=reader)])),
                       cfg=_Part(transform=_Part(transforms=[_Part(t=_Part(rng=np.random.default_rng(0)))])))
        assert "sub.base.datasets[0].reader.fh" in sandbox.held_handles([source])
        assert [w for w, _ in sandbox.held_generators([source])] == ["_Part.cfg.transform.transforms[0].t.rng"]


def test_a_shallow_handle_is_seen_behind_a_deep_branch_that_fills_the_walk(tmp_path):
    """The walk goes level by level: a deep branch met first cannot use up its bound before a shallow one."""
    deep = _Part(a=[_Part(**{f"x{j}": _Part(m=j) for j in range(10)}) for k in range(60)])  # 660 objects
    with open(tmp_path / "f", "wb") as handle:
        source = _Part(deep=deep, fh=handle)
        assert "fh" in (sandbox.held_handles([source]) or ""), sandbox.held_handles([source])


def test_a_generator_or_state_in_another_module_of_the_program_is_seen(monkeypatch):
    """``myaug.jitter(x)`` drawing from ``myaug._RNG``, ``vocab.VOCAB.encode(words)`` growing a vocabulary: a
    module of the program the code names is looked into, at the names the code uses (workers drew and numbered
    apart in an audit, and the program's vocabulary stayed empty)."""
    import types

    aug = types.ModuleType("program_aug_for_test")
    exec("import numpy as np\n_RNG = np.random.default_rng(0)\n"
         "def jitter(x, i):\n    return x + (_RNG.random() if i % 16 == 7 else 0.0)\n"
         "class Vocab:\n    def __init__(self):\n        self.ids = {}\n"
         "    def encode(self, w):\n        return self.ids.setdefault(w, len(self.ids))\n"
         "VOCAB = Vocab()\n", aug.__dict__)
    monkeypatch.setitem(sys.modules, aug.__name__, aug)
    scope = {"aug": aug}
    exec("def read(i):\n    return aug.jitter(float(i), i)\n"
         "def encode(i):\n    return aug.VOCAB.encode(str(i))\n", scope)
    read, encode = scope["read"], scope["encode"]
    assert [w for w, _ in sandbox.held_generators([read])] == ["function.<global aug>.jitter.<global _RNG>"]
    _, effects = sandbox.watch_effects(lambda: [encode(0), sandbox.first_read_done(), encode(1)], [encode])
    assert effects.state_per_read and "VOCAB.ids" in effects.state_per_read, effects
    numpy_only = {"np": np}
    exec("def draws(i):\n    return np.random.random()\n", numpy_only)  # numpy's own module: not walked
    assert sandbox.held_generators([numpy_only["draws"]]) == []


def test_a_handle_the_probe_closed_is_still_the_programs(tmp_path):
    """A lazy loader reads its file to the end and closes it on its first read: in the program the file is
    open, and 2 threads would each read it on their first row at once."""
    path = tmp_path / "blob"
    path.write_bytes(b"y" * 4096)

    class Lazy:
        def __init__(self):
            self.f = open(path, "rb")
            self.data = None

        def __getitem__(self, i):
            if self.data is None:
                self.data = self.f.read()
                self.f.close()
            return self.data[i]

    lazy = Lazy()
    try:
        _, effects = sandbox.watch_effects(lambda: lazy[0], [lazy])
        assert effects.holds_handle and "Lazy.f" in effects.holds_handle, effects
        assert effects.mode_bound == effects.holds_handle
    finally:
        lazy.f.close()


def test_an_array_array_that_grows_or_changes_is_state():
    import array

    values = array.array("q", [0] * 8)
    before = sandbox.state_of([values])
    values[3] += 1
    changed = sandbox.state_of([values])
    values.append(1)
    assert len({before, changed, sandbox.state_of([values])}) == 3


def test_a_big_list_or_dict_is_looked_into_at_a_few_items_spread_over_it():
    """Mostly data, but one of many alike holds what the others do (an audit: 100 shard readers under a
    ``ConcatDataset``, each with its open file, and two threads of ms_shm's racing on their offsets)."""
    size = sandbox._WALK_ITEMS + 1
    generators = [np.random.default_rng(k) for k in range(size)]
    found = [where for where, _ in sandbox.held_generators([generators])]
    assert found[0] == "list[0]" and found[-1] == f"list[{size - 1}]" and len(found) == sandbox._WALK_SPREAD, found
    by_name = {f"shard{k}": g for k, g in enumerate(generators)}
    found = [where for where, _ in sandbox.held_generators([by_name])]
    assert found == ["dict['shard0']", "dict['shard1']", "dict['shard2']", "dict['shard3']", "dict['shard64']",
                     "dict['shard63']", "dict['shard62']", "dict['shard61']"], found
    values = sandbox._reach([list(range(1_000_000))])
    assert len(values) == 1 + sandbox._WALK_SPREAD, values[:3]


class Counter:
    def __init__(self):
        self.calls = 0

    def __getitem__(self, i):
        self.calls += 1
        return i


class Lazy:
    def __init__(self):
        self.table = None

    def __getitem__(self, i):
        if self.table is None:
            self.table = list(range(10))
        return self.table[i]


class Vocabulary:
    """Numbers each new word as it meets it: reading row 0 again changes nothing, a new row does."""

    def __init__(self):
        self.ids = {}

    def __getitem__(self, i):
        return [self.ids.setdefault(word, len(self.ids)) for word in f"the doc{i} was good".split()]


@pytest.mark.parametrize("cls, per_read", [(Counter, True), (Lazy, False), (Vocabulary, True)])
def test_state_changed_on_every_read_is_told_from_lazy_set_up(cls, per_read):
    """``first_read_done`` marks the state after the first read: a vocabulary built on the fly changed nothing
    when row 0 was read again, and was taken for lazy set-up (an audit: planned as 2 worker processes, each
    numbering the words anew)."""
    obj = cls()

    def reads():
        first = obj[0]
        sandbox.first_read_done()
        return [first] + [obj[i] for i in (1, 2)]

    _, effects = sandbox.watch_effects(reads, [obj], again=lambda: obj[0])
    assert effects.mutates_state and not effects.order_dependent, effects
    assert bool(effects.state_per_read) == per_read, effects
    sandbox.first_read_done()  # outside a watch: nothing to mark, nothing raised


def test_a_probe_child_leaves_the_parents_files_and_pipes_as_they_were(tmp_path):
    """A file read in the child shares its offset with the parent: rewound after; a pipe reads as empty there."""
    import os

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 16)
    handle = open(path, "rb")
    handle.read(10)
    read_end, write_end = os.pipe()
    os.write(write_end, b"for the parent")

    def probe():
        handle.seek(1000)
        return len(handle.read(100)), os.read(read_end, 100), sandbox.blinded()

    try:
        outcome = sandbox.run_in_fork(probe)
        assert outcome.error is None, outcome.remote_traceback
        got, piped, blinded = outcome.value
        assert got == 100 and piped == b"" and any("pipe" in b for b in blinded), outcome.value
        assert handle.tell() == 10 and os.lseek(handle.fileno(), 0, os.SEEK_CUR) == len(path.read_bytes())
        assert os.read(read_end, 100) == b"for the parent"
    finally:
        handle.close()
        os.close(read_end)
        os.close(write_end)


def test_a_probe_that_reads_a_file_to_its_end_and_closes_it_leaves_the_parents_position(tmp_path):
    """PIL's ``Image.open`` then ``load()``, or a lazy loader: the child's read and close would leave the shared
    offset at the end, and the parent's own read would find nothing."""

    path = tmp_path / "records"
    path.write_bytes(bytes(range(256)) * 300)
    handle = open(path, "rb", buffering=0)
    header = handle.read(16)

    def probe():
        rest = handle.read()
        handle.close()
        return len(rest)

    try:
        outcome = sandbox.run_in_fork(probe)
        assert outcome.error is None and outcome.value == 256 * 300 - 16, outcome
        assert header + handle.read() == path.read_bytes()
    finally:
        handle.close()


SHARED_SEMAPHORE = None  # set by the test below: a module global a function's code names


def _waits_on_the_global(x):
    SHARED_SEMAPHORE.acquire()
    return x


def test_what_a_fork_shares_with_the_program_is_found_at_any_depth(monkeypatch):
    import multiprocessing as mp
    from multiprocessing import shared_memory

    class Counting:
        def __init__(self):
            self.count = mp.Value("i", 0)

    class Holding:
        def __init__(self, inner):
            self.parts = [inner]

    monkeypatch.setattr(sys.modules[__name__], "SHARED_SEMAPHORE", mp.Semaphore(0))
    block = shared_memory.SharedMemory(create=True, size=64)
    try:
        cases = [(Counting(), "Counting.count", "Synchronized"), (Holding(Counting()), "Holding.parts[0].count", ""),
                 (_waits_on_the_global, "<global SHARED_SEMAPHORE>", "Semaphore"),
                 (Holding(mp.RawArray("d", 4)), "parts[0]", ""), (Holding(mp.Queue()), "parts[0]", "Queue"),
                 (Holding(block), "parts[0]", "SharedMemory")]
        for obj, where, kind in cases:
            why = sandbox.shared_with_processes([obj])
            assert why is not None and where in why and kind in why and "shared with other processes" in why, why
    finally:
        block.close()
        block.unlink()
    assert sandbox.shared_with_processes([Holding(np.arange(4)), closure_drawing(), Augmented()]) is None


def test_open_handles_a_source_holds_are_named_and_closed_ones_are_not(tmp_path):
    import io as _io

    class Holding:
        def __init__(self, inner):
            self.parts = [inner]

    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8)
    handle = open(path, "rb")
    try:
        assert "Holding.parts[0] is a _io.BufferedReader, open" in sandbox.held_handles([Holding(handle)])
        assert "BytesIO" in sandbox.held_handles([Holding(_io.BytesIO(b"abc"))])
    finally:
        handle.close()
    assert sandbox.held_handles([Holding(handle)]) is None  # closed: nothing to share
    assert sandbox.held_handles([Holding(np.arange(4)), Augmented()]) is None


def test_a_thread_pool_the_source_holds_keeps_it_out_of_a_probe_fork():
    from concurrent.futures import ThreadPoolExecutor

    class Holding:
        def __init__(self):
            self.pool = ThreadPoolExecutor(1)

    obj = Holding()
    try:
        why = sandbox.shared_with_processes([obj])
        assert why is not None and "ThreadPoolExecutor" in why and "nothing is read ahead" in why
    finally:
        obj.pool.shutdown()


def test_the_standard_streams_and_a_logger_are_not_a_readers_handle():
    import logging
    import tempfile

    class Logs:
        def __init__(self):
            self.out, self.log = sys.stdout, logging.getLogger("ms_shm.test.handles")
            self.log.addHandler(logging.StreamHandler(sys.stderr))
            self.log.addHandler(logging.FileHandler(path))  # its writes hold the handler's lock

    path = tempfile.mktemp()
    holder = Logs()
    try:
        assert sandbox.held_handles([holder]) is None
    finally:
        for handler in holder.log.handlers:
            handler.close()
        holder.log.handlers.clear()
        os.unlink(path)


@pytest.mark.parametrize("event, args, expected", [
    ("open", ("/data/x.npy", "xb", 0), "create '/data/x.npy' (exclusively: a second creation fails)"),
    ("open", ("/data/x.npy", None, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "create '/data/x.npy' (exclusively: a "
                                                                          "second creation fails)"),
    ("open", ("/data/x.log", "a", 0), None),  # a log line: allowed, or every logging source goes unmeasured
    ("open", ("/data/x.npy", "wb", 0), None),
    ("open", ("/data/x.npy", "rb", 0), None),
    ("open", ("/data/x.npy", None, os.O_WRONLY | os.O_CREAT), None),
    ("open", (7, "xb", 0), None),  # a descriptor the program already holds
    ("open", ("/src/__pycache__/m.cpython-311.pyc.123", "xb", 0), None),  # bytecode cache
    ("os.remove", ("/data/x.npy", -1), "remove '/data/x.npy'"),
    ("os.remove", (os.path.join(__import__("tempfile").gettempdir(), "tmpk3x9"), -1), None),  # a scratch file
    ("os.rename", ("/data/a", "/data/b", -1, -1), "rename '/data/a'"),
    ("os.mkdir", ("/", 0o777, -1), None),  # there already: makedirs(exist_ok=True) changes nothing
    ("os.mkdir", ("/data/new-dir-ms-shm", 0o777, -1), "mkdir '/data/new-dir-ms-shm'"),
    ("socket.connect", (None, ("host", 80)), None),  # reads over the network stay allowed
    ("subprocess.Popen", ("ffmpeg", ["ffmpeg"], None, None), None),
])
def test_file_changes_a_probe_would_make_are_told_from_reads(event, args, expected):
    from ms_shm import outside

    assert outside.describe(event, args) == expected


def test_a_probe_that_would_write_a_file_writes_nothing_and_is_not_measured(tmp_path):
    target = tmp_path / "0.npy"

    def saves():
        with open(target, "xb") as f:
            f.write(b"x")
        return 1

    out = sandbox.run_in_fork(saves)
    assert out.unavailable and repr(str(target)) in out.unavailable and "cannot take back" in out.unavailable
    assert not target.exists()
    caught = sandbox.run_in_fork(lambda: _swallowing_write(target))  # a write the code itself catches
    assert caught.unavailable and not target.exists()
    assert sandbox.run_in_fork(lambda: (tmp_path.mkdir(exist_ok=True), open(__file__).read(1))[1]).value == '"'


def _scratch_file():
    import tempfile

    fd, path = tempfile.mkstemp()  # O_EXCL, from tempfile: a fresh name each time
    os.close(fd)
    os.remove(path)
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"x")
    return 2


def test_a_probe_may_use_scratch_files_of_its_own():
    assert sandbox.run_in_fork(_scratch_file).value == 2


def _swallowing_write(path):
    try:
        with open(path, "xb"):
            pass
    except OSError:
        pass
    return 1


# --- state kept outside the object's own attributes ----------------------------------------------------------

SEEN_ROWS: list = []
CALLS = 0


class ClassCounter:
    calls = 0

    def __getitem__(self, i):
        ClassCounter.calls += 1
        return i


def counting_in_a_global(x):
    global CALLS
    CALLS += 1
    return x


def counting_in_a_closure():
    box = {"n": 0}

    def op(x):
        box["n"] += 1
        return x
    return op


def _sink(x, sink):
    sink.append(x)
    return x


class Stats:
    def __init__(self):
        self.n = 0


class Nested:
    def __init__(self):
        self.stats = Stats()
        self.table = {"n": 0}
        self.hist = np.zeros(4, np.int64)

    def by_attribute(self, x):
        self.stats.n += 1
        return x

    def by_dict_value(self, x):
        self.table["n"] += 1
        return x

    def by_array(self, x):
        self.hist[x % 4] += 1
        return x


class PerRow:
    """Reads counted in places the walk fingerprints beyond a length or an identity (the handles audit: each
    counted 600 in the program under ms_shm's threads, 0 under raw's worker processes)."""

    def __init__(self, rows=600):
        self.counter = itertools.count()
        self.recent = collections.deque(maxlen=5)
        self.visits = np.zeros(rows, np.int64)  # 4.7 KiB: over the size compared byte by byte
        self.seen = [0] * rows  # longer than the walk looks into
        self.by_row = {i: 0 for i in range(rows)}

    def by_counter(self, x):
        next(self.counter)
        return x

    def by_bounded_deque(self, x):
        self.recent.append(x)
        return x

    def by_visits(self, x):
        self.visits[x] += 1
        return x

    def by_long_list(self, x):
        self.seen[x] += 1
        return x

    def by_long_dict(self, x):
        self.by_row[x] += 1
        return x


@functools.lru_cache(maxsize=None)
def _cached_load(x):
    return x * 2


def reads_through_a_cache(x):
    return _cached_load(x)


@pytest.mark.parametrize("make, where", [
    (lambda: counting_in_a_global, "<global CALLS>"),
    (lambda: (lambda x: SEEN_ROWS.append(x) or x), "<global SEEN_ROWS>"),
    (lambda: ClassCounter(), "<class ClassCounter.calls>"),
    (lambda: counting_in_a_closure(), "<closure box>['n']"),
    (lambda: functools.partial(_sink, sink=[]), "keywords['sink']"),
    (lambda: Nested().by_attribute, "stats.n"),
    (lambda: Nested().by_dict_value, "table['n']"),
    (lambda: Nested().by_array, "hist"),
    (lambda: PerRow().by_counter, "counter"),
    (lambda: PerRow().by_bounded_deque, "recent"),
    (lambda: PerRow().by_visits, "visits"),
    (lambda: PerRow().by_long_list, "seen"),
    (lambda: PerRow().by_long_dict, "by_row"),
    (lambda: reads_through_a_cache, "<global _cached_load>"),
], ids=["global", "module-list", "class-attribute", "closure-dict", "partial-keywords", "nested-object",
        "dict-value", "small-array", "itertools-count", "bounded-deque", "larger-array", "long-list", "long-dict",
        "lru-cache"])
def test_state_kept_beyond_the_objects_own_attributes_is_seen_on_every_read(make, where):
    """A counter in a global, a class attribute, a closure, a partial's arguments or a nested object: worker
    processes would change their copies and the program would see none of it (batch audit: 0 where raw gave 40)."""
    op = make()
    watched = measure._operation_objects(op)
    rows = iter(range(1, 100))
    read = (lambda: op[1]) if hasattr(op, "__getitem__") else (lambda: op(next(rows)))
    _, effects = sandbox.watch_effects(lambda: [read() for _ in range(3)], watched, again=read)
    assert effects.state_per_read and where in effects.state_per_read, effects


def test_pure_reads_of_a_deep_object_show_no_state():
    obj = Nested()
    _, effects = sandbox.watch_effects(lambda: obj.stats.n + len(obj.table), measure._operation_objects(obj.by_attribute))
    assert not effects.mutates_state and not effects.state_per_read, effects


def test_a_probes_native_crash_is_named_and_leaves_no_stack_dump_of_the_probe():
    """A dataset whose read segfaults: the probe child's death names SIGSEGV, and faulthandler (pytest's, on a
    dup of stderr) prints no "Fatal Python error" through ms_shm's frames: an audit took that for ms_shm's crash."""
    code = ("import ctypes, faulthandler, os, sys\n"
            "faulthandler.enable(os.fdopen(os.dup(2), 'w'))\n"
            "from ms_shm import sandbox\n"
            "print(sandbox.run_in_fork(lambda: ctypes.string_at(0)).unavailable)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(isolated.REPO)))
    assert done.returncode == 0, done.stderr
    assert "signal 11, SIGSEGV: a crash in native code" in done.stdout, done.stdout
    assert "Fatal Python error" not in done.stderr, done.stderr


def test_a_probe_killed_under_a_memory_limit_names_the_oom_killer(monkeypatch):
    """A few rows read in a 230 MB container: the probe child was SIGKILLed and the log said only 'died'."""
    import signal

    monkeypatch.setattr(sandbox.host, "read_memory", lambda *a: (230 << 20, 229 << 20))
    out = sandbox.run_in_fork(lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert "(signal 9, SIGKILL)" in out.unavailable and "OOM killer" in out.unavailable and "230.0 MiB" in out.unavailable
    monkeypatch.setattr(sandbox.host, "read_memory", lambda *a: (None, 1 << 20))
    assert "OOM" not in sandbox.run_in_fork(lambda: os.kill(os.getpid(), signal.SIGKILL)).unavailable


PROBING_FOREVER = """
import os, sys, time
from pathlib import Path
from ms_shm import sandbox

def probe():
    Path(sys.argv[1]).write_text(str(os.getpid()))  # the child's pid, for the test to watch
    time.sleep(60)

sandbox.run_in_fork(probe, timeout=120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _until(ready, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_probe_child_dies_with_the_program_that_was_stopped_while_it_probed(how, tmp_path):
    """An audit: Ctrl-C or SIGTERM while a source's slow rows were probed left the child reading on, orphaned (19 s
    for 10 s rows; a source that hangs, for ever), where raw MindSpore leaves no process."""
    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, "-c", PROBING_FOREVER, str(pid_file)],
                            preexec_fn=isolated.as_from_a_terminal)
    try:
        _until(lambda: pid_file.exists() and pid_file.read_text())
        child = int(pid_file.read_text())
        proc.send_signal(how)
        proc.wait(timeout=30)
        _until(lambda: not _alive(child), 5)
        assert not _alive(child), f"probe child {child} outlived its program (stopped by {how.name})"
    finally:
        proc.kill()
        proc.wait()


MINDSPORE_OPS_IN_A_PROBE = """
import sys, time
import numpy as np
import mindspore as ms
from mindspore import Tensor, ops
from ms_shm import sandbox

ops.matmul(Tensor(np.ones((4, 4), np.float32)), Tensor(np.ones((4, 4), np.float32)))  # the program ran an op
for _ in range(100):  # its runtime thread names itself a moment later: on a loaded machine, after the probe's fork
    if sandbox._mindspore_fork_hooks() is not None:
        break
    time.sleep(0.01)


def rows():
    return [ops.relu(Tensor(np.arange(64, dtype=np.float32).reshape(8, 8) - 20 - i)).asnumpy() for i in range(4)]


for _ in range(2):  # and again after the probe
    began = time.monotonic()
    out = sandbox.run_in_fork(rows, timeout=20)
    same = out.value is not None and all(np.array_equal(a, b) for a, b in zip(out.value, rows()))
    print("PROBE", round(time.monotonic() - began, 1), out.unavailable, same, flush=True)
"""


def test_a_probe_running_mindspore_ops_after_the_program_ran_one_does_not_hang():
    """An audit's dataset called ``ops.relu`` after the program had run a matmul: the bare fork's child hung on
    MindSpore's runtime and the build waited the probe's 60 s. MindSpore's own fork hooks
    (``_c_expression.fork_utils``, which its ``multiprocessing.Process`` calls) now run around the probe's fork,
    where the release has them (2.7.2+)."""
    ms = pytest.importorskip("mindspore", reason="mindspore is not installed")
    if getattr(getattr(ms, "_c_expression", None), "fork_utils", None) is None:
        pytest.skip(f"MindSpore {ms.__version__} has no fork hooks (2.0.0 has none): its probe child still waits")
    proc = subprocess.run([sys.executable, "-c", MINDSPORE_OPS_IN_A_PROBE], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    probes = [line.split() for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    assert proc.returncode == 0 and len(probes) == 2, proc.stdout + proc.stderr[-3000:]
    assert all(p[2:] == ["None", "True"] and float(p[1]) < 10 for p in probes), probes


PROBES_FORKED_AT_ONCE = """
import threading, time
import numpy as np
from mindspore import Tensor, ops
from ms_shm import sandbox

ops.relu(Tensor(np.ones(4, np.float32)))  # the program ran an op: the probe's fork runs MindSpore's fork hooks
for _ in range(100):  # once the runtime's threads are up, which they come a little after the op
    if sandbox._mindspore_fork_hooks() is not None:
        break
    time.sleep(0.1)
outcomes = []
for _ in range(10):
    start = threading.Barrier(2)

    def probe(i):
        start.wait()
        outcomes.append(sandbox.run_in_fork(lambda: i * 2, timeout=20).value)

    threads = [threading.Thread(target=probe, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print("VALUES", sorted(outcomes) == sorted([0, 2] * 10), flush=True)
"""


def test_probes_of_two_threads_fork_one_at_a_time_around_mindspores_hooks():
    """Two pipelines built at once on two threads each ran MindSpore's fork hooks at the same time: the program
    aborted (``terminate called without an active exception``, rc 134) or hung, 2 runs of 2, where raw built
    both. The hooked forks now take turns."""
    ms = pytest.importorskip("mindspore", reason="mindspore is not installed")
    if getattr(getattr(ms, "_c_expression", None), "fork_utils", None) is None:
        pytest.skip(f"MindSpore {ms.__version__} has no fork hooks (2.0.0 has none): nothing to take turns at")
    proc = subprocess.run([sys.executable, "-c", PROBES_FORKED_AT_ONCE], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == 0 and "VALUES True" in proc.stdout, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"


def test_a_probe_leaves_the_programs_shown_warnings_alone():
    """Python shows a warning once per place by default; a fork wrapped in ``warnings.catch_warnings()`` made it
    forget them all, and torch's "will create 3 worker processes" came again for every DataLoader (2 lines raw,
    8 under ms_shm, in PyTorch's own test_dataloader.py under ``patch()``)."""
    code = ("import warnings\n"
            "from ms_shm import sandbox\n"
            "def warn():\n"
            "    warnings.warn('shown once', UserWarning)\n"
            "for _ in range(3):\n"
            "    warn()\n"
            "    sandbox.run_in_fork(lambda: 1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.count("UserWarning: shown once") == 1, proc.stderr


class RowObject:
    """A value of the program's own: converting it may run its code (``__array__``)."""

    def __array__(self, dtype=None, copy=None):
        return np.zeros(3)


@pytest.mark.parametrize("source", [
    [(np.arange(4) + i, np.array(i)) for i in range(10)],
    tuple(np.full(3, i, np.float32) for i in range(6)),
    np.arange(40).reshape(10, 4),
    [(np.arange(2), "label", 3.5, b"raw") for _ in range(5)],
], ids=["list of tuples", "tuple of arrays", "ndarray", "strings and numbers"])
def test_plain_data_in_a_list_tuple_or_array_is_probed_without_a_fork(source, monkeypatch):
    def no_fork(*args, **kwargs):
        raise AssertionError("forked")

    monkeypatch.setattr(measure, "_fork", no_fork)
    names = ["a", "b", "c", "d"][:len(source[0]) if isinstance(source[0], tuple) else 1]
    probe = measure.probe_random_access(source, names, None)
    assert probe.stats is not None and probe.stats.length == len(source), probe
    assert probe.effects == sandbox.Effects() and probe.stats.threads_started == 0  # no thread pools to look for


@pytest.mark.parametrize("source", [
    [(np.arange(3),), (RowObject(),)] * 3,  # a row holding an object of the program's, not the first
    np.array([RowObject()] * 4, dtype=object),
    np.arange(8).reshape(4, 2).view(np.matrix),
    [([1, 2, 3],)] * 4,  # a list column
], ids=["an object in a later row", "object array", "ndarray subclass", "list column"])
def test_a_source_that_may_run_the_programs_code_when_read_is_probed_in_a_fork(source, monkeypatch):
    forks = []
    real = measure._fork

    def counted(*args, **kwargs):
        forks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "_fork", counted)
    try:
        measure.probe_random_access(source, ["a"], None)
    except RowError:  # what MindSpore makes of the row is not the question here
        pass
    assert forks == [1]


def test_where_memory_may_bind_a_plain_source_is_still_probed_in_a_fork_for_a_workers_pages(monkeypatch):
    forks = []
    real = measure._fork
    monkeypatch.setattr(measure, "_fork", lambda *a, **k: forks.append(1) or real(*a, **k))
    probe = measure.probe_random_access([(np.arange(4),)] * 5, ["a"], None, worker_pages=True)
    assert forks == [1] and probe.stats.worker_bytes is not None


def test_a_stream_over_an_open_socket_is_not_read_ahead_and_a_closed_one_is():
    import socket

    writer, reader = socket.socketpair()
    try:
        def rows():
            yield reader.recv(8)

        why = sandbox.stream_blocker([rows])
        assert why is not None and "socket.socket, open" in why and "taken off it for good" in why
    finally:
        writer.close()
        reader.close()
    assert sandbox.stream_blocker([rows]) is None  # closed: nothing left to take


def test_a_stream_over_a_queue_a_thread_fills_is_not_read_ahead():
    """An audit: the probe child, which has no producer thread, waited the probe's 60 s on the empty queue."""
    import queue

    feed = queue.Queue()

    def rows():
        while (item := feed.get()) is not None:
            yield item

    why = sandbox.shared_with_processes([rows])
    assert why is not None and "queue.Queue" in why and "threads a forked probe process would not have" in why
    feed.put(1)  # holding items (a free-list of buffers): the child reads its own copy
    assert sandbox.shared_with_processes([rows]) is None


def test_writable_memory_shared_with_other_processes_is_not_read_ahead(tmp_path):
    """The shared-cache idiom (a numpy view of ``mp.Array``, of ``SharedMemory.buf``, an ``r+`` memmap, a writable
    ``mmap``): a probe child's writes there reach the program (the handles audit: 44 visits counted where raw
    counted 40). Read-only and copy-on-write maps, and numpy's own memory, are the child's to write."""
    import mmap
    import multiprocessing as mp
    from multiprocessing import shared_memory

    class Holding:
        def __init__(self, inner):
            self.cache = inner

    path = tmp_path / "visits.bin"
    np.zeros(64, np.int64).tofile(path)
    block = shared_memory.SharedMemory(create=True, size=512)
    anonymous = mmap.mmap(-1, 4096)
    try:
        shared = [np.frombuffer(mp.Array("i", 16).get_obj(), np.int32), np.ndarray((8,), np.int64, block.buf),
                  np.memmap(path, np.int64, "r+"), anonymous]
        for inner in shared:
            why = sandbox.shared_with_processes([Holding(inner)])
            assert why and "Holding.cache" in why and "writable memory shared" in why, (type(inner), why)
        private = [np.memmap(path, np.int64, "r"), np.memmap(path, np.int64, "c"), np.zeros(64), np.arange(8)[::2]]
        for inner in private:
            assert sandbox.shared_with_processes([Holding(inner)]) is None, type(inner)
    finally:
        del shared
        anonymous.close()
        block.close()
        block.unlink()


def test_an_lmdb_environment_with_its_lock_file_is_not_read_ahead_and_one_without_is(monkeypatch):
    """Each reading thread of a probe process keeps a slot of the environment's reader table under the pid that
    opened it (the handles audit: ``MDB_READERS_FULL`` at the 31st build). lmdb itself is stood in for here."""
    fake = types.ModuleType("lmdb")

    class Environment:
        def __init__(self, lock):
            self.lock = lock

        def flags(self):
            return {"lock": self.lock, "readonly": True}

    fake.Environment = Environment
    monkeypatch.setitem(sys.modules, "lmdb", fake)

    class Records:
        def __init__(self, env):
            self.env = env

    why = sandbox.shared_with_processes([Records(Environment(lock=True))])
    assert why and "Records.env" in why and "lock=False" in why, why
    assert sandbox.shared_with_processes([Records(Environment(lock=False))]) is None


class GuardedReads:
    def __init__(self):
        self.lock = threading.RLock()

    def __getitem__(self, i):
        with self.lock:
            return i


def test_a_lock_another_thread_holds_at_the_fork_ends_the_probe_at_once():
    """A child has only the forking thread: a lock some other thread held is held there for good, and a read
    taking it waited the probe's 60 s (the handles audit: a pipeline built inside ``with self.lock:``)."""
    source = GuardedReads()
    started = time.perf_counter()
    with source.lock:  # this thread is not the probe's
        held = sandbox.run_in_fork(lambda: source[3], timeout=20, watched=[source])
    assert time.perf_counter() - started < 10
    assert held.unavailable and "GuardedReads.lock" in held.unavailable and "held by a thread" in held.unavailable
    assert sandbox.run_in_fork(lambda: source[3], timeout=20, watched=[source]).value == 3  # free: read


def test_what_the_program_wrote_to_a_file_is_flushed_before_the_fork_not_written_twice(tmp_path):
    """A header still in the file's buffer was written by the child's flush and again by the program's (the
    handles audit's log: two headers)."""
    log_file = open(tmp_path / "log.txt", "w")

    class Logging:
        def __getitem__(self, i):
            print(i, file=log_file, flush=True)
            return i

    source = Logging()
    log_file.write("# header\n")
    assert sandbox.run_in_fork(lambda: source[7], watched=[source]).value == 7
    log_file.write("end\n")
    log_file.close()
    assert (tmp_path / "log.txt").read_text() == "# header\n7\nend\n"


def test_the_child_writes_nothing_through_the_programs_own_streams(tmp_path, monkeypatch):
    """``sys.stdout`` (a file here, a notebook kernel's stream there) and logging's handlers are the program's: a
    child that printed through them also sent what the program had not flushed yet (a notebook showed a line
    printed before the build twice), or waited on a buffer lock a thread of the program held at the fork (a
    thread logging to a file: the probe waited its 60 s)."""
    import logging

    out = open(tmp_path / "out.txt", "w")
    logged = open(tmp_path / "log.txt", "w")
    handler = logging.StreamHandler(logged)
    logger = logging.getLogger("tests.a_program")
    logger.addHandler(handler)
    monkeypatch.setattr(sys, "stdout", out)
    try:
        print("before the build")  # still in the file's buffer at the fork
        logged.write("# the program's log\n")
        outcome = sandbox.run_in_fork(lambda: (print("probe row", flush=True), logger.warning("probe row"), 7)[-1])
        assert outcome.value == 7, outcome
    finally:
        logger.removeHandler(handler)
        out.close()
        logged.close()
    assert (tmp_path / "out.txt").read_text() == "before the build\n"
    assert (tmp_path / "log.txt").read_text() == "# the program's log\n"


NO_OPS_THEN_A_PROBE = """
import mindspore
from ms_shm import procfs, sandbox

before = procfs.thread_names()
assert sandbox.run_in_fork(lambda: 1).value == 1
print("NEW", sorted(procfs.thread_names() - before))
"""


def test_a_probe_in_a_program_that_ran_no_op_starts_none_of_mindspores_runtime_threads():
    """MindSpore's first fork hook starts its runtime's queue threads (``infer_queue``, ``launch_queue``,
    ``resize_queue``) in a program that had none, for good (the threads audit, 2.7.2-2.10: Python 3.12 then
    warned at the program's own later forks). With no queue up there is no runtime state to hang a child."""
    ms = pytest.importorskip("mindspore", reason="mindspore is not installed")
    if getattr(getattr(ms, "_c_expression", None), "fork_utils", None) is None:
        pytest.skip(f"MindSpore {ms.__version__} has no fork hooks (2.0.0 has none)")
    proc = subprocess.run([sys.executable, "-c", NO_OPS_THEN_A_PROBE], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    new = [line for line in proc.stdout.splitlines() if line.startswith("NEW")]
    assert proc.returncode == 0 and new, proc.stdout + proc.stderr[-3000:]
    assert not {"infer_queue", "launch_queue", "resize_queue"} & set(ast.literal_eval(new[0][4:])), new


def test_a_signal_action_is_told_changed_by_what_acts_not_by_the_c_librarys_leftover_mask_bytes():
    """glibc fills 8 of a ``struct sigaction``'s 128 mask bytes and leaves the rest as its stack had them: every
    signal read as changed by MindSpore's fork hooks, and was put back and said so, where only SIGINT's was."""
    action = bytes(range(152)) + bytes(360)
    leftovers = action[:16] + bytes(120) + action[136:]
    assert sandbox._what_acts(leftovers) == sandbox._what_acts(action)
    for at in (0, 8, 136, 144):  # the handler, the mask's first 64 signals, the flags, the restorer
        changed = action[:at] + bytes([action[at] ^ 1]) + action[at + 1:]
        assert sandbox._what_acts(changed) != sandbox._what_acts(action), at
