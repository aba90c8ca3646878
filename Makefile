# `make demo` and `make test` set everything up on first use (.venv + editable install), then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo quickstart test test-image-versions lint clean

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

# The suite on this CPU under the GPU image's versions (DESIGN.md "Versions": Python 3.12, jax 0.11.2, flax 0.12.10,
# optax 0.2.8, orbax-checkpoint 0.12.4, transformers 5.17), which the device's runs use: catches an API that moved
# before a device call does. Needs a Python 3.12, e.g. PY312="env PYENV_VERSION=3.12.1 python".
PY312 ?= python3.12
IMAGE_VENV := .venv-image
test-image-versions:
	test -d $(IMAGE_VENV) || $(PY312) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q "torch==2.13.0"
	$(IMAGE_VENV)/bin/pip install -q -e ".[dev]" "jax==0.11.2" "flax==0.12.10" "optax==0.2.8" \
		"orbax-checkpoint==0.12.4" "transformers==5.17.0"
	$(IMAGE_VENV)/bin/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check orl_jax kernels recipes benchmarks tests

clean:
	rm -rf $(VENV) $(IMAGE_VENV) .pytest_cache demo_out
