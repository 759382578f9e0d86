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

from ms_shm import advice, cli
from tests import isolated
from tests.conftest import release_skip

REPO = isolated.REPO
LOGS = REPO / "tests" / "data" / "logs"
MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096

# Expected /dev/shm peaks, worked out by hand from the facts sheet's formula (shared/MINDSPORE_SHM_FACTS.md §3,
# exact to the byte in 200/200 measured runs), never from ms_shm.model, which is what these commands print:
#   Q = max(2, min(P, 4P // W)), S = Q + 2 slots per worker, semaphores (6W + 7) pages
#   dynamic (2.10): peak = W * S * ceil(B / page) * page + (6W + 7) * page
#   static (<= 2.3): peak = W * S * (max_rowsize MiB + page) + (6W + 7) * page
# W=2, P=16, 8 MiB rows: Q = 16, S = 18 -> 2*18*8 MiB + 19 pages = 301,989,888 + 77,824. (§3 measured 288.21 MiB
# for these rows plus a 4-byte label column, which adds one page per slot: 302,215,168 B.)
PEAK_W2_8MIB = 302_067_712  # 288.07 MiB
# W=8, P=16, 8 MiB rows: Q = max(2, min(16, 64 // 8)) = 8, S = 10 -> 8*10*8 MiB + 55 pages = 671,088,640 + 225,280
PEAK_W8_8MIB = 671_313_920  # 640.21 MiB
# The same on 2.3 (static 6 MiB slots, its default): 8*10*(6 MiB + 4096) + 55 pages = 503,644,160 + 225,280
PEAK_W8_STATIC6 = 503_869_440  # 480.53 MiB
# W=2, P=2, 1 MiB rows: Q = max(2, min(2, 4)) = 2, S = 4 -> 2*4*1 MiB + 19 pages = 8,388,608 + 77,824. (§3 measured
# 8.11 MiB with the label page: 8,499,200 B.)
PEAK_W2_P2_1MIB = 8_466_432  # 8.07 MiB
assert PEAK_W2_8MIB == 2 * 18 * 8 * MiB + 19 * PAGE and PEAK_W8_8MIB == 8 * 10 * 8 * MiB + 55 * PAGE
assert PEAK_W8_STATIC6 == 8 * 10 * (6 * MiB + PAGE) + 55 * PAGE and PEAK_W2_P2_1MIB == 2 * 4 * MiB + 19 * PAGE


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
    """--strict exits 2 exactly when a finding is a crash; the host decides which, the rule must hold."""
    r = run("doctor", "--json", "--strict")
    data = json.loads(r.stdout)
    assert set(data) == {"schema", "host", "mindspore", "mindspore_note", "typical", "recommended_shm", "findings",
                         "ok"}
    st = os.statvfs("/dev/shm")
    assert data["host"]["shm_total"] == st.f_blocks * st.f_frsize
    assert isinstance(data["host"]["shm_free"], int)
    assert data["ok"] == (not any(f["severity"] == "crash" for f in data["findings"]))
    assert r.returncode == (0 if data["ok"] else 2)
    if isolated.mindspore_missing() is None:  # this interpreter can import MindSpore: the doctor must see it
        assert {"version", "prefetch_size", "shared_mem", "start_method", "num_parallel_workers"} <= set(data["mindspore"])
    else:
        assert data["mindspore"] is None and data["mindspore_note"]


def _dynamic_slots_only() -> None:
    """These figures are dynamic slots' (2.4+): a release with static slots has other peaks and another failure."""
    from ms_shm.engines.mindspore import profiles
    from ms_shm.host import mindspore_version

    if profiles.profile_for(mindspore_version()).generator_default_max_rowsize_mb:
        release_skip("static slots on this release: another peak, and a pre-check instead of a bus error")


@pytest.mark.privileged
def test_doctor_under_docker_default_64m(private_shm):
    """Two CPUs online (bound in the namespace), so the typical pipeline is 2 workers on every host."""
    _dynamic_slots_only()
    r = run_private(private_shm, "doctor", cpus=2)
    assert r.returncode == 0, isolated.describe(r)  # without --strict the doctor only reports
    out = r.stdout
    assert "64.0 MiB total" in out and "[crash]" in out
    assert "= 288.1 MiB per rank" in " ".join(out.split())  # PEAK_W2_8MIB
    size = shm_size_in(out)
    # 288.07 MiB / 80% headroom = 360.1 MiB, rounded up to a size people type
    assert size == 512 * MiB and size * 0.8 >= PEAK_W2_8MIB
    assert "emptyDir:" in out and "medium: Memory" in out and f"sizeLimit: {advice.human_size(size)[:-1]}" in out
    assert "resources.limits.memory" in out


@pytest.mark.privileged
def test_doctor_counts_the_files_a_dead_process_left_in_dev_shm(private_shm):
    """A killed ``file_system`` torch loader leaves ``torch_<pid>_*`` files; the doctor names them and ``ms-shm
    clean``, which before only the clean itself listed."""
    dead = 4_194_400  # above PID_MAX_LIMIT: never alive
    make = (f"head -c 4194304 /dev/zero > /dev/shm/torch_{dead}_77_0 && head -c 4096 /dev/zero > /dev/shm/torch_{dead}_77_1"
            f" && touch -d '1 hour ago' /dev/shm/torch_{dead}_77_0 /dev/shm/torch_{dead}_77_1")  # a dead run's
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ms_shm", "doctor", "--json"])
    r = private_shm.run_shell(f"{make} && exec {command}", shm="64m", timeout=120, env={"GLOG_v": "3"})
    assert r.returncode == 0, isolated.describe(r)
    (finding,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "dev-shm-leftovers"]
    assert finding["problem"].startswith("2 file(s) in /dev/shm left by dead processes, holding 4.0 MiB")
    assert f"torch_{dead}_77_0" in finding["problem"] and "ms-shm clean --yes" in finding["fix"]


@pytest.mark.privileged
def test_doctor_under_64m_sizes_an_8_worker_pipeline(private_shm):
    r = run_private(private_shm, "doctor", "--workers", "8")
    assert r.returncode == 0, isolated.describe(r)
    size = shm_size_in(r.stdout)
    assert size == GiB and size * 0.8 >= PEAK_W8_8MIB  # 640.2 MiB / 80% = 800.3 MiB: asks for 1g
    assert "sizeLimit: 1Gi" in r.stdout and "--shm-size=1g" in r.stdout


@pytest.mark.privileged
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


@pytest.mark.privileged
def test_doctor_strict_exit_codes_under_64m(private_shm):
    assert run_private(private_shm, "doctor", "--strict").returncode == 2
    # The same host with a /dev/shm large enough for a typical pipeline passes.
    big = run_private(private_shm, "doctor", "--strict", "--json", shm="2g")
    data = json.loads(big.stdout)
    assert big.returncode == (0 if data["ok"] else 2)
    assert not [f for f in data["findings"] if f["code"].startswith("shm")]


READ_ONLY_SHM = "mount -t tmpfs -o size=1g,ro tmpfs /dev/shm && "


def run_read_only(ns, *args: str) -> subprocess.CompletedProcess:
    """``python -m ms_shm ARGS`` in a fresh mount namespace whose /dev/shm is a 1 GiB tmpfs mounted read-only."""
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ms_shm", *args])
    return ns.run_shell(READ_ONLY_SHM + f"exec {command}", shm=None, timeout=120, env={"GLOG_v": "3"})


@pytest.mark.privileged
def test_doctor_on_a_read_only_dev_shm(private_shm):
    """1 GiB is room enough, but no worker pool starts on a read-only mount: a crash, so --strict exits 2."""
    r = run_read_only(private_shm, "doctor", "--json", "--strict")
    assert r.returncode == 2, isolated.describe(r)
    data = json.loads(r.stdout)
    assert data["ok"] is False and data["host"]["shm_readonly"] is True
    first = data["findings"][0]
    assert (first["code"], first["severity"]) == ("shm-readonly", "crash")
    assert any("remount,rw" in text for _, text in first["snippets"])
    text = run_read_only(private_shm, "doctor")
    assert text.returncode == 0, isolated.describe(text)
    assert "mounted read-only" in text.stdout and "[crash]" in text.stdout


@pytest.mark.privileged
def test_explain_generator_datasets_insufficient_shm_on_the_read_only_host(private_shm):
    r = run_read_only(private_shm, "explain", str(LOGS / "generator_readonly.log"))
    assert r.returncode == 0, isolated.describe(r)
    assert "1. shm-readonly [crash]" in r.stdout and "shm-full" not in r.stdout


# ------------------------------------------------------------------------------------------- plan


def test_plan_what_if_8_ranks_in_64m():
    r = run("plan", "--row-mb", "8", "--workers", "8", "--ranks", "8", "--shm", "64m")
    assert r.returncode == 0, isolated.describe(r)
    assert "Bus error" in r.stdout and "Insufficient shared memory" in r.stdout
    assert "640.2 MiB" in r.stdout  # PEAK_W8_8MIB
    assert "ms_shm would pick" in r.stdout
    data = json.loads(run("plan", "--row-mb", "8", "--workers", "8", "--ranks", "8", "--shm", "64m",
                          "--json").stdout)
    by_version = {v["version"]: v for v in data["versions"]}
    assert by_version["2.10"]["per_rank"] == PEAK_W8_8MIB
    assert by_version["2.3"]["per_rank"] == PEAK_W8_STATIC6
    assert by_version["2.10"]["all_ranks"] == 8 * PEAK_W8_8MIB
    assert by_version["2.10"]["map"]["transport"] == "sysv" and by_version["2.3"]["map"]["transport"] == "shm-pool"
    assert data["shm"]["total"] == 64 * MiB and data["fits"] is False
    # what ms_shm would build instead: threads, no /dev/shm (rows untimed in a what-if: the default that fits)
    assert data["plan_note"] is None, data["plan_note"]
    assert (data["plan"]["mode"], data["plan"]["workers"], data["plan"]["predicted_shm"]) == ("threads", 8, 0)
    assert data["plan"]["budget"]["shm_bytes"] == int(64 * MiB * 0.8 / 8)  # 6.4 MiB per rank


@pytest.mark.privileged
def test_plan_uses_this_hosts_shm(private_shm):
    r = run_private(private_shm, "plan", "--row-mb", "1", "--workers", "2", "--prefetch", "2",
                    "--mindspore", "2.10", "--json")
    assert r.returncode == 0, isolated.describe(r)
    data = json.loads(r.stdout)
    assert data["shm"]["total"] == 64 * MiB and "this host" in data["shm"]["source"]
    row = next(v for v in data["versions"] if v["version"] == "2.10")
    assert row["per_rank"] == PEAK_W2_P2_1MIB and row["fits"] is True


def test_plan_rejects_a_bad_size():
    r = run("plan", "--row-mb", "8", "--workers", "8", "--shm", "64x")
    assert r.returncode == 2 and "not a size" in r.stderr


# ------------------------------------------------------------------------------------------- explain


@pytest.mark.parametrize("name, kind", [
    ("bus_error.log", "bus-error"), ("insufficient_shm.log", "insufficient-shm"),
    ("shm_full_generator.log", "shm-full"), ("shm_full_map.log", "no-space"),
    ("too_many_open_files.log", "too-many-open-files"), ("pytorch_bus_error.log", "pytorch-bus-error"),
    ("msloader_bus_error.log", "msloader-bus-error"), ("msloader_bus_error_eof.log", "msloader-bus-error"),
    ("torch_readonly.log", "shm-readonly"), ("map_readonly.log", "shm-readonly"),
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


@pytest.mark.privileged
def test_explain_speaks_in_this_hosts_numbers(private_shm):
    r = run_private(private_shm, "explain", str(LOGS / "bus_error.log"))
    assert r.returncode == 0, isolated.describe(r)
    assert "This host's /dev/shm is 64.0 MiB" in " ".join(r.stdout.split())
    assert "--shm-size=" in r.stdout and "emptyDir" in r.stdout


@pytest.mark.mindspore
@pytest.mark.privileged
def test_explain_a_live_bus_error(real_mindspore):
    """End to end: a pipeline dies of SIGBUS in a 64 MB /dev/shm, and its own output is explained there."""
    _dynamic_slots_only()
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
    """A dry run attempts no removal, so none can fail: exit 0 whatever this host has left behind."""
    r = run("clean", "--json")
    assert r.returncode == 0, isolated.describe(r)
    report = json.loads(r.stdout)
    assert report["dry_run"] is True and not any(item["removed"] for item in report["leftovers"])
    both = run("clean", "--yes", "--dry-run", "--json")  # --dry-run wins
    assert json.loads(both.stdout)["dry_run"] is True


def test_watch_follows_another_process_until_it_ends():
    """``ms-shm watch PID`` from another shell: the job's own fds, limits and children, its summary once it
    ends (here a process that opens 30 fds under a soft limit of 512, with one child, for 2 s)."""
    job = subprocess.Popen([sys.executable, "-c", (
        "import resource, subprocess, sys, time\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "held = [open('/dev/null') for _ in range(30)]\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'])\n"
        "time.sleep(2)\n")])
    try:
        r = run("watch", str(job.pid), "--interval", "0.2", "--json")
    finally:
        job.wait(10)
    assert r.returncode == 0, isolated.describe(r)
    summary = json.loads(r.stdout)
    assert summary["samples"] >= 2 and summary["fd_soft_limit"] == 512 and summary["peak_fds"] >= 30
    assert summary["peak_workers"] >= 1
    gone = run("watch", str(job.pid))
    assert gone.returncode == 2 and "no process" in gone.stderr
    gone = run("watch", str(job.pid), "--json")  # a script reading --json gets JSON on the error path too
    assert gone.returncode == 2 and json.loads(gone.stdout)["error"] == f"no process {job.pid}"


def test_plan_without_its_size_is_a_usage_error():
    """Exit 2, as argparse exits for every other usage error (it was 1, "nothing recognised" elsewhere)."""
    for args in (("--workers", "2"), ("--framework", "torch", "--workers", "2")):
        r = run("plan", *args)
        assert r.returncode == 2 and r.stderr.startswith("ms-shm plan: ") and not r.stdout


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


def test_plan_rejects_non_finite_sizes():
    for args in (("plan", "--row-mb", "inf", "--workers", "2"), ("doctor", "--row-mb", "nan"),
                 ("plan", "--framework", "torch", "--batch-mb", "inf", "--workers", "2")):
        r = run(*args)
        assert r.returncode == 2 and "must be a finite number of MiB" in r.stderr and "Traceback" not in r.stderr


def test_plan_rejects_an_unknown_mindspore_version_and_names_the_known_ones():
    r = run("plan", "--row-mb", "8", "--workers", "2", "--shm", "1g", "--mindspore", "banana")
    assert r.returncode == 2 and "unknown MindSpore version 'banana'" in r.stderr and "2.3" in r.stderr, r.stderr
    assert "2.10" in r.stderr
    ok = run("plan", "--row-mb", "8", "--workers", "2", "--shm", "1g", "--mindspore", "2.7.1", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["input"]["mindspore"] == "2.7.1"


def test_plan_of_a_dataloader_prints_json_under_json():
    r = run("plan", "--framework", "torch", "--batch-mb", "8", "--workers", "2", "--shm", "1g", "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 0 and data["schema"] == 1 and data["fits"] is True
    assert data["input"]["framework"] == "torch" and data["input"]["batch_bytes"] == 8 * MiB
    assert data["shm"]["source"] == "given with --shm" and data["plan"]["workers"] == 2
    tight = json.loads(run("plan", "--framework", "torch", "--batch-mb", "8", "--workers", "2",
                           "--shm", "1m", "--json").stdout)
    assert tight["fits"] is False and tight["plan"] is None and "honouring" in tight["plan_note"]


def test_plan_of_mindspores_dataloader_under_numpy_2_does_not_fit_whatever_dev_shm_holds():
    """An audit: "Result: fits." on MindSpore 2.10 with NumPy 2.4.6, where the loader's workers fail (doctor's
    ``msloader-numpy2``)."""
    np = pytest.importorskip("numpy")
    if int(np.__version__.split(".")[0]) < 2:
        pytest.skip(f"NumPy {np.__version__}: MindSpore's DataLoader workers run")
    r = run("plan", "--framework", "mindspore-dataloader", "--batch-mb", "8", "--workers", "2", "--shm", "1g",
            "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 0 and data["fits"] is False and "numpy<2" in data["plan_note"], r.stdout


def test_explain_json_on_an_unreadable_file_is_a_json_error():
    r = run("explain", str(LOGS / "no-such.log"), "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 2 and data["schema"] == 1 and "cannot read" in data["error"]


# ------------------------------------------------------------------------------------------- run, exactly as python

INTROSPECT = '''\
import json, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "file": globals().get("__file__"),
                  "path0": sys.path[0], "path1": sys.path[1], "package": __package__,
                  "spec": getattr(__spec__, "name", None), "loader": type(__loader__).__name__,
                  "builtins": type(__builtins__).__name__, "cached": globals().get("__cached__", "absent"),
                  "main_is_me": sys.modules["__main__"].__dict__ is globals()}))
'''


def python_and_run(*target: str, cwd, run_options: tuple = ()) -> tuple:
    """``python TARGET...`` and ``python -m ms_shm run [OPTIONS] TARGET...`` from ``cwd``: (plain, ours)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    both = [[sys.executable, *target], [sys.executable, "-m", "ms_shm", "run", *run_options, *target]]
    return tuple(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=120)
                 for cmd in both)


def assert_same(plain, ours) -> None:
    assert (ours.returncode, ours.stdout, ours.stderr) == (plain.returncode, plain.stdout, plain.stderr), \
        f"plain:\n{isolated.describe(plain)}\nrun:\n{isolated.describe(ours)}"


def test_run_gives_the_script_pythons_main_module_absolute_file_and_path0(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "intro.py").write_text(INTROSPECT)
    plain, ours = python_and_run("sub/intro.py", "--strict", "x", cwd=tmp_path)
    assert_same(plain, ours)
    facts = json.loads(ours.stdout)
    assert facts["file"] == str(tmp_path / "sub" / "intro.py") and facts["argv"][0] == "sub/intro.py"
    assert facts["path0"] == str(tmp_path / "sub") and facts["path1"] != str(tmp_path)  # replaced, not inserted
    assert facts["package"] is None and facts["loader"] == "SourceFileLoader" and facts["builtins"] == "module"


def test_run_keeps_the_scripts_file_usable_after_chdir_and_prints_absolute_paths(tmp_path):
    (tmp_path / "data.txt").write_text("payload\n")
    (tmp_path / "chdir.py").write_text("import os, warnings\nos.chdir('/')\n"
                                       "print(open(os.path.join(os.path.dirname(__file__), 'data.txt')).read())\n"
                                       "warnings.warn('careful')\n"
                                       "def inner():\n    raise ValueError('boom')\n"
                                       "try:\n    inner()\nexcept ValueError as e:\n"
                                       "    raise RuntimeError('w') from e\n")
    plain, ours = python_and_run("chdir.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert "payload" in ours.stdout and f'{tmp_path / "chdir.py"}:4: UserWarning: careful' in ours.stderr
    assert f'File "{tmp_path / "chdir.py"}", line 6, in inner' in ours.stderr and "ms_shm" not in ours.stderr


def test_run_of_a_symlinked_script_puts_the_real_directory_on_sys_path(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    (tmp_path / "real" / "sibling.py").write_text("VALUE = 'sibling'\n")
    (tmp_path / "real" / "linked.py").write_text("import sys, sibling\nprint(sys.path[0], sibling.VALUE)\n")
    (tmp_path / "links" / "linked.py").symlink_to(tmp_path / "real" / "linked.py")
    plain, ours = python_and_run("links/linked.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.stdout == f"{tmp_path / 'real'} sibling\n"


def test_run_of_a_directory_or_zip_runs_its_main_with_itself_on_sys_path(tmp_path):
    import zipfile

    (tmp_path / "appdir").mkdir()
    body = "import sys; print(__name__, sys.argv, sys.path[0], __file__)\n"
    (tmp_path / "appdir" / "__main__.py").write_text(body)
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
        z.writestr("__main__.py", body)
    for target in ("appdir", "app.zip"):
        plain, ours = python_and_run(target, "a", cwd=tmp_path)
        assert_same(plain, ours)
        assert ours.stdout.startswith(f"__main__ ['{target}', 'a'] {tmp_path / target} ")


@pytest.mark.parametrize("end, file_kept", [("", False), ("sys.exit(3)", True), ("raise KeyError(1)", False)])
def test_run_keeps_the_script_as_main_for_atexit_and_deletes_file_as_python_does(tmp_path, end, file_kept):
    """``__file__`` goes once the script's code returned or raised, not on ``sys.exit`` (python exits at once:
    an atexit handler using ``__file__`` raised NameError under run); ``__annotations__`` is there, as in python's."""
    (tmp_path / "late.py").write_text(
        "import atexit, pickle, sys\nclass C: pass\n"
        "def at_end():\n"
        "    main = sys.modules['__main__']\n"
        "    print('pickled', len(pickle.dumps(C())) > 0, hasattr(main, 'C'), '__file__' in vars(main))\n"
        f"atexit.register(at_end)\nprint('done', __annotations__)\n{end}\n")
    plain, ours = python_and_run("late.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.stdout == f"done {{}}\npickled True True {file_kept}\n"


def test_run_keeps_ms_shms_lines_when_the_script_configures_logging(tmp_path):
    """dictConfig's ``disable_existing_loggers`` switched off every ms_shm logger made before the script ran: the
    warnings run promises (what it adapted, and where) were lost (audit)."""
    (tmp_path / "configured.py").write_text(
        "import logging, logging.config\n"
        "logging.config.dictConfig({'version': 1, 'root': {'level': 'INFO'}})\n"
        "for name in ('ms_shm', 'ms_shm.patch', 'ms_shm.engines.mindspore.planning'):\n"
        "    logging.getLogger(name).warning('still shown from %s', name)\n"
        "logging.getLogger('other').warning('not shown')\n")
    _, ours = python_and_run("configured.py", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    for name in ('ms_shm', 'ms_shm.patch', 'ms_shm.engines.mindspore.planning'):
        assert f"WARNING: still shown from {name}" in ours.stderr, ours.stderr


def test_run_gives_multiprocessings_main_alias_the_scripts_module(tmp_path):
    """multiprocessing, imported by ms_shm before the script, had aliased ms_shm's own ``__main__``."""
    (tmp_path / "alias.py").write_text(
        "import multiprocessing, sys\nprint(sys.modules['__mp_main__'] is sys.modules['__main__'])\n")
    plain, ours = python_and_run("alias.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.stdout == "True\n"


def test_run_with_spawned_processes_reimports_the_script(tmp_path):
    (tmp_path / "spawner.py").write_text(
        "import multiprocessing as mp\nclass K:\n    pass\ndef square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n    mp.set_start_method('spawn')\n"
        "    with mp.Pool(2) as pool:\n        print(pool.map(square, range(4)))\n")
    plain, ours = python_and_run("spawner.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.stdout == "[0, 1, 4, 9]\n"


def test_run_uses_the_scripts_excepthook(tmp_path):
    (tmp_path / "hook.py").write_text(
        "import sys\nsys.excepthook = lambda t, v, tb: print('HOOK', t.__name__, v, file=sys.stderr)\n"
        "raise ValueError('x')\n")
    plain, ours = python_and_run("hook.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.returncode == 1 and ours.stderr == "HOOK ValueError x\n"


@pytest.mark.parametrize("raised", ["ValueError('data file missing')", "KeyboardInterrupt"])
def test_a_hook_that_exits_ends_the_run_with_its_code_and_one_that_fails_is_told_as_python_tells_it(tmp_path,
                                                                                                     raised):
    """An audit: a launcher's hook that logs, then ``sys.exit(9)``, gave 1 (130) under run and a "failing hook"
    report with ms_shm's frame; a hook that raised another error showed ms_shm's frame and the chain."""
    (tmp_path / "exits.py").write_text(
        "import atexit, sys\natexit.register(lambda: print('AT EXIT', __file__ is not None))\n"
        "def hook(kind, value, tb):\n    print('fatal:', kind.__name__, file=sys.stderr)\n    sys.exit(9)\n"
        f"sys.excepthook = hook\nraise {raised}\n")
    (tmp_path / "fails.py").write_text(
        "import sys\ndef hook(kind, value, tb):\n    raise RuntimeError('hook broke')\n"
        f"sys.excepthook = hook\nraise {raised}\n")
    for script in ("exits.py", "fails.py"):
        plain, ours = python_and_run(script, cwd=tmp_path)
        assert_same(plain, ours)
        assert "ms_shm" not in ours.stderr
    assert ours.returncode in (1, -2) and "Error in sys.excepthook:" in ours.stderr
    plain, ours = python_and_run("exits.py", cwd=tmp_path)
    assert ours.returncode == 9 and ours.stdout == "AT EXIT True\n"


def test_run_keyboard_interrupt_and_syntax_error_show_no_ms_shm_frames(tmp_path):
    (tmp_path / "kbi.py").write_text("raise KeyboardInterrupt\n")
    (tmp_path / "syntax.py").write_text("x = 1\ndef (:\n")
    for script in ("kbi.py", "syntax.py"):
        plain, ours = python_and_run(script, cwd=tmp_path)
        assert_same(plain, ours)
        assert "ms_shm" not in ours.stderr and "runpy" not in ours.stderr
    assert ours.stderr.startswith(f'  File "{tmp_path / "syntax.py"}", line 2')
    plain, ours = python_and_run("kbi.py", cwd=tmp_path)
    assert ours.returncode == -2  # killed by SIGINT, as python ends an uncaught KeyboardInterrupt


def test_run_missing_script_or_module_is_pythons_one_line(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    plain, ours = python_and_run("nope.py", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.returncode == 2 and ours.stderr.count("\n") == 1 and f"'{tmp_path / 'nope.py'}'" in ours.stderr
    plain, ours = python_and_run("-m", "mypkg.nope", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.returncode == 1 and ours.stderr.endswith(": No module named mypkg.nope\n")


def test_run_with_nothing_to_run_is_a_usage_error(tmp_path):
    """An audit: exit 1, where every other usage error of the CLI exits 2."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "ms_shm", "run"], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: ms-shm run") and "give a SCRIPT" in proc.stderr


def test_run_reads_the_program_from_stdin_as_python_does(tmp_path):
    """An audit: ``ms-shm run -`` looked for a file named ``-``."""
    program = ("import sys\nprint(repr(globals().get('__file__')), sys.argv, repr(sys.path[0]), __name__)\n"
               "raise ValueError('x')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plain, ours = (subprocess.run(cmd, input=program, capture_output=True, text=True, env=env, cwd=str(tmp_path),
                                  timeout=120)
                   for cmd in ([sys.executable, "-", "a"], [sys.executable, "-m", "ms_shm", "run", "-", "a"]))
    assert_same(plain, ours)
    assert ours.stdout == "'<stdin>' ['-', 'a'] '' __main__\n" and ours.returncode == 1


def test_run_module_forms_and_a_leading_double_dash(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tool.py").write_text(INTROSPECT)
    (tmp_path / "argv.py").write_text("import sys; print(sys.argv)\n")
    plain, ours = python_and_run("-m", "mypkg.tool", "--strict", "--report", "r", cwd=tmp_path)
    assert_same(plain, ours)
    facts = json.loads(ours.stdout)
    assert facts["argv"] == [str(tmp_path / "mypkg" / "tool.py"), "--strict", "--report", "r"]
    assert facts["path0"] == str(tmp_path) and facts["spec"] == "mypkg.tool" and facts["main_is_me"]
    attached = subprocess.run([sys.executable, "-m", "ms_shm", "run", "-mmypkg.tool", "--strict"],
                              capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert json.loads(attached.stdout)["argv"][1:] == ["--strict"], attached.stderr
    plain, ours = python_and_run("argv.py", "--strict", cwd=tmp_path, run_options=("--",))
    assert_same(plain, ours)


def test_run_report_is_resolved_at_start_and_checked_before_the_script(tmp_path):
    (tmp_path / "away.py").write_text("import os\nos.chdir('/')\nprint('ran')\n")
    _, ours = python_and_run("away.py", cwd=tmp_path, run_options=("--report", "r.json"))
    assert ours.returncode == 0 and json.loads((tmp_path / "r.json").read_text())["schema"] == 1
    _, bad = python_and_run("away.py", cwd=tmp_path, run_options=("--report", str(tmp_path / "no" / "r.json")))
    assert bad.returncode == 2 and "ran" not in bad.stdout, bad.stderr
    assert bad.stderr.startswith(f"ms-shm run: cannot write report {tmp_path / 'no' / 'r.json'}")
    assert bad.stderr.count("\n") == 1


def test_run_report_that_cannot_be_written_at_exit_is_one_line_and_keeps_the_exit_code(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "rm.py").write_text(f"import shutil, sys\nshutil.rmtree({str(out)!r})\nsys.exit(3)\n")
    ours = subprocess.run([sys.executable, "-m", "ms_shm", "run", "--report", str(out / "r.json"), "rm.py"],
                          capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert ours.returncode == 3 and "Traceback" not in ours.stderr
    assert ours.stderr == f"ms-shm run: cannot write report {out / 'r.json'}: No such file or directory\n"


def test_clean_groups_many_dataset_ipc_files_in_its_text():
    from ms_shm.cleanup import KIND_IPC_FILE, KIND_SHM, CleanReport, Leftover

    files = [Leftover(KIND_IPC_FILE, f"/tmp/dataset_ipc_{100 + i % 3}_1_{i}", 0, 100 + i % 3, "pid dead")
             for i in range(10)]
    lines = CleanReport((Leftover(KIND_SHM, "shmid 2 key 0x1", MiB, 7, "dead"), *files), 0, True,
                        bytes_to_free=MiB).lines()
    assert sum(line.startswith("would remove: /tmp/dataset_ipc file ") for line in lines) == 3
    assert "... and 7 more /tmp/dataset_ipc files (would remove: 7; 0 B, 3 dead pid(s))" in lines[4]
    assert lines[5] == "would remove 11 object(s), 1.0 MiB freed if run with --yes"
    few = CleanReport(tuple(files[:4]), 0, True).lines()
    assert sum("/tmp/dataset_ipc file" in line for line in few) == 4


def test_run_module_errors_print_as_python_m_prints_them(tmp_path):
    """Under ``-m`` python itself shows runpy's frames; ``run -m`` shows the same, and none of ms_shm's."""
    (tmp_path / "pk").mkdir()
    (tmp_path / "pk" / "__init__.py").write_text("")
    (tmp_path / "pk" / "bad.py").write_text("raise ValueError('in module')\n")
    plain, ours = python_and_run("-m", "pk.bad", cwd=tmp_path)
    assert_same(plain, ours)
    assert ours.returncode == 1 and "ms_shm" not in ours.stderr


@pytest.mark.parametrize("argv, expected", [
    (["run", "--report", "r.json", "s.py", "--log-level", "x"], (["run", "--report", "r.json"], None, ["s.py", "--log-level", "x"])),
    (["run", "--rep", "r.json", "--log", "INFO", "s.py"], (["run", "--rep", "r.json", "--log", "INFO"], None, ["s.py"])),
    (["run", "--report=r.json", "s.py", "a"], (["run", "--report=r.json"], None, ["s.py", "a"])),
    (["run", "--strict", "-m", "pkg", "--rep"], (["run", "--strict"], "pkg", ["--rep"])),
])
def test_run_reads_its_options_as_argparse_does_abbreviations_included(argv, expected):
    from ms_shm.cli.run import split_run_argv

    assert split_run_argv(argv) == expected


LAUNCHER = '''
import json, multiprocessing, subprocess, sys

def patched():
    loaded = "ms_shm" in sys.modules  # a child loads nothing of ms_shm before it imports a framework
    import torch.utils.data  # noqa: F401 - the framework import that patches a child
    module = sys.modules.get("ms_shm.patch")
    return [loaded, bool(module and module.is_patched()), bool(module and module._ON_IMPORT)]  # tuned at import

def report(queue):
    queue.put(patched())

if __name__ == "__main__":
    if sys.argv[1:] == ["rank"]:  # a rank the script started again, as Lightning's DDP does
        print(json.dumps(patched()))
        sys.exit(0)
    context = multiprocessing.get_context("spawn")  # torch.multiprocessing.spawn's way
    queue = context.Queue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    spawned = queue.get(timeout=60)
    worker.join()
    rank = subprocess.run([sys.executable, __file__, "rank"], capture_output=True, text=True).stdout.strip()
    one_liner = subprocess.run([sys.executable, "-c", "import sys; print('ms_shm.patch' in sys.modules)"],
                               capture_output=True, text=True).stdout.strip()
    print(json.dumps({"me": patched(), "spawned": spawned, "rank": json.loads(rank), "one_liner": one_liner}))
'''


def test_run_patches_the_python_processes_its_script_starts(tmp_path):
    """Lightning's DDP ranks run the script again (``python script.py``), ``torch.multiprocessing.spawn`` starts
    spawned processes: an audit's rank 1 died of ENOSPC under 64 MB where rank 0, under ``ms-shm run``, ran. A
    child is patched at its first framework import and loads nothing of ms_shm before; a one-line ``python -c``
    (multiprocessing's resource tracker among them) is left alone; plain python patches nothing anywhere."""
    (tmp_path / "launch.py").write_text(LAUNCHER)
    plain, ours = python_and_run("launch.py", cwd=tmp_path)
    assert plain.returncode == 0 and ours.returncode == 0, isolated.describe(ours)
    assert json.loads(plain.stdout) == {"me": [False, False, False], "spawned": [False, False, False],
                                        "rank": [False, False, False], "one_liner": "False"}
    assert json.loads(ours.stdout) == {"me": [True, True, True], "spawned": [False, True, False],  # patched only
                                       "rank": [False, True, True], "one_liner": "False"}, ours.stderr
    assert ours.stderr == plain.stderr


def test_a_sitecustomize_the_run_hides_from_its_children_still_runs_there(tmp_path):
    """``ms-shm run`` puts its own ``sitecustomize`` first on the children's ``PYTHONPATH``; the one it hides (a
    virtual environment's, a site's) runs first, as it would have, and is the ``sitecustomize`` module there."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = True\n")
    (tmp_path / "child.py").write_text("import builtins, sys, sitecustomize\nimport torch.utils.data\n"
                                       "print(getattr(builtins, 'SITE_RAN', False), 'ms_shm.patch' in sys.modules, "
                                       "getattr(sitecustomize, '__file__', '').startswith(sys.argv[1]))\n")
    (tmp_path / "parent.py").write_text("import subprocess, sys\nsys.stdout.write(subprocess.run([sys.executable, "
                                        f"'child.py', {str(tmp_path / 'site')!r}], capture_output=True, "
                                        "text=True).stdout)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "site")]))
    ours = subprocess.run([sys.executable, "-m", "ms_shm", "run", "parent.py"], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=120)
    assert ours.returncode == 0 and ours.stdout.split() == ["True", "True", "True"], isolated.describe(ours)


SPAWNED_RANKS = '''
import json, os, sys
import torch.multiprocessing as mp
import torch.utils.data  # noqa: F401 - torch's DataLoader module: what ms_shm patches

def rank(index, queue):
    import ms_shm
    queue.put([index, ms_shm.session().host_facts().ranks.local_size])

if __name__ == "__main__":
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank, args=(queue,), nprocs=2)
    print(json.dumps({"ranks": sorted(queue.get() for _ in range(2)), "env": "MS_SHM_LOCAL_RANKS" in os.environ}))
'''


def test_ranks_started_by_torch_multiprocessing_spawn_plan_as_two_on_the_host(tmp_path):
    """``torch.multiprocessing.spawn`` sets no launcher variable: an audit's 2 gloo ranks under 64 MB each planned
    as the host's only rank, and one died of ShmFullError "planned for 1 rank(s)"."""
    (tmp_path / "ddp.py").write_text(SPAWNED_RANKS)
    plain, ours = python_and_run("ddp.py", cwd=tmp_path)
    assert plain.returncode == 0 and ours.returncode == 0, isolated.describe(ours)
    assert json.loads(plain.stdout) == {"ranks": [[0, 1], [1, 1]], "env": False}
    assert json.loads(ours.stdout) == {"ranks": [[0, 2], [1, 2]], "env": False}, ours.stderr
