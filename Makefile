# Two set-up commands: `make demo` runs the main job on the embedded default, `make test` runs the
# fast tests (`make test-e2e` the end-to-end and fault suites).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The exact versions CI tests (tools/lock.py writes it): every install goes through it.
LOCK := constraints.txt

# A fresh environment whenever pyproject or the lock changes, so it holds the lock and nothing else.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -c $(LOCK) --upgrade pip
	$(PY) -m pip install -c $(LOCK) -e '.[test,lint]'
	touch $@

.PHONY: demo test test-e2e lint lock upgrade numerics sandbox-tools
# The tiny config splits the CPU into two devices itself (mesh.cpu_devices): one generates, one trains.
demo: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny

# Style (ruff format and lint) and types (pyright, basic) first: they take seconds, the tests minutes.
# The fast suite: tests/unit (pyproject's addopts leave out `slow` and `e2e`).
test: lint sandbox-tools
	$(PY) -m pytest -q

# The code verifier's sandbox (scalerl_jax/sandbox) is bubblewrap, from the system's packages:
# installed with apt-get where it is missing (root, Debian or Ubuntu), else named for you to install.
sandbox-tools:
	@command -v bwrap >/dev/null || apt-get install -y -q --no-install-recommends bubblewrap \
	  || { apt-get update -q && apt-get install -y -q --no-install-recommends bubblewrap; } \
	  || { echo "the code sandbox needs bubblewrap (bwrap): install it with the system's package manager" >&2; exit 1; }

# The end-to-end and fault suites (tests/e2e, tests/faults): the main job and the commands run as a
# person runs them, real models, several processes. CI runs them after `make test`.
test-e2e: $(VENV)/.installed
	$(PY) -m pytest -q -m 'e2e and not slow'

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pyright

# Re-resolve every extra to the newest versions pyproject allows and write them to the lock.
# pip resolves in a throwaway environment with the newest pip, which the lock then pins too.
lock:
	$(PYTHON) -m venv --clear .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python tools/lock.py --out $(LOCK)

# A new jax, flax, transformers or torch as a reviewed change: refresh the lock (it prints what
# moved), reinstall from it, and run the numerics tests (logit parity with transformers, bfloat16
# KL, greedy tokens), which print their measured numbers. Review `git diff constraints.txt`.
upgrade: lock
	$(MAKE) $(VENV)/.installed
	$(MAKE) numerics

# The tests' own output (-s) goes to runs/numerics.log; the measured numbers and the verdict are shown.
numerics: $(VENV)/.installed
	@mkdir -p runs
	@$(PY) -m pytest -q -s -m 'not slow' tests/unit/models tests/e2e/test_real_smollm2.py > runs/numerics.log 2>&1; \
	  status=$$?; grep -o 'numerics: .*' runs/numerics.log; tail -n 1 runs/numerics.log; \
	  echo "full output: runs/numerics.log"; exit $$status
