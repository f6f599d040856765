# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv and
# installs what it needs first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=

include dashboard.mk

.PHONY: test test-django6 demo docs docs-serve lint typecheck check venv clean chaos bench bench-quick

$(VENV)/bin/pip:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Everything: development tools, docs, the dashboard and the guides' frameworks.
$(STAMP): pyproject.toml | $(VENV)/bin/pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Only what the demo runs: the dashboard, and pgserver for machines without PostgreSQL.
$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/pip
	$(BIN)/pip install --quiet -e '.[dashboard,embedded]'
	touch $(DEMO_STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck

# The documentation site; warnings (a broken link, a missing docstring target) are errors.
# NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about its successor on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: check docs assets
	$(BIN)/pytest -n 2 $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-django6

# Django's tasks framework is in Django 6, which needs Python 3.12; the dev venv may run an older
# Python (and then tests the backend on Django 5.2 with the django-tasks backport), so the
# backend's tests also run on real Django 6 in a venv of their own when python3.12 exists.
DJANGO6_PYTHON ?= $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.1[23]*/bin/python3; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo $$p && break; done)
DJANGO6_VENV := .venv-django6
test-django6:
	@if [ -z "$(DJANGO6_PYTHON)" ]; then \
	  echo "test-django6: no Python 3.12+ here, so Django 6 itself is not tested (the backport is)"; \
	else \
	  [ -x $(DJANGO6_VENV)/bin/pip ] || $(DJANGO6_PYTHON) -m venv $(DJANGO6_VENV); \
	  $(DJANGO6_VENV)/bin/pip install --quiet -e . 'django>=6.0' pytest pytest-asyncio pytest-timeout pytest-xdist; \
	  $(DJANGO6_VENV)/bin/python -c "import django; print('Django', django.__version__)"; \
	  $(DJANGO6_VENV)/bin/pytest -q tests/integration/test_django.py $(PYTEST_ARGS); \
	fi

# The fault-injection suite at full size (every scenario also runs small inside `make test`).
# Prints the results table; CHAOS_ARGS takes e.g. --seed N --scenario sigkill --rate 500.
CHAOS_ARGS ?=
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos $(CHAOS_ARGS)

demo: $(DEMO_STAMP) assets
	$(BIN)/pgqueue demo $(DEMO_ARGS)

# Side by side with the peers (installed from PyPI into .venv-peers), on a throwaway PostgreSQL:
# about 38 minutes; bench-quick is the same table, smaller, in about 10. See docs/performance.md.
bench: $(STAMP)
	$(BIN)/pgqueue bench --peers --peers-venv .venv-peers $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/pgqueue bench --peers --peers-venv .venv-peers --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DJANGO6_VENV) .pytest_cache .mypy_cache .ruff_cache site
