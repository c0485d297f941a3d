# Set-up, demo and tests. Everything installs from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default (this is what CI uses); e.g. TORCH_SPEC='torch>=2.6' for a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.autopart-installed

.PHONY: setup demo test lint clean bench-peers-setup bench-peers

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/autopart demo

# Two runs: the one-process tests on two pytest workers (pytest-xdist; a module marked
# xdist_group runs on one worker, so its module fixture is built once), then the multi-rank
# tests of tests/distributed alone, one at a time (their ranks already use every core).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --ignore=tests/distributed
	$(BIN)/python -m pytest -q tests/distributed

# Optional, for benchmarks/pipeline_cpu/peers.py only (never a package or CI dependency):
# DeepSpeed's pipeline engine on CPU, without prebuilt ops, keeping this venv's torch.
bench-peers-setup: $(STAMP)
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(BIN)/python -m pip install -q 'deepspeed==0.19.8'
	$(BIN)/python -m pip show torch | grep '^Version: $(subst torch==,,$(TORCH_SPEC))' \
		|| (echo "installing deepspeed changed torch; run make setup again" && exit 1)

bench-peers: $(STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python benchmarks/pipeline_cpu/peers.py --launches 3 --steps 7

lint: $(STAMP)
	$(BIN)/ruff check autopart profiler solver codegen tests

clean:
	rm -rf autopart-out .pytest_cache
