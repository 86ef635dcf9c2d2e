# Two set-up commands: `make demo` runs the main job on the embedded default, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,lint]'
	touch $@

.PHONY: demo test lint
# The tiny config splits the CPU into two devices itself (mesh.cpu_devices): one generates, one trains.
demo: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny

# Style (ruff format and lint) and types (pyright, basic) first: they take seconds, the tests minutes.
test: lint
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pyright
