# kvpipe: two commands set everything up on a fresh machine.
#   make demo  - venv, Kafka jars, broker, both apps, simulated nodes: the main job end to end
#   make test  - venv, Kafka jars, broker, then the whole test suite
#   make check - the everyday loop, no broker: lint, import contracts, types, unit and property tests
#   make dist  - the wheelhouse a deployment installs from: kvpipe and the abi3 kvpipe-native wheel in dist/
# Both are idempotent. The venv and the Kafka jars are cached outside the clone.

SHELL := /bin/bash
VENV = $(shell infra/scripts/venv.sh)
PY = $(VENV)/bin/python
PYTEST_ARGS ?=
DIST ?= dist

.PHONY: demo test check venv broker-up broker-down bench clean dist

venv:
	@infra/scripts/venv.sh >/dev/null

# `make test` starts the local broker if it is not running and stops it again afterwards only if it
# started it (a developer's running broker is left alone). Everything but the integration and fault tests (no
# broker, CPU only) runs on every core; those two, which time brokers and apps, one test at a
# time after them. Both parts always run; the exit status is the first failing part's (a part that
# PYTEST_ARGS leaves without tests, pytest's 5, counts as passed unless both are).
test: venv
	@py=$(PY); \
	if $$py -m kvpipe infra status >/dev/null 2>&1; then started=0; else started=1; fi; \
	$$py -m kvpipe infra up || exit $$?; \
	$$py -m pytest -q -p no:cacheprovider -n auto tests --ignore=tests/integration --ignore=tests/fault $(PYTEST_ARGS); rc=$$?; \
	$$py -m pytest -q -p no:cacheprovider tests/integration tests/fault $(PYTEST_ARGS); rc2=$$?; \
	if [ $$rc = 5 ] && [ $$rc2 != 5 ]; then rc=0; fi; if [ $$rc2 = 5 ] && [ $$rc != 5 ]; then rc2=0; fi; \
	if [ $$rc = 0 ]; then rc=$$rc2; fi; \
	if [ $$started = 1 ]; then $$py -m kvpipe infra down; fi; \
	exit $$rc

# The fast loop for everyday changes (no broker, no apps): each step stops the run at its first failure.
check: venv
	@bin=$(VENV)/bin; \
	$$bin/ruff check schemas gpu producer processors infra kvpipe tests && \
	$$bin/lint-imports && \
	$$bin/python -m pytest -q -p no:cacheprovider -n auto tests --ignore=tests/integration --ignore=tests/fault $(PYTEST_ARGS)

demo: venv
	@$(PY) -m kvpipe demo

broker-up: venv
	@$(PY) -m kvpipe infra up

broker-down: venv
	@$(PY) -m kvpipe infra down

bench: venv
	@for b in producer ingest bridge offload manager; do $(PY) -m kvpipe bench $$b --json | tail -n 1; done

# The wheelhouse: `pip install --find-links dist/ 'kvpipe[native]'` (plus the role's extras: README, "Installing
# by role") takes kvpipe and its native core from it, with no compiler on the target. kvpipe is built from a copy of the checkout's files (tracked and
# not ignored), because setuptools leaves build/ behind in the tree it builds and would ship a deleted module
# from there next time. kvpipe-native is built as infra/scripts/native.sh builds it, in the same cargo target
# dir beside the venv, so after `make venv` this is an incremental no-op for the Rust side.
dist: venv
	@set -euo pipefail; \
	out=$$(realpath -m "$(DIST)"); stage=$$(mktemp -d); trap 'rm -rf "$$stage"' EXIT; \
	git ls-files -z --cached --others --exclude-standard | \
	  while IFS= read -r -d '' f; do [ -f "$$f" ] && [ ! -L "$$f" ] && printf '%s\0' "$$f"; done | \
	  xargs -0 cp --parents -t "$$stage"; \
	mkdir -p "$$out"; rm -f "$$out"/kvpipe-*.whl "$$out"/kvpipe_native-*.whl; \
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w "$$out" "$$stage"; \
	CARGO_TARGET_DIR="$(dir $(VENV))native-target" $(VENV)/bin/maturin build --release --locked -q \
	  --manifest-path native/Cargo.toml -i $(PY) -o "$$out" >&2; \
	ls -1 "$$out"/kvpipe-*.whl "$$out"/kvpipe_native-*.whl

clean:
	rm -rf .kvpipe .pytest_cache
