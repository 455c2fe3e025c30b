"""Bad input gets a clear error naming the problem."""

from __future__ import annotations

import pytest
import torch

import sfi
from sfi import (
    ModelNotFoundError,
    PromptError,
    SFIConfig,
    SFIConfigError,
    SFIError,
    UnsupportedModelError,
)
from sfi.hf.facts import cache_argument


@pytest.mark.parametrize("kwargs, message", [
    (dict(k_head=-1), "k_head must be >= 0"),
    (dict(k_head="12"), "k_head must be an integer"),
    (dict(k_head=12.0), "k_head must be an integer"),
    (dict(sink=-4), "sink must be >= 0"),
    (dict(recent=True), "recent must be an integer"),
    (dict(recent=0), "recent must be >= 1"),
    (dict(k_head=None, k_fraction=0.0), "k_fraction must be > 0.0"),
    (dict(k_head=None, k_fraction=1.5), "k_fraction must be <= 1.0"),
    (dict(k_head=None, k_fraction=float("nan")), "k_fraction must be finite"),
    (dict(k_head=None, k_fraction="0.2"), "k_fraction must be a number"),
    (dict(k_head=2048, k_fraction=0.2), "not both"),
    (dict(k_head=None), "a budget is needed"),
    (dict(refresh_interval=0), "refresh_interval must be >= 1"),
    (dict(trigger="sometimes"), "trigger must be one of"),
    (dict(random_period_min=10, random_period_max=5), "random_period_max"),
    (dict(lambda_cap_single=2.0), "lambda_cap_single must be <= 1.0"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(SFIConfigError, match=message):
        SFIConfig(**kwargs)


def test_config_accepts_a_whole_fraction():
    assert SFIConfig(k_head=None, k_fraction=1.0).budget(100) == 100


def test_empty_prompt(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    for prompt in ("", "   \n", []):
        with pytest.raises(PromptError, match="empty"):
            sfi.generate(model, tok, prompt)


def test_prompt_longer_than_the_context(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    with pytest.raises(PromptError, match="more than the model's context of 2048 tokens"):
        sfi.generate(model, tok, "word " * 2100, max_new_tokens=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens="5"), "max_new_tokens must be an integer"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be > 0"),
    (dict(mode="sparse"), "mode must be one of"),
    (dict(mode="full", config=SFIConfig()), "config applies to mode='sfi' only"),
])
def test_generate_rejects_bad_arguments(tiny_llama_with_tokenizer, kwargs, message):
    model, tok = tiny_llama_with_tokenizer
    with pytest.raises(SFIError, match=message):
        sfi.generate(model, tok, "hello", **kwargs)


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        sfi.load("no-such-model")


def test_a_folder_without_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"holds no config\.json"):
        sfi.load(str(tmp_path))


def test_model_whose_attention_cannot_be_routed(tiny_llama_with_tokenizer, monkeypatch):
    with pytest.raises(UnsupportedModelError, match="does not route its attention"):
        sfi.SlowFastCache(torch.nn.Linear(2, 2), SFIConfig(trigger="fixed"))
    model, _ = tiny_llama_with_tokenizer
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", lambda self: False)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM does not route"):
        sfi.SlowFastCache(model, SFIConfig(trigger="fixed"))


def test_right_padding_is_refused(tiny_llama_with_tokenizer):
    model, _ = tiny_llama_with_tokenizer
    cache = sfi.SlowFastCache(model, SFIConfig(trigger="fixed"))
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(SFIError, match="left padding only"):
        model(input_ids=ids, attention_mask=mask, **{cache_argument(model): cache})


def test_config_must_be_an_sficonfig(tiny_llama_with_tokenizer):
    model, _ = tiny_llama_with_tokenizer
    with pytest.raises(SFIError, match="config must be an SFIConfig"):
        sfi.SlowFastCache(model, {"k_head": 5})


def test_a_forward_that_skips_the_planning_hook_is_refused(tiny_llama_with_tokenizer):
    model, _ = tiny_llama_with_tokenizer
    cache = sfi.SlowFastCache(model, SFIConfig(trigger="fixed"))
    ids = torch.ones(1, 5, dtype=torch.long)
    model(input_ids=ids, **{cache_argument(model): cache})
    with pytest.raises(SFIError, match="not planned for this forward pass"):
        inner = model.model  # the inner model: no planning hook
        inner(input_ids=ids[:, :1], **{cache_argument(inner): cache})
