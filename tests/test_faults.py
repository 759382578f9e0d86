"""Faults and bad inputs on real MindSpore 2.10, each under a private 64 MB /dev/shm and IPC namespace.

Every case ends in one of two outcomes: every row bit-exact, or a clear error (naming the row, the sizes and
the fix) before data is lost. And after every case, once all of its processes are gone, nothing is left:
no SysV segment or queue, no byte used in /dev/shm. Where a case claims the environment is hostile (a bus
error, a rejected column), raw MindSpore is run the same way first and its failure asserted.

The scenarios live in ``tests/fault_scenarios.py``; its ``drive`` role runs inside the namespace, hurts the
scenario when asked, waits for its whole session to exit, and measures what is left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import lru_cache

import pytest

from tests import isolated

pytestmark = [pytest.mark.mindspore, pytest.mark.privileged]

MiB = 1 << 20
BUS = "Unexpected bus error encountered in process"
WRAPPED = "Exception thrown from user defined Python function in dataset"


@lru_cache(maxsize=None)
def _no_ipc_namespace() -> str | None:
    probe = subprocess.run(["unshare", "-m", "-i", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot make a private IPC namespace: {probe.stderr.strip()[:200]}"


@pytest.fixture
def faults(real_mindspore):
    """Skip, with the reason, where a private mount + IPC namespace cannot be made."""
    why = _no_ipc_namespace()
    if why:
        pytest.skip(why)
    return drive


def drive(name: str, *args: str, shm: str = "64m", timeout: float = 150, may_hang: bool = False) -> dict:
    """Run one scenario in fresh namespaces (own /dev/shm, /tmp, SysV tables) and return the driver's report.

    The IPC namespace keeps SysV objects away from the host, so every object seen there is the scenario's
    and ``clean(dry_run=False)`` can only ever remove what the scenario leaked.
    """
    env = dict(os.environ, PYTHONPATH=str(isolated.REPO), GLOG_v="2")
    script = (f"mount -t tmpfs -o size={shm} tmpfs /dev/shm && {isolated.private_tmp()} && "
              f"exec {sys.executable} -m tests.fault_scenarios drive {name} " + " ".join(args))
    proc = subprocess.run(["unshare", "-m", "-i", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(isolated.REPO))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DRIVER ")]
    assert proc.returncode == 0 and lines, isolated.describe(proc)
    out = json.loads(lines[-1][len("DRIVER "):])
    assert may_hang or not out.get("timed_out"), describe(out)
    return out


def raw_reference(name: str, *args: str) -> dict:
    """Raw MindSpore run where it is expected to fail. Its main process may also never end once its workers
    died of SIGBUS (seen once, in CI: both workers' bus errors printed, then nothing until the driver's
    watchdog), so it gets a shorter watchdog and a hang counts as failing."""
    return drive(name, *args, "--timeout", "60", may_hang=True)


def assert_raw_died_of_bus_error(raw: dict) -> None:
    """Killed by MindSpore's own SIGTERM after a worker's SIGBUS, or hung after it."""
    assert BUS in raw["stderr"] and (raw["rc"] == -15 or raw.get("timed_out")), describe(raw)


def describe(out: dict) -> str:
    """The report for an assertion message, with the scenario's own output last."""
    short = {k: v for k, v in out.items() if k not in ("stderr", "stdout")}
    return (json.dumps(short, indent=1, default=str)[-6000:] + "\n--- scenario stdout ---\n" + out["stdout"]
            + "\n--- scenario stderr ---\n" + out["stderr"][-6000:])


def assert_nothing_left(out: dict) -> None:
    """No process of the scenario, no SysV object, no /dev/shm byte in use, once it is all over."""
    assert out["stragglers"] == [], describe(out)
    assert out["before"]["sysv"] == {"shm": [], "msg": []}
    final = out.get("after_clean_sysv", out["leftover_sysv"])
    assert final == {"shm": [], "msg": []}, describe(out)
    assert out["after"]["shm"]["used"] == 0, describe(out)


def result(out: dict) -> dict:
    assert out["rc"] == 0 and out["result"] is not None, describe(out)
    return out["result"]


def guard_message(error: str) -> str:
    """ms_shm's own line inside MindSpore's wrapper: the last ``XxxError: text`` line that is not the
    ``XxxError: Traceback ...`` line MindSpore writes when it re-raises a worker's exception."""
    found = re.findall(r"^(?:ms_shm\.\w+\.)?(\w+Error): (?!Traceback)(.*)$", error, re.M)
    assert found, error
    name, text = found[-1]
    return f"{name}: {text}"


# ------------------------------------------------------------------------------------------ killing


def test_worker_sigkilled_mid_epoch_ends_the_pipeline_with_mindspores_message_and_frees_everything(faults):
    """MindSpore's SIGCHLD handler names the worker and terminates the main process (rc -15): not silent,
    and every slot goes with it because each was unlinked when created."""
    out = faults("worker_kill", "--action", "kill-worker")
    ready = out["ready"]
    assert ready["plan"]["mode"] == "processes" and len(ready["workers"]) == 2, describe(out)
    assert ready["checked"] == [0, 1, 2, 3, 4]  # the rows delivered before the kill were bit-exact
    assert out["rc"] == -15, describe(out)
    # MindSpore's line, or, in the runs where its handler deadlocks (about 1 in 8), ms_shm's sentinel's, worded alike
    assert f"Dataset worker process {ready['workers'][0]} was killed by signal: Killed." in out["stderr"]
    assert_nothing_left(out)


def test_process_group_sigkilled_leaks_sysv_and_clean_removes_it(faults):
    """The OOM-killer case: nobody runs IPC_RMID, so the map workers' segments and queues stay (shown by
    ``ipcs``) until ``ms_shm.cleanup.clean`` removes them; /dev/shm itself is already empty."""
    out = faults("group_kill", "--action", "kill-group")
    assert out["ready"]["map_mode"] == "processes" and out["ready"]["checked"] == [0, 1, 2, 3, 4], describe(out)
    assert out["rc"] == -9
    leaked = out["leftover_sysv"]
    assert len(leaked["shm"]) == 2 and len(leaked["msg"]) == 2, describe(out)
    assert all(int(seg["nattch"]) == 0 and int(seg["size"]) >= 4 * MiB for seg in leaked["shm"])
    keys = sorted(int(seg["key"]) for seg in leaked["shm"])
    assert sorted(int(q["key"]) for q in leaked["msg"]) == keys
    assert all(f"0x{key:08x}" in out["ipcs"] for key in keys), out["ipcs"]
    main = out["ready"]["main"]
    assert [f.split("_")[2] for f in out["leftover_ipc_files"]] == [str(main)] * 2

    report = out["clean"]
    removed = sorted(item["kind"] for item in report["leftovers"] if item["removed"] and not item["error"])
    assert removed == ["ipc-file"] * 2 + ["sysv-msg"] * 2 + ["sysv-shm"] * 2, report
    assert report["bytes_freed"] >= 8 * MiB
    assert out["after_clean_sysv"] == {"shm": [], "msg": []}
    assert not any(f"0x{key:08x}" in out["after_clean_ipcs"] for key in keys), out["after_clean_ipcs"]
    assert out["after_clean_ipc_files"] == []
    assert_nothing_left(out)


# ---------------------------------------------------------------------------------------- /dev/shm


def test_dev_shm_filled_by_another_process_after_planning(faults):
    """Raw MindSpore has no check for dynamic slots: it dies of SIGBUS. The guard reads the free space when a
    slot is created and stops at the row that would not fit; the rows delivered before it are bit-exact."""
    raw = raw_reference("shm_filled_raw", "--action", "fill")
    assert raw["free_after_fill"] == 8 * MiB, describe(raw)
    assert_raw_died_of_bus_error(raw)
    assert_nothing_left(raw)

    out = faults("shm_filled", "--action", "fill")
    assert out["ready"]["planned_with"]["free"] == 64 * MiB and out["free_after_fill"] == 8 * MiB
    res = result(out)
    assert res["plan"]["mode"] == "processes" and res["bad"] == [], describe(out)
    assert WRAPPED in res["error"]
    message = guard_message(res["error"])
    # at the guard's check, or (the fill landing between the check and the copy) when the worker committed the slot
    match = re.match(r"ShmFullError: row (\d+) needs a new 1\.0 MiB shared-memory slot(?: plus 1\.0 MiB for the "
                     r"other 1 worker\(s\)' next slot)?, but /dev/shm (?:has only |had no room for it when the worker "
                     r"created it \()([\d.,]+) (MiB|KiB|B) free.*?: another worker of this pipeline grew its slots "
                     r"past its share for rows larger than the probe saw, or something else filled it after ms_shm "
                     r"planned this pipeline", message)
    assert match, message
    free = float(match.group(2).replace(",", "")) * {"MiB": MiB, "KiB": 1024, "B": 1}[match.group(3)]
    assert free < 2 * MiB, message
    # a bit-exact prefix of the rows before the refused one, and not an empty one (the refused row depends on
    # when the driver's fill lands: rows 2 and 7 measured)
    assert 1 <= res["rows"] <= int(match.group(1)), describe(out)
    assert "Fix: make room, this pipeline needs" in message and "ms-shm clean" in message
    assert_nothing_left(out)


# Where the guard must refuse in ``rows_larger``, worked out by hand (not by replaying ms_shm.guard):
# 64m tmpfs -> budget int(64 MiB x 0.8) = 53,687,091 B; the plan is processes, 2 workers, prefetch 16, so each
# worker has S = 18 slots and a share of (53,687,091 - 19 semaphore pages of 4096) // 2 = 26,804,633 B (25.6 MiB).
# Rows go round-robin: worker 0 gets even indices, worker 1 odd ones. Probe rows (0, 9, 18, 27, ...) are 1 MiB,
# every other row 12 MiB, each row filling a new slot (fewer than 18 rows per worker so far):
#   worker 0: row 0 -> 1 MiB, row 2 -> 13 MiB, row 4 -> 25 MiB (fits), row 6 -> 37 MiB: refused
#   worker 1: row 1 -> 12 MiB, row 3 -> 24 MiB (fits), row 5 -> 36 MiB: refused
# The first refused row in delivery order is 5. Over its share, a slot still goes on where /dev/shm has room now
# for it and as much again for the other worker (``SlotGuard._room_beyond_share``: 2 x 12 MiB): worker 1 reaching
# row 5 before worker 0 wrote row 4 finds 1 + 12 + 24 = 37 MiB in use, 27 MiB free, and goes on; worker 0 is then
# refused at row 6, its slots at 37 MiB (seen once, in a full suite on a loaded machine).
REFUSED_AT = {5: "36.0 MiB", 6: "37.0 MiB"}  # row -> its worker's slots then
# Worker 1 may also run far ahead of worker 0 (seen once in a full suite, a quiet machine): rows 1-9 written before
# row 2, its rows 5 and 7 going on over its share by that rule (26-39 MiB free each time, >= 2 x 12 MiB), row 9
# (1 MiB) too; worker 0 then finds 12.9 MiB free for row 2's 12 MiB plus 1 MiB kept for worker 1, and stops with
# ShmFullError before writing it. A clean stop, never a bus error (the guard of one worker does not see the
# other's slots: the wording names both causes). The mirror happens too (about 1 full suite in 10): worker 0
# writes rows 0-8 ahead (its rows 6 and 8 going on over its share by the same rule, 49 MiB in use), and worker
# 1, holding row 1's 12 MiB, finds 1.9 MiB free for row 3 and stops there. Which worker runs ahead is the
# scheduler's choice, so the refused row may be of either parity.
FAR_AHEAD = re.compile(r"ShmFullError: row (\d+) needs a new 12\.0 MiB shared-memory slot plus 1\.0 MiB for "
                       r"the other 1 worker\(s\)' next slot, but /dev/shm has only [\d.]+ MiB free: another worker "
                       r"of this pipeline grew its slots past its share")
WORKER_SHARE = 26_804_633


def test_rows_much_larger_than_the_probe_saw(faults):
    """Probe rows (``rows._spread``) are 1 MiB, all others 12 MiB. Raw: SIGBUS. ms_shm: bit-exact rows, then
    the guard's error at exactly the row its accounting predicts, naming sizes and the fix."""
    raw = raw_reference("rows_larger_raw")
    # Raw fails; by SIGBUS but for a loaded host, where its worker's fd hand-off (``resource_sharer``) met
    # ``EOFError`` first (one full run, three other jobs on the 2 cores): either way not ms_shm's subject here.
    assert raw["rc"] != 0, describe(raw)
    if "EOFError" not in raw["stderr"]:
        assert_raw_died_of_bus_error(raw)
        assert raw.get("timed_out") or "was killed by signal: Bus error" in raw["stderr"], describe(raw)
    assert_nothing_left(raw)

    out = faults("rows_larger")
    res = result(out)
    plan = res["plan"]
    assert (plan["mode"], plan["workers"], plan["prefetch"], plan["row_bytes"]) == ("processes", 2, 16, MiB), \
        describe(out)
    assert (plan["guard_slots"], plan["guard_worker_bytes"]) == (18, WORKER_SHARE)
    assert res["probed"] == [0, 9, 18, 27, 36, 45, 54, 63]
    message = guard_message(res["error"])
    ahead = FAR_AHEAD.match(message)
    if ahead:
        assert 1 <= res["rows"] <= int(ahead.group(1)) and res["bad"] == [], describe(out)
        assert_nothing_left(out)
        return
    k = int(message.split("row ", 1)[1].split()[0]) if message.startswith("RowTooLargeError: row ") else None
    assert k in REFUSED_AT, message
    assert message.startswith(f"RowTooLargeError: row {k} is 12.0 MiB, ms_shm planned rows of 1.0 MiB: this "
                              f"worker's 18 shared-memory slots would grow to {REFUSED_AT[k]}, over its 25.6 MiB "
                              f"share of /dev/shm"), message
    assert "which would end in a bus error. Fix: give /dev/shm at least" in message
    assert "for rows of 12.0 MiB (docker run --shm-size=" in message
    assert WRAPPED in res["error"]
    # rows 0..4, bit-exact (all 5 in every measured run); a pipeline that delivered none of them fails
    assert 1 <= res["rows"] <= k and res["bad"] == [], describe(out)
    assert_nothing_left(out)


def test_rows_somewhat_larger_than_the_probe_saw_all_arrive(faults):
    """1.3 MiB rows after 1 MiB probe rows still fit each worker's share: every row, bit-exact, no error."""
    out = faults("rows_bit_larger")
    res = result(out)
    assert res["plan"]["mode"] == "processes", describe(out)
    assert res == dict(res, rows=64, bad=[], error=None)
    assert_nothing_left(out)


# -------------------------------------------------------------------------------------- bad sources


def test_source_raising_at_row_k_surfaces_as_in_raw_mindspore_in_every_transport(faults):
    """The user's exception reaches the user as raw MindSpore delivers it: inside MindSpore's RuntimeError,
    with its type, its message and the line of the user's code that raised it (ms_shm's guard lets it through
    unchanged).

    What arrives before the error is a bit-exact prefix of rows 0..36, not always all of them: MindSpore
    aborts the pipeline on the first error and drops rows fetched ahead but not yet delivered: at most its
    16-row connector (``op_connector_size``) of them, we infer, so at least 21 arrive (measured: 37 with processes,
    23 to 34 with threads, 31 to 36 inline; raw 36).
    """
    res = result(out := faults("source_raises"))
    for mode in ("processes", "threads", "inline", "raw"):
        run = res[mode]
        if mode != "raw":
            assert run["plan"]["mode"] == mode, describe(out)
        assert run["error"].startswith(f"RuntimeError: {WRAPPED}"), (mode, run["error"][:300])
        assert "ValueError: bad jpeg header" in run["error"], (mode, run["error"][-600:])
        assert re.search(r'fault_scenarios\.py", line \d+, in __getitem__', run["error"]), mode
        assert "SourceError" not in run["error"]
        assert run["bad"] == [] and 37 - 16 <= run["rows"] <= 37, (mode, run)
    assert_nothing_left(out)


def test_len_lying(faults):
    """``__len__`` too large: raw MindSpore delivers up to 40 rows, then an IndexError without an index;
    ms_shm builds the pipeline as MindSpore would (the error is MindSpore's to raise, mid-epoch), and its probe,
    which reads the last index, says so in a warning that names the row and the fix, and plans from the rows
    read before it (unplanned, its slots filled a 64 MB /dev/shm before that row: an audit). Too small: both read
    exactly ``len`` rows and never look further."""
    res = result(out := faults("len_lying"))
    assert res["larger"]["error"] is None, res["larger"]
    assert ("the source's probe row 63 raised IndexError: list index out of range" in out["stderr"]
            and "if the data has fewer rows, __len__ is wrong" in out["stderr"]
            and "planned from the" in out["stderr"]), out["stderr"][-2000:]
    raw = res["larger_raw"]
    assert 40 - 16 <= raw["rows"] <= 40 and raw["bad"] == [], raw  # at most a 16-row connector is dropped
    assert "IndexError: list index out of range" in raw["error"]
    assert "source[" not in raw["error"]
    for run in (res["smaller"], res["smaller_raw"]):
        assert run == {"rows": 30, "bad": [], "error": None}
    assert_nothing_left(out)


def test_non_deterministic_shapes_arrive_bit_exact(faults):
    """A new shape per row (seeded by index, recomputed here) and a new shape per *call* (the probe saw other
    shapes than the workers): every row is exactly what the source returned."""
    res = result(out := faults("random_shapes"))
    assert res["seeded"]["plan"]["mode"] == "processes", describe(out)
    for run in (res["seeded"], res["per_call"]):
        assert run["rows"] == 64 and run["bad"] == [] and run["error"] is None, run
    assert res["per_call"]["shapes"] > 32
    assert_nothing_left(out)


GOOD = ["zero_d", "empty", "all_empty_some_rows", "non_contiguous", "strings", "dict_row", "column_types_match",
        "dict_with_none", "column_types_string", "schema_types_match"]
# Cases bad at one row: where ms_shm stops ("build": the probe, before any worker) and what it says, or the
# row after which MindSpore itself raises, as it does raw (a bad row the probe did not read).
BAD_AT = {
    "none_at_probe": ("build", "RowError: row 0 is None: the source returned nothing. Fix: return a tuple"),
    "dict_two_columns": ("build", "RowError: row 0 is a dict with keys ['x', 'y']"),
    "none_later": (5, f"RuntimeError: {WRAPPED}"),
    "object_later": (5, f"RuntimeError: {WRAPPED}"),
}
# Columns raw MindSpore 2.10 refuses under NumPy 2: refused by ms_shm at build, quoting MindSpore's own words.
REFUSED_AT_BUILD = {
    "list_column": "MindSpore's row conversion raises ValueError: Unable to avoid copy",
    "python_scalars": "MindSpore's row conversion raises ValueError: Unable to avoid copy",
    "numpy_scalar": "MindSpore's row conversion raises ValueError: Unable to avoid copy",
    "ragged_list": "MindSpore's row conversion raises ValueError: Unable to avoid copy",
    "big_endian": "RowError: column 'a' of row 0 has byte order >f4",
    "column_types_differ": "RowError: column 'b' of row 0 is int32, but column_types gives it Int64",
    "column_types_string_bytes": "RowError: column 'a' of row 0 is |S6, but column_types gives it String",
    "schema_types_differ": "RowError: column 'b' of row 0 is int64, but its schema gives it int32",
}
# What raw MindSpore 2.10 (NumPy 2) does with the same sources, so the cases above prove something.
RAW_FAILS = {
    "list_column": "Unable to avoid copy", "python_scalars": "Unable to avoid copy",
    "numpy_scalar": "Unable to avoid copy", "list_row": "inhomogeneous shape",
    "none_at_probe": "Unable to avoid copy",
    "column_types_differ": "should be same with specified column_types",
    "column_types_string_bytes": "should be same with specified column_types",
    "schema_types_differ": "should be same with specified column_types",
}
RAW_PASSES = GOOD


def test_bad_inputs_are_carried_exactly_or_refused_naming_row_column_and_fix(faults):
    """Through ms_shm (processes, 2 workers) every row raw MindSpore carries arrives with its values, shape and
    dtype; a row MindSpore refuses is refused at build when the probe read it (naming the column where there is
    one, with the fix and MindSpore's own words), and otherwise by MindSpore itself, after the rows before it
    arrived intact, exactly as raw. A list row fails at read in both (MindSpore's C++ side)."""
    res = result(out := faults("bad_inputs"))
    for name in GOOD:
        assert res[name] == {"rows": 16, "bad": [], "error": None, "at": "read"}, (name, res[name])
    for name, text in REFUSED_AT_BUILD.items():
        run = res[name]
        assert run["at"] == "build" and text in run["error"] and "Fix:" in run["error"], (name, run)
    for name, (where, text) in BAD_AT.items():
        run = res[name]
        assert run["bad"] == [], (name, run)
        if where == "build":
            assert run["at"] == "build" and run["error"].startswith(text), (name, run)
        else:
            assert 1 <= run["rows"] <= where and run["error"].startswith(text), (name, run)
    assert res["list_row"]["at"] == "read" and res["list_row"]["rows"] == 0
    assert_nothing_left(out)


def test_rows_that_are_not_tuples_are_read_where_mindspore_iterates_them(faults):
    """A source of ``[image, label]`` rows (or a deque, or a generator of columns) whose work is pure Python:
    ms_shm chose 2 worker processes, whose queue carries a row that is not a tuple as one column, and every
    epoch failed ("Exception thrown from user defined Python function", "Cannot pickle <class 'generator'>")
    where raw's default, MindSpore's own thread, iterates it for its columns. Such rows are now read in this
    process: raw's rows."""
    res = result(out := faults("row_kinds"))
    for kind in ("list", "deque", "generator"):
        assert res[kind + "_raw"] == {"rows": 12, "bad": [], "error": None}, (kind, res)
        assert res[kind]["mode"] in ("inline", "threads"), (kind, res[kind])
        assert {k: v for k, v in res[kind].items() if k != "mode"} == res[kind + "_raw"], (kind, res)
    assert_nothing_left(out)


def test_raw_mindspore_rejects_what_ms_shm_refuses_at_build(faults):
    """The environment claim behind the early refusals: raw 2.10 fails on scalars, lists and big-endian
    arrays, and carries non-contiguous arrays, empty arrays and dict rows correctly (no copy needed)."""
    res = result(out := faults("bad_inputs_raw"))
    for name, text in RAW_FAILS.items():
        assert res[name]["rows"] == 0 and text in res[name]["error"], (name, res[name])
    assert res["big_endian"]["rows"] == 0 and res["big_endian"]["error"].startswith("RuntimeError")
    assert "data type is unknown" in out["stderr"] or "data type is unknown" in res["big_endian"]["error"]
    for name in RAW_PASSES:
        assert res[name] == {"rows": 16, "bad": [], "error": None, "at": "read"}, (name, res[name])
    assert_nothing_left(out)


def test_iterable_sources_give_the_same_epochs_as_raw_mindspore(faults):
    """Re-iterables, generator functions, generator objects (MindSpore replays them), one-shot iterators (one
    epoch only), zips (MindSpore makes a list): ms_shm passes them on untouched, so every epoch is raw's, and
    columns raw MindSpore rejects (big-endian, lists) are rejected the same way."""
    res = result(out := faults("iterables"))
    for kind in ("iterable", "generator_function", "generator_object", "one_shot_iterator", "zip"):
        raw, ours = res[f"{kind}/raw"], res[f"{kind}/ms_shm"]
        assert raw["error"] is None and ours == raw, (kind, raw, ours)
    assert [len(e) for e in res["one_shot_iterator/ms_shm"]["epochs"]] == [10, 0]
    assert [len(e) for e in res["generator_object/ms_shm"]["epochs"]] == [10, 10]
    assert res["odd_columns/raw"]["epochs"] == [] and WRAPPED in res["odd_columns/raw"]["error"]
    assert res["odd_columns/ms_shm"]["epochs"] == [] and WRAPPED in res["odd_columns/ms_shm"]["error"]
    assert_nothing_left(out)


# ----------------------------------------------------------------------------------- broken hosts


def test_missing_dev_shm(faults):
    """No /dev/shm at all: the probe says why it is unknown, the plan avoids shared memory (threads) and the
    rows arrive; insisting on processes is refused up front. Raw MindSpore fails to start its workers."""
    res = result(out := faults("no_dev_shm", "--hide", "dev_shm"))
    assert res["exists"] is False and res["shm_free"] is None
    assert res["notes"] and res["notes"][0].startswith("statvfs(/dev/shm): FileNotFoundError")
    # num_parallel_workers=2 was passed, so ms_shm keeps 2 workers; without /dev/shm only threads carry them
    assert (res["default"]["plan"]["mode"], res["default"]["plan"]["workers"]) == ("threads", 2), res["default"]
    assert res["default"]["rows"] == 32 and res["default"]["bad"] == [] and res["default"]["error"] is None
    assert res["forced"]["error"].startswith("ShmBudgetError: No configuration honouring num_parallel_workers=2, "
                                             "python_multiprocessing=True fits"), res["forced"]
    assert "/dev/shm unknown" in res["forced"]["error"]
    assert res["raw"]["rows"] == 0 and "Init multiprocessing.Event() failed" in res["raw"]["error"]
    assert_nothing_left(out)


def test_unreadable_proc(faults):
    """/proc masked by an empty tmpfs: the probe returns None with a note for each fact, never raises.
    MindSpore's worker processes need /proc (psutil on their own pid), so ms_shm plans threads, and refuses
    an explicit ``python_multiprocessing=True`` with the reason instead of psutil's NoSuchProcess."""
    res = result(out := faults("no_proc", "--hide", "proc"))
    assert res["proc_empty"] is True
    facts = res["facts"]
    assert facts["mem_total"] is None and facts["open_fds"] is None and facts["shmmax"] is None
    assert facts["shm_free"] == 64 * MiB and facts["usable_cpus"] >= 1
    assert any(note.startswith("/proc/meminfo: FileNotFoundError") for note in res["notes"])
    default = res["default"]
    assert default["plan"]["mode"] == "threads" and default["rows"] == 32 and default["bad"] == [], default
    assert default["error"] is None
    assert res["forced"]["error"].startswith("ProcessesUnavailableError: python_multiprocessing=True cannot work here: psutil "
                                             "cannot read this process (NoSuchProcess"), res["forced"]
    assert "Fix: mount /proc" in res["forced"]["error"]
    assert res["raw"]["rows"] == 0 and res["raw"]["error"].startswith("NoSuchProcess")
    assert_nothing_left(out)
