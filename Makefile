# The two commands (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create or reuse .venv, install the CPU torch wheel first, then evictlab editable
# with the test and ray extras (the Ray executor is tested against a local Ray instance),
# every package at the version pinned in constraints.txt (the versions the suite last
# passed with). `make constraints` rewrites constraints.txt from .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.evictlab-installed
CONSTRAINTS := constraints.txt

.PHONY: demo test setup constraints clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@command -v $(PY) >/dev/null 2>&1 || { echo "error: $(PY) not found; install Python 3.11 or run 'make PY=python3 ...'"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/evictlab demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

# After upgrading packages in .venv and seeing `make test` pass: pin what is installed.
# pip freeze --all (setuptools is a dependency of torch) minus evictlab and pip, minus
# CUDA-only packages (the CPU wheel has none), and torch without its local label
# (2.13.0+cpu -> 2.13.0) so the pin holds for either wheel.
constraints:
	@test -x $(BIN)/python || { echo "error: $(BIN)/python not found; run 'make setup' first"; exit 1; }
	{ echo "# Versions of every package evictlab installs, as the test suite last passed with them."; \
	  echo "# Used by 'make setup' (pip install -c constraints.txt ...); regenerate with 'make constraints'."; \
	  $(BIN)/python -m pip freeze --exclude-editable --all \
	    | grep -viE '^(#|-e |evictlab==|pip==|nvidia-|triton==|cuda-)' \
	    | sed -E 's/^(torch==[^+]+)\+.*/\1/'; \
	} > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	@echo "wrote $(CONSTRAINTS) ($$(grep -c '==' $(CONSTRAINTS)) pins)"

clean-venv:
	rm -rf $(VENV)
