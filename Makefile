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

.PHONY: env demo test test-full test-unit test-parallel bench docs clean

env:
	@bash scripts/setup_env.sh

demo: env
	$(HVDRUN) -np 2 --gloo $(PY) examples/train_digits.py

test: env
	$(PY) scripts/run_tests.py

# the full tier: also the tests tests/parallel/full_tier.txt lists (about twice make test's time)
test-full: env
	$(PY) scripts/run_tests.py --full

test-unit: env
	$(PY) -m pytest tests/unit -q

test-parallel: env
	$(PY) scripts/run_tests.py --only parallel

bench: env
	$(HVDRUN) -np 2 --gloo $(PY) bench/dp.py

# API reference from the docstrings (pdoc, installed into the venv on first use only),
# next to the pages shipped in the package (python -m tfhybrid.docs).
docs: env
	@$(PY) -c "import pdoc" 2>/dev/null || $(PY) -m pip install -q "pdoc>=14"
	$(PY) -W "ignore:The module specification" -m pdoc --docformat google -o docs/api $$($(PY) -c 'import tfhybrid.docs as d; print(*d.api_modules())')
	cp tfhybrid/docs/*.md docs/api/
	@echo "API reference: docs/api/index.html (pages: docs/api/concepts.md, launching.md, timeline.md)"

clean:
	rm -rf $(VENV) .venv-tf* build *.egg-info .pytest_cache test-results docs/api
