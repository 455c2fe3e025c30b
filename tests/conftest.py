"""Shared fixtures: tiny random-weight models of four architectures, real tokenizers, and the
packaged default model."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import sfi
from sfi.models import load_tokenizer

TINY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=2048)


def tiny_config(arch: str, vocab_size: int = 256):
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, **TINY)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, use_sliding_window=False, **TINY)
    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, head_dim=16, use_sliding_window=False, **TINY)
    if arch == "mistral":
        return MistralConfig(vocab_size=vocab_size, sliding_window=None, **TINY)
    raise ValueError(arch)


def tiny_model(arch: str, vocab_size: int = 256, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size), dtype=torch.float32)
    return model.eval()


def tied_tiny_qwen2():
    """A tiny Qwen2 whose output layer shares the embedding table, 12 token ids and its
    logits on them: ``(model, ids, logits [1, 12, V])``."""
    model = tiny_model("qwen2")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 12))
    with torch.inference_mode():
        return model, ids, model(ids).logits


ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def smol_tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return load_tokenizer("qwen2.5-0.5b")


@pytest.fixture(scope="session")
def default_model():
    return sfi.load("default", weights="native")


@pytest.fixture
def tiny_llama_with_tokenizer(smol_tokenizer):
    """A tiny random Llama over SmolLM2's real vocabulary, so text and triggers are real."""
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    model.sfi_tokenizer = smol_tokenizer
    return model, smol_tokenizer


# --- the server tests' tiny model and a running server (tests/serverkit.py) ----------
@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    model.sfi_tokenizer = smol_tokenizer
    return model, smol_tokenizer


@pytest.fixture(scope="module")
def server(tiny):
    from serverkit import Server

    with Server(*tiny) as running:
        yield running
