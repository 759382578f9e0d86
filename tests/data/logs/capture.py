"""Re-capture the MindSpore failure logs in this folder (needs root, unshare and MindSpore).

Each case runs a small failing pipeline under a private tmpfs /dev/shm (``tests/isolated.py``) and stores the
process's stderr then stdout, untouched, as ``<case>.log``. ``test_explain.py`` reads these files, so the
recogniser is tested on what MindSpore really prints, not on text we typed. Run from the repository root:

    .venv/bin/python tests/data/logs/capture.py [case ...]
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests import isolated  # noqa: E402

HERE = Path(__file__).resolve().parent

SOURCE = """
import numpy as np
import mindspore.dataset as ds

class Rows:
    def __init__(self, n, mib):
        self.n, self.size = n, int(mib * 2**20)
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return (np.full(self.size, i % 127, dtype=np.uint8),)
"""

_FD_CODE = SOURCE + """
d = ds.GeneratorDataset(Rows(64, 1), ["x"], num_parallel_workers=2, shuffle=False)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""

CASES = {
    # Dynamic slots, no pre-check: 2 workers x 18 slots x 8 MiB > 64 MiB, so a worker's write hits SIGBUS.
    "bus_error": dict(shm="64m", code=SOURCE + """
ds.config.set_prefetch_size(16)
d = ds.GeneratorDataset(Rows(64, 8), ["x"], num_parallel_workers=2, shuffle=False)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    # Static max_rowsize: MindSpore's own launch check refuses (Required > 80% of free).
    "insufficient_shm": dict(shm="64m", code=SOURCE + """
ds.config.set_prefetch_size(16)
d = ds.GeneratorDataset(Rows(64, 8), ["x"], num_parallel_workers=2, shuffle=False, max_rowsize=9)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    # A full /dev/shm: not even the multiprocessing semaphores fit.
    "shm_full_generator": dict(shm="64m", pre="head -c 64m /dev/zero > /dev/shm/fill 2>/dev/null; ", code=SOURCE + """
d = ds.GeneratorDataset(Rows(16, 1), ["x"], num_parallel_workers=2, shuffle=False)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    "shm_full_map": dict(shm="64m", pre="head -c 64m /dev/zero > /dev/shm/fill 2>/dev/null; ", code=SOURCE + """
d = ds.NumpySlicesDataset({"x": np.zeros((16, 4), np.float32)}, shuffle=False)
d = d.map(lambda x: x + 1, input_columns=["x"], num_parallel_workers=2, python_multiprocessing=True)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    # A starved soft fd limit: every dynamic slot's fd is passed to the main process. At 40 the workers run
    # out first (shm_open errno 24); at 56 the main process does, while receiving a slot's fd.
    "too_many_open_files": dict(shm="64m", nofile=40, code=_FD_CODE),
    "too_many_open_files_main": dict(shm="64m", nofile=56, code=_FD_CODE),
}


def capture(name: str) -> None:
    case = dict(CASES[name])
    code = case.pop("code")
    pre = case.pop("pre", "")
    command = pre + f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    result = isolated.run_shell(command, timeout=180, **case)
    text = result.stderr + result.stdout
    (HERE / f"{name}.log").write_text(text)
    print(f"{name}: rc={result.returncode}, {len(text.splitlines())} lines")


if __name__ == "__main__":
    why = isolated.unavailable() or isolated.mindspore_missing()
    if why:
        sys.exit(why)
    for case_name in sys.argv[1:] or CASES:
        capture(case_name)
