"""``ms_shm.clean``: fake roots for every rule, then a real MindSpore crash in a private IPC namespace."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ms_shm import cleanup
from ms_shm.cleanup import KIND_DEV_SHM, KIND_IPC_FILE, KIND_MSG, KIND_SHM, clean, ftok

DEAD = 4_194_400  # above PID_MAX_LIMIT (4194304), so never alive on the real host either
LIVE = 777
SHM_HEADER = ("       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid"
              "      atime      dtime      ctime                   rss                  swap\n")
MSG_HEADER = ("       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid"
              "      stime      rtime      ctime\n")


class FakeHost:
    """A ``tmp_path`` tree laid out like ``/``: proc (with sysvipc), tmp, dev/shm."""

    def __init__(self, base: Path):
        self.root = base
        for sub in ("proc/sysvipc", "tmp", "dev/shm"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        self.shm_rows: list = []
        self.msg_rows: list = []
        self.live(LIVE)
        self.flush()

    def live(self, pid: int, fds: dict | None = None, maps: list | None = None) -> None:
        proc = self.root / "proc" / str(pid)
        (proc / "fd").mkdir(parents=True, exist_ok=True)
        for fd, target in (fds or {}).items():
            os.symlink(target, proc / "fd" / str(fd))
        lines = [f"7f0000000000-7f0000001000 rw-s 00000000 00:1b 12 {path}\n" for path in maps or ()]
        (proc / "maps").write_text("".join(lines))

    def ipc_file(self, pid: int, worker: int, uid: int | None = None) -> tuple:
        path = self.root / "tmp" / f"dataset_ipc_{pid}_140594783198080_{worker}"
        path.write_bytes(b"")
        if uid is not None:
            os.chown(path, uid, -1)
        return path, ftok(os.stat(path))

    def segment(self, key: int, shmid: int, size: int = 4 << 20, cpid: int = DEAD, lpid: int = DEAD,
                nattch: int = 0, uid: int = 0) -> None:
        self.shm_rows.append(f"{key:10d} {shmid:10d} 600 {size:21d} {cpid:5d} {lpid:5d} {nattch:6d} "
                             f"{uid:5d} 0 {uid:5d} 0 1796081584 0 1796081584 {size + 64:21d} 0\n")
        self.flush()

    def queue(self, key: int, msqid: int, lspid: int = DEAD, lrpid: int = DEAD, cbytes: int = 0,
              uid: int = 0) -> None:
        self.msg_rows.append(f"{key:10d} {msqid:10d} 600 {cbytes:11d} 0 {lspid:5d} {lrpid:5d} "
                             f"{uid:5d} 0 {uid:5d} 0 1796081584 1796081584 1796081583\n")
        self.flush()

    def dev_shm(self, name: str, size: int = 8192, uid: int | None = None, age: float = 3600) -> Path:
        """A ``/dev/shm`` file last written ``age`` seconds ago (a dead run's is older than a live job's batch)."""
        path = self.root / "dev" / "shm" / name
        path.write_bytes(b"\1" * size)
        if uid is not None:
            os.chown(path, uid, -1)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    def flush(self) -> None:
        (self.root / "proc/sysvipc/shm").write_text(SHM_HEADER + "".join(self.shm_rows))
        (self.root / "proc/sysvipc/msg").write_text(MSG_HEADER + "".join(self.msg_rows))

    def crashed_pipeline(self, pid: int = DEAD, workers: int = 2, first_id: int = 0) -> list:
        """What ``kill -9 -PGID`` leaves: per worker a key file, a segment and a queue."""
        keys = []
        for worker in range(workers):
            _, key = self.ipc_file(pid, worker)
            self.segment(key, first_id + worker, cpid=pid, lpid=pid + 3 + worker)
            self.queue(key, first_id + worker, lspid=pid + 3 + worker, lrpid=pid)
            keys.append(key)
        return keys


@pytest.fixture
def host(tmp_path):
    return FakeHost(tmp_path)


@pytest.fixture
def rmid(monkeypatch):
    """Record IPC_RMID calls instead of making them: ids under a fake root mean nothing to the kernel."""
    calls = []
    monkeypatch.setattr(cleanup, "_rmid", lambda kind, ipc_id, root: calls.append((kind, ipc_id)))
    return calls


def kinds(report) -> list:
    return sorted(item.kind for item in report.leftovers)


def test_ftok_matches_the_key_mindspore_used():
    """Measured: /tmp/dataset_ipc_4770_..._0 had st_dev 0x29, st_ino 0x3, and ipcs showed key 0x00290003."""
    st = os.stat_result((0o100600, 0x3, 0x29, 1, 0, 0, 0, 0, 0, 0))
    assert ftok(st) == 0x00290003
    big = os.stat_result((0o100600, 0x3F7E8, 0xFE00, 1, 0, 0, 0, 0, 0, 0))
    assert ftok(big) == 0x0000F7E8  # only the low byte of the device and 16 bits of the inode count


def test_dry_run_lists_a_crashed_pipeline_and_touches_nothing(host, rmid):
    host.crashed_pipeline()
    report = clean(root=host.root, uid=0)
    assert report.dry_run
    assert kinds(report) == [KIND_IPC_FILE] * 2 + [KIND_MSG] * 2 + [KIND_SHM] * 2
    assert not any(item.removed for item in report.leftovers)
    assert rmid == []
    assert len(list((host.root / "tmp").iterdir())) == 2
    assert report.bytes_freed == 0  # nothing was removed
    assert report.bytes_to_free == 2 * ((4 << 20) + 64)  # the segments' rss column
    text = "\n".join(report.lines())
    assert "would remove" in text and "8.0 MiB" in text and "--yes" in text
    assert all(item.owner_pid == DEAD for item in report.leftovers)
    assert report.to_dict()["leftovers"][0]["kind"] in (KIND_SHM, KIND_MSG)


def test_real_run_removes_and_logs_each_object(host, rmid, caplog):
    host.crashed_pipeline()
    with caplog.at_level(logging.INFO, logger="ms_shm.cleanup"):
        report = clean(dry_run=False, root=host.root, uid=0)
    assert sorted(rmid) == [(KIND_MSG, 0), (KIND_MSG, 1), (KIND_SHM, 0), (KIND_SHM, 1)]
    assert all(item.removed and item.error is None for item in report.leftovers)
    assert list((host.root / "tmp").iterdir()) == []
    assert report.bytes_freed == 2 * ((4 << 20) + 64) and report.bytes_to_free == 0
    assert sum("removed" in r.getMessage() for r in caplog.records) == 6
    assert "removed 6 object(s)" in "\n".join(report.lines())


def test_attached_or_live_objects_and_their_key_files_are_kept(host, rmid):
    _, attached = host.ipc_file(DEAD, 0)
    host.segment(attached, 10, nattch=1)
    _, live_sender = host.ipc_file(DEAD, 1)
    host.queue(live_sender, 11, lspid=LIVE)
    host.ipc_file(LIVE, 2)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == ()
    assert rmid == []
    assert len(list((host.root / "tmp").iterdir())) == 3  # removing a key file would lose the match


def test_key_files_of_finished_runs_go_even_without_objects(host, rmid):
    """Clean exits remove the SysV objects but never the files (strace showed no unlink)."""
    path, _ = host.ipc_file(DEAD, 0)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert [(item.kind, item.removed) for item in report.leftovers] == [(KIND_IPC_FILE, True)]
    assert not path.exists()


def test_a_live_main_process_keeps_its_objects_even_when_workers_died(host, rmid):
    _, key = host.ipc_file(LIVE, 0)
    host.segment(key, 3)
    host.queue(key, 3)
    assert clean(dry_run=False, root=host.root, uid=0).leftovers == ()


def test_other_users_objects_are_kept_unless_root(host, rmid):
    path, key = host.ipc_file(DEAD, 0, uid=1000)
    host.segment(key, 4, uid=1000)
    host.queue(key, 4, uid=1000)
    shm_file = host.dev_shm(f"mindspore_{DEAD}_abc_0", uid=1000)
    assert clean(root=host.root, uid=1234).leftovers == ()
    assert len(clean(root=host.root, uid=1000).leftovers) == 4
    assert len(clean(root=host.root, uid=0).leftovers) == 4
    assert path.exists() and shm_file.exists()


def test_dev_shm_patterns_of_dead_pids_are_removed(host, rmid):
    names = [f"mindspore_{DEAD}_8812_3", f"pym-{DEAD}-k2j3h", f"torch_{DEAD}_2955012_0", "sem.mp-abc123",
             f"ms_shm_list_{DEAD}_1a2b3c4d"]  # share_lists' block, left when a group kill took its resource tracker
    for name in names:
        host.dev_shm(name)
    bystanders = [host.dev_shm(name) for name in
                  ("sem.myapp", "postgres.123", f"mindspore_{LIVE}_1_0", f"pym-{LIVE}-x", "notes.txt",
                   f"ms_shm_list_{LIVE}_5e6f7a8b")]
    report = clean(dry_run=False, root=host.root, uid=0)
    assert sorted(Path(item.name).name for item in report.leftovers) == sorted(names)
    assert all(item.kind == KIND_DEV_SHM and item.removed for item in report.leftovers)
    assert report.bytes_freed == len(names) * 8192
    assert all(path.exists() for path in bystanders)


def test_an_unreaped_zombie_counts_as_dead(host, rmid):
    """``kill -9`` of a pipeline launched by a shell that never waits leaves its main process a zombie: it
    holds nothing, so its leftovers go; a process in any other state (or with an unreadable stat) stays live."""
    zombie, sleeping = 4242, 4343
    host.live(zombie)
    (host.root / "proc" / str(zombie) / "stat").write_text(f"{zombie} (python (x)) Z 1 4242 4242 0 -1\n")
    host.live(sleeping)
    (host.root / "proc" / str(sleeping) / "stat").write_text(f"{sleeping} (python) S 1 4343 4343 0 -1\n")
    gone = host.dev_shm(f"mindspore_{zombie}_1_0")
    kept = host.dev_shm(f"mindspore_{sleeping}_1_0")
    kept_unreadable = host.dev_shm(f"mindspore_{LIVE}_1_0")
    report = clean(dry_run=False, root=host.root, uid=0)
    assert [Path(item.name).name for item in report.leftovers] == [gone.name]
    assert not gone.exists() and kept.exists() and kept_unreadable.exists()


def test_a_running_jobs_batch_file_is_kept_however_the_first_snapshot_saw_it(host, rmid, monkeypatch):
    """torch's ``file_system`` strategy makes a ``/dev/shm`` file per batch in a worker: one forked after the
    process listing, or mapped by the main process after its maps were read, looked dead and unheld, and an
    audit's ``ms-shm clean --yes`` beside a live torch job unlinked its batches and killed it, 4 runs of 4. A file
    is now removed only where a second look, after the files were listed, still finds its pid dead and no
    holder, and where nothing wrote it in the last ``YOUNG_SECONDS``; a dead run's files still go."""
    fresh = host.dev_shm(f"torch_{DEAD}_1_0", age=0)  # just written: a batch in flight
    forked, worker = host.dev_shm("torch_4545_1_0"), 4545  # its worker appears after the first listing
    mapped = host.dev_shm(f"torch_{DEAD}_2_0")  # the main process maps it after its maps were read
    dead = host.dev_shm(f"torch_{DEAD}_3_0")
    first_look = cleanup._Processes

    def second_look_sees_more(root, *args):
        if getattr(second_look_sees_more, "taken", False):
            host.live(worker)
            host.live(LIVE + 1, maps=[f"/dev/shm/{mapped.name}"])
        second_look_sees_more.taken = True
        return first_look(root, *args)

    monkeypatch.setattr(cleanup, "_Processes", second_look_sees_more)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert [Path(item.name).name for item in report.leftovers] == [dead.name], report.lines()
    assert fresh.exists() and forked.exists() and mapped.exists() and not dead.exists()
    assert any(f"written in the last {cleanup.YOUNG_SECONDS:.0f} s" in note for note in report.notes), report.notes


def test_symlinks_are_never_followed_or_removed(host, rmid, tmp_path_factory):
    outside = tmp_path_factory.mktemp("victim") / "precious"
    outside.write_text("keep me")
    link = host.root / "dev/shm" / f"mindspore_{DEAD}_1_0"
    os.symlink(outside, link)
    os.symlink(outside, host.root / "tmp" / f"dataset_ipc_{DEAD}_1_0")
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == ()
    assert outside.read_text() == "keep me" and os.path.islink(link)
    assert sum("symlinks are never followed" in note for note in report.notes) == 2


def test_directories_with_known_names_are_not_touched(host, rmid):
    (host.root / "dev/shm" / f"torch_{DEAD}_1_0").mkdir()
    assert clean(dry_run=False, root=host.root, uid=0).leftovers == ()
    assert (host.root / "dev/shm" / f"torch_{DEAD}_1_0").is_dir()


def test_files_open_or_mapped_by_a_live_process_are_kept(host, rmid):
    opened = host.dev_shm(f"pym-{DEAD}-opened")
    mapped = host.dev_shm("sem.mp-mapped")
    key_file, _ = host.ipc_file(DEAD, 0)
    host.live(4242, fds={3: f"/dev/shm/{opened.name}", 4: f"/tmp/{key_file.name}"},
              maps=[f"/dev/shm/{mapped.name} (deleted)"])
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == ()
    assert opened.exists() and mapped.exists() and key_file.exists()


def test_semaphores_are_kept_when_some_maps_cannot_be_read(host, rmid):
    sem = host.dev_shm("sem.mp-unknown")
    host.live(4343)
    (host.root / "proc/4343/maps").unlink()
    (host.root / "proc/4343/maps").mkdir()  # reading it fails like a permission error would
    dead_pid_file = host.dev_shm(f"pym-{DEAD}-x")
    report = clean(dry_run=False, root=host.root, uid=0)
    assert sem.exists()
    assert not dead_pid_file.exists()  # pid-named files rest on the pid, not on the maps
    assert any("sem.mp-*" in note and "could not be read" in note for note in report.notes)


def test_orphan_keys_are_reported_and_removed_only_when_asked(host, rmid):
    key = 0x0000C0AB  # MindSpore's shape, but /tmp was wiped
    host.segment(key, 7)
    host.queue(key, 7)
    host.segment(0x0000C0AC, 8)  # a lone segment is not MindSpore's pair
    host.segment(0x5100C0AD, 9)  # proj_id 0x51
    host.queue(0x5100C0AD, 9)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == () and rmid == []
    assert any("0x0000c0ab" in note and "orphan_keys" in note for note in report.notes)
    forced = clean(dry_run=False, root=host.root, uid=0, orphan_keys=True)
    assert sorted(rmid) == [(KIND_MSG, 7), (KIND_SHM, 7)]
    assert all("file is gone" in item.reason for item in forced.leftovers)


def test_a_dry_run_reports_what_it_would_free_under_its_own_key(host, rmid):
    """`clean --json --dry-run` said "bytes_freed": 56844288 with nothing removed; now that is bytes_to_free."""
    host.crashed_pipeline()
    dry = json.loads(clean(root=host.root, uid=0).to_json())
    assert dry["dry_run"] and dry["bytes_freed"] == 0 and dry["bytes_to_free"] == 2 * ((4 << 20) + 64)
    assert "would remove 6 object(s), 8.0 MiB freed if run with --yes" in clean(root=host.root, uid=0).lines()
    real = json.loads(clean(dry_run=False, root=host.root, uid=0).to_json())
    assert real["bytes_freed"] == dry["bytes_to_free"] and real["bytes_to_free"] == 0


def test_every_unattached_segment_is_removed_or_kept_with_its_reason(host, rmid):
    """Doctor counts every segment nobody has attached as a leftover and sends the user to `ms-shm clean`; clean
    must account for each: the ones it removes, and for the rest why not."""
    host.crashed_pipeline()  # shmids 0, 1: removed
    host.segment(0x0000C0AB, 7)  # MindSpore's pair, key file gone: needs --orphan-keys
    host.queue(0x0000C0AB, 7)
    host.segment(0x0000D148, 8)  # MindSpore's shape, but no queue: not recognisably MindSpore's
    host.segment(0x7E00C0AD, 9)  # another proj_id
    host.segment(0, 12)  # IPC_PRIVATE
    _, live_key = host.ipc_file(LIVE, 5)
    host.segment(live_key, 13, cpid=LIVE)  # nattch 0, but its pipeline runs
    host.segment(0x0000C0AE, 14, uid=1000)
    host.segment(0x0000C0AF, 15, nattch=2)  # attached: doctor does not count it, and clean keeps it silently
    rows = cleanup.read_sysvipc(host.root / "proc/sysvipc/shm", [])
    doctor_count, _ = cleanup.procfs.detached_totals(rows)
    report = clean(root=host.root, uid=0)
    removed = [item.name.split()[1] for item in report.leftovers if item.kind == KIND_SHM]
    kept = {item.name.split()[1]: item for item in report.kept}
    assert sorted(removed) == ["0", "1"]
    assert len(removed) + len(kept) == doctor_count == 8
    assert kept["7"].why == cleanup.KEPT_ORPHAN and "--orphan-keys" in kept["7"].reason
    assert {kept[i].why for i in ("8", "9", "12", "14")} == {cleanup.KEPT_UNRECOGNISED}  # root: 14 is ours
    assert "no message queue" in kept["8"].reason and "ipcrm -m 8" in kept["8"].reason
    assert kept["13"].why == cleanup.KEPT_IN_USE and str(LIVE) in kept["13"].reason
    assert "15" not in kept
    text = report.lines()
    assert sum(line.startswith("kept: SysV shared memory segment") for line in text) == 6
    assert ("unattached SysV segments (what `ms-shm doctor` counts): 8: 2 would be removed, 1 kept (need "
            "--orphan-keys), 4 kept (not recognisably MindSpore's), 1 kept (of live processes)") in text
    as_user = clean(root=host.root, uid=1234)
    assert {item.name.split()[1]: item.why for item in as_user.kept}["14"] == cleanup.KEPT_OTHER_USER
    assert len(as_user.leftovers) == 0 and len(as_user.kept) == doctor_count


MAKE_DEAD_SEGMENTS = r"""
import ctypes, json, random, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
taken = set(json.loads(sys.argv[1]))  # ftok keys of /tmp/dataset_ipc files: ours must match none

def fresh(make, shape):
    while True:
        key = shape | random.randrange(0x1000, 0xFFFF) if shape is not None else 0
        if key in taken:
            continue
        ident = make(key, 0o600 | 0o1000 | (0o2000 if key else 0))  # IPC_CREAT | IPC_EXCL (not for IPC_PRIVATE)
        if ident >= 0:
            return key, ident
        if ctypes.get_errno() != 17:  # EEXIST: try another key
            sys.exit("shmget/msgget failed: errno %d" % ctypes.get_errno())

out = {}
for name, shape in (("lone", 0), ("foreign", 0x7E000000), ("private", None)):
    out[name] = fresh(lambda key, flags: libc.shmget(key, 1 << 20, flags), shape)
key, shmid = fresh(lambda key, flags: libc.shmget(key, 1 << 20, flags), 0)
out["pair"] = (key, shmid, libc.msgget(key, 0o600 | 0o1000))
print(json.dumps(out))
"""


def _remove_sysv(made: dict) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for _key, shmid, *queue in made.values():
        libc.shmctl(shmid, 0, None)  # IPC_RMID
        for msqid in queue:
            libc.msgctl(msqid, 0, None)


def _unattached_shmids() -> dict:
    return {row["shmid"]: row["cpid"] for row in cleanup.read_sysvipc(Path("/proc/sysvipc/shm"), [])
            if row.get("nattch") == 0}


def test_real_unattached_segments_of_a_dead_process_are_all_accounted_for():
    """Real segments made with shmget by a process that then exited, beside whatever this shared host holds: a
    dry run (read-only) names every unattached segment, as removed or kept with its reason."""
    if not Path("/proc/sysvipc/shm").exists():
        pytest.skip("no /proc/sysvipc on this host")
    taken = [ftok(entry.stat(follow_symlinks=False)) for entry in os.scandir("/tmp")
             if entry.name.startswith("dataset_ipc_")]
    made_by = subprocess.run([sys.executable, "-c", MAKE_DEAD_SEGMENTS, json.dumps(taken)], capture_output=True,
                             text=True, timeout=60)
    if made_by.returncode != 0:
        pytest.skip(f"cannot make SysV segments here: {made_by.stderr.strip()[-200:]}")
    made = json.loads(made_by.stdout)
    try:
        before = _unattached_shmids()
        report = clean()
        after = _unattached_shmids()
        removed = {int(item.name.split()[1]) for item in report.leftovers if item.kind == KIND_SHM}
        kept = {int(item.name.split()[1]): item for item in report.kept}
        stable = {shmid for shmid, cpid in before.items() if after.get(shmid) == cpid}  # others' may come and go
        assert stable <= removed | set(kept), (stable - removed - set(kept), report.lines())
        ours = {name: kept[made[name][1]] for name in ("lone", "foreign", "private", "pair")}
        assert ours["pair"].why == cleanup.KEPT_ORPHAN and "--orphan-keys" in ours["pair"].reason
        assert ours["lone"].why == cleanup.KEPT_UNRECOGNISED and "no message queue" in ours["lone"].reason
        assert ours["foreign"].why == ours["private"].why == cleanup.KEPT_UNRECOGNISED
        assert all(item.creator_pid and not os.path.exists(f"/proc/{item.creator_pid}") for item in ours.values())
        assert any(line.startswith("unattached SysV segments (what `ms-shm doctor` counts): ")
                   for line in report.lines())
    finally:
        _remove_sysv(made)
    assert not set(_unattached_shmids()) & {shmid for _, shmid, *_ in made.values()}


def test_ipc_private_segments_are_never_candidates(host, rmid):
    host.segment(0, 12)
    assert clean(dry_run=False, root=host.root, uid=0, orphan_keys=True).leftovers == ()


def test_fake_roots_never_reach_the_kernel(host):
    """Without the test seam, removal under a fake root must refuse, and keep the key file."""
    keys = host.crashed_pipeline()
    report = clean(dry_run=False, root=host.root, uid=0)
    sysv = [item for item in report.leftovers if item.kind in (KIND_SHM, KIND_MSG)]
    assert len(sysv) == 4 and all("refusing IPC_RMID" in item.error for item in sysv)
    assert not any(item.kind == KIND_IPC_FILE for item in report.leftovers)
    assert len(list((host.root / "tmp").iterdir())) == len(keys)
    assert report.bytes_freed == 0
    assert "FAILED" in "\n".join(report.lines()) and len(report.failed) == 4


def test_objects_that_vanish_meanwhile_are_no_failure(host, monkeypatch):
    def gone(kind, ipc_id, root):
        raise FileNotFoundError(errno.ENOENT, "already gone")

    monkeypatch.setattr(cleanup, "_rmid", gone)
    host.crashed_pipeline(workers=1)
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.failed == () and report.bytes_freed == 0
    assert [item.error for item in report.leftovers if item.kind != KIND_IPC_FILE] == ["already gone"] * 2
    assert any(item.kind == KIND_IPC_FILE and item.removed for item in report.leftovers)
    assert "already gone: SysV" in "\n".join(report.lines())


def test_a_recycled_id_is_left_alone(host, rmid):
    _, key = host.ipc_file(DEAD, 0)
    host.segment(key, 5)
    scan = cleanup._Scan(host.root, 0, cleanup._Processes(host.root), cleanup.engine_patterns())
    candidates, _ = cleanup._sysv_candidates(scan, cleanup._ipc_files(scan), False)
    host.shm_rows = []
    host.segment(key + 1, 5)  # the kernel gave id 5 to someone else in the meantime
    with pytest.raises(OSError) as info:
        candidates[0].undo()
    assert info.value.errno == errno.ESTALE and rmid == []


def test_unreadable_or_garbled_tables_become_notes(tmp_path):
    empty = clean(root=tmp_path)
    assert empty.leftovers == () and "cannot tell live processes" in empty.notes[0]
    host = FakeHost(tmp_path / "h")
    (host.root / "proc/sysvipc/shm").write_text(SHM_HEADER + "garbage line here\n")
    (host.root / "proc/sysvipc/msg").unlink()
    (host.root / "dev/shm").rmdir()
    report = clean(root=host.root, uid=0)
    assert report.leftovers == ()
    assert any("not numeric" in note for note in report.notes)
    assert any("msg" in note and "cannot read" in note for note in report.notes)
    assert any("cannot list" in note and "dev/shm" in note for note in report.notes)
    assert str(report).startswith("nothing to clean")


def test_contract_on_the_real_host_dry_run():
    """Read-only on the real machine: types only, never raises, never removes."""
    report = clean()
    assert report.dry_run and isinstance(report.bytes_freed, int)
    assert all(not item.removed for item in report.leftovers)
    json.loads(report.to_json())


# ------------------------------------------------------------------------------------- real MindSpore

CRASH_SCENARIO = r'''
import ctypes, json, os, signal, subprocess, sys, time
from ms_shm.cleanup import clean, read_sysvipc
from pathlib import Path

PROC = Path("/proc/sysvipc")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned workers come to us to be reaped

CHILD = """
import os, sys, numpy as np, mindspore.dataset as ds
def rows():
    for i in range(100000):
        yield (np.full((1 << 20,), i, dtype=np.float32),)  # 4 MiB
def plus(x):
    return x + 1
data = ds.GeneratorDataset(rows, ["x"], num_parallel_workers=1)
data = data.map(plus, input_columns=["x"], python_multiprocessing=True, num_parallel_workers=2)
for n, _ in enumerate(data.create_tuple_iterator(output_numpy=True, num_epochs=1)):
    if n == 4:
        open(sys.argv[1], "w").write(str(os.getpid()))
"""
marker = "/tmp/ms_shm_marker"
child = subprocess.Popen([sys.executable, "-c", CHILD, marker], start_new_session=True)
deadline = time.time() + 240
while not os.path.exists(marker) or not open(marker).read():
    if child.poll() is not None or time.time() > deadline:
        sys.exit("pipeline did not start: rc=%s" % child.poll())
    time.sleep(0.05)

def group(pgid):
    pids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = open("/proc/%s/stat" % name).read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.add(int(name))
    return pids

pids = group(child.pid)
os.killpg(child.pid, signal.SIGKILL)
deadline = time.time() + 30
while time.time() < deadline:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        pass
    if not any(os.path.exists("/proc/%d" % p) for p in pids):
        break
    time.sleep(0.05)

def ours():
    shm = [r for r in read_sysvipc(PROC / "shm", []) if r["cpid"] in pids or r["lpid"] in pids]
    msg = [r for r in read_sysvipc(PROC / "msg", []) if r["lspid"] in pids or r["lrpid"] in pids]
    return {"shm": shm, "msg": msg}

out = {"pids": sorted(pids), "main": child.pid, "before": ours(),
       "files": sorted(os.listdir("/tmp")), "ipcs": subprocess.run(["ipcs", "-m", "-q"],
       capture_output=True, text=True).stdout}
out["dry"] = clean(dry_run=True).to_dict()
out["after_dry"] = ours()
out["real"] = clean(dry_run=False).to_dict()
out["after"] = ours()
out["files_after"] = sorted(os.listdir("/tmp"))
try:  # an id that names nothing (private IPC namespace: harmless) counts as "already gone"
    __import__("ms_shm.cleanup").cleanup._libc_rmid("sysv-shm", 987654)
    out["bogus_rmid"] = "no error"
except FileNotFoundError:
    out["bogus_rmid"] = "FileNotFoundError"
print("RESULT " + json.dumps(out))
'''


def _run_private_ipc(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Like ``isolated.run_python`` but with a private IPC namespace and a private /tmp as well.

    SysV objects live in the IPC namespace, not the mount namespace: with ``unshare -i`` the real
    ``clean(dry_run=False)`` can only ever see (and remove) what this test's own pipeline leaked.
    """
    from tests import isolated

    env = dict(os.environ, PYTHONPATH=str(isolated.REPO), GLOG_v="3")
    script = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {isolated.private_tmp()} && "
              f"exec {sys.executable} -c \"$MS_SHM_CODE\"")
    env["MS_SHM_CODE"] = textwrap.dedent(code)
    return subprocess.run(["unshare", "-m", "-i", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(isolated.REPO))


@pytest.mark.mindspore
@pytest.mark.privileged
def test_real_map_pipeline_killed_as_a_group_leaks_and_clean_removes_it(real_mindspore):
    probe = subprocess.run(["unshare", "-m", "-i", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private IPC namespace: {probe.stderr.strip()[:200]}")
    result = _run_private_ipc(CRASH_SCENARIO)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, real_mindspore.describe(result)
    out = json.loads(lines[-1][len("RESULT "):])

    before = out["before"]
    assert len(before["shm"]) == 2 and len(before["msg"]) == 2, out
    assert all(row["nattch"] == 0 and row["size"] >= 4 << 20 for row in before["shm"]), out
    assert {row["key"] for row in before["shm"]} == {row["key"] for row in before["msg"]}
    assert all(f"{row['key']:08x}" in out["ipcs"] for row in before["shm"])
    key_files = [name for name in out["files"] if name.startswith(f"dataset_ipc_{out['main']}_")]
    assert len(key_files) == 2

    dry = out["dry"]
    assert dry["dry_run"] and out["after_dry"] == before
    listed = sorted(item["kind"] for item in dry["leftovers"])
    assert listed == [KIND_IPC_FILE] * 2 + [KIND_MSG] * 2 + [KIND_SHM] * 2, dry
    assert not any(item["removed"] for item in dry["leftovers"])
    assert dry["bytes_freed"] == 0 and dry["bytes_to_free"] >= 2 * (4 << 20)

    real = out["real"]
    assert all(item["removed"] and item["error"] is None for item in real["leftovers"]), real
    assert len(real["leftovers"]) == 6 and real["bytes_freed"] == dry["bytes_to_free"]
    assert out["after"] == {"shm": [], "msg": []}
    assert not any(name.startswith("dataset_ipc_") for name in out["files_after"])
    assert out["bogus_rmid"] == "FileNotFoundError"


def test_in_a_pid_namespace_of_its_own_nothing_resting_on_pids_goes_unless_the_ipc_is_the_containers_own(host, rmid):
    """An audit ran ``clean --yes`` in a PID namespace of its own that shared ``/dev/shm`` (what ``--ipc=host``, or
    a pod's containers, give): the live torch job's batch file, its pid not in that ``/proc``, was taken for a
    dead run's and removed, and the job aborted. A namespace's inode other than the host's marks it."""
    batch = host.dev_shm(f"torch_{DEAD}_3560029807_1")
    sem = host.dev_shm("sem.mp-x1y2z3")
    keys = host.crashed_pipeline(workers=1)  # a key file, an unattached segment and a queue: pids not listed
    (host.root / "proc/self/ns").mkdir(parents=True)
    (host.root / "proc/self/ns/pid").write_text("")  # any inode but the host namespace's 0xEFFFFFFC
    report = clean(dry_run=False, root=host.root, uid=0)
    assert report.leftovers == () and batch.exists() and sem.exists() and rmid == [], report.lines()
    assert [k.why for k in report.kept] == [cleanup.KEPT_UNSEEN] and keys
    assert any("PID namespace of its own" in n and "--private-ipc" in n for n in report.notes), report.notes
    assert "(but see the notes below)" in report.lines()[0]
    report = clean(dry_run=False, root=host.root, uid=0, private_ipc=True)
    assert sorted(i.kind for i in report.leftovers) == sorted([KIND_DEV_SHM, KIND_DEV_SHM, KIND_SHM, KIND_MSG,
                                                                KIND_IPC_FILE])
    assert not batch.exists() and not sem.exists()


def test_a_proc_hiding_other_users_processes_keeps_a_users_semaphores(host):
    """Under ``hidepid=2`` a user sees only their own processes: a semaphore another user's process maps would
    look unused (an audit: the "could not read" caution was gone, as hidden processes are not even listed)."""
    user = 4242
    sem = host.dev_shm("sem.mp-q1w2e3", uid=user)
    dead_run = host.dev_shm(f"pym-{DEAD}-abc", uid=user)  # the user's own processes are listed: judged as ever
    (host.root / "proc/self").mkdir(parents=True)
    (host.root / "proc/self/mountinfo").write_text(
        "22 27 0:21 / /proc rw,relatime shared:13 - proc proc rw,hidepid=2\n")
    report = clean(dry_run=True, root=host.root, uid=user)
    assert [Path(i.name).name for i in report.leftovers] == [dead_run.name], report.lines()
    assert any("hidepid=2" in n and "sem.mp-*" in n for n in report.notes), report.notes
    assert sem.exists()
