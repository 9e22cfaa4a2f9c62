# The two commands a newcomer needs: `make train` and `make test` (each installs first, idempotently).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: install train test test-fast lint format

install:
	VENV=$(VENV) bash scripts/install.sh

# The default job: SFT of a tiny offline Qwen2.5-VL on the synthetic task, on CPU (see README).
train: install
	$(PY) train.py $(ARGS)

# Test files run on TEST_WORKERS pytest-xdist workers, a file's tests on one worker (its module
# fixtures, e.g. a vLLM report, are built once), longest files first (tests/order.py); conftest.py
# shares the cores among them.
TEST_WORKERS ?= 2
# --no-loadscope-reorder: xdist would hand out files by their number of tests, not in the order given.
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Everything, slow learning and end-to-end tests included (CI runs this).
test: install
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# Without the slow learning/end-to-end tests.
test-fast: install
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .
