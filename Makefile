# The two set-up commands a newcomer needs are `make demo` and `make test`; both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo

.PHONY: demo test bench check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m goodput.demo --output $(DEMO_DIR)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m benchmarks

check: $(STAMP)
	$(BIN)/ruff check goodput tests benchmarks
	$(BIN)/ruff format --check goodput tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
