# Set-up and entry points. `make demo` and `make test` are all a new user needs:
# each creates .venv if missing and installs the project into it once.
#
# torch is installed first and explicitly (TORCH_SPEC), because pip would resolve a
# bare `torch` requirement to a CUDA build. With CUDA, install your own torch into
# .venv first: an importable torch is left alone.

SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# First interpreter of at least Python 3.11 found on PATH (override: make PYTHON=/path/to/python).
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && { echo $$p; break; }; done)
STAMP := $(VENV)/.nereus-installed
VLLM_STAMP := $(VENV)/.nereus-vllm-installed
# `make test` installs the vLLM extra too, so its engine tests run; `make test WITH_VLLM=0` skips
# them (and the install). An importable vllm is left alone.
WITH_VLLM ?= 1

.PHONY: demo test install install-vllm lint format clean

demo: $(STAMP)
	$(BIN)/nereus run examples/tiny_ppo.yaml

test: $(STAMP) $(if $(filter 1,$(WITH_VLLM)),$(VLLM_STAMP))
	$(BIN)/python -m pytest -q

install: $(STAMP)

# vLLM as the rollout engine (rollout.engine: vllm) on CPU; a few minutes. The CUDA torchvision,
# torchaudio and torchcodec it pulls in do not load against the CPU torch and break transformers.
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	@if $(BIN)/python -c 'import vllm' >/dev/null 2>&1; then \
		echo "vllm already installed in $(VENV)"; \
	else \
		$(BIN)/python -m pip install -e '.[vllm]' && \
		$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	$(BIN)/python -c 'import vllm, transformers.models.llama; print("vllm", vllm.__version__)'
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "nereus: Python >= 3.11 not found; run make PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Re-installs when the project's metadata changes or a package appears (a new __init__.py),
# so the editable install maps every package.
$(STAMP): $(BIN)/python pyproject.toml $(wildcard */__init__.py)
	@if $(BIN)/python -c 'import torch' >/dev/null 2>&1; then \
		echo "torch already installed in $(VENV): $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
		$(BIN)/python -m pip install '$(TORCH_SPEC)'; \
	fi
	$(BIN)/python -m pip install -e '.[test]'
	@touch $@

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache .hypothesis
