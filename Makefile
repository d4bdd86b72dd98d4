# One entry point for setting up, running and testing llmgw on a fresh clone.
# Everything installs into .venv from pyproject.toml, pinned by constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/llmgw demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python bench/xds_push.py

clean:
	rm -rf $(VENV) bench/results .pytest_cache .mypy_cache .ruff_cache
