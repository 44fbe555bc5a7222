# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv first (idempotent: a stamp file skips pip when nothing changed).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tide-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test test-fast lint format bench lock stack-up stack-down clean

venv: $(STAMP)

# Everything (pyproject's `dev` extra) at the tested pins of constraints.txt; SpecForge --no-deps.
$(STAMP): pyproject.toml requirements-nodeps.txt constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=68"
	$(BIN)/pip install --quiet --no-build-isolation -c constraints.txt -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps -r requirements-nodeps.txt
	@touch $(STAMP)

demo: venv
	$(BIN)/tide demo --keep-up

test: venv
	$(BIN)/python -m pytest

test-fast: venv
	$(BIN)/python -m pytest -m "not slow and not e2e"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: venv
	mkdir -p bench
	$(BIN)/tide bench lake --json bench/lake.json

stack-up: venv
	$(BIN)/tide stack up

stack-down: venv
	$(BIN)/tide stack down

lock: venv
	( echo "# pip freeze of a working .venv (make venv); regenerate with: make lock"; \
	  $(BIN)/pip freeze --exclude-editable | grep -viE '^(specforge|konlpy)==' | sed 's/+cpu$$//' ) > constraints.txt

clean:
	rm -rf $(VENV) .tide .pytest_cache .mypy_cache .ruff_cache
