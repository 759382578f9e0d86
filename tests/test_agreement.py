"""One host, one pipeline, three tools: ``ms-shm doctor --json`` (advice), ``ms-shm plan --json`` and
``tune(dry_run=True)`` must give the same sizes, on 2.10's dynamic slots and under 2.3's static profile.

The host is built by hand (no probing, no MindSpore import: the config read is replaced too), and the CLI runs
in-process through ``cli.main``. The expected numbers are worked out by hand from the facts sheet's formulas
(shared/MINDSPORE_SHM_FACTS.md sections 3 and 6), so the tools agree with MindSpore as well as with each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

import ms_shm
from ms_shm import advice, api, cli, host, sizes
from ms_shm.engines.mindspore import compat
from ms_shm.host import HostFacts
from tests.fakes import host_facts

MiB = 1 << 20
PAGE = 4096
ROW_MB, WORKERS = 4, 4
SHM = 128 * MiB
BUDGET = int(SHM * 0.8)  # one rank: 102.4 MiB
# W=4, P=16: Q = max(2, min(16, 64 // 4)) = 16, S = 18; semaphores (6 x 4 + 7) = 31 pages
PEAK_DYNAMIC = 4 * 18 * 4 * MiB + 31 * PAGE  # 288.1 MiB
PEAK_STATIC6 = 4 * 18 * (6 * MiB + PAGE) + 31 * PAGE  # 432.4 MiB: 2.3's default 6 MiB slots
# The largest prefetch that fits 102.4 MiB: dynamic P=4 (Q 4, S 6: 4 x 6 x 4 MiB = 96 MiB; P=5 gives 112 MiB);
# static P=2 (Q 2, S 4: 4 x 4 x 6 MiB = 96 MiB; P=3 gives Q 3, S 5: 120 MiB).
FIT_DYNAMIC, FIT_STATIC = 4, 2
CONFIG = compat.MindSporeConfig("2.10.0", 16, True, "fork", 8, True, True)


def facts(version: str) -> HostFacts:
    """A 4-CPU container with a 128 MiB /dev/shm and a low open-files soft limit."""
    return host_facts(shm_total=SHM, shm_free=SHM, cpu_count=4, cpu_affinity=4, usable_cpus=4, nofile_soft=100,
                      nofile_hard=1 << 20, container="docker", mindspore_version=version)


@pytest.fixture
def on_host(monkeypatch):
    """Make every tool see the fake host and config; keep the process's session as it was."""
    def use(version: str) -> HostFacts:
        fake = facts(version)
        monkeypatch.setattr(host, "probe", lambda *args, **kwargs: fake)
        monkeypatch.setattr(compat, "read_config", lambda: replace(CONFIG, version=version))
        monkeypatch.setattr(api, "_mindspore_in_use", lambda: True)  # a MindSpore program, whoever imported torch
        state = ms_shm.session()
        for name in ("facts", "fraction", "ranks"):
            monkeypatch.setattr(state, name, getattr(state, name))
        monkeypatch.setattr(state, "advised", set(state.advised))
        return fake
    return use


def run_json(capsys, *argv: str) -> dict:
    assert cli.main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def doctor(capsys) -> dict:
    return run_json(capsys, "doctor", "--workers", str(WORKERS), "--row-mb", str(ROW_MB))


def plan(capsys, *extra: str) -> dict:
    return run_json(capsys, "plan", "--row-mb", str(ROW_MB), "--workers", str(WORKERS), *extra)


def findings(data: dict) -> dict:
    return {f["code"]: f for f in data["findings"]}


def prefetch_in(finding: dict) -> int:
    """The prefetch the doctor's ``ds.config`` snippet sets."""
    text = dict(finding["snippets"])["ds.config"]
    return int(re.search(r"set_prefetch_size\((\d+)\)", text).group(1))


def asked_row(data: dict) -> dict:
    want = data["input"]["mindspore"].split(".")[:2]
    return next(v for v in data["versions"] if v["version"].split(".")[:2] == want)


def test_doctor_plan_and_tune_agree_on_2_10(on_host, capsys):
    fake = on_host("2.10.0")
    doc, what = doctor(capsys), plan(capsys)
    report = ms_shm.tune(dry_run=True, workers=WORKERS, row_mb=ROW_MB)
    row = asked_row(what)
    # the typical pipeline's peak and the /dev/shm to ask for
    assert doc["typical"]["peak"] == row["all_ranks"] == row["per_rank"] == PEAK_DYNAMIC
    assert doc["recommended_shm"]["bytes"] == row["need"] == sizes.with_headroom(PEAK_DYNAMIC)
    assert doc["recommended_shm"]["size"] == row["size"] == "512m"
    # this rank's budget and the prefetch that fits it
    assert report.budget.shm_bytes == what["plan"]["budget"]["shm_bytes"] == BUDGET
    decided = {d.setting: d for d in report.decisions}
    small = findings(doc)["shm-small"]
    assert prefetch_in(small) == decided["prefetch_size"].value == what["plan"]["prefetch"] == FIT_DYNAMIC
    assert what["plan"]["mode"] == "processes" and f"lower the prefetch to {FIT_DYNAMIC}" in small["fix"]
    # the open-files need (one rule: advice.fds_needed) and the limit to ask for (sizes.nofile_target)
    one, two = advice.fds_needed(fake, WORKERS, 16), advice.fds_needed(fake, WORKERS, 16, pipelines=2)
    soft = findings(doc)["nofile-soft"]
    assert f"needs about {one} fds" in soft["problem"] and f"< {two} needed" in decided["RLIMIT_NOFILE(soft)"].reason
    assert f"raise the soft limit to {decided['RLIMIT_NOFILE(soft)'].value}" in soft["fix"]
    assert "Bus error" in small["problem"] and "Bus error" in row["outcome"]


def test_doctor_plan_and_tune_agree_under_the_2_3_profile(on_host, capsys):
    on_host("2.3.0")
    doc, what = doctor(capsys), plan(capsys, "--mindspore", "2.3")
    report = ms_shm.tune(dry_run=True, workers=WORKERS, row_mb=ROW_MB)
    assert {d.setting: d.value for d in report.decisions}["prefetch_size"] == FIT_STATIC
    row = asked_row(what)
    assert row["version"] == "2.3" and row["slot_mb"] == doc["typical"]["slot_mb"] == 6
    assert doc["typical"]["peak"] == row["all_ranks"] == PEAK_STATIC6
    assert doc["recommended_shm"]["bytes"] == row["need"] and doc["recommended_shm"]["size"] == row["size"] == "1g"
    small = findings(doc)["shm-small"]
    assert prefetch_in(small) == what["plan"]["prefetch"] == FIT_STATIC
    assert what["plan"]["max_rowsize"] == 6 and what["plan"]["budget"]["shm_bytes"] == BUDGET
    # the failure is the static pre-check, in the words of the profile, in both tools
    failure = "RuntimeError at launch: 'Insufficient shared memory available'"
    assert failure in small["problem"] and row["outcome"] == failure and row["fits"] is False
    assert "Bus error" not in small["problem"]


def test_plan_defaults_to_the_hosts_release(on_host, capsys):
    on_host("2.0.0")
    what = plan(capsys, "--shm", "1g")
    row = asked_row(what)
    assert what["input"]["mindspore"] == "2.0.0" and row["version"] == "2.0.0"
    assert row["failure"].startswith("Exception at launch") and row["fits"] is True
    assert cli.main(["plan", "--row-mb", str(ROW_MB), "--workers", str(WORKERS), "--shm", "64m"]) == 0
    assert "*2.0.0" in capsys.readouterr().out
