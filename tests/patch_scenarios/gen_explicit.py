"""A raw-MindSpore script written for a big machine: 2 worker processes, 8 MiB rows, explicit arguments."""
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


def report(dataset):
    out = [(hashlib.sha256(r["data"].tobytes()).hexdigest(), int(r["label"]))
           for r in dataset.create_dict_iterator(output_numpy=True, num_epochs=1)]
    print("RESULT " + json.dumps({"digests": [d for d, _ in out], "labels": [lab for _, lab in out],
                                  "type_is_generator": type(dataset) is ds.GeneratorDataset,
                                  "type": type(dataset).__name__}), flush=True)


def main():
    report(ds.GeneratorDataset(Rows(), ["data", "label"], shuffle=False, python_multiprocessing=True, num_parallel_workers=2))


if __name__ == "__main__":
    main()
