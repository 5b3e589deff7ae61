# The two commands: `make run` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test bootstrap celery lint bench clean

bootstrap:
	@./.ci/bootstrap

run: bootstrap
	@$(PY) manage.py runhost --host $(HOST) --port $(PORT)

test: bootstrap
	@$(PY) -m tests.runner

celery: bootstrap
	@$(VENV)/bin/celery -A sageproject.celery worker --loglevel=INFO --pool=threads --concurrency=4

lint: bootstrap
	@$(VENV)/bin/ruff check .

bench: bootstrap
	@$(PY) manage.py bench_pooling
	@$(PY) manage.py bench_single_host --sessions 64 --writes 8 --io-ms 2 --backend memory

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
