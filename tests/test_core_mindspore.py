"""Acceptance: pipelines that die on raw MindSpore in Docker's 64 MB /dev/shm run, bit-exact, through ms_shm.

Each case first runs the raw pipeline and asserts that it fails the way users see it (which proves the
environment really is constrained), then runs the same pipeline through ms_shm and checks every row.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from tests import isolated

pytestmark = pytest.mark.mindspore

BUS = ("bus error", "Bus error")
EMFILE = ("Too many open files", "errno: 24")


def scenario(*args: str, **kwargs):
    cmd = f"exec {shlex.quote(sys.executable)} -m tests.scenarios " + " ".join(shlex.quote(a) for a in args)
    return isolated.run_shell(cmd, **kwargs)


def result_of(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, isolated.describe(proc)
    return json.loads(lines[-1][len("RESULT "):])


def assert_crashed(proc, *needles: str) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, "raw MindSpore was expected to fail here:\n" + isolated.describe(proc)
    assert "RESULT " not in proc.stdout
    if needles:
        assert any(n in text for n in needles), isolated.describe(proc)


def assert_all_rows(res: dict, rows: int) -> None:
    assert res["rows"] == rows and res["unique"] == rows, res


@pytest.mark.parametrize("kind,mb", [("fixed", 8), ("fixed", 2), ("ragged", 6), ("strings", 2)])
def test_small_dev_shm_raw_dies_ms_shm_delivers(real_mindspore, kind, mb):
    raw = scenario(kind, "--mode", "raw", "--mb", str(mb), shm="64m")
    assert_crashed(raw, *BUS)
    res = result_of(scenario(kind, "--mode", "ms_shm", "--mb", str(mb), shm="64m"))
    assert_all_rows(res, 64)
    assert res["in_order"]
    assert res["predicted_shm"] <= 64 * (1 << 20) * 0.8


def test_four_ranks_share_320m(real_mindspore):
    """Four ranks on one /dev/shm: raw sizes each as if alone and loses ranks; ms_shm splits the budget."""
    def ranks(mode: str):
        procs = []
        for r in range(4):
            env = f"RANK_SIZE=4 RANK_ID={r} DEVICE_ID={r}"
            procs.append(f"({env} {shlex.quote(sys.executable)} -m tests.scenarios fixed --mode {mode} --mb 4 "
                         f"--hold 4 > /tmp/ms_shm_rank_{mode}_{r}.out 2>&1; echo \"rank {r} rc=$?\")")
        script = " & ".join(procs) + " & wait; " + \
            f"for r in 0 1 2 3; do grep '^RESULT' /tmp/ms_shm_rank_{mode}_$r.out || echo NORESULT; done"
        return isolated.run_shell(script, shm="320m", timeout=600)

    raw = ranks("raw")
    assert raw.stdout.count("NORESULT") >= 1, isolated.describe(raw)
    shm = ranks("ms_shm")
    assert shm.stdout.count("NORESULT") == 0, isolated.describe(shm)
    results = [json.loads(line[len("RESULT "):]) for line in shm.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 4
    for res in results:
        assert_all_rows(res, 64)
        assert res["predicted_shm"] <= 320 * (1 << 20) * 0.8 / 4


def test_starved_soft_fd_limit(real_mindspore):
    raw = scenario("fixed", "--mode", "raw", "--mb", "1", shm="1g", nofile=40)
    assert_crashed(raw, *EMFILE)
    assert_all_rows(result_of(scenario("fixed", "--mode", "ms_shm", "--mb", "1", shm="1g", nofile=40)), 64)


def test_starved_hard_fd_limit_plans_within_it(real_mindspore):
    """Hard limit 40 too: tune() cannot raise it, so the plan must fit its slots' fds under it."""
    raw = scenario("fixed", "--mode", "raw", "--mb", "1", shm="1g", nofile=40, nofile_hard=40)
    assert_crashed(raw, *EMFILE)
    res = result_of(scenario("fixed", "--mode", "ms_shm", "--mb", "1", shm="1g", nofile=40, nofile_hard=40))
    assert_all_rows(res, 64)


def test_map_output_grows_to_8mb(real_mindspore):
    res = result_of(scenario("map", "--mode", "ms_shm", "--map-mb", "8", shm="64m"))
    assert_all_rows(res, 64)
    assert res["map_mode"] in ("threads", "processes", "inline")


def test_iterable_source_every_row_once(real_mindspore):
    res = result_of(scenario("generator", "--mode", "ms_shm", "--mb", "8", "--rows", "40", shm="64m"))
    assert_all_rows(res, 40)
    assert res["in_order"] and res["mode"] == "inline"


def test_spawn_start_method(real_mindspore):
    raw = scenario("fixed", "--mode", "raw", "--mb", "2", "--spawn", shm="64m", timeout=600)
    assert_crashed(raw, *BUS)
    res = result_of(scenario("fixed", "--mode", "ms_shm", "--mb", "2", "--spawn", shm="64m", timeout=600))
    assert_all_rows(res, 64)
    assert res["mode"] in ("processes", "pipes")


def test_train_and_eval_alive_together_share_one_budget(real_mindspore):
    """Each raw pipeline alone fits 64 MB (36 MiB); two alive together do not. ms_shm reserves per plan."""
    raw = scenario("pair", "--mode", "raw", "--mb", "1", shm="64m")
    assert_crashed(raw, *BUS)
    res = result_of(scenario("pair", "--mode", "ms_shm", "--mb", "1", shm="64m"))
    assert res["rows"] == 128
    assert res["predicted_shm"] <= 64 * (1 << 20) * 0.8


def test_map_on_a_dataset_ms_shm_did_not_build(real_mindspore):
    res = result_of(scenario("foreign-map", "--mode", "ms_shm", "--map-mb", "8", "--rows", "16", shm="64m"))
    assert_all_rows(res, 16)
    assert res["row_bytes"] == 8 << 20


def test_bad_row_fails_before_any_worker_starts(real_mindspore):
    proc = isolated.run_python("""
        import numpy as np, ms_shm
        class Src:
            def __getitem__(self, i):
                return np.zeros(4), (None if i == 5 else np.int64(i))
            def __len__(self):
                return 6
        try:
            ms_shm.build_dataset(Src(), ["image", "label"], num_parallel_workers=2)
        except ms_shm.RowError as exc:
            print("ERROR", exc)
    """, shm="64m")
    assert "ERROR column 'label' of row 5 is None" in proc.stdout, isolated.describe(proc)
    assert "Fix:" in proc.stdout


COW_SOURCE = """
import logging, sys, numpy as np, ms_shm
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
class ListSource:
    def __init__(self):
        self.captions = [f"caption {{i}}" for i in range(200_000)]
    def __getitem__(self, i):
        return np.frombuffer(self.captions[i].encode(), np.uint8).copy(), np.array(i, np.int64)
    def __len__(self):
        return 64
class ArraySource:
    def __init__(self):
        self.table = np.arange(200_000)
    def __getitem__(self, i):
        return np.array([self.table[i]]), np.array(i, np.int64)
    def __len__(self):
        return 64
src = {kind}()
ds = ms_shm.build_dataset(src, ["data", "label"], num_parallel_workers=2, python_multiprocessing=True,
                          shuffle=False, share_lists={share})
n = 0
for data, label in ds.create_tuple_iterator(output_numpy=True, num_epochs=1):
    if {kind!r} == "ListSource":
        assert bytes(data).decode() == f"caption {{int(label)}}"
    n += 1
print("ROWS", n, type(getattr(src, "captions", None)).__name__)
"""


@pytest.mark.parametrize("kind,share", [("ListSource", False), ("ListSource", True), ("ArraySource", False)])
def test_copy_on_read_warning_and_shared_lists(real_mindspore, kind, share):
    proc = isolated.run_python(COW_SOURCE.format(kind=kind, share=share), shm="1g")
    assert "ROWS 64" in proc.stdout, isolated.describe(proc)
    warned = "WARNING ms_shm.cow" in proc.stderr and "captions" in proc.stderr
    if kind == "ArraySource":
        assert "WARNING ms_shm.cow" not in proc.stderr, proc.stderr[-2000:]
    elif share:
        assert "SharedList" in proc.stdout and not warned, isolated.describe(proc)
    else:
        assert warned and ("200,000" in proc.stderr or "200000" in proc.stderr), proc.stderr[-2000:]
