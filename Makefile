# fxpar: two commands on a fresh machine with only Python: `make demo` and `make test`.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# pin torch first: an unpinned torch pulls a multi-GB CUDA build
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m fxpar.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check fxpar passes backends schedules tests bench

bench: $(STAMP)
	$(VENV)/bin/python bench/compare_dtensor.py
