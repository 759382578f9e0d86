"""A GeneratorDataset's poll of its workers, made shorter (``engines/mindspore/polling.py``): the rule, and with
real MindSpore that the hook is in place and the rows are those MindSpore's own thread reads."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ms_shm.engines.mindspore import polling


def test_only_mindspores_poll_is_made_shorter(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    shorter = polling.ShorterPoll()
    shorter.sleep(0.1)
    shorter.sleep(0.01)  # 2.10's wait for a worker's exit
    shorter.sleep(5)
    assert slept == [polling.SHORTER_POLL, 0.01, 5]
    assert shorter.time is time.time and shorter.perf_counter is time.perf_counter  # the rest is time's own


def _polls_like_mindspore(queue):
    while queue.empty():
        time.sleep(0.1)


def _sleeps_otherwise(queue):
    while queue.empty():
        time.sleep(0.5)


def test_a_loop_is_taken_for_mindspores_poll_only_where_it_sleeps_point_one():
    assert polling.polls(_polls_like_mindspore.__code__)
    assert not polling.polls(_sleeps_otherwise.__code__) and not polling.polls(None)


class Rows:
    """Rows of some work, each its index's own."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        rng = np.random.default_rng(int(i))
        return rng.standard_normal(2048).astype(np.float32) * float(np.fft.rfft(rng.standard_normal(4096)).real[0]), \
            np.array(i, np.int64)


@pytest.mark.mindspore
@pytest.mark.parametrize("multiprocessing", [False, True])
def test_mindspores_generator_polls_shorter_once_ms_shm_is_in_and_gives_the_same_rows(multiprocessing):
    try:
        import mindspore.dataset as ds
        from mindspore.dataset.engine import datasets_user_defined
    except ImportError as exc:
        pytest.skip(f"mindspore is not importable: {exc}")
    from ms_shm.engines.mindspore import compat

    compat.read_config()  # ms_shm's first touch of MindSpore installs its hooks
    assert polling.installed(datasets_user_defined), "this release's SamplerFn.process no longer polls as 2.0-2.10"
    assert compat.read_config().generator_poll_seconds == polling.SHORTER_POLL

    def rows(**kwargs):
        dataset = ds.GeneratorDataset(Rows(), ["x", "i"], shuffle=False, **kwargs)
        return [tuple(c.tobytes() for c in row) for row in dataset.create_tuple_iterator(output_numpy=True,
                                                                                        num_epochs=1)]

    assert rows(num_parallel_workers=2, python_multiprocessing=multiprocessing) == rows(num_parallel_workers=1)
