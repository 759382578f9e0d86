"""``ms_shm.procfs``: each /proc and statvfs fact read once, over fake trees; and every tool that reports the
fact gives the same number (doctor's probe, watch, clean, the guard, SharedList)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ms_shm import cleanup, host, procfs, shared_list
from ms_shm._results import mib
from ms_shm.engines.mindspore import guard
from ms_shm.watch import Watcher, descendants

SHM_HEADER = ("       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid"
              "      atime      dtime      ctime                   rss                  swap\n")


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def fixed_statvfs(monkeypatch):
    """A mount of 1000 blocks of 4 KiB: 300 free to root, 200 to everyone else (ext4 keeps a reserve)."""
    result = os.statvfs_result((4096, 4096, 1000, 300, 200, 0, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: result)
    return procfs.Space(total=1000 * 4096, free=200 * 4096, used=700 * 4096)


# ------------------------------------------------------------------------------------------------ statvfs


def test_statvfs_counts_free_as_a_user_and_used_as_written(fixed_statvfs):
    assert procfs.statvfs("/anywhere") == fixed_statvfs


@pytest.mark.parametrize("files, favail, out", [(100, 0, True), (100, 3, False), (0, 0, False)])
def test_statvfs_says_a_mount_is_out_of_inodes_only_where_it_has_a_limit(monkeypatch, files, favail, out):
    """A tmpfs out of inodes fails writes with ENOSPC though bytes are free; one mounted without a limit
    reports no inodes at all."""
    result = os.statvfs_result((4096, 4096, 1000, 300, 200, files, favail, favail, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: result)
    assert procfs.statvfs("/anywhere").out_of_files is out


def test_statvfs_of_a_real_directory_and_a_missing_one(tmp_path):
    st = os.statvfs(tmp_path)
    space = procfs.statvfs(tmp_path)
    assert space.total == st.f_blocks * st.f_frsize and space.total >= space.used >= 0
    with pytest.raises(OSError):
        procfs.statvfs(tmp_path / "missing")


def test_every_tool_reads_the_same_free_and_used_bytes(fixed_statvfs, tmp_path, monkeypatch):
    """doctor's probe, the guard, SharedList's reservation and watch agree on one mount."""
    assert host.read_shm(tmp_path, host._Notes()) == (fixed_statvfs.total, fixed_statvfs.free)
    assert guard._free_bytes(str(tmp_path)) == fixed_statvfs.free
    w = Watcher(pids=[], shm_path=tmp_path, sysv_path=tmp_path / "none")
    assert w._read_shm() == (fixed_statvfs.used, fixed_statvfs.total)
    monkeypatch.setattr(shared_list, "_SHM_DIR", str(tmp_path))

    def no_fallocate(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, "not supported here")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    with open(tmp_path / "block", "wb") as handle:
        with pytest.raises(OSError) as info:
            shared_list._reserve(handle.fileno(), fixed_statvfs.free + 1)
    assert info.value.errno == errno.ENOSPC and f"({mib(fixed_statvfs.free)} free)" in str(info.value)


# ------------------------------------------------------------------------------------------------ sysvipc


def test_sysvipc_rows_are_read_by_header_in_any_column_order(tmp_path):
    write(tmp_path, "proc/sysvipc/shm", "shmid key size\n  3  49154  8192\n\n  4  -1 100\n")
    rows = procfs.read_sysvipc(tmp_path, "shm")
    assert rows == [{"shmid": 3, "key": 49154, "size": 8192}, {"shmid": 4, "key": -1, "size": 100}]
    assert procfs.read_sysvipc(procfs.sysvipc_path(tmp_path, "shm")) == rows
    assert procfs.segment_totals(rows) == (2, 8292)


def test_garbled_rows_are_skipped_with_a_note_and_unreadable_tables_raise(tmp_path):
    write(tmp_path, "proc/sysvipc/msg", "key msqid\n1 2\nnot numbers\n")
    notes: list = []
    assert procfs.read_sysvipc(tmp_path, "msg", notes) == [{"key": 1, "msqid": 2}]
    assert notes == [f"{tmp_path}/proc/sysvipc/msg: line 3 is not numeric, skipped"]
    write(tmp_path, "proc/sysvipc/sem", "")
    assert procfs.read_sysvipc(tmp_path, "sem") == []
    with pytest.raises(OSError):
        procfs.read_sysvipc(tmp_path / "nowhere", "shm")
    with pytest.raises(ValueError):
        procfs.sysvipc_path(tmp_path, "shmem")


def test_doctor_watch_and_clean_count_the_same_segments(tmp_path):
    table = write(tmp_path, "proc/sysvipc/shm", SHM_HEADER
                  + "     49154          3   600     8389120  4242  4242      0     0     0     0     0"
                    " 0 0 0 8389120 0\n"
                  + "     49155          4   600    16777728  4242  4243      1     0     0     0     0"
                    " 0 0 0 4096 0\n"
                  + "garbage\n")
    notes = host._Notes()
    sysv = host.read_sysv(tmp_path, notes)
    w = Watcher(pids=[], shm_path=tmp_path, sysv_path=table, main_pid=4242)  # watch counts its job's: 4242's
    assert (sysv["sysv_segments"], sysv["sysv_bytes"]) == (2, 8389120 + 16777728)
    assert w._read_sysv() == (8389120 + 16777728, 2)
    assert len(cleanup.read_sysvipc(table, [])) == 2
    assert any("line 4 is not numeric" in note for note in notes)
    assert any("line 4 is not numeric" in note for note in w._notes)


# ------------------------------------------------------------------------------------------------ processes


def test_pids_and_zombies_of_a_fake_tree(tmp_path):
    write(tmp_path, "proc/10/stat", "10 (python (worker) ) Z 1 10 10 0 -1\n")
    write(tmp_path, "proc/11/stat", "11 (python) S 1 11 11 0 -1\n")
    (tmp_path / "proc/12").mkdir()  # stat unreadable: alive, the safe answer
    write(tmp_path, "proc/meminfo", "")
    assert sorted(procfs.pids(tmp_path)) == [10, 11, 12]
    assert [procfs.is_zombie(pid, tmp_path) for pid in (10, 11, 12)] == [True, False, False]
    with pytest.raises(OSError):
        procfs.pids(tmp_path / "nowhere")


def test_fd_targets_and_maps_drop_the_deleted_suffix(tmp_path):
    fd_dir = tmp_path / "proc/7/fd"
    fd_dir.mkdir(parents=True)
    os.symlink("/dev/shm/a (deleted)", fd_dir / "3")
    os.symlink("socket:[123]", fd_dir / "4")
    write(tmp_path, "proc/7/maps", "7f00-7f01 rw-s 00000000 00:1b 12 /dev/shm/b (deleted)\n"
                                   "7f01-7f02 rw-p 00000000 00:00 0\n")
    assert sorted(procfs.fd_targets(7, tmp_path)) == ["/dev/shm/a", "socket:[123]"]
    assert list(procfs.mapped_paths(7, tmp_path)) == ["/dev/shm/b"]
    with pytest.raises(FileNotFoundError):
        procfs.fd_targets(8, tmp_path)
    with pytest.raises(FileNotFoundError):
        list(procfs.mapped_paths(8, tmp_path))


def test_open_fds_do_not_count_the_listing_itself(tmp_path):
    """One rule for doctor and watch: listing /proc/self/fd opens one fd, which is not the process's own."""
    for fd in range(5):
        write(tmp_path, f"proc/self/fd/{fd}", "")
    assert procfs.open_fd_count("self", tmp_path) == 5  # a fake tree has no listing fd in it
    before = procfs.open_fd_count()
    assert before == len(os.listdir("/proc/self/fd")) - 1
    with open(tmp_path / "x", "w"):
        assert procfs.open_fd_count() == before + 1
        assert procfs.open_fd_count(os.getpid()) == before + 1
    assert host.read_nofile(Path("/"), host._Notes())[2] == before
    assert Watcher(pids=[])._own_fds()[0] == before


def test_descendants_follow_every_thread_of_a_fake_tree(tmp_path):
    write(tmp_path, "proc/1/task/1/children", "2 3")
    write(tmp_path, "proc/1/task/5/children", "4\n")
    write(tmp_path, "proc/2/task/2/children", "6")
    write(tmp_path, "proc/3/task/3/children", "")
    (tmp_path / "proc/4").mkdir()  # exited meanwhile: no task directory
    assert sorted(procfs.descendants(1, tmp_path)) == [2, 3, 4, 6]
    assert procfs.descendants(99, tmp_path) == []
    assert procfs.children_files_exist(tmp_path) is False
    assert descendants is procfs.descendants
