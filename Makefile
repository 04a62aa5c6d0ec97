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

# The lab's base layer (debootstrap: the first minute of a cold demo's longest chain) builds with the
# machine's python3 while the venv is made; the demo finds it built, or waits on its lock.
demo: deps
	@mkdir -p .lab-cache
	@$(PY) -m sparklab.image --base-only > .lab-cache/demo-base.log 2>&1 & base=$$!; \
	$(MAKE) --no-print-directory venv && $(BIN)/python -m sparklab.demo; rc=$$?; wait $$base; exit $$rc

# Three at once on a 2-core machine: the lab's caches build in the background (images, lab-tiny,
# hub repos, the Ray venv, the real vLLM's rootfs: sparklab/prebuild.py; a test that needs one
# waits on its lock); beside the lab's tests, which wait on engines most of their time, the tests
# that need no lab of namespaces (tests/unit, and tests/sparklab: the lab's own parts run on
# loopback), at the lowest CPU priority (nice 19): the lab's tests are the longest path, so they get the cores
# first and the others fill the gaps. Each suite prints its own summary; either failing fails the run.
test: deps venv lint
	@mkdir -p .lab-cache
	@$(BIN)/python -m sparklab.prebuild > .lab-cache/prebuild.log 2>&1 & pre=$$!; \
	nice -n 19 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests/unit tests/sparklab > .lab-cache/unit.log 2>&1 & unit=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=40 tests/lab tests/reliability; lab_rc=$$?; \
	wait $$unit; unit_rc=$$?; wait $$pre; \
	echo "--- tests/unit and tests/sparklab (run beside the lab's tests):"; cat .lab-cache/unit.log; \
	sed -n '/^prebuild: /p' .lab-cache/prebuild.log; \
	echo "lab and reliability: exit $$lab_rc; unit and sparklab: exit $$unit_rc"; \
	[ $$lab_rc -eq 0 ] && [ $$unit_rc -eq 0 ]

lint: venv  ## ruff and the import contracts (.importlinter)
	$(BIN)/ruff check sparkprov sparklab tests tasks.py bench
	$(BIN)/lint-imports

test-unit: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/sparklab

lab-down: venv
	$(BIN)/invoke lab.down

clean:
	rm -rf $(VENV) .lab-cache

test-lab: deps venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/lab
