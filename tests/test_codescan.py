"""``codescan.global_draw``: which code a DataLoader runs per sample or per index draws from a global generator.

Pure logic on classes defined here (no DataLoader runs). The cases come from an audit: a dataset that draws for
some samples only, and samplers that draw per index, both missed by the probe (3 samples, whether the global
generators moved); each made ms_shm pick 2 workers where torch's default 0 gives other batches.
"""

from __future__ import annotations

import random
import sys
from random import randint

import numpy as np
import pytest

from ms_shm import codescan

WORKERS_SEEDED_APART = "draws from the global generator; workers are seeded apart"


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: its functions are found by identity")


class Sometimes:
    """A random crop of the larger images only: 1 sample in 4 draws (the audit's ``sometimes_auto``)."""

    def __getitem__(self, i):
        x = list(range(10))
        if i % 4 == 1:
            x = x[random.randint(0, 3):]
        return x


class FromImport:
    def __getitem__(self, i):
        return randint(0, i)


class LocalImport:
    def __getitem__(self, i):
        from random import uniform as jitter

        return i * jitter(0.5, 2.0)


class NumpyLegacy:
    def __getitem__(self, i):
        return np.random.rand(3) + i


class NumpySeededPerSample:
    def __getitem__(self, i):
        return np.random.default_rng(i).random(3)


class NumpyHeld:
    """Its own generator: the probe reads it (``rows draw from a random generator the source holds``)."""

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __getitem__(self, i):
        return self.rng.integers(0, 5) + i


class RandomSeeded:
    def __getitem__(self, i):
        return random.Random(i).random()


class MentionsRandom:
    """``random`` as a local name and in an attribute's name: nothing drawn."""

    def __init__(self):
        self.random_crop_size = 3

    def __getitem__(self, i):
        random = [i, i + 1]  # noqa: F811 - the point of the case
        return random[0] + self.random_crop_size


def jitter(x):
    return x + random.random()


class ThroughHelper:
    def __getitem__(self, i):
        return jitter(i)


class Scale:
    def __call__(self, x):
        return x * random.uniform(0.5, 2.0)


class Transformed:
    def __init__(self):
        self.transform = Scale()

    def __getitem__(self, i):
        return self.transform(i)


class FillsInPlace:
    def __getitem__(self, i):
        return self.buffer.uniform_(0, len(str(i)))


class FillsInPlaceSeeded:
    def __getitem__(self, i):
        return self.buffer.uniform_(0, len(str(i)), generator=self.g)


class Cropper:
    def random_crop(self, x):
        return x[random.randint(0, 3):] if len(x) > 8 else x


class HelperMethod:
    """A held helper's ordinary method (not ``__call__``), drawing for the larger samples only (an audit's
    ``self.crop.random_crop(x)``: ms_shm added workers and every run's crops differed)."""

    def __init__(self):
        self.crop = Cropper()

    def __getitem__(self, i):
        return self.crop.random_crop(list(range(i)))


def random_collate(batch):
    return batch[:random.randint(1, len(batch))]


@pytest.mark.parametrize("dataset, where, call", [
    (Sometimes(), "Sometimes.__getitem__", "random.randint"),
    (FromImport(), "FromImport.__getitem__", "random.randint"),
    (LocalImport(), "LocalImport.__getitem__", "random.uniform"),
    (NumpyLegacy(), "NumpyLegacy.__getitem__", "numpy.random.rand"),
    (ThroughHelper(), "ThroughHelper.__getitem__", "random.random through jitter"),
    (Transformed(), "Scale.__call__", "random.uniform"),
    (FillsInPlace(), "FillsInPlace.__getitem__", "Tensor.uniform_"),
    (HelperMethod(), "HelperMethod.__getitem__", "random.randint through Cropper.random_crop"),
])
def test_a_draw_from_a_global_generator_is_named_with_where_it_is(dataset, where, call):
    assert codescan.global_draw(dataset) == f"{where} calls {call} ({WORKERS_SEEDED_APART})"


@pytest.mark.parametrize("dataset", [NumpySeededPerSample(), NumpyHeld(), RandomSeeded(), MentionsRandom(),
                                     FillsInPlaceSeeded()], ids=type)
def test_seeded_generators_and_mere_mentions_are_not_draws(dataset):
    assert codescan.global_draw(dataset) is None


class Identity:
    def __call__(self, x):
        return x


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class CropSometimes:
    def __call__(self, x):
        return x[random.randint(0, 3):] if len(x) > 8 else x


class Wrapper:
    """A ``Subset`` / ``ConcatDataset``-like wrapper: the dataset it reads is an attribute (or in a list)."""

    def __init__(self, inner, as_list=False):
        self.datasets = [inner] if as_list else None
        self.dataset = None if as_list else inner

    def __getitem__(self, i):
        return (self.dataset or self.datasets[0])[i]


class Holds:
    def __init__(self, transform):
        self.transform = transform

    def __getitem__(self, i):
        return self.transform(i)


class HeldNoise:
    """Holds a global generator's method, called for some samples: ``self.noise()`` cannot be resolved from the
    bytecode."""

    def __init__(self):
        self.noise = np.random.normal

    def __getitem__(self, i):
        return i + (self.noise() if i % 4 == 0 else 0)


@pytest.mark.parametrize("dataset", [
    Wrapper(Holds(Compose([Identity(), CropSometimes()]))),
    Wrapper(Wrapper(Holds(Transformed().transform))),
    Wrapper(Holds(Compose([Identity()] * 8 + [Transformed().transform])), as_list=True),
], ids=["Subset(DS(Compose))", "Subset(Subset(DS(transform)))", "Concat(DS(Compose of 9))"])
def test_a_draw_deep_in_wrapped_datasets_and_long_composes_is_found(dataset):
    """An audit: ``random_split``'s ``Subset`` or a ``ConcatDataset`` of a dataset holding a ``Compose``, and a
    ``Compose`` of 9 transforms, hid a transform drawing for some samples only from a walk of 2 levels and 8
    items; ms_shm added workers and the batches changed."""
    assert codescan.global_draw(dataset) is not None


def test_a_held_global_generator_method_is_a_draw():
    assert codescan.global_draw(HeldNoise()) == (
        "HeldNoise holds numpy.random.normal (held) (draws from numpy's global generator; workers are seeded apart)")


class ClassNoise:
    """A global generator's method held on the class, not set in ``__init__`` (an audit's dataset)."""

    wobble = staticmethod(np.random.random_sample)

    def __getitem__(self, i):
        return i + (self.wobble() if i % 5 == 3 else 0)


class ClassNoisePlain(ClassNoise):
    wobble = np.random.random_sample  # a builtin method: no binding to the instance, no staticmethod needed


class ClassSeeded(ClassNoise):
    wobble = staticmethod(np.random.default_rng(0).random)  # a generator of its own: the probe watches it


@pytest.mark.parametrize("dataset, expected", [
    (ClassNoise(), "ClassNoise holds numpy.random.random_sample (held)"),
    (ClassNoisePlain(), "ClassNoisePlain holds numpy.random.random_sample (held)"),
    (ClassSeeded(), None),
])
def test_a_global_generator_method_held_on_the_class_is_a_draw(dataset, expected):
    found = codescan.global_draw(dataset)
    assert (found if found is None else found.split(" (draws")[0]) == expected


def test_a_collate_fn_that_draws_is_named():
    assert codescan.global_draw(MentionsRandom(), random_collate) == (
        f"collate_fn random_collate calls random.randint ({WORKERS_SEEDED_APART})")


def test_nothing_is_imported_to_resolve_a_name():
    before = set(sys.modules)
    codescan.global_draw(Sometimes(), random_collate, PerIndex())
    assert set(sys.modules) == before


class Plain:
    def __getitem__(self, i):
        return i


class PerIndex:
    """A class-balanced sampler's shape (the audit's ``lazysampler_auto``)."""

    def __iter__(self):
        for _ in range(10):
            yield random.randrange(10)


class PerEpoch:
    """Draws once, when the epoch's first index is asked for: with and without workers before the first batch."""

    def __iter__(self):
        order = list(range(10))
        random.shuffle(order)
        for i in order:
            yield i


class PlainIter:
    """Not a generator: it draws when ``iter()`` is called, which torch does twice per epoch with workers on
    the index sampler (``_BaseDataLoaderIter.__init__`` and ``_reset``)."""

    def __iter__(self):
        order = list(range(10))
        random.shuffle(order)
        return iter(order)


class HoldsSampler:
    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        batch = []
        for i in self.sampler:
            batch.append(i)
            if len(batch) == 2:
                yield batch
                batch = []


RUNS_AHEAD = "(with workers it runs ahead of the training loop, which may draw from the same generator)"


def test_a_sampler_that_draws_per_index_is_named():
    assert codescan.global_draw(Plain(), sampler=PerIndex()) == (
        f"the sampler's PerIndex.__iter__ calls random.randrange per index {RUNS_AHEAD}")
    assert codescan.global_draw(Plain(), batch_sampler=HoldsSampler(PerIndex())) == (
        f"the batch_sampler's PerIndex.__iter__ calls random.randrange per index {RUNS_AHEAD}")


def test_a_sampler_that_draws_once_per_epoch_is_not():
    assert codescan.global_draw(Plain(), sampler=PerEpoch()) is None
    assert codescan.global_draw(Plain(), batch_sampler=HoldsSampler(PerEpoch())) is None


def test_a_plain_iter_that_draws_counts_only_as_the_index_sampler():
    assert codescan.global_draw(Plain(), sampler=PlainIter()) is None  # wrapped in torch's BatchSampler
    assert "twice per epoch" in codescan.global_draw(Plain(), sampler=PlainIter(), batch_size=None)
    assert "twice per epoch" in codescan.global_draw(Plain(), batch_sampler=PlainIter())


def test_torch_functions_are_draws_unless_the_call_passes_a_generator():
    torch = _torch()

    class Draws:
        def __getitem__(self, i):
            return torch.randint(0, 10, (1,))

    class Seeded:
        def __init__(self):
            self.g = torch.Generator().manual_seed(0)

        def __getitem__(self, i):
            return torch.randint(0, len(str(i)), (1,), generator=self.g)

    class ModuleTransform(torch.nn.Module):  # called through torch's Module.__call__: its forward is read
        def forward(self, x):
            return x + torch.randn_like(x)

    class HoldsModule:
        def __init__(self):
            self.augment = ModuleTransform()

        def __getitem__(self, i):
            return self.augment(torch.zeros(3))

    assert codescan.global_draw(Draws()) == f"Draws.__getitem__ calls torch.randint ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(Seeded()) is None
    assert codescan.global_draw(HoldsModule()) == (
        f"ModuleTransform.forward calls torch.randn_like ({WORKERS_SEEDED_APART})")


def test_a_generator_argument_that_is_none_draws_from_the_default_generator():
    """``generator=self.g`` with ``g`` left ``None`` (a seed the caller did not set) and ``generator=None`` draw
    from torch's default generator, as no ``generator=`` does: workers would change the samples."""
    torch = _torch()

    class Optional:
        def __init__(self, g=None):
            self.g = g

        def __getitem__(self, i):
            return torch.rand(3, generator=self.g, dtype=torch.float32) + i

    class Fills(Optional):
        def __getitem__(self, i):
            return torch.zeros(3).uniform_(0, 1, generator=self.g)

    class ExplicitNone:
        def __getitem__(self, i):
            return torch.randint(0, 5, (2,), generator=None)

    assert codescan.global_draw(Optional()) == f"Optional.__getitem__ calls torch.rand ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(Optional(torch.Generator().manual_seed(0))) is None
    assert codescan.global_draw(Fills()) == f"Fills.__getitem__ calls Tensor.uniform_ ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(Fills(torch.Generator())) is None
    assert codescan.global_draw(ExplicitNone()) == (
        f"ExplicitNone.__getitem__ calls torch.randint ({WORKERS_SEEDED_APART})")


def test_the_default_generator_passed_by_name_is_the_global_one():
    """``generator=torch.default_generator`` draws from the global generator, as no ``generator=`` does (an
    audit: 2 workers gave other batches than raw's main process)."""
    torch = _torch()
    from torch import default_generator

    class Attribute:
        def __getitem__(self, i):
            return torch.rand(3, generator=torch.default_generator) + i

    class Imported:
        def __getitem__(self, i):
            return torch.rand(3, generator=default_generator) + i

    assert codescan.global_draw(Attribute()) == f"Attribute.__getitem__ calls torch.rand ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(Imported()) == f"Imported.__getitem__ calls torch.rand ({WORKERS_SEEDED_APART})"


def test_torchs_random_library_code_is_a_draw_called_held_or_made():
    """The audit's datasets that augment one sample in four through torch's own code (``F.dropout``, a held
    ``nn.Dropout``, a ``Normal`` sampled): the probe's three samples did not draw, and 2 workers changed the
    batches. torch's code is not read, so its random functions, modules and distributions are known by class."""
    torch = _torch()
    import torch.nn.functional as F

    class CallsDropout:
        def __getitem__(self, i):
            x = torch.full((4,), float(i))
            return F.dropout(x, 0.5, training=True) if i % 4 == 1 else x

    class HoldsDropout:
        def __init__(self):
            self.drop = torch.nn.Dropout(0.5)

        def __getitem__(self, i):
            x = torch.full((4,), float(i))
            return self.drop(x) if i % 4 == 1 else x

    class HoldsModel(HoldsDropout):
        def __init__(self, training=True):
            self.features = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Dropout(0.1)))
            self.features.train(training)

    class HoldsNormal(HoldsDropout):
        def __init__(self):
            self.noise = torch.distributions.Normal(0.0, 1.0)

    class MakesNormal:
        def __getitem__(self, i):
            return torch.distributions.Normal(0.0, 1.0).sample((4,)) if i % 4 == 1 else torch.zeros(4)

    assert codescan.global_draw(CallsDropout()) == (
        f"CallsDropout.__getitem__ calls torch.nn.functional.dropout ({WORKERS_SEEDED_APART})")
    held = "(draws from torch's global generator; workers are seeded apart)"
    assert codescan.global_draw(HoldsDropout()) == f"HoldsDropout holds nn.Dropout (in training mode) {held}"
    assert codescan.global_draw(HoldsModel()) == (
        f"HoldsModel holds nn.Dropout inside Sequential (in training mode) {held}")
    assert codescan.global_draw(HoldsNormal()) == f"HoldsNormal holds torch.distributions.Normal (sampled) {held}"
    assert codescan.global_draw(MakesNormal()) == (
        f"MakesNormal.__getitem__ calls torch.distributions.Normal ({WORKERS_SEEDED_APART})")

    evaluating = HoldsDropout()
    evaluating.drop.eval()  # a module in eval mode draws nothing
    assert codescan.global_draw(evaluating) is None
    assert codescan.global_draw(HoldsModel(training=False)) is None


def test_a_torch_sampler_drawing_per_index_is_named():
    torch = _torch()

    class Balanced(torch.utils.data.Sampler):  # the audit's lazytorch_dropout_auto
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            for _ in range(self.n):
                yield int(torch.randint(0, self.n, ()))

        def __len__(self):
            return self.n

    assert codescan.global_draw(Plain(), sampler=Balanced(8)) == (
        f"the sampler's Balanced.__iter__ calls torch.randint per index {RUNS_AHEAD}")


def test_torchs_own_samplers_draw_once_per_epoch_and_are_not_read():
    torch = _torch()
    data = torch.utils.data
    from torch.utils.data.distributed import DistributedSampler

    dataset = data.TensorDataset(torch.zeros(8))
    for kwargs in ({"sampler": data.RandomSampler(dataset)}, {"sampler": data.SequentialSampler(dataset)},
                   {"batch_sampler": data.BatchSampler(data.RandomSampler(dataset), 3, False)},
                   {"sampler": DistributedSampler(dataset, num_replicas=2, rank=0)},
                   {"sampler": data.WeightedRandomSampler([1.0] * 8, 8)}):
        assert codescan.global_draw(dataset, data.default_collate, **kwargs) is None, kwargs


def _chain_to_a_draw(depth: int):
    """A dataset whose ``__getitem__`` reaches ``random.random()`` through ``depth`` module functions."""
    source = "\n".join(f"def f{k}(x):\n    return f{k + 1}(x)" for k in range(depth))
    source += f"\ndef f{depth}(x):\n    return random.random()\n"
    source += "class Deep:\n    def __getitem__(self, i):\n        return f0(i)\n"
    namespace: dict = {"random": random, "__name__": "deep_program"}
    exec(source, namespace)
    return namespace["Deep"]()


def test_the_walk_stays_within_max_codes():
    assert "random.random through f5" in codescan.global_draw(_chain_to_a_draw(5))
    assert codescan.global_draw(_chain_to_a_draw(codescan.MAX_CODES + 10)) is None  # the probe watches the rest


AUGMENT = Scale()  # a module-level transform object


class GlobalTransform:
    def __getitem__(self, i):
        return AUGMENT(i)


def test_a_module_level_transform_objects_call_is_read():
    assert codescan.global_draw(GlobalTransform()) == (
        f"GlobalTransform.__getitem__ calls random.uniform through Scale.__call__ ({WORKERS_SEEDED_APART})")


LAZY_NUMPY = """
import sys
import numpy as np
from ms_shm import codescan
class Legacy:
    def __getitem__(self, i):
        return np.random.rand(3)
class FromImport:
    def __getitem__(self, i):
        from numpy.random import randint
        return randint(3)
before = "numpy.random" in sys.modules
print(codescan.global_draw(Legacy()))
print(codescan.global_draw(FromImport()))
print(before == ("numpy.random" in sys.modules))
"""


def test_numpys_legacy_functions_are_read_before_numpy_random_is_imported():
    """numpy 2 imports ``numpy.random`` on first use: a fresh process, where the dataset has not drawn yet."""
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(codescan.__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", LAZY_NUMPY], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.splitlines() == [
        f"Legacy.__getitem__ calls numpy.random.rand ({WORKERS_SEEDED_APART})",
        f"FromImport.__getitem__ calls numpy.random.randint ({WORKERS_SEEDED_APART})",
        "True"]  # nothing imported by the scan


class ShufflesWithItsOwnGenerator:
    """A batch sampler whose plain ``__iter__`` shuffles with a generator it holds (an audit's): the framework
    calls it twice per epoch with workers, so epoch 0 got epoch 1's batches."""

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __iter__(self):
        return iter(np.array_split(self.rng.permutation(8), 4))


class ShufflesLazily(ShufflesWithItsOwnGenerator):
    def __iter__(self):  # a generator: the second call's iterator is the one read, and the first drew nothing
        yield from np.array_split(self.rng.permutation(8), 4)


def test_an_index_sampler_holding_a_generator_with_a_plain_iter_is_named():
    why = codescan.global_draw(Plain(), batch_sampler=ShufflesWithItsOwnGenerator())
    assert why and "ShufflesWithItsOwnGenerator.__iter__" in why and "twice per epoch" in why, why
    assert codescan.global_draw(Plain(), batch_sampler=ShufflesLazily()) is None
    assert codescan.global_draw(Plain(), sampler=ShufflesWithItsOwnGenerator()) is None  # torch's BatchSampler


class SourceDrawingSometimes:
    """A GeneratorDataset source that draws for 2 rows in 5 (an audit's): the probe's spread rows drew none."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = np.full(4, i, np.float32)
        return (x + np.random.rand(4).astype(np.float32),) if i % 5 in (1, 2) else (x,)


class Scale:
    def __call__(self, x):
        return x * 2


def test_a_mindspore_stage_that_draws_in_its_code_is_named():
    assert codescan.stage_draw(SourceDrawingSometimes()) == (
        "SourceDrawingSometimes.__getitem__ calls numpy.random.rand (draws from the global generator)")
    assert codescan.stage_draw(operations=[Scale(), jitter]) == "jitter calls random.random (draws from the global " \
                                                                "generator)"
    assert codescan.stage_draw(Plain(), [Scale()]) is None
    assert codescan.stage_draw(NumpyHeld()) is None  # a held generator: the probe child names it


def test_mindspores_random_transforms_and_functions_are_draws():
    ms = pytest.importorskip("mindspore", reason="mindspore is not installed: its functions are found by identity")
    from mindspore.dataset import vision

    class Crops:
        def __init__(self):
            self.crop = vision.RandomCrop(4)

        def __getitem__(self, i):
            return self.crop(np.zeros((8, 8, 3), np.uint8))

    class Noise:
        def __getitem__(self, i):
            return ms.ops.rand(1).asnumpy()

    assert codescan.global_draw(Crops()) == ("Crops holds mindspore.dataset.vision.RandomCrop (draws from "
                                             "MindSpore's seed; workers are seeded apart)")
    assert codescan.stage_draw(Crops()) == "Crops holds mindspore.dataset.vision.RandomCrop (draws from MindSpore's seed)"
    assert codescan.global_draw(Noise()) == f"Noise.__getitem__ calls mindspore.ops.rand ({WORKERS_SEEDED_APART})"


@pytest.mark.parametrize("name, random", [("RandomCrop", True), ("AutoAugment", True), ("CutOut", True),
                                          ("CutMixBatch", True), ("SoftDvppDecodeRandomCropResizeJpeg", True),
                                          ("Decode", False), ("Resize", False), ("HWC2CHW", False)])
def test_mindspores_random_transforms_are_known_by_name_not_only_by_prefix(name, random):
    from ms_shm.engines.mindspore.profiles import is_random_transform

    assert is_random_transform(name) is random


RECENT = []


class WritesOnSomeRows:
    """State written on some rows only, as a retry's flag or a bad-sample list is (the resume audit)."""

    def __init__(self):
        self.failed, self.skipped, self.calls, self.cache, self.meta = False, [], 0, {}, Scale()

    def flag(self, i):
        if i == 7 and not self.failed:
            self.failed = True
        return i

    def bad_samples(self, i):
        if i == 41:
            self.skipped.append(i)
        return i

    def counter(self, i):
        self.calls += 1
        return i

    def cache_fill(self, i):
        self.cache[i] = i
        return i

    def nested(self, i):
        self.meta.last = i
        return i

    def through_a_helper(self, i):
        return self._remember(i)

    def _remember(self, i):
        global RECENT
        RECENT = RECENT[-3:] + [i]
        return i

    def vocabulary(self, i):  # in a comprehension: ``self`` is a cell there (3.9-3.11)
        return [self.cache.setdefault(w, len(self.cache)) for w in str(i)]

    def lazy_set_up(self, i):  # done once, maybe by a read the program made before the probe
        if self.meta is None:
            self.meta = Scale()
        if not hasattr(self, "index"):
            self.index = list(range(4))
        return i

    def load(self):  # builds the index: called by __init__ only, never by ``np.load`` below
        self.skipped = []

    def reads_a_module_function_named_as_a_method(self, i):
        return np.load(i)

    def guarded_with_a_condition(self, i):  # not set-up: the write waits for a row the probe may not read
        if self.meta is None and i == 60:
            self.meta = i
        return i

    def set_up_then_counted(self, i):
        if not hasattr(self, "seen"):
            self.seen = 0
        if i == 60:
            self.seen += 1
        return i

    def set_up_after_an_early_return(self, i):
        if self.meta is not None:
            return i
        self.meta = Scale()
        return i

    def reads_only(self, i):
        local = Scale()
        local.factor = 2  # a local object's attribute: not the source's state
        seen = []
        seen.append(i)
        return self.cache.get(i, i) + len(self.skipped) + len(seen)


@pytest.mark.parametrize("method, written", [
    ("flag", "self.failed"), ("bad_samples", "self.skipped.append()"), ("counter", "self.calls"),
    ("cache_fill", "self.cache[...]"), ("nested", "self.meta.last"), ("through_a_helper", "the global RECENT"),
    ("vocabulary", "self.cache.setdefault()"), ("lazy_set_up", None),
    ("reads_a_module_function_named_as_a_method", None), ("guarded_with_a_condition", "self.meta"),
    ("set_up_then_counted", "self.seen"), ("set_up_after_an_early_return", None), ("reads_only", None)])
def test_state_a_stage_writes_on_some_rows_is_named(method, written):
    source = type(f"Source_{method}", (WritesOnSomeRows,), {"__getitem__": getattr(WritesOnSomeRows, method)})()
    found = codescan.stage_writes(source)
    assert (found is None) if written is None else (found == f"Source_{method}.__getitem__ writes {written}"), found
    assert codescan.stage_writes(operations=[Scale(), jitter]) is None


class _Loads:
    def load(self, i):
        self.loaded = i
        return i


class _LoadsThroughSuper(_Loads):
    def __getitem__(self, i):  # ``np.load`` beside ``super().load``: LOAD_SUPER_ATTR on 3.12
        return super().load(i) if i == 60 else np.load


def test_a_method_reached_through_super_is_read_though_a_module_has_a_function_of_its_name():
    assert codescan.stage_writes(_LoadsThroughSuper()) == "_LoadsThroughSuper.__getitem__ writes self.loaded"


class EpochCounting:
    """Samplers that keep state in ``__iter__`` (the DataLoader audits): a plain ``__iter__`` runs twice per
    epoch with workers; a generator's body runs once, and only what it writes in its loop moves ahead of the
    training loop."""

    def __init__(self):
        self.epoch, self.position = 0, 0

    def __len__(self):
        return 4


class PlainEpochs(EpochCounting):
    def __iter__(self):
        self.epoch += 1
        return iter(np.random.default_rng(self.epoch).permutation(4).tolist())


class GeneratorEpochs(EpochCounting):
    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(4).tolist()
        self.epoch += 1
        yield from order


class GeneratorPositions(EpochCounting):
    def __iter__(self):
        for i in range(4):
            self.position += 1
            yield i


@pytest.mark.parametrize("sampler, written", [(PlainEpochs, "self.epoch"), (GeneratorEpochs, None),
                                              (GeneratorPositions, "self.position")])
def test_a_samplers_iter_writing_its_state_is_named_where_workers_move_it(sampler, written):
    found = codescan.sampler_writes(sampler())
    assert (found is None) if written is None else (found == f"the sampler's {sampler.__name__}.__iter__ writes "
                                                             f"{written}"), found
    assert codescan.sampler_writes(None, sampler()) == (found and found.replace("sampler's", "batch_sampler's"))


class _BadRowsSetUpLazily:
    """A count and a tuple of bad rows, created by the first read and added to on bad rows only (the
    GeneratorDataset audit's): the probe sees the set-up, never the additions."""

    rows = None

    def __getitem__(self, i):
        if not hasattr(self, "count"):
            self.count = 0
        if self.rows is None:
            self.rows = ()
        if i % 61 == 60:
            self.count += 1
            self.rows = self.rows + (i,)
        return i


class _SetUpOnly(_BadRowsSetUpLazily):
    def __getitem__(self, i):
        if self.rows is None:
            self.rows = ()
        self.last = i  # set, never added to
        return i


_LAZY_GLOBAL = None


class _GlobalsSetUpAndAddedTo:
    def lazily(self, i):  # a module's tokenizer, made by the first read: set up, not added to
        global _LAZY_GLOBAL
        if _LAZY_GLOBAL is None:
            _LAZY_GLOBAL = object()
        return i

    def counted(self, i):
        global RECENT
        RECENT = RECENT + [i] if i == 60 else RECENT
        return i


def test_state_added_to_on_some_rows_counts_beside_lazy_set_up():
    from ms_shm import sandbox

    globals_ = _GlobalsSetUpAndAddedTo
    assert codescan.stage_grows(type("Lazily", (globals_,), {"__getitem__": globals_.lazily})()) is None
    assert codescan.stage_grows(type("Counted", (globals_,), {"__getitem__": globals_.counted})()) == \
        "Counted.__getitem__ adds to the global RECENT"

    assert codescan.stage_grows(_BadRowsSetUpLazily()) == "_BadRowsSetUpLazily.__getitem__ adds to self.count"
    assert codescan.stage_grows(_SetUpOnly()) is None
    set_up = sandbox.Effects(mutates_state="_BadRowsSetUpLazily.count changed while rows were read")
    grown = set_up.with_writes("x writes self.count", codescan.stage_grows(_BadRowsSetUpLazily()))
    assert "adds to self.count" in grown.state_per_read, grown
    assert set_up.with_writes("x writes self.last", None) == set_up  # set up on the probe's rows: decided there


# --- reads through a raw descriptor's shared offset (``stage_offsets``) ------------------------------------------

import os  # noqa: E402 - with the cases that use it
from os import lseek as seek_to  # noqa: E402


class FdRecords:
    """The audit's record file: ``os.lseek`` then ``os.read`` on a descriptor opened in ``__init__``."""

    def __init__(self, fd):
        self.fd = fd

    def __getitem__(self, i):
        os.lseek(self.fd, i * 16, os.SEEK_SET)
        return np.frombuffer(os.read(self.fd, 16), np.uint8)


class FdThroughHelper(FdRecords):
    def _payload(self, i):
        seek_to(self.fd, i * 16)
        return os.read(self.fd, 16)

    def __getitem__(self, i):
        return self._payload(i)


class PositionalReads(FdRecords):
    def __getitem__(self, i):
        return os.pread(self.fd, 16, i * 16)  # its own offset: any reader may


@pytest.mark.parametrize("source, found", [
    (FdRecords(3), "FdRecords.__getitem__ calls os.lseek"),
    (FdThroughHelper(3), "FdThroughHelper.__getitem__ calls os.lseek through FdThroughHelper._payload"),
    (PositionalReads(3), None),
    (Sometimes(), None),  # draws are another question's
])
def test_reads_through_a_descriptors_shared_offset_are_found(source, found):
    said = codescan.stage_offsets(source)
    assert (said is None) if found is None else said.startswith(found + ": a descriptor's offset belongs to")


def test_a_map_operation_reading_a_descriptor_is_found_and_draws_still_are():
    assert "<lambda> calls os.read: " in codescan.stage_offsets(None, [lambda x: os.read(3, 4)])
    assert codescan.stage_offsets(None, [lambda x: np.random.rand()]) is None
    assert "numpy.random.rand" in codescan.stage_draw(None, [lambda x: np.random.rand()])


VISITS = np.zeros(300_000, np.int64)  # > 1 MiB: the probe's fingerprint does not sum it
BAD_ROWS: list = []
INDEX = {"a": 1}


class _Registry:
    def __init__(self):
        self.items = [0]


REGISTRY = _Registry()


class WritesIntoGlobals:
    def visit(self, x):
        VISITS[int(x[0])] += 1
        return x

    def mark_bad(self, i):
        if i % 7 == 3:
            BAD_ROWS.append(i)
        return i

    def through_a_helper(self, i):
        return _note(i)

    def into_an_attribute(self, i):
        REGISTRY.items[0] = i
        return i

    def reads_only(self, i, out=None):
        out = [0, 0] if out is None else out
        out[0] = VISITS[i]  # a local written with a global read
        out[int(VISITS[i])] += 1  # a global in the key
        return out, VISITS.shape[0], len(BAD_ROWS), sorted(BAD_ROWS), INDEX.get("a"), os.path.join("a", "b")

    def removes_a_file(self, i):
        os.remove(str(i))  # ``remove`` is a mutator's name, but ``os`` is a module
        return i


def _note(i):
    INDEX[i] = i


@pytest.mark.parametrize("method, written", [
    ("visit", "the global VISITS[...]"), ("mark_bad", "the global BAD_ROWS.append()"),
    ("through_a_helper", "the global INDEX[...]"), ("into_an_attribute", "the global REGISTRY[...]"),
    ("reads_only", None), ("removes_a_file", None)])
def test_rows_that_write_into_a_module_globals_contents_are_named(method, written):
    """What a row adds to a global container stays in the program where rows are read in it, and in each
    worker's copy where processes read them: an audit's visit count and list of bad samples read 0 after a map
    in worker processes, where raw's threads counted 150 and 16."""
    source = type(f"Globals_{method}", (WritesIntoGlobals,), {"__getitem__": getattr(WritesIntoGlobals, method)})()
    found, grown = codescan.stage_writes(source), codescan.stage_grows(source)
    if written is None:
        assert found is None and grown is None, (found, grown)
    else:
        assert found == f"Globals_{method}.__getitem__ writes {written}", found
        assert grown == f"Globals_{method}.__getitem__ adds to {written}", grown


def test_tensor_methods_that_return_a_drawn_tensor_are_draws():
    torch = _torch()

    class Dropped:
        def __getitem__(self, i):
            x = torch.ones(4)
            return x * torch.full_like(x, 0.5).bernoulli() if i % 16 == 7 else x

    class Sampled:
        def __getitem__(self, i):
            return torch.ones(4).multinomial(2)

    assert codescan.global_draw(Dropped()) == f"Dropped.__getitem__ calls Tensor.bernoulli ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(Sampled()) == f"Sampled.__getitem__ calls Tensor.multinomial ({WORKERS_SEEDED_APART})"


def test_a_data_librarys_own_code_is_not_the_programs():
    """pandas' ``DataFrame.iloc`` fills its own caches: read as the program's state, a dataset over a DataFrame
    lost its workers (an audit)."""
    from ms_shm import objects

    assert not objects.of_program("pandas.core.indexing") and not objects.of_program("PIL.Image")
    assert not objects.of_program("numpy.random") and not objects.of_program("collections")
    assert objects.of_program("mindcv.data.transforms") and objects.of_program("__main__")
    pd = pytest.importorskip("pandas", reason="pandas is not installed")

    class Rows:
        def __init__(self):
            self.df = pd.DataFrame({"a": np.arange(100), "b": np.arange(100) * 2.0})

        def __getitem__(self, i):
            return self.df.iloc[i].to_numpy()

    assert codescan.stage_writes(Rows()) is None and codescan.stage_grows(Rows()) is None


def _jitter(x):
    return x + np.random.normal()


def _identity(x):
    return x


AUGMENTATIONS = {"jitter": _jitter, "identity": _identity}
PLAIN = [_identity]


class CallsARegistry:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, i):
        return AUGMENTATIONS[self.name](float(i)) if i % 16 == 7 else float(i)


class CallsAPlainRegistry(CallsARegistry):
    def __getitem__(self, i):
        return PLAIN[0](float(i))


def test_a_draw_in_a_function_called_from_a_global_registry_is_found():
    """``AUGS[name](x)``: the registry's functions are read as the code may call any of them (an audit's drew
    ``np.random.normal`` for 2 samples of 16, and 2 workers drew them from their own seeds)."""
    assert codescan.global_draw(CallsARegistry("jitter")) == \
        f"CallsARegistry.__getitem__ calls numpy.random.normal through _jitter ({WORKERS_SEEDED_APART})"
    assert codescan.global_draw(CallsAPlainRegistry("identity")) is None
