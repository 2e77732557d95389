# The two commands. Each does all its own set-up (.ci/setup: system packages
# where missing, then .venv when pyproject.toml changed).
#
#   make run    start the embedded PostgreSQL cluster (./.ringq) and a demo queue
#   make test   the test suite, against clusters the tests start themselves

SHELL = /bin/sh
RINGQ = .venv/bin/ringq

.PHONY: run test setup

setup:
	@./.ci/setup

test: setup
	.venv/bin/python -m pytest -q

# Grows as the monitor and viewer land.
run: setup
	$(RINGQ) db start
	@if $(RINGQ) queue --help >/dev/null 2>&1; then \
		echo "$(RINGQ) queue create demo --capacity 1000 --max-payload 512"; \
		$(RINGQ) queue create demo --capacity 1000 --max-payload 512 || exit $$?; \
	else \
		echo "run: skipped 'ringq queue create demo': this ringq has no 'queue' command yet" >&2; \
	fi
	@echo
	@echo "ringq is running; the database is $$($(RINGQ) db url)"
	@echo "  $(RINGQ) db status    # the cluster"
	@echo "  psql \"\$$($(RINGQ) db url)\""
	@echo "  $(RINGQ) db stop      # stop it"
