"""A model zoo's dataset class: a GeneratorDataset subclass passing explicit worker processes to ``super()``."""
import mindspore.dataset as ds
from gen_explicit import Rows, report


class ZooDataset(ds.GeneratorDataset):
    def __init__(self):
        super().__init__(Rows(), ["data", "label"], shuffle=False, python_multiprocessing=True, num_parallel_workers=2)


if __name__ == "__main__":
    report(ZooDataset())
