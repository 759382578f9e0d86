"""A raw-MindSpore script with spawned worker processes: 2 workers, 8 MiB rows, explicit arguments."""
import hashlib
import json
import sys

import mindspore.dataset as ds
from spawn_rows import Rows

if __name__ == "__main__":
    ds.config.set_multiprocessing_start_method("spawn")
    seed, rows, mb = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dataset = ds.GeneratorDataset(Rows(seed, rows, mb), ["data", "label"], shuffle=False, python_multiprocessing=True, num_parallel_workers=2)
    out = [(hashlib.sha256(r["data"].tobytes()).hexdigest(), int(r["label"]))
           for r in dataset.create_dict_iterator(output_numpy=True, num_epochs=1)]
    print("RESULT " + json.dumps({"digests": [d for d, _ in out], "labels": [lab for _, lab in out]}), flush=True)
