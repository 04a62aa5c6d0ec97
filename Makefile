# Two entry points: `make demo` and `make test`. Both install what they need.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: deps venv demo test test-unit test-lab clean lab-down lint

deps:  ## system packages the lab needs (Debian; run as root)
	@bash .ci/apt-deps.sh

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: deps venv
	$(BIN)/python -m sparkprov.cli.demo

test: deps venv lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: venv  ## ruff and the import contracts (.importlinter)
	$(BIN)/ruff check sparkprov tests tasks.py bench
	$(BIN)/lint-imports

test-unit: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

lab-down: venv
	$(BIN)/invoke lab.down

clean:
	rm -rf $(VENV) .lab-cache

test-lab: deps venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/lab
