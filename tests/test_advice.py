"""``advice``: sizes, snippets and findings, table-driven over fake ``HostFacts``. Pure, so microseconds each."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from ms_shm import advice, model
from ms_shm.host import HostFacts, Ranks
from tests.fakes import host_facts, logind_facts

MiB = 1 << 20
GiB = 1 << 30
HUGE = 18446744073692774399


def facts(**kw) -> HostFacts:
    """A roomy 8-CPU bare host; each test changes only what it is about."""
    base = dict(mem_total=64 * GiB, mem_available=60 * GiB, cgroup_version="v2", cpu_count=8, cpu_affinity=8,
                usable_cpus=8)
    base.update(kw)
    return host_facts(**base)


def codes(findings) -> list:
    return [f.code for f in findings]


# ------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("nbytes, human", [
    (1, "64m"), (64 * MiB, "64m"), (64 * MiB + 1, "128m"), (300 * MiB, "512m"), (800 * MiB, "1g"),
    (GiB, "1g"), (GiB + 1, "2g"), (int(6.25 * GiB), "7g"), (100 * GiB, "100g"),
])
def test_human_size_rounds_up(nbytes, human):
    assert advice.human_size(nbytes) == human
    assert advice.parse_size(human) >= nbytes


@pytest.mark.parametrize("text, nbytes", [
    ("64m", 64 * MiB), ("64M", 64 * MiB), ("512Mi", 512 * MiB), ("2g", 2 * GiB), ("2GB", 2 * GiB),
    ("1.5g", int(1.5 * GiB)), ("4096", 4096), ("8k", 8192), ("1Gi", GiB),
])
def test_parse_size(text, nbytes):
    assert advice.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "m", "64x", "-1g", "lots", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        advice.parse_size(text)


def test_recommended_shm_reproduces_mindspores_5gb():
    """8 ranks x 8 workers x 10 slots x 8 MiB = 5 GiB: MindSpore's "at least 5 GB", plus ms_shm's headroom."""
    need, why = advice.recommended_shm(facts(ranks=Ranks(8, 0, "LOCAL_WORLD_SIZE")))
    per_rank = model.generator_peak(8 * MiB, 8, 16)
    assert per_rank == 8 * 10 * 8 * MiB + model.semaphore_bytes(8)
    assert (8 * per_rank) / GiB == pytest.approx(5.0, abs=0.01)
    assert need == math.ceil(8 * per_rank / 0.8)
    assert "reference row" in why and "8 rank(s)" in why and "10 slots" in why


@pytest.mark.parametrize("cpus, workers", [(1, 1), (2, 2), (4, 4), (8, 8), (64, 8)])
def test_typical_workers_follow_usable_cpus(cpus, workers):
    assert advice.typical_workers(facts(usable_cpus=cpus)) == workers


def test_recommended_shm_single_cpu_needs_none():
    need, why = advice.recommended_shm(facts(usable_cpus=1))
    assert need == 0 and "main process" in why


def test_recommended_shm_uses_the_given_pipeline():
    need, _ = advice.recommended_shm(facts(), row_bytes=MiB, workers=2, ranks=1, prefetch=4)
    assert need == math.ceil(model.generator_peak(MiB, 2, 4) / 0.8)


def test_fitting_prefetch():
    assert advice.fitting_prefetch(8 * MiB, 2, 10 * GiB) == 16
    p = advice.fitting_prefetch(MiB, 2, 20 * MiB)
    assert p is not None and model.generator_peak(MiB, 2, p) <= 20 * MiB < model.generator_peak(MiB, 2, p + 1)
    assert advice.fitting_prefetch(8 * MiB, 2, 51 * MiB) is None  # 4 slots x 2 workers x 8 MiB = 64 MiB


# ------------------------------------------------------------------------------------------- snippets


def test_shm_fixes_kubernetes_block():
    fixes = dict(advice.shm_fixes(800 * MiB, "kubernetes"))
    assert list(dict(advice.shm_fixes(800 * MiB, "kubernetes")))[0] == "kubernetes"
    k8s = fixes["kubernetes"]
    for text in ("emptyDir:", "medium: Memory", "sizeLimit: 1Gi", "mountPath: /dev/shm", "name: dshm",
                 "resources.limits.memory", "memory limit"):
        assert text in k8s
    assert "--shm-size=1g" in fixes["docker run"]
    assert 'shm_size: "1g"' in fixes["docker-compose"]


def test_shm_fixes_raise_the_known_memory_limit():
    k8s = dict(advice.shm_fixes(GiB, "kubernetes", memory_limit=4 * GiB))["kubernetes"]
    assert "memory: 5Gi" in k8s and "was 4.0 GiB" in k8s


@pytest.mark.parametrize("container, first", [
    ("kubernetes", "kubernetes"), ("docker", "docker run"), ("podman", "podman run"),
    ("container", "docker run"), (None, "bare host"),
])
def test_shm_fixes_put_where_we_run_first(container, first):
    fixes = advice.shm_fixes(300 * MiB, container)
    assert fixes[0][0] == first
    labels = [label for label, _ in fixes]
    assert "kubernetes" in labels and "docker run" in labels  # the same image runs everywhere
    if container is None:
        assert "remount,size=512m" in fixes[0][1] and "/etc/fstab" in fixes[0][1]


def test_nofile_fixes():
    fixes = dict(advice.nofile_fixes(2000))
    assert "ulimit -n 65536" in fixes["shell"]
    assert "*  soft  nofile  65536" in fixes["limits.conf"]
    assert "setrlimit" in fixes["python"]
    assert "--ulimit nofile=65536:65536" in dict(advice.nofile_fixes(2000, "docker"))["docker run"]
    # the one rule (sizes.nofile_target): 1024 x 4^k, at least 65536
    assert advice.nofile_target(10) == 65536 and advice.nofile_target(70000) == 262144


def test_ds_config_fixes():
    (label, text), = advice.ds_config_fixes(prefetch=4)
    assert label == "ds.config" and "ds.config.set_prefetch_size(4)" in text
    assert "set_enable_shared_mem(False)" in advice.ds_config_fixes(shared_mem_off=True)[0][1]


# ------------------------------------------------------------------------------------------- diagnose


def test_roomy_host_has_no_problems():
    assert advice.diagnose(facts()) == ()


def test_docker_default_64m_is_a_crash_with_a_size_that_fits():
    f = facts(shm_total=64 * MiB, shm_free=64 * MiB, container="docker")
    findings = advice.diagnose(f)
    first = findings[0]
    assert (first.code, first.severity) == ("shm-small", "crash")
    assert "64.0 MiB" in first.problem and "640.2 MiB" in first.problem
    snippets = dict(first.snippets)
    size = snippets["docker run"].split("--shm-size=")[1].split()[0]
    assert advice.parse_size(size) * 0.8 >= model.generator_peak(8 * MiB, 8, 16)
    assert "emptyDir" in snippets["kubernetes"]
    assert "ds.config" in snippets


def test_a_torch_program_gets_only_what_holds_for_any_framework():
    f = facts(shm_total=64 * MiB, shm_free=64 * MiB, container="docker", mindspore_version="2.10.0",
              numpy_version="2.4.0", ranks=Ranks(4, 0, "RANK_SIZE (assumed all on this host)"))
    mindspore = codes(advice.diagnose(f))
    assert "shm-small" in mindspore and "msloader-numpy2" in mindspore
    assert codes(advice.diagnose(f, mindspore=False)) == ["ranks-assumed"]
    missing = dataclasses.replace(f, shm_total=None, shm_free=None, notes=("statvfs: FileNotFoundError",))
    assert codes(advice.diagnose(missing, mindspore=False))[0] == "shm-missing"


def test_tight_shm_is_slow_not_crash():
    peak = model.generator_peak(8 * MiB, 8, 16)
    f = facts(shm_total=int(peak * 1.1), shm_free=int(peak * 1.1))
    assert [(a.code, a.severity) for a in advice.diagnose(f)] == [("shm-tight", "slow")]


def test_ranks_multiply_the_need():
    f = facts(shm_total=2 * GiB, shm_free=2 * GiB, ranks=Ranks(8, 0, "LOCAL_WORLD_SIZE"))
    first = advice.diagnose(f)[0]
    assert first.code == "shm-small" and "8 rank(s)" in first.problem
    assert "--shm-size=7g" in dict(first.snippets)["docker run"]


def test_nearly_full_and_full_shm():
    nearly = advice.diagnose(facts(shm_free=100 * MiB))
    assert nearly[0].code == "shm-nearly-full" and nearly[0].severity == "crash"
    full = advice.diagnose(facts(shm_free=0))
    assert full[0].code == "shm-full" and "5 GB" in full[0].problem


def test_an_empty_dev_shm_too_small_for_every_ranks_semaphores_is_not_called_full():
    """An audit: ``doctor --ranks 900`` in an empty 64 MB /dev/shm read "is full: 64.0 MiB free of 64.0 MiB (0 B
    used)"."""
    small = advice.diagnose(facts(shm_total=64 * MiB, shm_free=64 * MiB, ranks=Ranks(900, 0, "override")))
    assert small[0].code == "shm-full" and "too small for 900 rank(s)" in small[0].problem
    assert "is full" not in small[0].problem and "run fewer ranks" in small[0].fix


def test_a_dev_shm_others_hold_says_so_where_no_other_finding_does():
    """An audit filled 57 MiB of a 64 MB /dev/shm with another program's file: doctor said the size was small,
    never that most of it was taken before the program started, nor where to look."""
    held = advice.diagnose(facts(shm_total=64 * MiB, shm_free=6_800_000))
    codes = [a.code for a in held]
    assert "shm-small" in codes and "shm-held" in codes, codes
    assert "ls -laS /dev/shm" in next(a.fix for a in held if a.code == "shm-held")
    assert "shm-held" not in [a.code for a in advice.diagnose(facts(shm_total=64 * MiB, shm_free=63 * MiB))]
    assert "shm-held" not in [a.code for a in advice.diagnose(facts(shm_free=0))]  # "shm-full" says it


def test_unreadable_shm_is_info():
    f = facts(shm_total=None, shm_free=None, notes=("statvfs(/dev/shm): PermissionError: denied",))
    (finding,) = advice.diagnose(f)
    assert finding.severity == "info" and "could not determine (statvfs(/dev/shm): PermissionError" in finding.problem


def test_low_soft_nofile():
    f = facts(nofile_soft=64, nofile_hard=1 << 20)
    (finding,) = advice.diagnose(f)
    need = model.generator_fds(8, 16) + model.FD_MARGIN + 6
    assert finding.code == "nofile-soft" and str(need) in finding.problem
    assert "hard limit allows it" in finding.fix
    assert "ulimit -n 65536" in dict(finding.snippets)["shell"]


def test_low_hard_nofile():
    f = facts(nofile_soft=100, nofile_hard=100)
    found = {a.code: a for a in advice.diagnose(f)}
    assert found["nofile-soft"].severity == "crash" and "must go up first" in found["nofile-soft"].fix
    assert found["nofile-hard"].severity == "crash" and "not root" in found["nofile-hard"].problem
    slow = {a.code: a for a in advice.diagnose(facts(nofile_soft=200, nofile_hard=200))}
    assert set(slow) == {"nofile-hard"} and slow["nofile-hard"].severity == "slow"


def test_cgroup_limit_below_the_shm_need():
    f = facts(cgroup_mem_limit=256 * MiB, container="kubernetes")
    found = {a.code: a for a in advice.diagnose(f)}
    k8s = dict(found["cgroup-small"].snippets)["kubernetes"]
    assert found["cgroup-small"].severity == "crash" and "was 256.0 MiB" in k8s
    info = {a.code: a for a in advice.diagnose(facts(cgroup_mem_limit=8 * GiB))}
    assert info["cgroup-below-shm"].severity == "info"


def test_sysv_limits_for_map_workers():
    found = {a.code: a for a in advice.diagnose(facts(shmmax=MiB, shmall_pages=1024, shmmni=4, msgmni=4))}
    assert {"sysv-shmmax", "sysv-shmall", "sysv-shmmni", "sysv-msgmni"} <= set(found)
    assert all(found[c].severity == "crash" for c in ("sysv-shmmax", "sysv-shmall"))
    # MindSpore <= 2.3 sends map rows through /dev/shm, not SysV: no SysV finding there.
    assert not [a for a in advice.diagnose(facts(shmmax=MiB, mindspore_version="2.3.1")) if "sysv" in a.code]


def test_sysv_segments_in_use_are_info():
    found = {a.code: a for a in advice.diagnose(facts(sysv_segments=3, sysv_bytes=24 * MiB))}
    assert found["sysv-in-use"].severity == "info" and "ms-shm clean" in found["sysv-in-use"].fix


def test_only_segments_nobody_attached_are_called_leftovers():
    """A running map pool keeps its segments attached: doctor beside a live job called them leftovers."""
    live = facts(sysv_segments=2, sysv_bytes=16 * MiB, sysv_detached_segments=0, sysv_detached_bytes=0)
    assert "sysv-in-use" not in {a.code for a in advice.diagnose(live)}
    mixed = facts(sysv_segments=3, sysv_bytes=24 * MiB, sysv_detached_segments=1, sysv_detached_bytes=8 * MiB)
    found = {a.code: a for a in advice.diagnose(mixed)}["sysv-in-use"]
    assert found.problem.startswith("1 SysV shared-memory segment(s) that no process has attached (8.0 MiB)")


def test_config_findings_accept_dataclass_or_dict():
    @dataclasses.dataclass(frozen=True)
    class Config:
        prefetch_size: int = 16
        shared_mem: bool = False
        start_method: str = "spawn"
        num_parallel_workers: int = 32

    for config in (Config(), dataclasses.asdict(Config())):
        got = set(codes(advice.diagnose(facts(), config)))
        assert got == {"config-shm-off", "config-spawn", "config-workers"}


def test_configured_prefetch_changes_the_need():
    """Prefetch 1 gives 8 workers 4 slots: 256 MiB instead of 640 MiB, which a 300 MiB /dev/shm holds."""
    f = facts(shm_total=300 * MiB, shm_free=300 * MiB)
    assert codes(advice.diagnose(f, {"prefetch_size": 16})) == ["shm-small"]
    assert codes(advice.diagnose(f, {"prefetch_size": 1})) == ["shm-tight"]


def test_unknown_facts_are_info_lines():
    f = facts(mem_total=None, mem_available=None, shmmax=None, mindspore_version=None,
              notes=("/proc/meminfo: PermissionError: denied", "/proc/sys/kernel/shmmax: OSError: x"))
    infos = [a for a in advice.diagnose(f) if a.code == "unknown"]
    text = "\n".join(a.problem for a in infos)
    assert "memory: could not determine (/proc/meminfo: PermissionError" in text
    assert "kernel.shmmax: could not determine" in text
    assert "MindSpore version: could not determine (MindSpore is not installed)" in text


def test_findings_sorted_worst_first_and_json_ready():
    f = facts(shm_total=64 * MiB, shm_free=64 * MiB, nofile_soft=100, nofile_hard=100, sysv_segments=2,
              sysv_bytes=MiB, cgroup_mem_limit=8 * GiB, mem_total=None)
    findings = advice.diagnose(f)
    ranks = [a.rank for a in findings]
    assert ranks == sorted(ranks) and findings[0].severity == "crash" and findings[-1].severity == "info"
    data = json.loads(json.dumps([a.to_dict() for a in findings]))
    assert set(data[0]) == {"problem", "severity", "fix", "snippets", "code"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        findings[0].severity = "info"


def test_advice_and_explain_do_not_import_mindspore():
    code = ("import sys, ms_shm.advice, ms_shm.explain; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'mindspore']; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------- releases


# 8 workers x 10 static slots x (6 MiB + one page) + 55 semaphore pages: <= 2.3's default max_rowsize, committed
# when the iterator starts (shared/MINDSPORE_SHM_FACTS.md sections 6 and 10), whatever the row size.
PEAK_W8_STATIC6 = 8 * 10 * (6 * MiB + 4096) + 55 * 4096


@pytest.mark.parametrize("version, error", [("2.0.0", "Exception"), ("2.3.1", "RuntimeError")])
def test_static_releases_are_judged_by_their_pre_check(version, error):
    f = facts(shm_total=64 * MiB, shm_free=64 * MiB, container="docker", mindspore_version=version)
    t = advice.Typical.of(f)
    assert (t.peak, t.slot_mb, t.version) == (PEAK_W8_STATIC6, 6, version)
    assert "static 6 MiB slots" in t.reason and "committed at launch" in t.reason and "pipes" in t.reason
    first = advice.diagnose(f)[0]
    assert first.code == "shm-small" and first.severity == "crash"
    assert f"{error} at launch: 'Insufficient shared memory available'" in first.problem
    assert "Bus error" not in first.problem and "480.5 MiB" in first.problem


def test_dynamic_release_is_judged_by_the_bus_error():
    first = advice.diagnose(facts(shm_total=64 * MiB, shm_free=64 * MiB, mindspore_version="2.10.0"))[0]
    assert "Bus error" in first.problem and "Insufficient" not in first.problem


def test_static_pre_check_refuses_inside_the_headroom_band():
    """2.3 refuses at 80% of free /dev/shm: a size that holds the static slots, but not 1/0.8 of them, is a crash
    there, not the 'tight' a dynamic release would make of the same margin."""
    slots = 8 * 10 * 6 * MiB
    f = facts(shm_total=int(slots / 0.8) - MiB, shm_free=int(slots / 0.8) - MiB, mindspore_version="2.3.0")
    assert PEAK_W8_STATIC6 < f.shm_total
    assert codes(advice.diagnose(f)) == ["shm-small"]


def test_fitting_prefetch_follows_the_release():
    """Static 6 MiB slots do not shrink with the row: 1 MiB rows fit 20 MiB at some prefetch on 2.10 only."""
    assert advice.fitting_prefetch(MiB, 2, 20 * MiB, version="2.10.0") is not None
    assert advice.fitting_prefetch(MiB, 2, 20 * MiB, version="2.3.0") is None  # 2 x 4 x 6 MiB > 20 MiB
    p = advice.fitting_prefetch(MiB, 2, 60 * MiB, version="2.3.0")
    assert p is not None and model.generator_peak(MiB, 2, p, None, 6) <= 60 * MiB


def test_checkup_is_the_doctors_json():
    f = facts(shm_total=64 * MiB, shm_free=64 * MiB)
    report = advice.checkup(f, None, "MindSpore is not importable")
    data = json.loads(json.dumps(report.to_dict()))
    assert list(data) == ["host", "mindspore", "mindspore_note", "typical", "recommended_shm", "findings", "ok"]
    assert data["recommended_shm"] == {"bytes": report.typical.need, "size": "1g", "reason": report.typical.reason}
    assert {"workers", "prefetch", "ranks", "row_bytes", "row_known", "peak", "need", "reason"} <= set(data["typical"])
    assert data["ok"] is False and data["findings"][0]["code"] == "shm-small"


# ------------------------------------------------------------------------------------------- systemd-logind RemoveIPC


def test_removeipc_at_risk_is_a_finding_with_both_fixes():
    f = facts(logind=logind_facts())
    (finding,) = advice.diagnose(f)
    assert (finding.code, finding.severity) == ("removeipc", "info")  # doctor's ok stays true: it needs a logout
    assert "RemoveIPC=yes (systemd default)" in finding.problem and "alice (uid 1000)" in finding.problem
    assert "one SysV message queue each" in finding.problem and "Exec msgrcv failed" in finding.problem
    assert "loginctl enable-linger alice" in finding.fix
    snippets = dict(finding.snippets)
    assert "RemoveIPC=no" in snippets["logind.conf"] and "/etc/systemd/logind.conf.d/ms_shm.conf" in snippets[
        "logind.conf"] and "systemctl restart systemd-logind" in snippets["logind.conf"]
    assert "sudo loginctl enable-linger alice" in snippets["shell"]
    assert advice.checkup(f).ok is True


def test_removeipc_before_sysv_releases_names_dev_shm():
    (finding,) = advice.diagnose(facts(logind=logind_facts(), mindspore_version="2.3.1"))
    assert "message queue" not in finding.problem.split(";")[1] and "/dev/shm slots" in finding.problem


@pytest.mark.parametrize("safe", [
    dict(remove_ipc=False, source="/etc/systemd/logind.conf.d/ms_shm.conf", at_risk=False),
    dict(user="root", uid=0, system_user=True, at_risk=False),
    dict(user="syslog", uid=104, system_user=True, at_risk=False),
    dict(linger=True, at_risk=False),
    dict(systemd_present=False, at_risk=False),
    dict(remove_ipc=None, systemd_present=False, at_risk=False),  # a container: nothing to judge
])
def test_removeipc_no_finding_when_logind_leaves_the_ipc(safe):
    assert advice.diagnose(facts(logind=logind_facts(**safe))) == ()


def test_removeipc_unknown_is_an_info_line():
    lg = logind_facts(remove_ipc=None, at_risk=False,
                      reason="RemoveIPC unknown: /etc/systemd/logind.conf: IsADirectoryError: x")
    (finding,) = advice.diagnose(facts(logind=lg))
    assert (finding.code, finding.severity) == ("removeipc-unknown", "info")
    assert finding.problem.startswith("systemd-logind RemoveIPC at logout: could not determine (RemoveIPC unknown")
    assert advice.diagnose(facts()) == ()  # facts built without logind (older callers): no finding at all


def test_cgroup_limit_counts_rows_in_flight_and_workers_not_only_shm():
    """A limit above the /dev/shm peak can still be too small: rows in flight and workers' pages count too."""
    t = advice.typical(facts())
    assert t.memory > t.peak / advice.HEADROOM
    limit = (t.peak + t.memory) // 2  # above the /dev/shm a typical pipeline writes, below what it needs
    found = {a.code: a for a in advice.diagnose(facts(cgroup_mem_limit=limit))}
    assert "cgroup-small" in found and "rows in flight" in found["cgroup-small"].problem


def test_mindspore_dataloader_under_numpy2_is_a_finding_with_the_fix():
    assert advice._loader_findings(facts(mindspore_version="2.10.0"), "1.26.4") == []
    assert advice._loader_findings(facts(mindspore_version="2.7.2"), "2.4.6") == []
    found = advice._loader_findings(facts(mindspore_version="2.10.0"), "2.4.6")
    assert found[0].code == "msloader-numpy2" and "numpy<2" in found[0].fix
    # numpy<2 alone broke ``import mindspore`` where pip had taken SciPy 1.18 (Python 3.12): the pin goes with it
    assert found[0].snippets == (("pip", "pip install 'numpy<2' 'scipy<1.18'"),), found[0].snippets


def test_low_soft_nofile_under_a_hard_limit_that_allows_it_suggests_what_ulimit_takes():
    f = facts(nofile_soft=40, nofile_hard=20000)
    found = {a.code: a for a in advice.diagnose(f)}
    soft = found["nofile-soft"]
    assert "raise the soft limit to 20000 (the hard limit allows it)" in soft.fix, soft.fix
    assert "ulimit -n 20000" in dict(soft.snippets)["shell"]


@pytest.mark.parametrize("limit", [300 * MiB, 1000 * MiB, 256 * MiB])
def test_cgroup_small_text_and_kubernetes_block_name_one_limit(limit):
    """The audit's 1000M limit said "raise ... by at least 2g" beside a block setting memory: 2Gi in total."""
    found = {a.code: a for a in advice.diagnose(facts(cgroup_mem_limit=limit, container="kubernetes"))}
    small = found["cgroup-small"]
    target = small.fix.split("to at least ")[1].split()[0]
    assert "by at least" not in small.fix
    assert f"memory: {advice.k8s_size(target)} " in dict(small.snippets)["kubernetes"]
    t = advice.typical(facts())
    assert advice.parse_size(target) >= max(t.memory, limit)


# ------------------------------------------------------------------------------------------- a read-only /dev/shm


def test_read_only_shm_is_a_crash_with_the_remount_fix():
    """A 1 GiB /dev/shm mounted read-only: plenty of room, yet multiprocessing cannot create a semaphore there, so
    every worker pool fails at launch (torch: EROFS; GeneratorDataset: 'insufficient shm')."""
    f = facts(shm_total=GiB, shm_free=GiB, shm_readonly=True, container="docker")
    findings = advice.diagnose(f)
    first = findings[0]
    assert (first.code, first.severity) == ("shm-readonly", "crash")
    assert "read-only" in first.problem and "1.0 GiB" in first.problem
    assert "remount" in first.fix and "--shm-size" in first.fix and "emptyDir" in first.fix
    snippets = dict(first.snippets)
    assert "mount -o remount,rw /dev/shm" in snippets["shell"]
    assert "--shm-size=" in snippets["docker run"] and "medium: Memory" in snippets["kubernetes"]
    assert codes(findings).count("shm-readonly") == 1
    assert advice.checkup(f).ok is False


def test_read_only_shm_holds_for_any_framework():
    f = facts(shm_total=GiB, shm_free=GiB, shm_readonly=True)
    assert codes(advice.diagnose(f, mindspore=False)) == ["shm-readonly"]


@pytest.mark.parametrize("readonly", [False, None])
def test_writable_or_unknown_mount_flag_is_no_read_only_finding(readonly):
    """Unknown (statvfs failed: ``shm-unknown`` says so already) is never called read-only."""
    assert "shm-readonly" not in codes(advice.diagnose(facts(shm_readonly=readonly)))
    unread = facts(shm_total=None, shm_free=None, shm_readonly=None,
                   notes=("statvfs(/dev/shm): PermissionError: denied",))
    assert codes(advice.diagnose(unread)) == ["shm-unknown"]


# ------------------------------------------------------------------------------------------- leftovers


def test_files_dead_processes_left_in_dev_shm_are_one_finding_with_clean_as_the_fix():
    from ms_shm.cleanup import CleanReport, Leftover

    report = CleanReport(tuple(Leftover("dev-shm", f"/dev/shm/torch_4194400_{i}_0", 8 * MiB, 4194400, "dead")
                               for i in range(5)) + (Leftover("ipc-file", "/tmp/dataset_ipc_1_2_0", 0, 1, "dead"),))
    checkup = advice.checkup(facts(), None, None, leftovers=report)
    (finding,) = [f for f in checkup.findings if f.code == "dev-shm-leftovers"]
    assert finding.severity == "info" and "ms-shm clean --yes" in finding.fix
    assert finding.problem.startswith("5 file(s) in /dev/shm left by dead processes, holding 40.0 MiB")
    assert "torch_4194400_0_0, torch_4194400_1_0, torch_4194400_2_0, ..." in finding.problem
    assert [f.rank for f in checkup.findings] == sorted(f.rank for f in checkup.findings)
    assert not [f for f in advice.checkup(facts(), None, None, leftovers=None).findings
                if f.code == "dev-shm-leftovers"]
