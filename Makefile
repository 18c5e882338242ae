# The README's two commands: `make quickstart` (main job) and `make test`.
# Both run scripts/setup.sh first, which is idempotent and cheap once done.
VENV ?= .venv
PY := $(VENV)/bin/python
# Heavy first-use work (the tiny model, its warm start, task images, the GPU-install
# resolution) is cached per user, outside the checkout, keyed by what built it: a second
# clone or a CI checkout reuses it.
export SLUICE_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/sluice
export TORCH_EXTENSIONS_DIR ?= $(SLUICE_CACHE_DIR)/torch_extensions
export WANDB_MODE ?= offline

.PHONY: setup quickstart test test-system test-unit test-gpu dry-run

setup:
	SLUICE_VENV=$(VENV) scripts/setup.sh

# Ends with the run report (launch.report): one offline HTML page of the run just written,
# its figures also logged into the run's wandb run (offline unless the recipe says otherwise).
quickstart: setup
	$(PY) -m trainer.main recipe=quickstart.yaml
	$(PY) -m launch.report --latest runs --wandb

# Parallel workers (pytest-xdist), one per core: each file runs on one worker
# (tests/conftest.py), slowest first. A third worker bought no wall time on 2 cores (25.4
# min warm, as serial) and put three whole systems at once on them, where Ray's fixed 30 s
# wait for a raylet to register ran out. TEST_WORKERS=0 runs it in this process.
# `make test` leaves out the system tier (tests/conftest.py SYSTEM_TIER: the CLI's and the
# multi-node cluster's whole-system starts, the container backend's matrices), which
# `make test-system` runs; CI (.ci/run) runs both.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PY) -m pytest tests/unit tests/integration -m "not system" $(PYTEST_PARALLEL)

test-system: setup
	$(PY) -m pytest tests/integration -m system $(PYTEST_PARALLEL)

test-unit: setup
	$(PY) -m pytest tests/unit -q

dry-run: setup
	$(PY) -m trainer.main recipe=quickstart.yaml --dry-run

test-gpu: setup
	$(PY) -m pytest tests/gpu -q
