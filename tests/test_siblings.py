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
