"""``gen_explicit``'s pipeline over a source whose ``__len__`` says more rows than it has: rows from DATA on raise
``IndexError`` (the probe reads the last index). Prints each row's label as it arrives."""
import sys

import mindspore.dataset as ds
from gen_explicit import Rows as Full

DATA = int(sys.argv[4])


class Rows(Full):
    def __getitem__(self, i):
        if i >= DATA:
            raise IndexError(f"index {i} out of range")
        return super().__getitem__(i)


def main():
    dataset = ds.GeneratorDataset(Rows(), ["data", "label"], shuffle=False, python_multiprocessing=True,
                                  num_parallel_workers=2)
    for row in dataset.create_dict_iterator(output_numpy=True, num_epochs=1):
        print("ROW", int(row["label"]), flush=True)


if __name__ == "__main__":
    main()
