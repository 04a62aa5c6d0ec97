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

# The lab's caches (images, lab-tiny, hub repos, Ray venv) build in the background while the unit
# tests run first (tests/lab/conftest.py orders them); a test that needs one waits on its lock.
test: deps venv lint
	@mkdir -p .lab-cache
	@$(BIN)/python -m sparkprov.lab.prebuild > .lab-cache/prebuild.log 2>&1 & \
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests; rc=$$?; \
	wait; sed -n '/^prebuild: /p' .lab-cache/prebuild.log; exit $$rc

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
