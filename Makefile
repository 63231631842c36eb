# Conveyor: the two commands are `make run` (the whole stack) and `make test` (the whole suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-fast bench bench-full lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build of 2.13.0 where it is on disk, PyPI's otherwise.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# A laptop's stack: no authentication, on 127.0.0.1 (`conveyor up` warns); CONVEYOR_AUTH=keys closes it.
run: $(STAMP)
	$(BIN)/conveyor model pull
	CONVEYOR_AUTH=$${CONVEYOR_AUTH:-none} $(BIN)/conveyor up

test: $(STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/conveyor model pull
	$(BIN)/python -m bench.suite --quick

bench-full: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/conveyor model pull
	$(BIN)/python -m bench.suite

lint: $(STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
