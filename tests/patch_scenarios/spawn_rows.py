"""The source of ``spawn_gen.py``, in a module of its own so spawned workers import it (as spawn requires)."""
import numpy as np


class Rows:
    def __init__(self, seed, rows, mb):
        self.seed, self.rows, self.mb = seed, rows, mb

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        block = np.random.default_rng([self.seed, int(i)]).integers(0, 256, 65521, dtype=np.uint8)
        return np.resize(block, self.mb << 20), np.array(i, dtype=np.int64)
