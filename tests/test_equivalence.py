"""With a budget that covers the whole context, slow-fast decoding is full attention."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, tiny_model
from helpers import lockstep

import sfi
from sfi import SFIConfig
from sfi.hf.facts import cache_argument

FULL_BUDGET = dict(sink=4, recent=8, k_head=4096, force_sparse=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("trigger", ["fixed", "random"])
def test_full_budget_matches_full_attention_every_step(arch, trigger):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    run = lockstep(model, ids, SFIConfig(**FULL_BUDGET, trigger=trigger, period=5,
                                         random_period_min=3, random_period_max=7), steps=24)
    kinds = [k[0] for k in run.kinds]
    assert kinds[0] == "slow"  # prefill + bootstrap selection
    assert kinds.count("fast") >= 15 and kinds.count("slow") >= 3, kinds
    for step, (a, b) in enumerate(zip(run.sfi_logits, run.full_logits)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {step} ({kinds[step]})")


@pytest.mark.parametrize("arch", ARCHS)
def test_small_budget_differs_but_stays_finite(arch):
    """The same run with a tiny budget is not full attention (the fast path really is sparse)."""
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    run = lockstep(model, ids, SFIConfig(sink=2, recent=4, k_head=4, force_sparse=True,
                                         trigger="fixed", period=50), steps=6)
    fast = [i for i, k in enumerate(run.kinds) if k[0] == "fast"]
    assert fast
    diffs = [float((run.sfi_logits[i] - run.full_logits[i]).abs().max()) for i in fast]
    assert max(diffs) > 1e-3
    assert all(torch.isfinite(run.sfi_logits[i]).all() for i in fast)


def test_generate_same_tokens_both_ways_tiny(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    prompt = "The cat sat on the mat. It was happy! Was it? " * 6
    full = sfi.generate(model, tok, prompt, max_new_tokens=24, mode="full")
    fast = sfi.generate(model, tok, prompt, max_new_tokens=24,
                        config=SFIConfig(**FULL_BUDGET, min_refresh_gap=2))
    assert fast.token_ids == full.token_ids
    assert fast.stats.fast_steps > 0


def test_hf_generate_equals_sfi_generate(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    prompt = "One two three. Four five six! " * 10
    config = SFIConfig(sink=2, recent=8, k_head=6, force_sparse=True, min_refresh_gap=3)
    inputs = tok(prompt, return_tensors="pt")
    cache = sfi.SlowFastCache(model, config)
    out = model.generate(**inputs, **{cache_argument(model): cache}, max_new_tokens=20,
                         do_sample=False, min_new_tokens=20, pad_token_id=tok.eos_token_id)
    ours = sfi.generate(model, tok, prompt, config=config, max_new_tokens=20)
    hf_tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert hf_tokens[: len(ours.token_ids)] == ours.token_ids
    assert cache.stats().to_dict() == ours.stats.to_dict()


@pytest.mark.model
def test_default_model_full_budget_matches_full_attention(default_model):
    model, tok = default_model
    from sfi.texts import essay

    ids = tok(essay(300, tok), return_tensors="pt")["input_ids"]
    run = lockstep(model, ids, SFIConfig(sink=4, recent=16, k_head=8192, force_sparse=True,
                                         trigger="fixed", period=6), steps=12, tokenizer=tok)
    kinds = [k[0] for k in run.kinds]
    assert kinds.count("fast") >= 8
    for step, (a, b) in enumerate(zip(run.sfi_logits, run.full_logits)):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4, msg=f"step {step}")
        assert a.argmax() == b.argmax()


@pytest.mark.model
def test_default_model_generate_full_budget_same_text(default_model):
    model, tok = default_model
    prompt = "Write three sentences about the sea. The sea is"
    full = sfi.generate(model, tok, prompt, max_new_tokens=40, mode="full")
    fast = sfi.generate(model, tok, prompt, max_new_tokens=40,
                        config=SFIConfig(recent=8, k_head=8192, force_sparse=True,
                                         trigger="fixed", period=3, coverage_layers=0))
    assert fast.token_ids == full.token_ids
    assert fast.stats.fast_steps > 0 and fast.stats.slow_steps > 0
    assert fast.stats.fast_read_fraction == pytest.approx(1.0)  # no probes: the memory alone


def test_gemma2_sliding_layers_stay_dense_and_full_layers_match():
    """Gemma-style models: sliding-window layers keep transformers' own window layer; the full
    layers go slow-fast, soft-capped logits included."""
    from transformers import AutoModelForCausalLM, Gemma2Config
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from sfi.hf.slab import SlabLayer

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=256, hidden_size=96, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
                          head_dim=16, sliding_window=16, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(3))
    run = lockstep(model, ids, SFIConfig(**FULL_BUDGET, trigger="fixed", period=4), steps=10)
    kinds = [type(layer) for layer in run.cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, SlabLayer] * 2
    assert [k[0] for k in run.kinds].count("fast") >= 6
    for a, b in zip(run.sfi_logits, run.full_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
