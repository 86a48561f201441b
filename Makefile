# Every target creates the virtualenv and installs what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench up down clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ledgerflow demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy rules ledger
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m bench.compare

up: $(STAMP)
	$(BIN)/ledgerflow up

down: $(STAMP)
	$(BIN)/ledgerflow down

clean:
	-$(BIN)/ledgerflow down
	rm -rf .ledgerflow
