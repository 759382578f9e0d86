"""How each MindSpore release moves rows between processes: one profile per release, the one place that knows
how releases differ (facts sheet sections 6 and 10). Pure: importable without MindSpore.

A contributor adding a release's behaviour adds or changes a branch of ``profile_for`` and the test that pins it
(``tests/test_profiles.py``).
"""

from __future__ import annotations

import re

from ms_shm._results import Result, record

# Releases whose behaviour ms_shm models, oldest first (``ms-shm plan`` prints one row per release).
KNOWN_VERSIONS = ("2.3", "2.10")

# numpy kinds a MindSpore dataset column can hold: bool, ints, floats, unicode and bytes strings. Complex,
# datetime, structured and object arrays fail in C++ with "Failed to create tensor from numpy array, data type
# is unknown" (measured on 2.10).
CARRIED_KINDS = {"b": "bool", "i": "int", "u": "uint", "f": "float", "U": "str", "S": "bytes"}
# MindSpore transforms that draw random numbers beside every ``Random*`` class (vision, transforms, audio; 2.0 to
# 2.10): their rows depend on which worker runs them. The ``random`` flag MindSpore sets tells too little (most of
# these lack it, as do many fixed transforms). An audit: seeded maps of AutoAugment, RandAugment, CutOut and
# CutMixBatch gave other images with the one worker ms_shm chose than with MindSpore's default of 2.
RANDOM_TRANSFORMS = frozenset({"AutoAugment", "RandAugment", "TrivialAugmentWide", "UniformAugment", "CutOut", "Cutout",
                               "CutMixBatch", "MixUpBatch", "MixUp", "BoundingBoxAugment", "FrequencyMasking",
                               "TimeMasking", "MaskAlongAxisIID", "Dither", "GriffinLim"})
# (``GriffinLim`` draws only with ``rand_init=True``, its default: counted as drawing, the safe side)


def is_random_transform(class_name: str) -> bool:
    """Whether a transform of this class draws random numbers (``RANDOM_TRANSFORMS``); "Random" anywhere in the
    name counts (``SoftDvppDecodeRandomCropResizeJpeg``)."""
    return "Random" in class_name or class_name in RANDOM_TRANSFORMS


def random_mindspore_base(cls: type) -> type | None:
    """The MindSpore random transform ``cls`` is or derives from (``mindspore.dataset``'s own classes only): a
    user's ``class TrainCrop(vision.RandomCrop)`` draws as ``RandomCrop`` does (an audit: its map was planned on
    one thread, where raw's two workers drew other crops)."""
    for base in getattr(cls, "__mro__", ()):
        if is_random_transform(base.__name__) and (getattr(base, "__module__", "") or "").startswith("mindspore."):
            return base
    return None


# dtypes (native byte order) of arrays MindSpore's iterator hands out from a dict column (``Tensor.np_types``, 2.10),
# beside strings; any other array there raises its TypeError as the row is yielded
DICT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
               "float64", "bool", "complex64", "complex128")


@record
class EngineProfile(Result):
    """How one MindSpore version moves rows between processes. Unknown versions get the newest profile."""

    version: str | None
    generator_default_max_rowsize_mb: int | None  # None = dynamic slots sized to each row
    map_transport: str  # "sysv" (2.7+: one SysV segment per worker) or "shm-pool" (<=2.6: /dev/shm slots)
    map_default_max_rowsize_mb: int | None
    map_checks_dev_shm: bool  # 2.7.0 pre-checks /dev/shm for map/batch with a static max_rowsize
    max_rowsize_deprecated: bool
    shared_mem_switch_deprecated: bool
    note: str
    precheck_error: str = "RuntimeError"  # the class MindSpore raises from its static /dev/shm pre-check
    dynamic_failure: str = "Bus error when /dev/shm fills"  # what a dynamic slot past the end does
    # 2.0.0's watchdog reaps any child (waitpid(-1)), so ~18% of worker teardowns leave a worker's static slots
    # committed until the process ends: a fresh iterator per epoch then fails the pre-check (measured; 0 of 21
    # leaked with set_enable_watchdog(False)).
    watchdog_leaks_slots: bool = False
    map_teardown_seconds: float = 1.05  # closing a map/batch process pool (2.10: close_worker sleeps per worker)
    threads_need_dev_shm: bool = False  # 2.0.0 makes a multiprocessing.Value for threads too (measured)
    generator_objects_replay: bool = True  # 2.0.0 gives a generator object once, not every epoch
    # Rows read in MindSpore's own process (inline, threads) are carried without a copy where the source returned
    # contiguous arrays it holds: three 300 MiB rows iterated or not, the same peak RSS on 2.7.2, 2.8.0, 2.9.0 and
    # 2.10.0; 2.0.0 copies each (+900 MiB). 2.1-2.6 not measured: copied.
    rows_by_reference: bool = True


def parse_version(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


# The releases ``profile_for`` models, first and last: outside them a version is planned as the nearest one
MODELED = ((2, 0), (2, 10))


def modeled_releases() -> tuple:
    """``("2.0", ..., "2.10")``: every minor release ``profile_for`` was measured across."""
    (major, first), (_, last) = MODELED
    return tuple(f"{major}.{minor}" for minor in range(first, last + 1))


def is_modeled(version: str) -> bool:
    """``version`` (``2.7`` or ``2.7.1``) is a release ``profile_for`` models, not one it would silently plan as
    another."""
    return bool(re.fullmatch(r"\d+\.\d+(\.\d+)?", version)) and \
        MODELED[0] <= (parse_version(version) or (0, 0)) <= MODELED[1]


def profile_for(version: str | None) -> EngineProfile:
    """The transport rules of a MindSpore version (facts sheet section 6)."""
    v = parse_version(version)
    if v is None:
        return EngineProfile(version, None, "sysv", None, False, True, True,
                             "MindSpore version unknown: assuming the newest measured behaviour (2.10)")
    if v <= (2, 0):
        return EngineProfile(version, 6, "shm-pool", 16, True, False, False,
                             "2.0: static 6 MiB Generator slots and 16 MiB map slots, all in /dev/shm; each "
                             "iterator leaves static slots behind for the next",
                             precheck_error="Exception", watchdog_leaks_slots=True, map_teardown_seconds=0.6,
                             threads_need_dev_shm=True, generator_objects_replay=False, rows_by_reference=False)
    if v <= (2, 3):
        return EngineProfile(version, 6, "shm-pool", 16, True, False, False,
                             "<=2.3: static 6 MiB Generator slots and 16 MiB map slots, all in /dev/shm",
                             rows_by_reference=False)
    if v <= (2, 6):
        return EngineProfile(version, None, "shm-pool", None, True, v >= (2, 6), False,
                             "2.4-2.6: dynamic slots; map/batch still use /dev/shm slots", rows_by_reference=False)
    if v < (2, 8):
        return EngineProfile(version, None, "sysv", None, True, True, False,
                             "2.7: map/batch through SysV, but a static max_rowsize is still checked on /dev/shm",
                             map_teardown_seconds=6.3)
    if v < (2, 10):
        return EngineProfile(version, None, "sysv", None, False, True, True,
                             "2.8+: dynamic Generator slots; map/batch through SysV", map_teardown_seconds=1.2)
    return EngineProfile(version, None, "sysv", None, False, True, True,
                         "2.8+: dynamic Generator slots; map/batch through SysV")


__all__ = ["EngineProfile", "profile_for", "parse_version", "is_modeled", "modeled_releases", "MODELED",
           "KNOWN_VERSIONS", "CARRIED_KINDS", "DICT_DTYPES", "RANDOM_TRANSFORMS", "is_random_transform",
           "random_mindspore_base"]
