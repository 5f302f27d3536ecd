# Each target does its own set-up on a fresh machine: a virtual environment with the CPU
# build of PyTorch (never a multi-GB CUDA download) and Stratagem installed editable.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint bench clean

$(BIN)/stratagem: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,cluster]"
	touch $@

setup: $(BIN)/stratagem

demo: setup
	$(BIN)/stratagem run --nproc 2 examples/train_mlp.py --epochs 5

# Two pytest workers: the suite's processes leave a core idle about a third of the time
# (1316 s alone, 1055 s so, on 2 cores). Tests that take host-wide things (virtual
# clusters, Ray) run one after another on one worker (tests/conftest.py, SHARED_HOST).
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check src tests bench tools examples

bench: setup
	$(BIN)/python bench/allreduce_vs_ddp.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
