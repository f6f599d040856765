# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv and
# installs what it needs first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

include dashboard.mk

.PHONY: test demo lint typecheck check venv clean bench bench-quick

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck

test: check assets
	$(BIN)/pytest -n 2 $(PYTEST_ARGS)

demo: $(STAMP) assets
	$(BIN)/python examples/demo.py

# Side by side with the peers (installed from PyPI into .venv-peers), on a throwaway PostgreSQL:
# about 12 minutes; bench-quick is the same table, smaller, in about 5. See docs/performance.md.
bench: $(STAMP)
	$(BIN)/pgqueue bench --peers --peers-venv .venv-peers $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/pgqueue bench --peers --peers-venv .venv-peers --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
