# The two commands (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create or reuse .venv, install the CPU torch wheel first, then evictlab editable.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.evictlab-installed

.PHONY: demo test setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "error: $(PY) not found; install Python 3.11 or run 'make PY=python3 ...'"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/evictlab demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean-venv:
	rm -rf $(VENV)
