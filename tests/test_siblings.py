"""Other ranks of this job, found by their command line when /dev/shm filled up: real processes, no framework."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ms_shm import host, siblings

RANK = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from ms_shm import siblings
    shm = Path(sys.argv[1])
    held = open(shm / f"writing_{os.getpid()}", "wb+")
    held.write(b"x" * (3 << 20)); held.flush()
    os.rename(shm / f"writing_{os.getpid()}", shm / f"slot_{os.getpid()}")  # a sibling sees the slot once it is full
    def wait_for(prefix, n):
        deadline = time.time() + 30
        while len(list(shm.glob(prefix + "*"))) < n and time.time() < deadline:
            time.sleep(0.02)
    wait_for("slot_", 2)
    mine = siblings.find(shm)
    read, write = os.pipe()
    if os.fork() == 0:  # a forked worker of this rank finds the same sibling, not its own main process
        os.write(write, json.dumps(list(siblings.find(shm).pids)).encode()); os._exit(0)
    os.wait()
    worker = json.loads(os.read(read, 4096))
    (shm / f"done_{os.getpid()}").touch()
    wait_for("done_", 2)
    print(json.dumps({"pid": os.getpid(), "pids": list(mine.pids), "bytes": mine.shm_bytes, "worker": worker}))
""")


def test_two_copies_of_one_command_find_each_other_and_what_they_hold(tmp_path):
    """Two ranks started with one command line and no launcher variables: each names the other and the 3 MiB it
    holds, from its main process and from a forked worker; a process running another command is not counted."""
    shm = tmp_path / "shm"
    shm.mkdir()
    command = [sys.executable, "-c", RANK, str(shm)]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1]) for proc in ranks]
    finally:
        other.kill()
    pids = sorted(out["pid"] for out in outs)
    for out in outs:
        sibling = [pid for pid in pids if pid != out["pid"]]
        assert out["pids"] == sibling and out["worker"] == sibling
        assert out["bytes"] >= 3 << 20


def test_the_hint_names_siblings_only_beyond_the_ranks_planned(monkeypatch):
    monkeypatch.setattr(siblings, "find", lambda shm_path: siblings.Siblings((4242, 4243), 96 << 20))
    named, fix = host.sharing_hint(1)
    assert named.startswith("2 other process(es) run this same command here (pid 4242, 4243), holding 96.0 MiB")
    assert fix == ("tell every rank how many share /dev/shm: export LOCAL_WORLD_SIZE=3 (or MS_SHM_LOCAL_RANKS=3), "
                   "or ms_shm.tune(ranks=3); or ")
    planned, fix = host.sharing_hint(3)  # three ranks planned for: the siblings are not the cause named
    assert planned.startswith("ms_shm planned for 3 rank(s)") and "4242" not in planned and fix == ""


def test_nothing_found_where_proc_is_not_there(tmp_path):
    assert siblings.find(tmp_path, root=tmp_path, me=os.getpid()) is None


COPY = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from ms_shm import host
    marks = Path(sys.argv[1])
    (marks / str(__import__("os").getpid())).touch()
    deadline = time.time() + 30
    while len(list(marks.iterdir())) < int(sys.argv[2]) and time.time() < deadline:  # every copy is up
        time.sleep(0.02)
    ranks = host.probe().ranks
    (marks / "read").mkdir(exist_ok=True)
    (marks / "read" / str(__import__("os").getpid())).touch()
    while len(list((marks / "read").iterdir())) < int(sys.argv[2]) and time.time() < deadline:  # all read
        time.sleep(0.02)
    print(json.dumps([ranks.local_size, ranks.local_rank, ranks.source]))
""")
_LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK_SIZE", "RANK_ID", "WORLD_SIZE", "RANK", "MS_WORKER_NUM",
                  "MS_SHM_LOCAL_RANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS", "DEVICE_ID")


def _copies(tmp_path, n: int, **env: str) -> list:
    marks = tmp_path / "marks"
    marks.mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    command = [sys.executable, "-c", COPY, str(marks), str(n)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=dict(clean, **env)) for _ in range(n)]
    return [json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1]) for proc in procs]


def test_copies_of_one_command_with_no_launcher_plan_as_the_local_ranks_they_are(tmp_path):
    """An audit: 4 copies of one script, no launcher variables, a 256m /dev/shm: each planned as if alone (2 worker
    processes at prefetch 16) and 8 ranks of 12 died of ShmFullError where raw's defaults ran. Each copy now counts
    the copies running beside it, and says so."""
    outs = _copies(tmp_path, 3)
    assert sorted(out[1] for out in outs) == [0, 1, 2]
    assert all(out[0] == 3 and out[2].startswith("3 copies of this command line run here (pid ") for out in outs)


def test_a_launcher_that_says_how_many_is_believed_over_the_copies_seen(tmp_path):
    outs = _copies(tmp_path, 2, LOCAL_WORLD_SIZE="1")
    assert all(out[0] == 1 and out[2] == "LOCAL_WORLD_SIZE" for out in outs)
