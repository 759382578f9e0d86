"""``host.probe`` over fake roots: cgroup v1/v2, limits on a parent, no limit, unreadable files, launcher env.

Every tree is written under ``tmp_path`` (psutil's ``PROCFS_PATH`` way), never by patching ``open``. Whatever
is unreadable must come back as ``None`` plus a note, and the CLI must print it as "could not determine".
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

import pytest

from ms_shm import advice, cli, host

GiB = 1 << 30
MiB = 1 << 20


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def base_tree(root: Path) -> Path:
    """A plausible host: meminfo, kernel SysV limits, an empty sysvipc table, a /dev/shm directory."""
    write(root, "proc/meminfo", "MemTotal:       16384000 kB\nMemFree:         8000000 kB\n"
                                "MemAvailable:   12000000 kB\n")
    for name, value in (("shmmax", "18446744073692774399"), ("shmall", "18446744073692774399"),
                        ("shmmni", "4096"), ("msgmni", "32000")):
        write(root, f"proc/sys/kernel/{name}", value + "\n")
    write(root, "proc/sysvipc/shm", "       key      shmid perms       size  cpid  lpid nattch   uid   gid\n")
    (root / "proc/self/fd").mkdir(parents=True)
    for fd in range(5):
        (root / f"proc/self/fd/{fd}").write_text("")
    (root / "dev/shm").mkdir(parents=True)
    return root


def probe(root: Path, env: dict | None = None, **kw) -> host.HostFacts:
    return host.probe(root=root, env=env or {}, **kw)


# ------------------------------------------------------------------------------------------- cgroups


def test_cgroup_v1_memory_limit_and_cpu_quota(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "12:memory:/docker/abc\n5:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    write(root, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{512 * MiB}\n")
    write(root, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", f"{100 * MiB}\n")
    write(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    write(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    facts = probe(root)
    assert facts.cgroup_version == "v1"
    assert facts.cgroup_mem_limit == 512 * MiB
    assert facts.cgroup_mem_usage == 100 * MiB
    assert facts.cpu_quota == pytest.approx(1.5)
    assert facts.usable_cpus == 1  # int(1.5) CPUs of quota, like loky
    assert facts.memory_limit == 512 * MiB  # tighter than the 15.6 GiB of RAM


def test_cgroup_v1_without_limit(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "12:memory:/\n5:cpu,cpuacct:/\n")
    write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    facts = probe(root)
    assert facts.cgroup_version == "v1"
    assert facts.cgroup_mem_limit is None
    assert facts.cpu_quota is None
    assert facts.memory_limit == 16384000 * 1024


def test_cgroup_v2_limit_and_quota(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", f"{GiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.current", f"{200 * MiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "200000 100000\n")
    facts = probe(root)
    assert facts.cgroup_version == "v2"
    assert facts.cgroup_mem_limit == GiB
    assert facts.cgroup_mem_usage == 200 * MiB
    assert facts.cpu_quota == pytest.approx(2.0)


def test_cgroup_v2_nested_limit_on_parent(tmp_path):
    """Kubernetes often sets the pod's limit on the pod cgroup and leaves the container's at "max"."""
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/memory.max", f"{2 * GiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/cpu.max", "50000 100000\n")
    write(root, "sys/fs/cgroup/kubepods/memory.max", f"{64 * GiB}\n")
    facts = probe(root)
    assert facts.cgroup_mem_limit == 2 * GiB
    assert facts.cpu_quota == pytest.approx(0.5)
    assert facts.usable_cpus == 1


def test_cgroup_v2_no_limit(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "0::/\n")
    write(root, "sys/fs/cgroup/memory.max", "max\n")
    write(root, "sys/fs/cgroup/cpu.max", "max 100000\n")
    facts = probe(root)
    assert (facts.cgroup_version, facts.cgroup_mem_limit, facts.cpu_quota) == ("v2", None, None)


def test_cgroup_v2_garbage_becomes_a_note(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "0::/\n")
    write(root, "sys/fs/cgroup/memory.max", "lots\n")
    write(root, "sys/fs/cgroup/cpu.max", "abc 0\n")
    facts = probe(root)
    assert facts.cgroup_mem_limit is None and facts.cpu_quota is None
    assert any("memory.max" in n and "ValueError" in n for n in facts.notes)


def test_no_cgroup_filesystem(tmp_path):
    root = base_tree(tmp_path)
    facts = probe(root)  # no /proc/self/cgroup at all
    assert facts.cgroup_version is None and facts.cgroup_mem_limit is None
    assert any("proc/self/cgroup" in n for n in facts.notes)


# ------------------------------------------------------------------------------------------- unreadable


def unreadable(path: Path) -> None:
    """Make a file unreadable even for root: a directory where a file should be (read raises EISDIR)."""
    if path.exists():
        path.unlink()
    path.mkdir(parents=True)


def test_unreadable_files_become_none_and_notes(tmp_path):
    root = base_tree(tmp_path)
    unreadable(root / "proc/meminfo")
    unreadable(root / "proc/sys/kernel/shmmax")
    (root / "proc/sys/kernel/msgmni").write_bytes(b"\xff\xfe\x00")  # not UTF-8
    unreadable(root / "proc/sysvipc/shm")
    facts = probe(root)
    assert facts.mem_total is None and facts.mem_available is None
    assert facts.shmmax is None and facts.msgmni is None and facts.sysv_segments is None
    assert facts.shmmni == 4096  # the readable ones are still read
    notes = "\n".join(facts.notes)
    for name in ("meminfo", "shmmax", "msgmni", "sysvipc"):
        assert name in notes


def test_unknown_facts_print_as_could_not_determine(tmp_path):
    root = base_tree(tmp_path)
    unreadable(root / "proc/meminfo")
    unreadable(root / "proc/sys/kernel/shmmax")
    unreadable(root / "proc/sysvipc/shm")
    (root / "dev/shm").rmdir()
    facts = probe(root)
    typical = advice.Typical.of(facts)
    rows = dict(cli.fact_rows(facts, None, "MindSpore is not importable", typical))
    assert rows["RAM"].startswith("could not determine (")
    assert "could not determine" in rows["/dev/shm"]
    assert "shmmax could not determine" in rows["SysV limits"]
    assert rows["SysV in use"].startswith("could not determine")
    assert rows["cgroup"].startswith("could not determine")
    assert rows["dataset config"] == "could not determine (MindSpore is not importable)"
    assert "None" not in "\n".join(rows.values())
    findings = advice.diagnose(facts)  # and the rules do not trip over the Nones either
    assert any(f.code == "shm-missing" for f in findings)
    assert any("could not determine" in f.problem for f in findings if f.severity == "info")


def test_missing_dev_shm(tmp_path):
    root = base_tree(tmp_path)
    (root / "dev/shm").rmdir()
    facts = probe(root)
    assert facts.shm_total is None and facts.shm_free is None
    assert any(n.startswith("statvfs(") and "FileNotFoundError" in n for n in facts.notes)
    first = advice.diagnose(facts)[0]
    assert (first.code, first.severity) == ("shm-missing", "crash")


def test_dev_shm_reads_statvfs_of_the_mount(tmp_path):
    root = base_tree(tmp_path)
    facts = probe(root)
    st = os.statvfs(root / "dev/shm")
    assert facts.shm_total == st.f_blocks * st.f_frsize
    assert facts.open_fds == 5


def test_meminfo_available_above_total_is_distrusted(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/meminfo", "MemTotal: 1000 kB\nMemFree: 400 kB\nMemAvailable: 5000 kB\n")
    facts = probe(root)
    assert facts.mem_available == 400 * 1024
    assert any("MemAvailable" in n for n in facts.notes)


def test_sysv_segments_counted(tmp_path):
    root = base_tree(tmp_path)
    write(root, "proc/sysvipc/shm",
          "       key      shmid perms                  size  cpid  lpid nattch   uid   gid\n"
          "     49154          3   600               8389120  4242  4242      0     0     0\n"
          "     49155          4   600              16777728  4242  4243      1     0     0\n")
    facts = probe(root)
    assert facts.sysv_segments == 2
    assert facts.sysv_bytes == 8389120 + 16777728
    assert (facts.sysv_detached_segments, facts.sysv_detached_bytes) == (1, 8389120)  # nattch 0: nobody's


# ------------------------------------------------------------------------------------------- where we run


@pytest.mark.parametrize("setup, env, expected", [
    (lambda r: None, {}, None),
    (lambda r: (r / ".dockerenv").write_text(""), {}, "docker"),
    (lambda r: write(r, "run/.containerenv", ""), {}, "podman"),
    (lambda r: None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "kubernetes"),
    (lambda r: write(r, "proc/1/cgroup", "0::/kubepods/burstable/pod1/abc\n"), {}, "kubernetes"),
    (lambda r: write(r, "proc/1/cgroup", "12:memory:/docker/abc\n"), {}, "docker"),
])
def test_container_detection(tmp_path, setup, env, expected):
    root = base_tree(tmp_path)
    setup(root)
    assert probe(root, env).container == expected


@pytest.mark.parametrize("env, size, rank, source", [
    ({}, 1, 0, "default"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 4, 2, "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}, 8, 3, "LOCAL_WORLD_SIZE"),  # torchrun
    ({"MS_WORKER_NUM": "4", "RANK_ID": "1"}, 4, 1, "assumed all on this host"),  # msrun, one host (it does not say)
    ({"MS_WORKER_NUM": "16", "RANK_ID": "11"}, 8, 3, "assumed 8 per host"),  # msrun, two hosts
    ({"RANK_SIZE": "2", "DEVICE_ID": "1"}, 2, 1, "RANK_SIZE=2"),
    ({"MS_SHM_LOCAL_RANKS": "3"}, 3, 0, "MS_SHM_LOCAL_RANKS"),
    # srun -n 4 without --ntasks-per-node: the per-node layout, this node's entry
    ({"SLURM_NTASKS": "4", "SLURM_LOCALID": "2", "SLURM_TASKS_PER_NODE": "4"}, 4, 2, "SLURM_TASKS_PER_NODE"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_TASKS_PER_NODE": "8", "SLURM_NODEID": "3", "SLURM_LOCALID": "0"},
     1, 0, "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_TASKS_PER_NODE": "3,5", "SLURM_LOCALID": "1"}, 5, 1, "SLURM_TASKS_PER_NODE"),  # node unknown: largest
    # a local rank proves as many ranks here: msrun's DEVICE_ID on a 16-device host, a rank without a count
    ({"MS_WORKER_NUM": "16", "RANK_SIZE": "16", "RANK_ID": "11", "DEVICE_ID": "11"}, 12, 11, "at least 12"),
    ({"LOCAL_RANK": "3"}, 4, 3, "a local rank without a local size"),
    ({"LOCAL_RANK": "0"}, 1, 0, "a local rank without a local size"),  # not "no launcher variables"
    # torch.distributed.launch (legacy) and mp.spawn scripts: the global count only, as msrun's
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 2, 0, "WORLD_SIZE=2 (assumed all on this host)"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, 2, 1, "WORLD_SIZE=2 (assumed all on this host)"),
    ({"WORLD_SIZE": "16", "RANK": "9"}, 8, 1, "WORLD_SIZE=16 (assumed 8 per host)"),
    # launchers an audit found unread (each rank planned as if alone: 3 of 4 died of ShmFullError under 64 MB)
    ({"MV2_COMM_WORLD_LOCAL_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "2"}, 4, 2, "MV2_COMM_WORLD_LOCAL_SIZE"),
    ({"HOROVOD_LOCAL_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}, 4, 1, "HOROVOD_LOCAL_SIZE"),
    ({"PALS_LOCAL_SIZE": "3", "PALS_LOCAL_RANKID": "2"}, 3, 2, "PALS_LOCAL_SIZE"),
    ({"JSM_NAMESPACE_LOCAL_SIZE": "2", "JSM_NAMESPACE_LOCAL_RANK": "1"}, 2, 1, "JSM_NAMESPACE_LOCAL_SIZE"),
    # a count ms_shm cannot read is said in the source, not silently dropped
    ({"MS_SHM_LOCAL_RANKS": "abc", "LOCAL_WORLD_SIZE": "2"}, 2, 0, "MS_SHM_LOCAL_RANKS='abc' ignored"),
])
def test_ranks_from_launcher_env(tmp_path, env, size, rank, source):
    facts = probe(base_tree(tmp_path), env)
    assert (facts.ranks.local_size, facts.ranks.local_rank) == (size, rank)
    assert source in facts.ranks.source


def test_ranks_override_wins(tmp_path):
    facts = probe(base_tree(tmp_path), {"LOCAL_WORLD_SIZE": "8"}, ranks=2)
    assert (facts.ranks.local_size, facts.ranks.source) == (2, "override")


@pytest.mark.parametrize("env", [{"MS_WORKER_NUM": "32"}, {"SLURM_LOCALID": "5"}])
def test_assumed_ranks_are_said_in_the_findings(tmp_path, env):
    facts = probe(base_tree(tmp_path), env)
    assert any(f.code == "ranks-assumed" for f in advice.diagnose(facts))


def test_real_host_contract():
    """On the real machine: never raises, types hold, and the result is JSON-ready."""
    facts = host.probe()
    assert isinstance(facts.usable_cpus, int) and facts.usable_cpus >= 1
    for name in ("shm_total", "shm_free", "mem_total", "nofile_soft", "open_fds", "shmmni"):
        assert getattr(facts, name) is None or isinstance(getattr(facts, name), int)
    assert isinstance(facts.to_json(), str)


def test_cgroup_v1_working_set_leaves_out_inactive_page_cache(tmp_path):
    """``docker stats`` and the kubelet count usage less inactive file pages: the kernel drops those first."""
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "4:memory:/docker/abc\n")
    write(root, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{450 * MiB}\n")
    write(root, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", f"{400 * MiB}\n")
    write(root, "sys/fs/cgroup/memory/docker/abc/memory.stat", f"cache 1\ntotal_inactive_file {240 * MiB}\n")
    facts = probe(root)
    assert (facts.cgroup_mem_limit, facts.cgroup_mem_usage) == (450 * MiB, 160 * MiB)
    assert facts.memory_left[0] == min(290 * MiB, facts.mem_available or 290 * MiB)


def test_cgroup_v2_the_level_with_least_room_binds(tmp_path):
    """A pod's limit above the container's: whichever has less room left is what the OOM killer uses."""
    root = base_tree(tmp_path)
    write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", f"{4 * GiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.current", f"{1 * GiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/memory.max", f"{5 * GiB}\n")
    write(root, "sys/fs/cgroup/kubepods/pod1/memory.current", f"{4 * GiB}\n")  # a sidecar holds 3 GiB
    write(root, "sys/fs/cgroup/kubepods/pod1/memory.stat", "inactive_file 0\n")
    facts = probe(root)
    assert (facts.cgroup_mem_limit, facts.cgroup_mem_usage) == (5 * GiB, 4 * GiB)


# ------------------------------------------------------------------------------------------- a read-only /dev/shm


def test_writable_dev_shm_is_not_read_only(tmp_path):
    assert probe(base_tree(tmp_path)).shm_readonly is False


def test_unreadable_dev_shm_mount_flag_is_unknown_with_a_note(tmp_path):
    root = base_tree(tmp_path)
    (root / "dev/shm").rmdir()
    facts = probe(root)
    assert facts.shm_readonly is None
    assert any(n.startswith("statvfs(") and "FileNotFoundError" in n for n in facts.notes)


@pytest.mark.privileged
def test_a_read_only_tmpfs_on_dev_shm_is_read_from_the_statvfs_flag(private_shm):
    """A real tmpfs mounted ro on /dev/shm in a private mount namespace (the machine's own is not touched)."""
    code = "from ms_shm import host; f = host.probe(); print(f.shm_readonly, f.shm_total)"
    r = private_shm.run_shell("mount -t tmpfs -o size=1g,ro tmpfs /dev/shm && "
                              f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm=None, timeout=120)
    assert r.returncode == 0, private_shm.describe(r)
    assert r.stdout.split() == ["True", str(GiB)]
    rw = private_shm.run_shell(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}", shm="1g", timeout=120)
    assert rw.stdout.split() == ["False", str(GiB)], private_shm.describe(rw)


def test_doctor_row_says_read_only(tmp_path):
    facts = probe(base_tree(tmp_path))
    rows = cli.fact_rows(dataclasses.replace(facts, shm_readonly=True), None, "not installed",
                         advice.Typical.of(facts))
    (text,) = [text for label, text in rows if label == "/dev/shm"]
    assert "mounted read-only" in text
