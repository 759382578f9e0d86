"""tune(): dry run changes nothing, changes are recorded and undone, fd limits are raised, ranks are read.

Each case runs in a child process: tune() changes process-wide state (rlimits, MindSpore's config) that the
test runner must not inherit.
"""

from __future__ import annotations

import json

import pytest

from tests import isolated

pytestmark = pytest.mark.mindspore

PRELUDE = """
import json, logging, resource, sys
import mindspore.dataset as ds
import ms_shm
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
def state():
    from mindspore.dataset.core import config as c
    return {"prefetch": ds.config.get_prefetch_size(), "shm": c._get_enable_shared_mem(),
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
"""


def run(body: str, **kwargs) -> tuple:
    proc = isolated.run_python(PRELUDE + body, **kwargs)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    assert proc.returncode == 0 and lines, isolated.describe(proc)
    return json.loads(lines[-1]), proc.stderr


def test_dry_run_changes_nothing_and_restore_undoes(real_mindspore):
    out, log = run("""
before = state()
dry = ms_shm.tune(dry_run=True, row_mb=4, workers=2)
after_dry = state()
report = ms_shm.tune(row_mb=4, workers=2)
tuned = state()
again = ms_shm.tune(row_mb=4, workers=2)
report.restore()
print(json.dumps({"before": before, "after_dry": after_dry, "tuned": tuned, "restored": state(),
                  "dry_decisions": [d.setting for d in dry.decisions], "dry_changes": len(dry.changes),
                  "changes": [c.setting for c in report.changes], "again": len(again.changes),
                  "json": json.loads(report.to_json())["budget"]["ranks"],
                  "hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1]}))
""", shm="64m", nofile=40)
    assert out["after_dry"] == out["before"] and out["dry_changes"] == 0
    assert {"prefetch_size", "RLIMIT_NOFILE(soft)"} <= set(out["dry_decisions"])
    # 4 MiB rows, 2 workers, budget int(64 MiB x 0.8) = 53,687,091 B. Facts sheet §3: prefetch 4 gives S = 6 slots,
    # 2 x 6 x 4 MiB + 19 semaphore pages = 50,409,472 B (fits); prefetch 5 gives S = 7: 58,798,080 B (does not)
    assert (out["before"]["prefetch"], out["tuned"]["prefetch"]) == (16, 4)
    assert out["tuned"]["nofile"] == min(out["hard"], 65536)  # a low soft limit goes to 65536, within the hard
    assert out["again"] == 0, "tune() is idempotent: a second call changes nothing more"
    assert out["restored"] == out["before"]
    assert {"prefetch_size", "RLIMIT_NOFILE(soft)"} <= set(out["changes"])
    assert "RLIMIT_NOFILE" in log and "ms_shm.tune: /dev/shm budget" in log
    # each change said once as a warning, the dry run's none (an audit: ``ms-shm run`` raised the soft limit
    # with nothing shown at the default level)
    for setting in ("RLIMIT_NOFILE(soft) from 40 to", "prefetch_size from 16 to 4"):
        assert log.count(f"WARNING:ms_shm:ms_shm.tune changed {setting}") == 1, log


def test_rows_too_big_for_any_prefetch_are_explained(real_mindspore):
    out, log = run("""
r = ms_shm.tune(dry_run=True, row_mb=8, workers=2)
print(json.dumps([str(d) for d in r.decisions if d.setting == "prefetch_size"]))
""", shm="64m")
    assert len(out) == 1 and "threads or pipes" in out[0]


def test_ranks_from_launcher_env_split_the_budget(real_mindspore):
    out, log = run("""
r = ms_shm.tune(dry_run=True)
print(json.dumps({"ranks": r.budget.ranks, "budget": r.budget.shm_bytes, "source": r.facts.ranks.source,
                  "local_rank": r.facts.ranks.local_rank}))
""", shm="320m", env={"RANK_SIZE": "4", "RANK_ID": "2", "DEVICE_ID": "2"})
    assert out["ranks"] == 4 and out["local_rank"] == 2
    assert "RANK_SIZE=4" in out["source"]
    assert out["budget"] == int(320 * (1 << 20) * 0.8 / 4)
    assert "RANK_SIZE=4" in log


def test_advice_only_from_local_rank_zero(real_mindspore):
    body = """
ms_shm.tune(dry_run=True)
ms_shm.tune(dry_run=True)
print(json.dumps({}))
"""
    _, log0 = run(body, shm="64m", env={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    _, log1 = run(body, shm="64m", env={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert log0.count("--shm-size=") == 1, "advice is logged once per process, though tune() ran twice"
    # ... with what ms_shm does about it: an audit read a typical pipeline's bus error as the fate of its own
    assert log0.count("ms_shm plans the pipelines built through it (build_dataset") == 1, log0[-3000:]
    assert "--shm-size" not in log1


def test_shared_memory_switched_off_when_dev_shm_is_tiny(real_mindspore):
    out, log = run("""
r = ms_shm.tune()
print(json.dumps({"after": state(), "changes": [c.setting for c in r.changes]}))
""", shm="64k")
    assert out["after"]["shm"] is False and "shared_mem" in out["changes"]


def test_dataloader_numpy_advice_is_reported_not_logged(real_mindspore):
    """MindSpore's DataLoader under NumPy 2 is ``build_dataloader``'s to say where one is built: ``tune()`` keeps
    it in its report (``ms-shm doctor`` shows it) and leaves it out of a GeneratorDataset script's log."""
    out, log = run("""
import numpy
r = ms_shm.tune(dry_run=True)
print(json.dumps({"codes": [a.code for a in r.advice], "numpy": numpy.__version__}))
""")
    if int(out["numpy"].split(".")[0]) < 2:
        pytest.skip(f"NumPy {out['numpy']}: MindSpore's DataLoader has no NumPy 2 finding to leave out")
    assert "msloader-numpy2" in out["codes"]
    assert "returned a result with an exception set" not in log
