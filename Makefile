# `make demo` and `make test` set everything up on first use (.venv + editable install), then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo quickstart test lint clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (set PY=python3.x)"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 first: on the CI machine it is a CPU wheel on disk; any other torch pulls a CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python recipes/train_qwendlm.py --out outputs/demo-$$(date +%Y%m%d-%H%M%S)

quickstart: $(STAMP)
	$(BIN)/python recipes/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -x tests

lint: $(STAMP)
	$(BIN)/ruff check orl_jax kernels recipes benchmarks tests

clean:
	rm -rf $(VENV) .pytest_cache demo_out
