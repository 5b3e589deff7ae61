# The two commands: `make run` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test torture bootstrap celery lint bench clean

bootstrap:
	@./.ci/bootstrap

run: bootstrap
	@$(PY) manage.py runhost --host $(HOST) --port $(PORT)

# The suite also checks the OpenTelemetry spans: bootstrap installs requirements-otel.txt.
test: export SAGE_BOOTSTRAP_EXTRAS = requirements-otel.txt
test: bootstrap
	@$(PY) -m tests.runner

# Hostile input and broken upstreams against a live host (schemathesis, the cross-user
# matrix, the credential canary, the upstream fault catalogue, a 10,000-submission flood)
# on SQLite and PostgreSQL, and the fault tests at full size on every database (the chaos
# run kills a worker 20 times while 400 runs of 40 sessions execute); one summary table.
# The suite runs all of it reduced. See docs/OPERATIONS.md, "Torture".
torture: bootstrap
	@$(PY) -m tests.torture

celery: bootstrap
	@$(VENV)/bin/celery -A sageproject.celery worker --loglevel=INFO --pool=threads --concurrency=4

# ruff, then the layers contract of pyproject.toml (tests/test_layers.py runs it in make test).
lint: bootstrap
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/lint-imports --no-logo

bench: bootstrap
	@$(PY) manage.py bench_pooling
	@$(PY) manage.py bench_single_host --sessions 64 --writes 8 --io-ms 2 --backend memory

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
