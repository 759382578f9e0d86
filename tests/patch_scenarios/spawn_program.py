"""A program that chose the ``spawn`` start method for its own processes, then builds a pipeline of GIL-bound
rows with GeneratorDataset's defaults and a Python map, unchanged: raw MindSpore starts no worker process for
it, and the program's start method must stay ``spawn`` through ``ms-shm run`` too (MindSpore's pools set it to
``fork`` for the whole program once they start)."""
import json
import multiprocessing

import numpy as np


class Slow:
    def __len__(self):
        return 200

    def __getitem__(self, i):
        s = 0
        for k in range(100_000):  # ~5 ms of pure Python: worker processes would win
            s += k % 7
        return (np.array([int(i), s], np.int64),)


def slow_op(x):
    s = 0
    for k in range(100_000):
        s += k % 7
    return x + s


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    import mindspore.dataset as ds

    dataset = ds.GeneratorDataset(Slow(), ["x"], shuffle=False).map(slow_op, input_columns=["x"])
    rows = [r[0].tolist() for r in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]
    print("RESULT", json.dumps({"rows": rows, "start_method": multiprocessing.get_start_method(allow_none=True)}))
