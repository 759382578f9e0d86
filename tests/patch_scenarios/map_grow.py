"""A raw-MindSpore script whose map grows 1 KiB rows to 8 MiB in 2 worker processes."""
import hashlib
import json
import sys

import mindspore.dataset as ds
import numpy as np

SEED, ROWS, MB = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


class Rows:
    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        block = np.random.default_rng([SEED, int(i)]).integers(0, 256, 65521, dtype=np.uint8)
        return np.resize(block, 1024), np.array(i, dtype=np.int64)


def grow(data):
    return np.resize(data, MB << 20)


dataset = ds.GeneratorDataset(Rows(), ["data", "label"], shuffle=False, python_multiprocessing=True, num_parallel_workers=2)
dataset = dataset.map(grow, input_columns=["data"], python_multiprocessing=True, num_parallel_workers=2, max_rowsize=16)
dataset = dataset.project(["label", "data"]).repeat(1)
out = [(hashlib.sha256(r["data"].tobytes()).hexdigest(), int(r["label"]))
       for r in dataset.create_dict_iterator(output_numpy=True, num_epochs=1)]
print("RESULT " + json.dumps({"digests": [d for d, _ in out], "labels": [lab for _, lab in out]}), flush=True)
