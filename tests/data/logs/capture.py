"""Re-capture the MindSpore (and PyTorch) failure logs in this folder (needs root, unshare and MindSpore; the
``msloader_*`` cases MindSpore 2.8 with NumPy 1.x in ``.venv-ms2.8.0``, the ``torch_*`` ones torch).

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

# MindSpore 2.8 with NumPy 1.x: its DataLoader's workers fail on NumPy 2 (the 2.10 venv), whatever /dev/shm holds.
MS28 = str(Path(__file__).resolve().parents[3] / ".venv-ms2.8.0" / "bin" / "python")

_MSLOADER = """
import numpy as np
from mindspore.dataset.dataloader import Dataset, DataLoader

class Samples(Dataset):
    def __init__(self, n, floats):
        self.n, self.floats = n, floats
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return np.full((self.floats,), i, np.float32)
"""
_MSLOADER_BUS = _MSLOADER + """
for batch in DataLoader(Samples(24, 5 << 18), batch_size=4, num_workers=2):
    pass
print("done")
"""
_MSLOADER_SMALL = _MSLOADER + """
print(sum(float(b.sum()) for b in DataLoader(Samples(8, 1024), batch_size=2, num_workers=2)))
"""
_TORCH_LOADER = """
import torch
from torch.utils.data import DataLoader, Dataset

class Samples(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.full((1024,), float(i))

print(sum(float(b.sum()) for b in DataLoader(Samples(), batch_size=2, num_workers=2)))
"""
_READONLY = "mount -t tmpfs -o size=1g,ro tmpfs /dev/shm && "

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
    # MindSpore 2.8's DataLoader (mindspore.dataset.dataloader, PyTorch's design) past the end of a 64 MiB /dev/shm:
    # 2 workers x 3 batches of 4 x 5 MiB. No GeneratorDataset anywhere, yet MindSpore's own "Unexpected bus error
    # encountered in process" line comes first. The main process then ends one of two ways (a race): the
    # DataLoader's SIGCHLD handler raises "DataLoader worker (pid: N) was killed by signal: Bus error.", or the
    # main process is reading a batch's fd from the dead worker and ends in EOFError with no kill line at all.
    # The second is rare (none in 10 runs on the 2-core VM): msloader_bus_error_eof.log came from an audit's run
    # of this loader under the same 64 MiB /dev/shm.
    "msloader_bus_error": dict(shm="64m", python=MS28, code=_MSLOADER_BUS,
                               want=lambda text: "was killed by signal: Bus error" in text),
    "msloader_bus_error_eof": dict(shm="64m", python=MS28, code=_MSLOADER_BUS,
                                   want=lambda text: "EOFError" in text and "killed by signal" not in text),
    # A read-only /dev/shm of 1 GiB (a tmpfs mounted ro): nothing is short of space, yet no worker pool starts.
    # multiprocessing's semaphores and heap live there, so sem_open / mkstemp fail with EROFS; GeneratorDataset
    # hides it behind its "insufficient shm ... at least 5 GB" message.
    "torch_readonly": dict(shm=None, pre=_READONLY, code=_TORCH_LOADER),
    "generator_readonly": dict(shm=None, pre=_READONLY, code=SOURCE + """
d = ds.GeneratorDataset(Rows(8, 0.01), ["x"], num_parallel_workers=2, python_multiprocessing=True, shuffle=False)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    "map_readonly": dict(shm=None, pre=_READONLY, code=SOURCE + """
d = ds.NumpySlicesDataset({"x": np.zeros((16, 4), np.float32)}, shuffle=False)
d = d.map(lambda x: x + 1, input_columns=["x"], num_parallel_workers=2, python_multiprocessing=True)
n = sum(1 for _ in d.create_tuple_iterator(output_numpy=True, num_epochs=1))
print("rows", n)
"""),
    "msloader_readonly": dict(shm=None, pre=_READONLY, python=MS28, code=_MSLOADER_SMALL),
}


def capture(name: str, tries: int = 10) -> None:
    """Run case ``name`` until its log shows what the case is about (``want``: one outcome of a race), at most
    ``tries`` times; a log that never does is not written, so the file already here stays."""
    case = dict(CASES[name])
    code = case.pop("code")
    pre = case.pop("pre", "")
    python = case.pop("python", sys.executable)
    want = case.pop("want", lambda text: True)
    command = pre + f"exec {shlex.quote(python)} -c {shlex.quote(code)}"
    for attempt in range(1, tries + 1):
        result = isolated.run_shell(command, timeout=180, **case)
        text = result.stderr + result.stdout
        if want(text):
            (HERE / f"{name}.log").write_text(text)
            print(f"{name}: rc={result.returncode}, {len(text.splitlines())} lines, run {attempt}")
            return
    print(f"{name}: not the outcome wanted in {tries} runs; {name}.log kept as it was")


if __name__ == "__main__":
    why = isolated.unavailable() or isolated.mindspore_missing()
    if why:
        sys.exit(why)
    for case_name in sys.argv[1:] or CASES:
        capture(case_name)
