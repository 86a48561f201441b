# Every target creates the virtualenv and installs what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test example lint bench bench-2k bench-10k soak drill up down clean

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
	$(BIN)/lint-imports  # the layers in pyproject.toml: nothing imports upward
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	command -v bwrap >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap)
	@# promtool (Debian's prometheus package) checks the alert rules and the deployment's Prometheus config.
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	@# Known vulnerabilities in the installed dependencies (pip-audit asks PyPI's JSON API); offline, one line says so.
	@if $(BIN)/python -c "import urllib.request as u; u.urlopen('https://pypi.org/pypi/pip/json', timeout=10)" 2>/dev/null; \
	then $(BIN)/pip-audit --local --skip-editable --progress-spinner off -f json -o $(VENV)/pip-audit.json && \
	$(BIN)/python -c "import json; d = json.load(open('$(VENV)/pip-audit.json'))['dependencies']; n = sum('skip_reason' in x for x in d); n and print(f'pip-audit: {n} of {len(d)} packages unknown to the index, not audited ($(VENV)/pip-audit.json)')"; \
	else echo "pip-audit: package index unreachable, skipped"; fi
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory example

# The vendor plugin example (examples/vendor_package): installed from its own directory, as a user installs a
# plugin, but into a directory of its own (never into the venv, whose installed adapters the suite lists), and
# its contract tests run by the shipped kit in its own pytest session (its own embedded PostgreSQL).
example: $(STAMP)
	rm -rf $(VENV)/example-site
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/example-site examples/vendor_package
	cd examples/vendor_package && PYTHONPATH=$(CURDIR)/$(VENV)/example-site \
		$(CURDIR)/$(BIN)/python -m pytest -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python -m bench.decide
	$(BIN)/python -m bench.compare
	$(BIN)/python -m bench.ledger

# One very wide task end to end (bench/scale.py): 2,002 nodes within 120 s; 10,002 nodes with exact money,
# continuing as new along the way.
bench-2k: $(STAMP)
	$(BIN)/python -m bench.scale --fan-outs 4 --limit 120

bench-10k: $(STAMP)
	$(BIN)/python -m bench.scale --fan-outs 20 --limit 1800

# 1,000 tasks of a 20-stage plan on 4 workers: every task completes, money exact; the run's figures.
soak: $(STAMP)
	LEDGERFLOW_ACTIVE_TASKS=64 $(BIN)/ledgerflow soak --tasks 1000 --workers 4 --plan examples/soak_20_stages.yaml \
		--sim examples/simulator_soak.json --hero-share 0.1 --require-complete

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
