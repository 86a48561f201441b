# Every target creates the virtualenv and installs what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench drill up down clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ledgerflow demo

# The reviewer page's browser test drives Debian's chromium (Playwright never downloads a browser).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy rules ledger runtime reconcile activities vendors artifacts media workflows ledgerflow worker.py
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m bench.decide
	$(BIN)/python -m bench.compare

# The crash drill with every unkind vendor habit on, once per vendor mode (long: not part of `make test`).
drill: $(STAMP)
	for mode in idempotent lookup_only none; do \
		$(BIN)/ledgerflow drill --profile realistic --mode $$mode --kills 30 || exit 1; \
	done

up: $(STAMP)
	$(BIN)/ledgerflow up

down: $(STAMP)
	$(BIN)/ledgerflow down

clean:
	-$(BIN)/ledgerflow down
	rm -rf .ledgerflow
