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

test: bootstrap
	@$(PY) -m tests.runner

# The fault tests at full size on every database (the suite runs them reduced): the chaos
# run kills a worker 20 times while 400 runs of 40 sessions execute.
torture: bootstrap
	@SAGE_TORTURE=1 $(PY) -m tests.runner tests/scheduling/test_lifecycle_faults.py tests/scheduling/test_database_outages.py

celery: bootstrap
	@$(VENV)/bin/celery -A sageproject.celery worker --loglevel=INFO --pool=threads --concurrency=4

lint: bootstrap
	@$(VENV)/bin/ruff check .

bench: bootstrap
	@$(PY) manage.py bench_pooling
	@$(PY) manage.py bench_single_host --sessions 64 --writes 8 --io-ms 2 --backend memory

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
