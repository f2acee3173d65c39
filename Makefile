# One entry point for people and CI. Every target sets itself up: a virtual environment in .venv,
# the pinned dependencies from pyproject.toml, and the package installed in editable mode.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The two tiers of tests/ (tests/README.md): the fast tier (units and in-process runs, on three pytest
# workers, each test file on one of them: on 2 cores the third fills the time tests spend waiting on real
# clocks, grace windows and stalled streams) and the process tier (the `process` marker: tests/process/ and
# the commands run in a child process, one test at a time: each starts processes that want both cores).
FAST := $(PY) -m pytest -q -n 3 --dist loadfile -m "not slow and not process"
PROCESS := $(PY) -m pytest -q -m "process and not slow"

.PHONY: run test lint test-fast test-process test-slow test-cloud bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The default job: see README.md.
run: $(STAMP)
	$(PY) -m diloco_jax local --config configs/small_cpu.py --learners 4 --workdir runs/default

# Lint, then both tiers, one after the other (the process tier runs even when the fast one failed), each timed.
test: lint
	@fast=0; process=0; \
	start=$$(date +%s); $(FAST) || fast=$$?; fast_s=$$(( $$(date +%s) - start )); \
	start=$$(date +%s); $(PROCESS) || process=$$?; process_s=$$(( $$(date +%s) - start )); \
	printf 'fast tier: %dm%02ds (exit %d)\nprocess tier: %dm%02ds (exit %d)\n' \
	  $$((fast_s / 60)) $$((fast_s % 60)) $$fast $$((process_s / 60)) $$((process_s % 60)) $$process; \
	test $$fast -eq 0 && test $$process -eq 0

# ruff (configured in pyproject.toml): import order, no function-local import without a reason, bugbear...
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-fast: $(STAMP)
	@start=$$(date +%s); rc=0; $(FAST) || rc=$$?; s=$$(( $$(date +%s) - start )); \
	printf 'fast tier: %dm%02ds\n' $$((s / 60)) $$((s % 60)); exit $$rc

test-process: $(STAMP)
	@start=$$(date +%s); rc=0; $(PROCESS) || rc=$$?; s=$$(( $$(date +%s) - start )); \
	printf 'process tier: %dm%02ds\n' $$((s / 60)) $$((s % 60)); exit $$rc

# The `slow` tests of both tiers (deselected by the others).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The Cloud TPU scripts on the emulated cloud (tests/emucloud.py): a whole run from the data step to a saved
# model, about 3.5 minutes on 2 cores (also in test's process tier), then the scripts' fast tests.
test-cloud: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow" tests/process/test_cloud.py tests/launch/test_tpu.py \
	  tests/process/test_launch_hosts.py

# The headline benchmarks, one after the other, into one JSON file of figures with the commit, date and load
# (`bench suite`): `make bench REPEATS=3`, `make bench BENCHES=all` (adds hetero and chaos, whose repeats are
# seeds), BENCHES=wan,syncer.
REPEATS ?= 1
BENCHES ?=
bench: $(STAMP)
	$(PY) -m diloco_jax bench suite --out runs/bench/figures.json --repeats $(REPEATS) $(if $(BENCHES),--benches $(BENCHES))

clean:
	rm -rf $(VENV) runs
