# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu

$(STAMP): setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,compare]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m experiments.speedup

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_plain

.PHONY: install demo test test-slow test-all bench
