"""Quick start: tune the host, build a pipeline that fits it, iterate it, and show what ms_shm decided.

Run with ``make demo``. Try it in a Docker-sized /dev/shm (as root):
``unshare -m --propagation private sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && .venv/bin/python
examples/quickstart.py'`` — the plan is weighed against 51.2 MiB there (raw MindSpore with these rows in 2 worker
processes, ``num_parallel_workers=2, python_multiprocessing=True``, dies there of a bus error; its defaults read them
in the main process).
"""

import logging
import time

import numpy as np

import ms_shm

MiB = 1 << 20


class Images:
    """A random-access dataset of 8 MiB "images" and labels, like a decoded high-resolution image set."""

    def __init__(self, n=48):
        self.n = n

    def __getitem__(self, i):
        return np.full((1024, 1024, 8), i % 251, np.uint8), np.array(i % 10, np.int64)

    def __len__(self):
        return self.n


def normalise(image):
    return (image.astype(np.float32) / 255.0)[::4, ::4]


def main():
    logging.basicConfig(level=logging.INFO, format="%(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("ms_shm").info("ms_shm %s: tune, build, iterate, report", ms_shm.__version__)

    report = ms_shm.tune()
    ds = ms_shm.build_dataset(Images(), ["image", "label"], shuffle=True)
    mapped = ms_shm.map(ds, normalise, input_columns=["image"])
    ds = mapped.batch(8)

    start, rows = time.perf_counter(), 0
    for _image, label in ds.create_tuple_iterator(output_numpy=True, num_epochs=1):
        rows += len(label)
    seconds = time.perf_counter() - start

    log = logging.getLogger("quickstart")
    log.info("iterated %d rows in %.2f s", rows, seconds)
    log.info("tune report:\n%s", report)
    for name, stage in (("source", ms_shm.plan_of(mapped.children[0])), ("map", ms_shm.plan_of(mapped))):
        log.info("%s stage: %s", name, stage)
        for decision in stage.decisions:
            log.info("    %s", decision)


if __name__ == "__main__":
    main()
