"""``ms-shm`` as a user runs it: subprocesses of ``python -m ms_shm``, under the machine's /dev/shm and under a
private 64 MB one (Docker's default) made with ``tests/isolated.py``."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import subprocess
import sys

import pytest

from ms_shm import advice, cli, model
from ms_shm._results import mib
from tests import isolated

REPO = isolated.REPO
LOGS = REPO / "tests" / "data" / "logs"
MiB = 1 << 20


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python -m ms_shm ARGS`` against this machine's /dev/shm."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), GLOG_v="3")
    return subprocess.run([sys.executable, "-m", "ms_shm", *args], capture_output=True, text=True, input=stdin,
                          env=env, cwd=str(REPO), timeout=120)


def run_private(ns, *args: str, shm: str = "64m", **kw) -> subprocess.CompletedProcess:
    """The same inside a fresh mount namespace whose /dev/shm is a ``shm``-sized tmpfs."""
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ms_shm", *args])
    return ns.run_shell(f"exec {command}", shm=shm, timeout=120, env={"GLOG_v": "3"}, **kw)


def shm_size_in(text: str) -> int:
    return advice.parse_size(text.split("--shm-size=")[1].split()[0])


# ------------------------------------------------------------------------------------------- doctor


def test_doctor_on_this_machine():
    r = run("doctor")
    assert r.returncode == 0, isolated.describe(r)
    for label in ("/dev/shm", "RAM", "cgroup", "CPUs", "open files", "SysV limits", "SysV in use", "container",
                  "ranks on this host", "MindSpore", "dataset config", "Python", "typical pipeline"):
        assert f"  {label} " in r.stdout
    assert "% used" in r.stdout and "Result:" in r.stdout
    assert "Traceback" not in r.stderr


def test_doctor_json_and_strict_on_this_machine():
    r = run("doctor", "--json", "--strict")
    data = json.loads(r.stdout)
    assert set(data) == {"schema", "host", "mindspore", "mindspore_note", "typical", "recommended_shm", "findings",
                         "ok"}
    st = os.statvfs("/dev/shm")
    assert data["host"]["shm_total"] == st.f_blocks * st.f_frsize
    assert isinstance(data["host"]["shm_free"], int)
    assert data["ok"] == (not any(f["severity"] == "crash" for f in data["findings"]))
    assert r.returncode == (0 if data["ok"] else 2)
    if data["mindspore"] is not None:
        assert {"version", "prefetch_size", "shared_mem", "start_method", "num_parallel_workers"} <= set(data["mindspore"])
    else:
        assert data["mindspore_note"]


def test_doctor_under_docker_default_64m(private_shm):
    r = run_private(private_shm, "doctor")
    assert r.returncode == 0, isolated.describe(r)  # without --strict the doctor only reports
    out = r.stdout
    assert "64.0 MiB total" in out and "[crash]" in out
    size = shm_size_in(out)
    typical = advice.typical_workers(type("F", (), {"usable_cpus": os.cpu_count()})())
    assert size * 0.8 >= model.generator_peak(8 * MiB, typical, 16)
    assert "emptyDir:" in out and "medium: Memory" in out and f"sizeLimit: {advice.human_size(size)[:-1]}" in out
    assert "resources.limits.memory" in out


def test_doctor_under_64m_sizes_an_8_worker_pipeline(private_shm):
    r = run_private(private_shm, "doctor", "--workers", "8")
    assert r.returncode == 0, isolated.describe(r)
    size = shm_size_in(r.stdout)
    assert size * 0.8 >= model.generator_peak(8 * MiB, 8, 16)  # 640.2 MiB: asks for 1g
    assert "sizeLimit: 1Gi" in r.stdout and "--shm-size=1g" in r.stdout


def test_doctor_json_under_64m(private_shm):
    r = run_private(private_shm, "doctor", "--json", "--strict")
    assert r.returncode == 2, isolated.describe(r)
    data = json.loads(r.stdout)
    assert data["host"]["shm_total"] == 64 * MiB
    assert data["ok"] is False
    first = data["findings"][0]
    assert (first["code"], first["severity"]) == ("shm-small", "crash")
    assert any(label == "kubernetes" and "emptyDir" in text for label, text in first["snippets"])
    assert data["recommended_shm"]["bytes"] > 64 * MiB


def test_doctor_strict_exit_codes_under_64m(private_shm):
    assert run_private(private_shm, "doctor", "--strict").returncode == 2
    # The same host with a /dev/shm large enough for a typical pipeline passes.
    big = run_private(private_shm, "doctor", "--strict", "--json", shm="2g")
    data = json.loads(big.stdout)
    assert big.returncode == (0 if data["ok"] else 2)
    assert not [f for f in data["findings"] if f["code"].startswith("shm")]


# ------------------------------------------------------------------------------------------- plan


def test_plan_what_if_8_ranks_in_64m():
    r = run("plan", "--row-mb", "8", "--workers", "8", "--ranks", "8", "--shm", "64m")
    assert r.returncode == 0, isolated.describe(r)
    assert "Bus error" in r.stdout and "Insufficient shared memory" in r.stdout
    assert mib(model.generator_peak(8 * MiB, 8, 16)) in r.stdout
    assert "ms_shm would pick" in r.stdout
    data = json.loads(run("plan", "--row-mb", "8", "--workers", "8", "--ranks", "8", "--shm", "64m",
                          "--json").stdout)
    by_version = {v["version"]: v for v in data["versions"]}
    assert by_version["2.10"]["per_rank"] == model.generator_peak(8 * MiB, 8, 16)
    assert by_version["2.3"]["per_rank"] == model.generator_peak(8 * MiB, 8, 16, max_rowsize_mb=6)
    assert by_version["2.10"]["all_ranks"] == 8 * by_version["2.10"]["per_rank"]
    assert by_version["2.10"]["map"]["transport"] == "sysv" and by_version["2.3"]["map"]["transport"] == "shm-pool"
    assert data["shm"]["total"] == 64 * MiB and data["fits"] is False
    assert data["plan"] is not None or data["plan_note"]


def test_plan_uses_this_hosts_shm(private_shm):
    r = run_private(private_shm, "plan", "--row-mb", "1", "--workers", "2", "--prefetch", "2",
                    "--mindspore", "2.10", "--json")
    assert r.returncode == 0, isolated.describe(r)
    data = json.loads(r.stdout)
    assert data["shm"]["total"] == 64 * MiB and "this host" in data["shm"]["source"]
    row = next(v for v in data["versions"] if v["version"] == "2.10")
    assert row["per_rank"] == model.generator_peak(MiB, 2, 2) and row["fits"] is True  # 8.11 MiB, measured


def test_plan_rejects_a_bad_size():
    r = run("plan", "--row-mb", "8", "--workers", "8", "--shm", "64x")
    assert r.returncode == 2 and "not a size" in r.stderr


# ------------------------------------------------------------------------------------------- explain


@pytest.mark.parametrize("name, kind", [
    ("bus_error.log", "bus-error"), ("insufficient_shm.log", "insufficient-shm"),
    ("shm_full_generator.log", "shm-full"), ("shm_full_map.log", "no-space"),
    ("too_many_open_files.log", "too-many-open-files"), ("pytorch_bus_error.log", "pytorch-bus-error"),
])
def test_explain_captured_logs(name, kind):
    r = run("explain", str(LOGS / name))
    assert r.returncode == 0, isolated.describe(r)
    assert f"1. {kind} [" in r.stdout and "cause:" in r.stdout and "fix:" in r.stdout


def test_explain_stdin_json_and_nothing():
    r = run("explain", "-", "--json", stdin=(LOGS / "insufficient_shm.log").read_text())
    data = json.loads(r.stdout)
    assert r.returncode == 0 and data["recognised"][0]["kind"] == "insufficient-shm"
    assert data["recognised"][0]["required"] > data["recognised"][0]["available"]
    nothing = run("explain", stdin="epoch 3: loss 0.12\n")
    assert nothing.returncode == 1 and "recognised nothing" in nothing.stdout
    missing = run("explain", str(LOGS / "no-such.log"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_explain_speaks_in_this_hosts_numbers(private_shm):
    r = run_private(private_shm, "explain", str(LOGS / "bus_error.log"))
    assert r.returncode == 0, isolated.describe(r)
    assert "This host's /dev/shm is 64.0 MiB" in " ".join(r.stdout.split())
    assert "--shm-size=" in r.stdout and "emptyDir" in r.stdout


@pytest.mark.mindspore
def test_explain_a_live_bus_error(real_mindspore):
    """End to end: a pipeline dies of SIGBUS in a 64 MB /dev/shm, and its own output is explained there."""
    code = (
        "import numpy as np, mindspore.dataset as ds\n"
        "class Rows:\n"
        "    def __len__(self): return 64\n"
        "    def __getitem__(self, i): return (np.full(8 << 20, i % 127, np.uint8),)\n"
        "d = ds.GeneratorDataset(Rows(), ['x'], num_parallel_workers=2, shuffle=False)\n"
        "print(sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1)))\n")
    py = shlex.quote(sys.executable)
    r = real_mindspore.run_shell(f"{py} -c {shlex.quote(code)} > /tmp/ms_shm_live.log 2>&1; "
                                 f"{py} -m ms_shm explain /tmp/ms_shm_live.log; rc=$?; rm -f /tmp/ms_shm_live.log; "
                                 "exit $rc", timeout=240)
    assert r.returncode == 0, isolated.describe(r)
    assert "bus-error [crash]" in r.stdout and "64.0 MiB" in r.stdout


# ------------------------------------------------------------------------------------------- clean, entry points


def test_clean_is_a_dry_run_by_default():
    r = run("clean", "--json")
    assert r.returncode in (0, 2), isolated.describe(r)
    assert json.loads(r.stdout)["dry_run"] is True
    both = run("clean", "--yes", "--dry-run", "--json")  # --dry-run wins
    assert json.loads(both.stdout)["dry_run"] is True


def test_no_command_prints_usage():
    r = run()
    assert r.returncode == 2 and "usage: ms-shm" in r.stderr


def test_console_script_declared():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "ms-shm = ms_shm.cli:main" in cfg["options.entry_points"]["console_scripts"]
    assert callable(cli.main)


def test_main_in_process(capsys):
    assert cli.main(["plan", "--row-mb", "1", "--workers", "2", "--shm", "1g"]) == 0
    assert "fits" in capsys.readouterr().out
