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
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
DEVICE_VENV ?= .venv-device

.PHONY: setup setup-system demo test test-quick test-floor test-newest lint format bench bench-full \
	gpu-check device-wheels gpu-check-dry-run clean help

help:
	@echo "make setup       create $(VENV) (torch CPU pinned first) and install the package with test/lint extras"
	@echo "make demo        tiny chess model + engine games, 2-process FSDP run on CPU, judged by Stockfish (~2 min)"
	@echo "make test        the whole test suite (installs Slurm + munge via apt for the Slurm tests)"
	@echo "make test-quick  the suite without the slow end-to-end tests"
	@echo "make test-floor  the quick suite in $(FLOOR_VENV), every dependency at its declared floor"
	@echo "make test-newest the quick suite in $(NEWEST_VENV), every dependency at its newest release"
	@echo "make lint        ruff check + ruff format --check + mypy + import layers and circles"
	@echo "make bench       throughput, LoRA and memory-planner benchmarks, results in bench/results/ (~7 min)"
	@echo "make bench-full  the long set: more rounds, every row, fast vs full traces (not timed here; well over the short set)"
	@echo "make gpu-check   on a GPU node: run the CUDA paths, measure tokens/s, MFU, memory vs plan"
	@echo "make device-wheels       the wheels a lent GPU machine lacks, in .whl/ (docs/gpu-check.md)"
	@echo "make gpu-check-dry-run   the device call on CPU, from the carried wheels, at its versions"

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

# The demo's engine judge: Debian's stockfish where it is missing and root can install it; else
# the demo says so in one line and shows legality only.
demo: setup
	@[ -x /usr/games/stockfish ] || command -v stockfish >/dev/null \
		|| { [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stockfish >/dev/null; } || true
	$(PY) -m fsdp_utils.demo

test: setup setup-system
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-quick: setup setup-system
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# A second environment, rebuilt each time, at the oldest versions pyproject.toml declares: each
# dependency (and each of the test extra) pinned to its lower bound, torch first (2.11.0, the lent
# GPUs' version: PyPI's CUDA build, which runs on CPU; several GB into pip's cache once), the
# project without dependencies; `pip check` proves the floors agree
# with each other, then the quick suite runs (Slurm's commands installed: the submitit golden
# script needs `srun`). See docs/development.md#tested-versions.
test-floor: setup setup-system
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

# A third environment, rebuilt each time, at the newest release of every dependency the index
# serves, torch included: PyPI's torch is a CUDA build that runs on CPU (several GB, once into
# pip's cache). This machine's pip configuration caps torch (/etc/xdg/pip/constraints.txt):
# PIP_CONSTRAINT=/dev/null lifts the cap for these installs only. Then as test-floor.
test-newest: setup setup-system
	rm -rf $(NEWEST_VENV)
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	PIP_CONSTRAINT=/dev/null $(NEWEST_PY) -m pip install -q --upgrade torch
	PIP_CONSTRAINT=/dev/null $(NEWEST_PY) -m pip install -q --upgrade --upgrade-strategy eager \
		-e ".[test]"
	$(NEWEST_PY) -m pip check
	$(NEWEST_PY) -m fsdp_utils.versions
	$(NEWEST_PY) -m pytest -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

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

# The wheels a device call carries to a lent GPU machine (cp312), checked against the one list
# in bench/device_stack.py; the device call itself is in docs/gpu-check.md.
device-wheels: setup
	$(PY) bench/device_stack.py download

# That call's dry run on CPU: the same script, from the carried wheels (the cp311 builds of the
# same versions), in an environment at the image's versions (built once: $(DEVICE_VENV)).
gpu-check-dry-run: setup
	$(PY) bench/device_stack.py download --python 3.11 --dest .whl-cp311
	test -x $(DEVICE_VENV)/bin/python || \
		$(PY) bench/device_stack.py standin $(DEVICE_VENV) --wheels .whl-cp311
	rm -rf $(DEVICE_VENV)/site bench/results/gpu_check_dry_run
	$(DEVICE_VENV)/bin/python bench/gpu_check.py --wheels .whl-cp311 --site $(DEVICE_VENV)/site \
		--allow-cpu --shapes tiny --budget 0 --output bench/results/gpu_check_dry_run

clean:
	rm -rf $(STAMPS) runs demo_assets bench/results
