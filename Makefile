# kvpipe: two commands set everything up on a fresh machine.
#   make demo  - venv, Kafka jars, broker, both apps, simulated nodes: the main job end to end
#   make test  - venv, Kafka jars, broker, then the whole test suite
#   make check - the everyday loop, no broker: lint, import contracts, types, unit and property tests
# Both are idempotent. The venv and the Kafka jars are cached outside the clone.

SHELL := /bin/bash
VENV = $(shell infra/scripts/venv.sh)
PY = $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test check venv broker-up broker-down bench clean

venv:
	@infra/scripts/venv.sh >/dev/null

# `make test` starts the local broker if it is not running and stops it again afterwards only if it
# started it (a developer's running broker is left alone).
test: venv
	@py=$(PY); \
	if $$py -m kvpipe infra status >/dev/null 2>&1; then started=0; else started=1; fi; \
	$$py -m kvpipe infra up || exit $$?; \
	$$py -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	if [ $$started = 1 ]; then $$py -m kvpipe infra down; fi; \
	exit $$rc

# The fast loop for everyday changes (no broker, no apps): each step stops the run at its first failure.
check: venv
	@bin=$(VENV)/bin; \
	$$bin/ruff check schemas gpu producer processors infra kvpipe tests && \
	$$bin/lint-imports && \
	$$bin/mypy && \
	$$bin/python -m pytest -q -p no:cacheprovider tests/unit tests/property $(PYTEST_ARGS)

demo: venv
	@$(PY) -m kvpipe demo

broker-up: venv
	@$(PY) -m kvpipe infra up

broker-down: venv
	@$(PY) -m kvpipe infra down

bench: venv
	@for b in producer ingest bridge offload manager; do $(PY) -m kvpipe bench $$b --json | tail -n 1; done

clean:
	rm -rf .kvpipe .pytest_cache
