"""One home for the numbers several tools print: units, the ``--shm-size`` a need rounds to, headroom, and the
open-files need and target. ``doctor``, ``plan``, ``tune``, the guard, ``watch`` and ``explain`` all call these,
so they agree on every figure (``tests/test_sizes.py`` pins them).
"""

from __future__ import annotations

import math

from ms_shm.errors import UsageError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096

# The share of free /dev/shm ms_shm plans to use. MindSpore's own static pre-check refuses at 80% too, and the
# rest is room for what other processes of the container write meanwhile.
HEADROOM = 0.8

FD_MARGIN = 8  # what the user's own code may open while the pipeline runs
NOFILE_FLOOR = 65536  # the open-files limit ms_shm asks for at least: what most distributions' hard limit allows


def with_headroom(nbytes: int) -> int:
    """The /dev/shm that holds ``nbytes`` with ms_shm's headroom."""
    return math.ceil(nbytes / HEADROOM)


def shm_size_flag(nbytes: int) -> str:
    """Round up to a size people write in a Dockerfile: a power of two below 1 GiB, whole GiB above; never less
    than Docker's default 64m. Docker reads ``m``/``g`` as MiB/GiB.

    Examples:
        >>> shm_size_flag(300 * MiB), shm_size_flag(800 * MiB), shm_size_flag(int(6.25 * GiB))
        ('512m', '1g', '7g')
    """
    nbytes = max(int(nbytes), 64 * MiB)
    if nbytes <= GiB:
        size = 64
        while size * MiB < nbytes:
            size *= 2
        return "1g" if size >= 1024 else f"{size}m"
    return f"{math.ceil(nbytes / GiB)}g"


def where_to_set(nbytes: int) -> str:
    """Where a container's /dev/shm of ``nbytes`` is set, as the guards' fixes say it."""
    return (f"docker run --shm-size={shm_size_flag(nbytes)}, or a Kubernetes emptyDir with medium: Memory and "
            f"that sizeLimit")


def k8s_size(flag: str) -> str:
    """Kubernetes spells Docker's ``512m``/``2g`` as ``512Mi``/``2Gi`` (``512m`` would mean 0.512 bytes)."""
    return flag[:-1] + ("Mi" if flag.endswith("m") else "Gi")


def parse_size(text: str) -> int:
    """Bytes of a Docker-style size (``64m``, ``2g``, ``512Mi``, ``1.5G``, ``4096``); binary units, like Docker.

    Raises:
        UsageError: the text is not a size.
    """
    raw = text.strip().lower().replace(" ", "")
    for suffix in ("ib", "b", "i"):
        if raw.endswith(suffix) and len(raw) > len(suffix) and raw[-len(suffix) - 1] in "kmgt":
            raw = raw[: -len(suffix)]
            break
    units = {"k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
    scale = 1
    if raw and raw[-1] in units:
        scale, raw = units[raw[-1]], raw[:-1]
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (try 64m, 512m, 2g)") from None
    if value < 0 or not math.isfinite(value * scale):  # 1e308g is a finite float and an infinite size
        raise UsageError(f"not a size: {text!r}")
    return int(value * scale)


def fds_needed(pipeline_fds: int, open_fds: int | None, pipelines: int = 1) -> int:
    """Fds the main process needs: what is open now, a margin, and ``pipelines`` pipelines' own fds (a train and
    an eval pipeline alive together are two)."""
    return (open_fds or 0) + FD_MARGIN + pipelines * pipeline_fds


def nofile_target(need: int) -> int:
    """The open-files limit to ask for: ``need`` rounded up to 1024 x 4^k, and at least ``NOFILE_FLOOR``."""
    target = 1024
    while target < need:
        target *= 4
    return max(target, NOFILE_FLOOR)


def nofile_within(need: int, hard: int | None) -> int:
    """``nofile_target(need)``, never past the hard limit (``None``: unlimited): what a soft limit is raised to."""
    target = nofile_target(need)
    return target if hard is None else min(hard, target)


__all__ = ["KiB", "MiB", "GiB", "PAGE", "HEADROOM", "FD_MARGIN", "NOFILE_FLOOR", "with_headroom", "shm_size_flag", "where_to_set",
           "k8s_size", "parse_size", "fds_needed", "nofile_target", "nofile_within"]
