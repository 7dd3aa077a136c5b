# tfhybrid: the single entry point. `make demo` and `make test` set up the
# environment themselves (scripts/setup_env.sh) on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/horovodrun
# One intra-op thread per process: several Horovod ranks share 2 cores.
export TF_NUM_INTRAOP_THREADS ?= 1
export TF_NUM_INTEROP_THREADS ?= 2
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1

.PHONY: env demo test test-unit test-parallel bench clean

env:
	@bash scripts/setup_env.sh

demo: env
	$(HVDRUN) -np 2 --gloo $(PY) examples/train_digits.py

test: env
	$(PY) scripts/run_tests.py

test-unit: env
	$(PY) -m pytest tests/unit -q

test-parallel: env
	$(PY) scripts/run_tests.py --only parallel

bench: env
	$(HVDRUN) -np 2 --gloo $(PY) bench/dp.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache test-results
