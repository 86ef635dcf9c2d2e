# Two set-up commands: `make demo` runs the main job on the embedded default, `make test` runs the
# fast tests (`make test-e2e` the end-to-end and fault suites).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,lint]'
	touch $@

.PHONY: demo test test-e2e lint
# The tiny config splits the CPU into two devices itself (mesh.cpu_devices): one generates, one trains.
demo: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny

# Style (ruff format and lint) and types (pyright, basic) first: they take seconds, the tests minutes.
# The fast suite: tests/unit (pyproject's addopts leave out `slow` and `e2e`).
test: lint
	$(PY) -m pytest -q

# The end-to-end and fault suites (tests/e2e, tests/faults): the main job and the commands run as a
# person runs them, real models, several processes. CI runs them after `make test`.
test-e2e: $(VENV)/.installed
	$(PY) -m pytest -q -m 'e2e and not slow'

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pyright
