# Set-up, demo and tests. Everything installs from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default (this is what CI uses); e.g. TORCH_SPEC='torch>=2.6' for a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.autopart-installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/autopart demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check autopart profiler solver codegen tests

clean:
	rm -rf autopart-out .pytest_cache
