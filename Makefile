# Two commands for a fresh machine:  make demo   and   make test
# Each creates the virtual environment (.venv) if it is missing. torch is pinned here, not
# in pyproject.toml: `pip install torch==2.13.0` is the CPU build on our machines, while an
# unpinned torch downloads gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

$(BIN)/batchgen: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(BIN)/batchgen

demo: install
	$(BIN)/batchgen run configs/demo.yaml --overwrite

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/bench_engine.py

clean:
	rm -rf $(VENV) out

.PHONY: install demo test bench clean
