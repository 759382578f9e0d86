"""A raw-MindSpore script: 4 MiB rows from 2 worker processes, batched by 4 with a per_batch_map in processes."""
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
        return np.resize(block, MB << 20), np.array(i, dtype=np.int64)


def flip(data, label, info):
    return [d ^ np.uint8(0x5A) for d in data], [lab + 1000 for lab in label]


dataset = ds.GeneratorDataset(Rows(), ["data", "label"], shuffle=False, python_multiprocessing=True, num_parallel_workers=2)
dataset = dataset.batch(4, per_batch_map=flip, input_columns=["data", "label"], python_multiprocessing=True, num_parallel_workers=2)
out = []
for batch in dataset.create_dict_iterator(output_numpy=True, num_epochs=1):
    out += [(hashlib.sha256(d.tobytes()).hexdigest(), int(lab)) for d, lab in zip(batch["data"], batch["label"])]
print("RESULT " + json.dumps({"digests": [d for d, _ in out], "labels": [lab for _, lab in out]}), flush=True)
