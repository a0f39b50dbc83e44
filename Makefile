# The commands a newcomer types: `make demo` and `make test`. Everything else is a building block.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch must be installed before anything that depends on torch: an unpinned
# `torch` pulls a multi-GB CUDA build. On a GPU cluster use environment.yml instead.
TORCH_PIN ?= torch==2.13.0
STAMPS := .stamps
PYTEST_ARGS ?=
# Two pytest-xdist workers: the Slurm tests on one, whole modules on either (tests/conftest.py).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python

.PHONY: setup setup-system demo test test-quick test-floor lint format bench bench-full gpu-check clean help

help:
	@echo "make setup       create $(VENV) (torch CPU pinned first) and install the package with test/lint extras"
	@echo "make demo        tiny chess model + random games, 2-process FSDP run on CPU (< 5 min)"
	@echo "make test        the whole test suite (installs Slurm + munge via apt for the Slurm tests)"
	@echo "make test-quick  the suite without the slow end-to-end tests"
	@echo "make test-floor  the quick suite in $(FLOOR_VENV), every dependency at its declared floor"
	@echo "make lint        ruff check + ruff format --check + mypy + import layers and circles"
	@echo "make bench       throughput, LoRA and memory-planner benchmarks, results in bench/results/ (~7 min)"
	@echo "make bench-full  the long set: more rounds, every row, fast vs full traces (not timed here; well over the short set)"
	@echo "make gpu-check   on a GPU node: run the CUDA paths, measure tokens/s, MFU, memory vs plan"

$(STAMPS)/venv: pyproject.toml
	@mkdir -p $(STAMPS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,lint]"
	@touch $@

# Debian packages used by the tests: Slurm (one-node cluster on localhost) and munge.
$(STAMPS)/system: slurm/local/install.sh
	@mkdir -p $(STAMPS)
	bash slurm/local/install.sh
	@touch $@

setup: $(STAMPS)/venv

setup-system: $(STAMPS)/system

demo: setup
	$(PY) -m fsdp_utils.demo

test: setup setup-system
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-quick: setup
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# A second environment, rebuilt each time, at the oldest versions pyproject.toml declares: each
# dependency (and each of the test extra) pinned to its lower bound, torch first (the floor is the
# CPU build's version), the project without dependencies; `pip check` proves the floors agree
# with each other, then the quick suite runs. See docs/development.md#tested-versions.
test-floor: setup
	rm -rf $(FLOOR_VENV)
	python3 -m venv $(FLOOR_VENV)
	$(PY) -m fsdp_utils.versions --floors test > $(FLOOR_VENV)/floors.txt
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q "$$(grep '^torch==' $(FLOOR_VENV)/floors.txt)"
	$(FLOOR_PY) -m pip install -q -r $(FLOOR_VENV)/floors.txt
	$(FLOOR_PY) -m pip install -q --no-deps -e .
	$(FLOOR_PY) -m pip check
	$(FLOOR_PY) -m fsdp_utils.versions
	$(FLOOR_PY) -m pytest -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests/test_imports.py

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The short set by default; bench/run_all.py prints each benchmark's time and the total at the end.
bench: setup
	$(PY) bench/run_all.py

bench-full: setup
	$(PY) bench/run_all.py --full

# On a GPU node (srun ... make gpu-check): random-weight Llama models, several configurations,
# measured against the planner. Without a CUDA device it says so and exits 2.
gpu-check: setup
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(STAMPS) runs demo_assets bench/results
