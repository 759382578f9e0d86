"""``explain`` on what MindSpore really prints (``tests/data/logs``, captured by ``capture.py``), on PyTorch's
messages and MindSpore 2.0.0's worker-death line (written by hand from their source: neither is installed here),
judged against fake host facts of several releases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ms_shm import advice
from ms_shm._results import mib
from ms_shm.explain import explain, known
from ms_shm.host import HostFacts, Ranks
from tests.fakes import logind_facts

LOGS = Path(__file__).resolve().parent / "data" / "logs"
MiB = 1 << 20
GiB = 1 << 30


def facts(**kw) -> HostFacts:
    """Docker's default container: 64 MiB /dev/shm, 2 CPUs, a low-ish fd limit."""
    base = dict(
        shm_path="/dev/shm", shm_total=64 * MiB, shm_free=64 * MiB, mem_total=16 * GiB, mem_available=12 * GiB,
        cgroup_version="v2", cgroup_mem_limit=None, cgroup_mem_usage=None, cpu_count=2, cpu_affinity=2,
        cpu_quota=None, usable_cpus=2, nofile_soft=1024, nofile_hard=4096, open_fds=6, shmmax=1 << 63,
        shmall_pages=1 << 63, shmmni=4096, msgmni=32000, sysv_segments=0, sysv_bytes=0, container="docker",
        ranks=Ranks(1, 0, "default"), mindspore_version="2.10.0", start_method="fork", notes=(),
    )
    base.update(kw)
    return HostFacts(**base)


def log(name: str) -> str:
    return (LOGS / name).read_text()


def only(text: str, **kw):
    found = explain(text, facts(**kw))
    assert len(found) == 1, [e.kind for e in found]
    return found[0]


CAPTURED = ["bus_error.log", "insufficient_shm.log", "shm_full_generator.log", "shm_full_map.log",
            "too_many_open_files.log", "too_many_open_files_main.log"]


@pytest.mark.parametrize("name", CAPTURED)
def test_captured_logs_are_real_mindspore_output(name):
    """The test data came from MindSpore, not from us: each file carries MindSpore's own traces."""
    text = log(name)
    assert "Written by hand" not in text
    assert "mindspore" in text.lower() or "Unexpected bus error encountered in process" in text


def test_bus_error_log():
    text = log("bus_error.log")
    e = only(text)
    assert (e.kind, e.severity, e.signal) == ("bus-error", "crash", "Bus error")
    assert f"Dataset worker process {e.pid} was killed by signal: Bus error" in text
    assert "64.0 MiB" in e.cause  # this host's numbers
    snippets = dict(e.snippets)
    size = snippets["docker run"].split("--shm-size=")[1].split()[0]
    assert advice.parse_size(size) * 0.8 >= advice.Typical.of(facts()).peak
    assert "emptyDir" in snippets["kubernetes"]
    assert "set_enable_shared_mem(False)" in snippets["ds.config"]  # 64 MiB is too small even at prefetch 1


def test_insufficient_shm_log_parses_the_numbers():
    text = log("insufficient_shm.log")
    e = only(text)
    assert e.kind == "insufficient-shm"
    assert f"Required: {e.required}, Available: {e.available}" in text
    assert e.required > e.available > 0
    size = dict(e.snippets)["docker run"].split("--shm-size=")[1].split()[0]
    assert advice.parse_size(size) * 0.8 >= e.required  # MindSpore's own 80% check would pass
    assert "max_rowsize" in e.fix


def test_a_pre_check_counts_what_the_pipelines_earlier_stages_held():
    """MindSpore 2.0.0's batch asked 384 MiB with 103.6 MiB of a 512 MiB /dev/shm available (its generator and map
    held the rest): "512m" was said again, the space in use at the check taken as what is in use now."""
    text = ("RuntimeError: Insufficient shared memory available. Required: 402653184, Available: 108683264. The "
            "required memory can't exceed 80% of the available shared memory\n")
    e = only(text, shm_total=512 * MiB, shm_free=512 * MiB, mindspore_version="2.0.0")
    size = advice.parse_size(dict(e.snippets)["docker run"].split("--shm-size=")[1].split()[0])
    assert size - (512 * MiB - 108683264) >= 402653184 / 0.8, size  # what the stages held, and the 80% check


def test_a_log_read_on_a_roomy_host_is_sized_for_the_job_not_for_this_host():
    """A bus error from a 64 MB container explained on a 24 GiB host was told --shm-size=24g: this host's size
    is a floor only where the job plausibly failed here."""
    e = only(log("bus_error.log"), shm_total=24 * GiB, shm_free=24 * GiB)
    size = advice.parse_size(dict(e.snippets)["docker run"].split("--shm-size=")[1].split()[0])
    assert size * 0.8 >= advice.Typical.of(facts()).peak and size <= 1 * GiB, size
    assert "ran elsewhere" in e.cause


def test_full_shm_generator_log():
    e = only(log("shm_full_generator.log"), shm_free=0)
    assert e.kind == "shm-full" and "0 B free" in e.cause
    assert "ms-shm clean" in e.fix


def test_full_shm_map_log_is_the_semaphores():
    e = only(log("shm_full_map.log"))
    assert e.kind == "no-space" and e.severity == "crash" and "semaphores" in e.cause


@pytest.mark.parametrize("name", ["too_many_open_files.log", "too_many_open_files_main.log"])
def test_too_many_open_files_logs(name):
    e = only(log(name), nofile_soft=40, nofile_hard=4096)
    assert e.kind == "too-many-open-files"
    assert "soft limit is 40" in e.cause
    assert "--ulimit nofile=4096" in dict(e.snippets)["docker run"]  # what the need takes, within the hard limit
    assert "at least 4096" in e.fix  # as doctor says it: `ulimit -n` past the hard limit fails


def test_too_many_open_files_with_no_pipeline_in_the_log_is_the_programs_own():
    """An audit: a bare traceback of ``open()`` in a loop was told of MindSpore's shared-memory slots."""
    e = only("Traceback (most recent call last):\n  File \"prep.py\", line 3, in <module>\n    open(f).read()\n"
             "OSError: [Errno 24] Too many open files: '/data/img_1.jpg'\n", nofile_soft=40, nofile_hard=4096)
    assert e.kind == "too-many-open-files" and "no data pipeline" in e.cause and "MindSpore shared-memory" not in \
        e.cause and "with open(" in e.fix and "at least" in e.fix


def test_pytorch_bus_error_written_by_hand():
    text = log("pytorch_bus_error.log")
    assert text.startswith("# Written by hand")
    e = only(text)
    assert (e.kind, e.pid, e.signal) == ("pytorch-bus-error", 1234, "Bus error")
    assert "--shm-size=" in dict(e.snippets)["docker run"]


def test_pytorch_shm_file_write_failure():
    text = ("RuntimeError: unable to write to file </torch_287_2714559211_8>: No space left on device (28)\n")
    e = only(text)
    assert e.kind == "pytorch-no-space" and "/dev/shm" in e.cause
    # a DataLoader's batches, not a GeneratorDataset's slots (it was told of "2 workers x 18 slots x 8.0 MiB rows")
    assert "slots" not in e.cause and "--framework torch --batch-mb" in e.cause
    told = e.fix.split("a /dev/shm of ")[1].split()[0]
    assert f"a /dev/shm of {told} holds " in e.cause


def test_nothing_recognised():
    assert explain("Epoch 1 loss 0.25\nall good\n", facts()) == ()
    assert explain("", facts()) == ()


def test_enospc_outside_multiprocessing_is_probably_a_disk():
    e = only("OSError: [Errno 28] No space left on device: '/data/ckpt/model.ckpt'\n")
    assert e.kind == "no-space" and e.severity == "info" and "disk" in e.cause


def test_worker_killed_by_sigkill_points_at_oom():
    line = ("[ERROR] MD(1,7f,python):2026-01-01 [sig_handler.cc:556] SIGCHLDHandler] Dataset worker process 4242 "
            "was killed by signal: Killed. Main process will be terminated.")
    e = only(line, cgroup_mem_limit=2 * GiB)
    assert (e.kind, e.pid, e.signal) == ("worker-killed", 4242, "Killed")
    assert "OOM" in e.cause and "2.0 GiB" in e.cause


@pytest.mark.parametrize("how, kind", [("was killed by signal: Killed", "worker-killed"),
                                       ("exited unexpectedly with exit code 1", "worker-exited")])
def test_the_sentinels_line_reads_as_mindspores(how, kind):
    """Where MindSpore's watchdog deadlocked, ``ms_shm.sentinel`` says what it would have, in its words."""
    line = (f"ms_shm: Dataset worker process 4242 {how}. MindSpore's watchdog, which ends the run then, has not in "
            "3 s (its SIGCHLD handler can deadlock in malloc); ms_shm's sentinel terminates the main process 1 as "
            "the watchdog would.")
    assert only(line).kind == kind


def test_worker_exit_alone_is_reported_but_not_when_explained():
    line = ("SIGCHLDHandler] Dataset worker process 77 exited unexpectedly with exit code 1. "
            "Main process will be terminated.")
    assert only(line).kind == "worker-exited"
    kinds = [e.kind for e in explain(log("too_many_open_files.log"), facts())]
    assert kinds == ["too-many-open-files"]  # the exit is the consequence, not a second failure


def test_static_row_too_big_warning():
    text = ("[WARNING] ME(1:1,MainProcess): Using shared memory queue, but rowsize is larger than allocated "
            "memory max_rowsize: 4.0MB, current rowsize: 4.0MB.")
    e = only(text)
    assert e.kind == "row-too-big" and e.severity == "slow" and "max_rowsize=5" in e.fix


def test_several_failures_in_order_of_appearance():
    text = log("too_many_open_files_main.log") + "\n" + log("bus_error.log")
    assert [e.kind for e in explain(text, facts())] == ["too-many-open-files", "bus-error"]


def test_unknown_host_facts_do_not_break_explanations():
    unknown = facts(shm_total=None, shm_free=None, nofile_soft=None, nofile_hard=None, open_fds=None,
                    notes=("statvfs(/dev/shm): PermissionError: denied",))
    for name in CAPTURED + ["pytorch_bus_error.log", "worker_died_2_0.log"]:
        for e in explain(log(name), unknown):
            assert e.cause and e.fix and "None" not in e.cause


def test_explanations_are_json_ready():
    import json

    for e in explain(log("bus_error.log") + log("insufficient_shm.log"), facts()):
        data = json.loads(json.dumps(e.to_dict()))
        assert set(data) >= {"kind", "severity", "line", "cause", "fix", "snippets", "pid", "signal",
                             "required", "available"}
        assert re.match(r"^[a-z-]+$", data["kind"])


# ------------------------------------------------------------------------------------------- releases and engines


def test_mindspore_2_0_worker_death_line_written_by_hand():
    text = log("worker_died_2_0.log")
    assert text.startswith("# Written by hand")
    e = only(text, mindspore_version="2.0.0", cgroup_mem_limit=2 * GiB)
    assert (e.kind, e.severity, e.pid) == ("worker-died", "crash", None)
    assert "The subprocess of dataset may exit unexpected or be killed" in e.line
    assert "OOM" in e.cause and "2.0 GiB" in e.cause and "dmesg" in e.fix


def test_worker_death_line_is_a_consequence_when_the_cause_is_there():
    text = log("insufficient_shm.log") + "\n" + log("worker_died_2_0.log")
    assert [e.kind for e in explain(text, facts(mindspore_version="2.0.0"))] == ["insufficient-shm"]


@pytest.mark.parametrize("version, error, dynamic", [("2.0.0", "Exception", False), ("2.3.1", "RuntimeError", False),
                                                     ("2.10.0", "RuntimeError", True)])
def test_pre_check_is_worded_for_the_hosts_release(version, error, dynamic):
    e = only(log("insufficient_shm.log"), mindspore_version=version)
    assert f"({error} on MindSpore {version})" in e.cause
    assert ("dropping max_rowsize" in e.fix) is dynamic  # <= 2.3 has no dynamic slots to fall back to
    assert ("default static 6 MiB slots" in e.cause) is not dynamic
    # the host sentence is the doctor's, for the same release: static slots peak lower than 8 MiB dynamic ones
    assert f"peaks at {mib(advice.Typical.of(facts(mindspore_version=version)).peak)}" in e.cause


def test_row_too_big_fix_follows_the_release():
    line = ("rowsize is larger than allocated memory max_rowsize: 6.0MB, current rowsize: 8.0MB.")
    assert "max_rowsize=None" in only(line).fix
    old = only(line, mindspore_version="2.3.0")
    assert "max_rowsize=None" not in old.fix and "max_rowsize=9" in old.fix and "only static slots" in old.fix


def test_a_static_row_fix_says_the_dev_shm_its_larger_slots_take():
    """An audit: 2.0.0's "pass max_rowsize=9", applied under 64 MB, raised 'Insufficient shared memory' at launch
    where the rows had run through pipes."""
    line = "rowsize is larger than allocated memory max_rowsize: 6.0MB, current rowsize: 8.0MB."
    fix = only(line, mindspore_version="2.0.0").fix
    assert "2 workers x 18 slots x 9 MiB = 324.2 MiB at prefetch 16" in fix, fix
    assert "Exception 'Insufficient shared memory available' at launch" in fix and "through pipes" in fix


def test_torchs_own_too_many_open_files_is_torchs():
    """An audit: torch's "Communication with the workers is no longer possible" was told as MindSpore's slots."""
    line = ("RuntimeError: Too many open files. Communication with the workers is no longer possible. Please "
            "increase the limit using `ulimit -n` in the shell or change the sharing strategy by calling "
            "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code\n")
    assert only(line).kind == "pytorch-too-many-files"


def test_a_line_saying_there_was_no_such_error_is_not_one():
    assert explain("health check: no Bus error, no Too many open files seen in 24h\n", facts()) == ()


def test_mindspores_dataloader_under_numpy_2_quotes_the_error_line():
    text = ('  File "/x/mindspore/multiprocessing/reductions.py", line 48, in restore_tensor\n'
            "    t = _restore_tensor(storage, storage_offset, shape, stride)\n"
            "SystemError: <built-in method __instancecheck__ of pybind11_type object at 0x5650> returned a result "
            "with an exception set\n")
    e = only(text)
    assert e.kind == "msloader-numpy2" and e.line.startswith("SystemError:"), e.line


def test_every_signature_template_formats():
    """Each engine's templates name only fields its regex, its ``words`` and explain provide."""
    from ms_shm import explain as explain_mod

    samples = {"pid": "12", "signal": "Killed", "code": "1", "required": "400000000", "available": "60000000",
               "slot_mb": "4.0", "row_mb": "4.0", "gb": "5", "detail": "row 5 is 12.0 MiB", "own_fix": "give more",
               "scope": "Memory cgroup out of memory", "victim_pid": "9", "constraint": "CONSTRAINT_MEMCG"}
    for version in ("2.0.0", "2.3.0", "2.10.0", None):
        f = facts(mindspore_version=version)
        for sig in explain_mod.signatures(f):
            groups = re.compile(sig.regex).groupindex
            fields = {g: int(samples[g]) if g in ("pid", "required", "available") else samples[g] for g in groups}
            e = explain_mod._explanation("line\n", f, 0, sig, fields)
            assert e.cause and e.fix and "{" not in e.cause + e.fix, sig.kind


def test_signatures_come_from_every_engine(monkeypatch):
    """A new engine's failures are recognised without touching explain: it only lists its signatures."""
    from ms_shm import engines
    from ms_shm.engines.base import Signature

    class Other:
        name = "other"

        def signatures(self, version=None):
            return (Signature("other-oom", "Other's OOM line", r"OTHER ran out of (?P<what>\w+)", "crash",
                              "Other ran out of {what}. {shm_state}", "give it a /dev/shm of {size}", need="shm"),)

    real = engines.all_engines()
    monkeypatch.setattr(engines, "all_engines", lambda: real + [Other()])
    e = only("boom: OTHER ran out of memory\n")
    assert e.kind == "other-oom" and "Other ran out of memory. This host's /dev/shm is 64.0 MiB" in e.cause
    assert "--shm-size=" in dict(e.snippets)["docker run"]
    assert "Other's OOM line" in known()


# ------------------------------------------------------------------------------------------- IPC deleted under a job

# MindSpore's main process after its worker's SysV queue was deleted (message_queue.cc: msgrcv fails, then msgget
# finds no queue under the key, so the errno printed is msgget's ENOENT). Written by hand from MindSpore's source.
MSGRCV = ("RuntimeError: Exception thrown from dataset pipeline. Refer to 'Dataset Pipeline Error Message'.\n"
          "- Dataset Pipeline Error Message:\n"
          "[ERROR] Exec msgrcv failed. Msg queue id: 32769, mtype: 777, errno: 2\n")
IPC_GONE = [
    MSGRCV,
    "OSError: [Errno 43] Identifier removed\n",
    '  File "/usr/lib/python3.12/multiprocessing/synchronize.py", line 115, in __setstate__\n'
    "    self._semlock = _multiprocessing.SemLock._rebuild(*state)\n"
    "                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "FileNotFoundError: [Errno 2] No such file or directory\n",
    "RuntimeError: could not unlink the shared memory file /torch_2070_3445168708_503 : No such file or directory (2)\n",
    "RuntimeError: unable to open shared memory object </torch_5962_408180057_3> in read-write mode: "
    "No such file or directory (2)\n",
]


@pytest.mark.parametrize("text", IPC_GONE)
def test_ipc_deleted_names_removeipc_when_this_host_would(text):
    e = only(text, logind=logind_facts())
    assert (e.kind, e.severity) == ("ipc-removed", "crash")
    assert "Likely cause: systemd-logind on this host has RemoveIPC=yes (systemd default)" in e.cause
    assert "loginctl enable-linger alice" in e.fix and "RemoveIPC=no" in e.fix
    assert "RemoveIPC=no" in dict(e.snippets)["logind.conf"]


@pytest.mark.parametrize("text", IPC_GONE)
def test_ipc_deleted_does_not_blame_removeipc_where_it_cannot_apply(text):
    root = only(text, logind=logind_facts(user="root", uid=0, system_user=True, at_risk=False,
                                          reason="root: logind never removes root's IPC"))
    assert root.kind == "ipc-removed" and "Likely cause" not in root.cause
    assert "RemoveIPC does not delete it here (root: logind never removes root's IPC)" in root.cause
    assert "ipcrm" in root.cause and root.snippets == ()
    unread = only(text)  # facts without logind: said so, never "None"
    assert "was not checked" in unread.cause and "None" not in unread.cause + unread.fix


def test_interrupted_msgrcv_is_not_a_deleted_queue():
    """errno 4 (EINTR) is MindSpore's own shutdown on a signal, not a queue that vanished."""
    assert explain("[ERROR] Exec msgrcv failed. Msg queue id: 32769, mtype: 777, errno: 4\n", facts()) == ()


def test_torch_shm_open_for_other_reasons_stays_pytorch_shm():
    e = only("RuntimeError: unable to open shared memory object </torch_1_2_3> in read-write mode: "
             "Permission denied (13)\n")
    assert e.kind == "pytorch-shm"


# The DataLoaders' own lines (facts sheet section 9, measured with torch 2.13.0 and MindSpore 2.10.0)
LOADER_LINES = {
    "RuntimeError: unable to allocate shared memory(shm) for file </torch_2718_3141592653_5>: No space left on "
    "device (28)": "pytorch-no-space",
    "RuntimeError: unable to open shared memory object </torch_2718_3141_7> in read-write mode: Too many open "
    "files (24)": "pytorch-too-many-files",
    "RuntimeError: received 0 items of ancdata": "pytorch-too-many-files",
    "RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly": "pytorch-worker-exited",
    "RuntimeError: DataLoader worker (pid: 4242) was killed by signal: Bus error.": "msloader-bus-error",
    "[ERROR] MapAllocator: shm_open failed with errno: 24": "msloader-too-many-files",
    "RuntimeError: DataLoader worker (pid: 4242) was killed by signal: Killed.": "msloader-worker-killed",
    "RuntimeError: DataLoader worker (pid(s): 4242) exited unexpectedly.": "msloader-worker-exited",
}


@pytest.mark.parametrize("line, kind", list(LOADER_LINES.items()))
def test_dataloader_failures_are_told_apart(line, kind):
    e = only(line + "\n")
    assert e.kind == kind, e
    if "too-many-files" in kind:
        assert "not a /dev/shm size problem" in e.cause


def test_mindspore_dataloader_bus_error_is_not_read_as_generator_dataset():
    e = only("RuntimeError: DataLoader worker (pid: 4242) was killed by signal: Bus error.\n")
    assert "DataLoader" in e.cause and "GeneratorDataset" not in e.cause


# ------------------------------------------------------------------------------------------- ms_shm's own output

# What ``ms-shm run`` printed under a full 64 KiB /dev/shm (tune's prediction, its snippet), then a --strict refusal
TUNE_WARNING = (
    "WARNING: /dev/shm is full: 64.0 KiB free of 64.0 KiB (0 B used). MindSpore cannot even create its semaphores "
    "(76.0 KiB for 1 rank(s)): GeneratorDataset fails with 'recommended shm size is at least 5 GB', map with "
    "'[Errno 28] No space left on device' Fix: free /dev/shm\n"
    "  shell:\n"
    "    df -h /dev/shm\n")
BUDGET = ("ms_shm.errors.ShmBudgetError: No configuration honouring num_parallel_workers=2 fits: rows of 8.0 MiB. "
          "Fix: drop the explicit num_parallel_workers=2 / python_multiprocessing=True so ms_shm can choose threads "
          "or fewer than 2 workers (1 reads rows in the main process); or give /dev/shm at least 95.0 KiB "
          "(docker run --shm-size=64m).\n")
ROW_TOO_LARGE = ("ms_shm.guard.RowTooLargeError: row 5 is 12.0 MiB, ms_shm planned rows of 1.0 MiB: this worker's 18 "
                 "shared-memory slots would grow to 36.0 MiB. Fix: give /dev/shm at least 540.1 MiB for rows of "
                 "12.0 MiB\n")
SHM_FULL = ("ms_shm.guard.ShmFullError: row 7 needs a new 1.0 MiB shared-memory slot, but /dev/shm has only 948.0 "
            "KiB free. Fix: make room, this pipeline needs 36.1 MiB of /dev/shm for its slots\n")


def test_ms_shms_own_logged_predictions_are_not_crashes():
    assert explain(TUNE_WARNING, facts()) == ()
    assert explain(TUNE_WARNING.replace("WARNING: ", "WARNING:ms_shm.api:"), facts()) == ()
    assert explain("INFO: ms_shm generator: mode=pipes workers=2 (Bus error when /dev/shm fills)\n", facts()) == ()
    # ``str(tune())`` as the quick start logs it: its advice lines say "Bus error" and "SystemError" too
    report = ("INFO    quickstart: tune report:\n"
              "ms_shm.tune: budget 51.2 MiB of /dev/shm per pipeline (64.0 MiB free), 18.0 GiB of memory\n"
              "  advice: /dev/shm is 64.0 MiB ... the first worker that writes past the end dies (Bus error when "
              "/dev/shm fills) -> give the container a /dev/shm of 512m\n"
              "  advice: MindSpore 2.10.0's DataLoader (mindspore.dataset.dataloader) can fail on batches from worker "
              "processes under NumPy 2.4.6 ('SystemError: ... returned a result with an exception set' in "
              "restore_tensor) -> pip install 'numpy<2'\n")
    assert explain(report, facts()) == ()
    # the same words from MindSpore itself, after ms_shm's warning, are still explained
    mindspore_said = "OSError: [Errno 28] No space left on device\n  File synchronize.py\n"
    assert only(TUNE_WARNING + mindspore_said).kind == "no-space"


def test_a_line_two_signatures_match_is_explained_once():
    line = "RuntimeError: recommended shm size is at least 5 GB: [Errno 28] No space left on device (SemLock)\n"
    assert only(line).kind == "shm-full"


@pytest.mark.parametrize("text, kind, fix", [
    (BUDGET, "shm-budget-error", "drop the explicit num_parallel_workers=2"),
    (ROW_TOO_LARGE, "row-too-large-error", "give /dev/shm at least 540.1 MiB for rows of 12.0 MiB"),
    (SHM_FULL, "shm-full-error", "make room, this pipeline needs 36.1 MiB"),
])
def test_ms_shms_own_errors_are_recognised_with_their_own_fix(text, kind, fix):
    e = only(TUNE_WARNING + "Traceback (most recent call last):\n  File \"train.py\", line 6, in <module>\n" + text)
    assert e.kind == kind and e.severity == "crash" and e.fix.startswith(fix), e
    assert "Fix:" not in e.cause and text.split(": ", 1)[1].split(" Fix:")[0] in e.cause
    assert kind in [x.kind for x in explain(text.split(" Fix:")[0] + "\n", facts())]  # no Fix: the default one


def test_mindspores_reraise_header_is_not_read_as_ms_shms_error():
    """MindSpore re-raises a worker's exception as ``<Name>: Traceback (most recent call last):`` and the worker's
    traceback; the worker's own line, further down, carries the message and the ranks hint."""
    header = ("  File \"datasets_user_defined.py\", line 400, in process\n    raise self.except_type(err_msg)\n"
              "ShmFullError: Traceback (most recent call last):\n  File \"guard.py\", line 188, in _check_free\n"
              "    raise self.no_room(size, index, free, margin=margin)\n")
    e = only(header + SHM_FULL)
    assert e.kind == "shm-full-error" and "row 7 needs" in e.cause and "Traceback" not in e.cause, e
    assert e.fix.startswith("make room, this pipeline needs 36.1 MiB"), e


# ------------------------------------------------------------------------------------------- cgroup-v1 memory audit

CGROUP = LOGS / "cgroup_v1"  # captured in a cgroup-v1 memory group: see its README.md


def cgroup_log(name: str) -> str:
    return (CGROUP / name).read_text()


# What subprocess, torchrun and a shell say when the child was SIGKILLed (their formats, pids made up)
SIGKILL_LINES = [
    "subprocess.CalledProcessError: Command 'python train.py' returned non-zero exit status -9.",
    "torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 1234) of binary: "
    "/usr/bin/python",
    "  Signal 9 (SIGKILL) received by PID 1234",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGKILL: 9>.",
    "train.py exited with code 137",
    "    Last State:     Terminated\n      Exit Code:    137",  # kubectl describe pod, columns padded
]


def _same_oom_answer(e, worker) -> None:
    """The MindSpore worker-killed answer's fix, snippet and memory-limit sentence: one OOM rule, not two."""
    assert e.fix == worker.fix and set(worker.snippets) <= set(e.snippets), e
    assert "this cgroup's limit is 2.0 GiB" in e.cause and "OOM killer" in e.cause
    assert "memory.failcnt" in e.cause and "memory.events" in e.cause and "dmesg | grep -i oom" in e.cause


WORKER_KILLED = ("[ERROR] MD(1,7f,python):2026-01-01 [sig_handler.cc:556] SIGCHLDHandler] Dataset worker process "
                 "4242 was killed by signal: Killed. Main process will be terminated.\n")


@pytest.mark.parametrize("line", SIGKILL_LINES)
def test_a_sigkill_is_most_likely_the_oom_killer_with_the_existing_fix(line):
    e = only(line + "\n", cgroup_mem_limit=2 * GiB)
    assert (e.kind, e.severity, e.signal) == ("sigkill", "crash", "Killed")
    _same_oom_answer(e, only(WORKER_KILLED, cgroup_mem_limit=2 * GiB))


def test_the_kernels_oom_kill_lines_name_the_cgroup_and_the_process():
    e = only(cgroup_log("oom_dmesg.log"), cgroup_mem_limit=2 * GiB)
    assert (e.kind, e.severity, e.pid) == ("oom-killed", "crash", None)  # the job, not a dataset worker
    assert "process 22683" in e.cause and "memory cgroup" in e.cause
    _same_oom_answer(e, only(WORKER_KILLED, cgroup_mem_limit=2 * GiB))


def test_a_host_without_a_memory_limit_is_not_said_to_have_one():
    """An audit: "the memory limit (23.5 GiB here)" named a host's RAM as a limit it never had."""
    e = only(WORKER_KILLED)
    assert "no container limit here, and RAM is 16.0 GiB" in e.cause and "limit (16.0 GiB here)" not in e.cause


def test_a_bare_killed_is_weaker_evidence_than_an_oom_line():
    e = only(cgroup_log("killed_shell.log"), cgroup_mem_limit=2 * GiB)
    assert (e.kind, e.severity) == ("killed", "likely")
    _same_oom_answer(e, only(WORKER_KILLED, cgroup_mem_limit=2 * GiB))
    assert "memory.failcnt" in dict(e.snippets)["cgroup"]
    job = "./run.sh: line 3: 12345 Killed                  python train.py\n"
    assert only(job).kind == "killed"
    for shell in ("[1]+  Killed                  python train.py\n", "zsh: killed     python train.py\n"):
        assert only(shell).kind == "killed", shell  # bash job control, zsh


def test_kubernetes_and_docker_name_the_oom_kill_themselves():
    for text in ("    Last State:     Terminated\n      Reason:       OOMKilled\n      Exit Code:    137\n",
                 '"State": {"Status": "exited", "OOMKilled": true, "ExitCode": 137}\n'):
        e = only(text, cgroup_mem_limit=2 * GiB)
        assert (e.kind, e.severity) == ("oom-killed", "crash"), text
    # a more specific line explains the same kill once
    assert [x.kind for x in explain(WORKER_KILLED + "Killed\n", facts())] == ["worker-killed"]
    assert [x.kind for x in explain(cgroup_log("oom_dmesg.log") + "Killed\n" + SIGKILL_LINES[0], facts())] == [
        "oom-killed"]
    assert explain("Killed process list refreshed\nnot Killed\n", facts()) == ()


def test_ms_shms_memory_budget_error_is_about_memory_not_dev_shm():
    text = cgroup_log("memory_budget_error.log")
    e = only(text)
    assert (e.kind, e.severity) == ("memory-budget-error", "crash")
    assert "OOM kill" in e.cause and "memory limit" in e.cause and "cgroup v1 limit 300.0 MiB" in e.cause
    assert "would end in a bus error" not in e.cause and "its /dev/shm was smaller" not in e.cause
    assert "more memory" in e.fix
    assert only(BUDGET).kind == "shm-budget-error"  # a /dev/shm refusal stays one


def test_ms_shms_advice_records_in_any_log_format_are_not_the_failure():
    text = cgroup_log("memory_budget_error.log")
    assert "INFO ms_shm: MindSpore 2.10.0's DataLoader" in text and "restore_tensor" in text
    assert [e.kind for e in explain(text, facts())] == ["memory-budget-error"]
    advice_line = next(x for x in text.split("\n") if "DataLoader (mindspore.dataset.dataloader)" in x)
    for prefix in ("", "2026-12-03 03:00:00,001 INFO ms_shm.api: ", "2026-12-03 03:00:00 - ms_shm - WARNING - ",
                   "[INFO] ms_shm: "):
        line = prefix + advice_line.split("ms_shm: ", 1)[1]
        assert explain(line + "\n  pip:\n    pip install 'numpy<2'\n", facts()) == (), prefix
    real = ('  File ".../mindspore/dataset/dataloader/_utils/collate.py", line 80, in restore_tensor\n'
            "SystemError: <built-in function frombuffer> returned a result with an exception set\n")
    assert [e.kind for e in explain(text + real, facts())] == ["memory-budget-error", "msloader-numpy2"]


def test_bus_error_in_a_512m_dev_shm_never_recommends_512m():
    e = only(cgroup_log("bus_error_512m.log"), shm_total=512 * MiB, shm_free=512 * MiB)
    assert e.kind == "bus-error"
    assert "/dev/shm of 1g" in e.fix and "--shm-size=1g" in dict(e.snippets)["docker run"]
    assert "does not show the row size, so 8 MiB is assumed" in e.cause
    assert "That fits, so if the job ran elsewhere" not in e.cause


def test_bus_error_sized_with_the_rows_and_dev_shm_the_log_shows():
    shown = ("INFO ms_shm: ms_shm.tune: /dev/shm budget 409.6 MiB per pipeline: 512.0 MiB free in /dev/shm x 80% "
             "headroom / 1 local rank(s) [default (no launcher variables)] = 409.6 MiB\n"
             "INFO ms_shm: ms_shm generator: mode=processes workers=2 prefetch=16 row=16.0 MiB predicted /dev/shm\n")
    e = only(shown + cgroup_log("bus_error_512m.log"), shm_total=None, shm_free=None)  # explained elsewhere
    assert "16.0 MiB rows" in e.cause and "/dev/shm at 512.0 MiB or more" in e.cause and "assumed" not in e.cause
    size = advice.parse_size(e.fix.split("/dev/shm of ")[1].split(",")[0])
    assert size > 512 * MiB and size * advice.HEADROOM >= advice.typical(facts(), row_bytes=16 * MiB).peak
    df = "Filesystem      Size  Used Avail Use% Mounted on\nshm             2.0G  2.0G     0 100% /dev/shm\n"
    full = only(df + cgroup_log("bus_error_512m.log"), shm_total=None, shm_free=None)
    assert "/dev/shm of 3g" in full.fix
    # df's row gives the size, not what was free (Avail 0 here): the sentence claims no free space (an audit)
    assert "/dev/shm at 2.0 GiB or more" in full.cause and "free" not in full.cause.split(";")[0]


def _audit_refusal(request, modes=("threads", "processes", "pipes")) -> str:
    """The planner's refusal of the audit's run: 16 MiB rows, every transport at 2 workers over the memory left."""
    from ms_shm import budget as budget_mod
    from ms_shm import plan
    from ms_shm.rows import RowStats

    left = int(109.8 * MiB)
    cands = [plan.Candidate(m, 2, 2, 0, 0, 1.0, False, f"needs 300.0 MiB of memory > {mib(left)} left for it",
                            300 * MiB) for m in modes]
    b = budget_mod.compute(512 * MiB, 1, 4096, 10, memory_left=int(137.2 * MiB), memory_source="cgroup v1")
    stats = RowStats(True, 96, 2, (0, 1), ("data",), 16 * MiB, 16 * MiB, None, None, 0.0)
    return "ms_shm.errors.ShmBudgetError: " + plan.no_fit_message(cands, request, b, stats, 16 * MiB) + "\n"


def test_budget_error_fix_names_only_what_the_planner_did_not_rule_out():
    from ms_shm.plan import Request

    e = only(_audit_refusal(Request(workers=2)))
    assert e.kind == "memory-budget-error"
    assert e.fix.startswith("drop the explicit num_parallel_workers=2 so ms_shm can choose fewer than 2 workers")
    assert "threads" not in e.fix.split(";")[0] and "pipes" not in e.fix.split(";")[0]
    forced = only(_audit_refusal(Request(workers=2, multiprocessing=True), ("processes", "pipes")))
    assert "so ms_shm can choose threads or fewer than 2 workers" in forced.fix


# ------------------------------------------------------------------------- MindSpore's DataLoader and a read-only /dev/shm

# Captured by ``capture.py``: MindSpore 2.8's DataLoader past a 64 MiB /dev/shm (the kill line, or the rarer EOFError
# with none), and loaders of each kind under a read-only 1 GiB tmpfs on /dev/shm.
MSLOADER_BUS = ["msloader_bus_error.log", "msloader_bus_error_eof.log"]
READONLY = ["torch_readonly.log", "generator_readonly.log", "map_readonly.log", "msloader_readonly.log"]


@pytest.mark.parametrize("name", MSLOADER_BUS + READONLY)
def test_new_captured_logs_are_real_framework_output(name):
    text = log(name)
    assert "Written by hand" not in text and "Traceback (most recent call last)" in text
    assert "site-packages/mindspore/" in text or "site-packages/torch/" in text


@pytest.mark.parametrize("name", MSLOADER_BUS)
def test_a_mindspore_dataloader_bus_error_log_is_one_dataloader_failure(name):
    """No GeneratorDataset in the log, and one kill: one DataLoader explanation, whether the kill line is there
    (it then names the worker) or the main process ended in EOFError without one."""
    text = log(name)
    assert "GeneratorDataset" not in text and "Unexpected bus error encountered in process" in text
    e = only(text)
    assert (e.kind, e.severity, e.signal) == ("msloader-bus-error", "crash", "Bus error")
    assert "DataLoader" in e.cause and "GeneratorDataset" not in e.cause + e.fix
    assert "num_workers" in e.fix and "--shm-size=" in dict(e.snippets)["docker run"]
    killed = re.search(r"DataLoader worker \(pid: (\d+)\) was killed by signal: Bus error", text)
    assert e.pid == (int(killed.group(1)) if killed else None)


def test_generator_dataset_bus_error_reads_as_a_sentence():
    e = only(log("bus_error.log"))
    assert e.kind == "bus-error"
    assert f"A MindSpore GeneratorDataset worker ({e.pid}) wrote a row" in e.cause
    assert "GeneratorDataset a worker" not in e.cause


def test_a_bare_bus_error_line_does_not_claim_a_pipeline_the_log_does_not_show():
    """MindSpore prints this line for a GeneratorDataset's and a DataLoader's worker alike."""
    line = ("Unexpected bus error encountered in process. Non-existent physical address. This might be caused by "
            "insufficient shared memory. Please check if '/dev/shm' has enough available space via 'df -h'.\n")
    e = only(line)
    assert e.kind == "bus-error"
    assert "GeneratorDataset a worker" not in e.cause and "DataLoader" in e.cause


@pytest.mark.parametrize("name", ["torch_readonly.log", "map_readonly.log", "msloader_readonly.log"])
def test_erofs_in_dev_shm_names_the_read_only_mount(name):
    """'[Errno 30] Read-only file system' from multiprocessing's semaphores or heap in /dev/shm: the log says it,
    whatever this host's /dev/shm is."""
    e = only(log(name), shm_total=GiB, shm_free=GiB)
    assert (e.kind, e.severity) == ("shm-readonly", "crash")
    assert "read-only" in e.cause and "remount" in e.fix
    snippets = dict(e.snippets)
    assert "remount,rw /dev/shm" in snippets["shell"] and "emptyDir" in snippets["kubernetes"]
    # the size was not the problem: nothing asks for more than a typical pipeline needs
    assert advice.parse_size(snippets["docker run"].split("--shm-size=")[1].split()[0]) <= GiB


def test_mindspores_insufficient_shm_on_a_read_only_host_is_the_read_only_mount():
    """GeneratorDataset hides EROFS behind its 'insufficient shm ... 5 GB' line; on a host whose /dev/shm is
    read-only (the probe's statvfs flag), that line is the read-only mount, not a full /dev/shm."""
    text = log("generator_readonly.log")
    assert "Read-only file system" not in text and "recommended shm size is at least 5 GB" in text
    e = only(text, shm_total=GiB, shm_free=GiB, shm_readonly=True)
    assert (e.kind, e.severity) == ("shm-readonly", "crash")
    assert "read-only" in e.cause and "remount" in e.fix and "5 GB" in e.cause


@pytest.mark.parametrize("readonly", [False, None])
def test_mindspores_insufficient_shm_elsewhere_stays_shm_full_and_names_the_other_cause(readonly):
    e = only(log("generator_readonly.log"), shm_readonly=readonly)
    assert e.kind == "shm-full"
    assert "read-only" in e.cause


def test_erofs_outside_dev_shm_is_not_the_read_only_shm():
    found = explain("OSError: [Errno 30] Read-only file system: '/data/ckpt/model.ckpt'\n", facts())
    assert "shm-readonly" not in [e.kind for e in found]


def test_new_logs_with_unknown_host_facts():
    unknown = facts(shm_total=None, shm_free=None, shm_readonly=None, nofile_soft=None, nofile_hard=None,
                    open_fds=None, notes=("statvfs(/dev/shm): PermissionError: denied",))
    for name in MSLOADER_BUS + READONLY:
        found = explain(log(name), unknown)
        assert found, name
        for e in found:
            assert e.cause and e.fix and "None" not in e.cause, (name, e)


# Written by hand from the formats of torch's MapAllocator ("unable to open shared memory object <%s> in read-write
# mode: %s (%d)") and MindSpore's DataLoader ("MapAllocator: shm_open failed with errno: %d"), as an EROFS reads.
@pytest.mark.parametrize("line", [
    "RuntimeError: unable to open shared memory object </torch_2718_3141_7> in read-write mode: Read-only file "
    "system (30)\n",
    "[ERROR] MapAllocator: shm_open failed with errno: 30\n",
])
def test_a_dataloaders_shared_memory_file_on_a_read_only_mount(line):
    e = only(line)
    assert e.kind == "shm-readonly" and "read-only" in e.cause


def test_a_generator_dataset_bus_error_beside_doctors_dataloader_finding_stays_generator_datasets():
    """The DataLoader is told by its own lines and source files, not by its module named in prose."""
    doctor = ("  3. [info] MindSpore 2.10.0's DataLoader (mindspore.dataset.dataloader) can fail on batches from "
              "worker processes under NumPy 2.4.6\n")
    e = only(doctor + log("bus_error.log"))
    assert e.kind == "bus-error" and "GeneratorDataset worker" in e.cause


def test_a_generator_datasets_lost_fds_are_mindspores_not_torchs():
    """An audit's raw GeneratorDataset run out of fds (``ulimit -n 100``) died in MindSpore's queue with Python's
    "received 0 items of ancdata", no torch in the log: explain told it as PyTorch's, with torch's fix."""
    text = ('  File "/v/site-packages/mindspore/dataset/engine/queue.py", line 281, in check_and_attach_shm\n'
            '  File "/usr/lib/python3.11/multiprocessing/reduction.py", line 164, in recvfds\n'
            "    raise RuntimeError('received %d items of ancdata' %\n"
            "RuntimeError: received 0 items of ancdata\n")
    e = only(text)
    assert e.kind == "too-many-open-files" and "set_sharing_strategy" not in e.fix, (e.kind, e.fix)
    torchs = ('  File "/v/site-packages/torch/multiprocessing/reductions.py", line 541, in rebuild_storage_fd\n'
              "RuntimeError: received 0 items of ancdata\n")
    assert only(torchs).kind == "pytorch-too-many-files"


@pytest.mark.parametrize("code", ["22", "28"])
def test_a_map_workers_segment_the_kernel_refused_is_told(code):
    """An audit (kernel.shmmax of 1 MiB, a map in worker processes) was told "recognised nothing"."""
    e = only(f"map operation: [PyFunc] failed. shmget key: 53136 error. Errno: {code}\n")
    assert e.kind == "sysv-limit" and f"errno {code}" in e.cause and "ms-shm doctor" in e.fix


def test_the_pre_checks_sum_is_the_sum_it_says():
    """"108.0 MiB / 80% plus what is in use gives 512m" was said where that sum is ~136 MiB: the 512m was a
    typical pipeline's need."""
    line = ("RuntimeError: Insufficient shared memory available. Required: 113246208, Available: 67088384. The "
            "required memory can't exceed 80% of the available shared memory\n")
    e = only(line)
    assert "Asking for 108.0 MiB / 80% plus what is in use gives 136.0 MiB; " in e.cause, e.cause
