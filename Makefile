# specdraft: `make demo` runs the whole pipeline on the bundled pocket target; `make test` runs the checks.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint format demo clean

install: $(STAMP)

# torch first and pinned: a bare `torch` requirement can resolve to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: install lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest

demo: install
	$(BIN)/python recipes/pocket/demo.py

clean:
	rm -rf runs artifacts/demo
