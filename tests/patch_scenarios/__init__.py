"""Unmodified raw-MindSpore scripts for ``tests/test_patch.py``: nothing here imports ms_shm.

Each prints one ``RESULT {json}`` line: the sha256 of every row's bytes and its label, in the order the pipeline
yielded them. Row ``i`` is ``np.resize(default_rng([seed, i]).integers(0, 256, 65521, uint8), nbytes)``; the
test computes the expected digests itself, from the index.
"""
