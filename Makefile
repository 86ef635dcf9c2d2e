# Two set-up commands: `make demo` runs the main job on the embedded default, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $@

.PHONY: demo test
# The tiny config splits the CPU into two devices itself (mesh.cpu_devices): one generates, one trains.
demo: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny

test: $(VENV)/.installed
	$(PY) -m pytest -q
