# Two commands do everything on a fresh machine:
#   make demo   - the whole system on this machine (embedded defaults), with a live view
#   make test   - lint, type-check and the full test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/model-rollout-demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -ra

bench: install
	$(BIN)/python bench/swap_under_load.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/rollout_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
