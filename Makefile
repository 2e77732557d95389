# The two commands. Each does all its own set-up (.ci/setup: system packages
# where missing, then .venv when pyproject.toml changed); only `make test`
# needs the browser the viewer's tests drive.
#
#   make run    the main job: database, monitor, viewer, one regression cycle proven by Spark
#   make test   the test suite, against clusters the tests start themselves

SHELL = /bin/sh
RINGQ = .venv/bin/ringq

.PHONY: run test setup check setup-run

setup:
	@./.ci/setup test

setup-run:
	@./.ci/setup run

# lint (ruff) and types (mypy --strict) first: a red check fails the test run.
test: check
	.venv/bin/python -m pytest -q

# The main job: embedded PostgreSQL, queues, the monitor and the viewer in the
# background (their addresses are printed), then one regression cycle proven
# by Spark. `.venv/bin/ringq run --stop` stops what it started.
run: setup-run
	$(RINGQ) run

# ruff (the rules in pyproject.toml), the import contracts (.importlinter) and
# mypy --strict over the packages, the tests and the benchmarks; `make test`
# runs it first.
check: setup
	./.ci/typecheck
