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
# Two fake CPU devices: the generator and the trainer get one each, as on a cluster.
demo: $(VENV)/.installed
	XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
	$(PY) -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny

test: $(VENV)/.installed
	$(PY) -m pytest -q
