# fxpar: on a fresh machine with only Python, `make demo` and `make test` are all it takes.
# The first target run creates .venv and installs into it once; the stamp is redone when pyproject.toml changes.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench golden

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	@echo "installing torch 2.13.0 (CPU) and fxpar[test] into $(VENV) (once; may take a few minutes)"
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m fxpar.demo

# two pytest-xdist workers (the CI machine has 2 cores; each worker has its own gloo rank pool): 18 against 30 minutes
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# bench: ledger vs optimum, compile time, step time vs DTensor; JSON in bench/results/, tables in bench/README.md.
# Quick run: make bench BENCH_ARGS="--layers 2,8"
bench: $(STAMP)
	$(VENV)/bin/python bench/run_all.py $(BENCH_ARGS)

# rewrites tests/golden/*.txt (printed rank programs + ledgers) that tests/test_golden.py diffs against
golden: $(STAMP)
	$(VENV)/bin/python tests/golden/regen.py
