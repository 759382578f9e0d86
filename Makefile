# The two commands of the README's quick start, on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The MindSpore release ms_shm's model was measured on (CPU wheel from PyPI); override for another build.
MINDSPORE ?= mindspore==2.10.0
# PyTorch for the torch DataLoader engine's tests (the CPU wheel these machines already hold; others are GBs).
TORCH ?= torch==2.13.0
# torchdata's StatefulDataLoader (a DataLoader subclass ms_shm patches too), for its tests; pure Python, needs torch.
TORCHDATA ?= torchdata==0.11.0
# pandas, for the copy-on-read tests of a dataset that holds a DataFrame (pandas itself is never imported by ms_shm).
PANDAS ?= pandas==3.1.1

.PHONY: install demo test test-main test-matrix lint bench doctor clean

$(VENV)/.installed: setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' '$(MINDSPORE)' '$(TORCH)' '$(TORCHDATA)' '$(PANDAS)'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/quickstart.py

lint: install
	$(VENV)/bin/ruff check ms_shm tests benchmarks examples

# MS_SHM_REQUIRE_MINDSPORE=1 (tests/conftest.py): the run fails unless real-MindSpore tests ran, and fails if any
# real-MindSpore or privileged (private /dev/shm) test was skipped, instead of looking green.
# Then the release matrix (scripts/release_matrix.sh): MindSpore 2.0.0 (Python 3.9), 2.7.2, 2.8.0, 2.9.0 and 2.10.0
# (Python 3.12, NumPy 1), each in its own virtual environment made here, run the fidelity contract and the release-specific tests.
test: test-main test-matrix

test-main: install lint
	MS_SHM_REQUIRE_MINDSPORE=1 MS_SHM_REQUIRE_TORCH=1 $(PY) -m pytest -q

test-matrix:
	scripts/release_matrix.sh

bench: install
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_cow.py
	$(PY) benchmarks/bench_guard.py
	$(PY) benchmarks/bench_watch.py

doctor: install
	$(VENV)/bin/ms-shm doctor

clean:
	rm -rf $(VENV) .venv-ms* build *.egg-info .pytest_cache .ruff_cache
