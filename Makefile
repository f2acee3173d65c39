# One entry point for people and CI. Every target sets itself up: a virtual environment in .venv,
# the pinned dependencies from pyproject.toml, and the package installed in editable mode.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The default job: see README.md.
run: $(STAMP)
	$(PY) -m diloco_jax local --config configs/small_cpu.py --learners 4 --workdir runs/default

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m diloco_jax bench step --config configs/small_cpu.py

clean:
	rm -rf $(VENV) runs
