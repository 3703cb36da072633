# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv demo test test-quick test-cpus fuzz drill gpu-check lint format clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m mula_lightning.demo

test: venv
	$(PY) -m pytest -q --durations=20 tests

# The inner loop: unit tests and the parity tests not marked slow, without the launcher and end-to-end tiers that
# start `mula` processes. Every test of it is also in `make test` (what CI runs).
test-quick: venv
	$(PY) -m pytest -q -m "not slow" --ignore=tests/launch --ignore=tests/training tests

# The parity and distributed tests under other CPU kernels (AVX2, no SIMD, one thread): one line per setting.
test-cpus: venv
	$(PY) scripts/cpu_matrix.py

# The differential tester of training loops on fresh programs for MINUTES minutes; failing programs, shrunk and
# printed as code, go to fuzz-failures/ (make test runs a fixed, seeded share of it).
MINUTES ?= 10
fuzz: venv
	$(PY) scripts/fuzz_loops.py --minutes $(MINUTES) --out fuzz-failures

# `mula launch` through FAULTS faults of mixed kinds (kill, hang, NaN, abort, exception, full disk, slow rank) drawn
# from SEED, ending bit-equal to a straight run; prints the table of BENCHMARKS.md (make test runs 9 of them).
# IN_JOB=1: mula launch --in-job (failed ranks restarted inside the running job, the others kept).
FAULTS ?= 100
SEED ?= 0
drill: venv
	$(PY) scripts/drill.py --faults $(FAULTS) --seed $(SEED) --out runs/drill$(if $(IN_JOB), --in-job)

# On a machine with one CUDA or XPU device: parity, block speed and a tiny `mula fit` on it, as one table.
gpu-check: venv
	$(PY) benchmarks/gpu_check.py

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts

format: venv
	$(VENV)/bin/ruff check --fix src tests benchmarks examples scripts
	$(VENV)/bin/ruff format src tests benchmarks examples scripts

clean:
	rm -rf $(VENV) build dist .pytest_cache
