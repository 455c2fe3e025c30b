"""The cost model: sparse decoding starts only where a fast step skips ``min_skip`` entries
and reads ``min_gain`` times fewer bytes than a dense step, weights included, decided per
sequence from its own context and the model, so a batch decides as its rows alone would."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from helpers import lockstep

from sfi import SFIConfig
from sfi.core.config import SFIConfigError
from sfi.core.decode_stats import DecodeStats
from sfi.decoding.decode import GenerateResult, Timing


def test_sparse_reads_start_where_a_fast_step_skips_min_skip_entries():
    config = SFIConfig(sink=4, recent=16, k_head=32, min_skip=40)
    assert config.sparse_from() == 4 + 32 + 16 + 40
    assert not config.sparse_pays(4 + 32 + 16 + 39)
    assert config.sparse_pays(4 + 32 + 16 + 40)
    forced = SFIConfig(sink=4, recent=16, k_head=32, min_skip=40, force_sparse=True)
    assert forced.sparse_from() == 0
    # the paper's rule in the paper preset: sparse as soon as S + K + R fit
    assert SFIConfig.paper().min_skip == 0 and SFIConfig.paper().min_gain == 1.0
    assert SFIConfig.paper(sink=4, recent=16, k_head=32).sparse_from(weight_positions=10**5) == 52


def test_sparse_reads_wait_until_they_save_min_gain_of_the_bytes_weights_included():
    config = SFIConfig(sink=4, recent=16, k_head=32, min_skip=0, min_gain=1.1)
    # (W + T) >= 1.1 (W + 52): T >= 157.2 with W = 1000 weights' worth of positions
    assert not config.sparse_pays(157, 1000) and config.sparse_pays(158, 1000)
    assert config.sparse_from(1000) == 158
    assert config.sparse_from(0) == 58  # W unknown: the KV alone, T >= 57.2
    both = SFIConfig(sink=4, recent=16, k_head=32, min_skip=2000, min_gain=1.1)
    assert both.sparse_from(1000) == 2052  # min_skip binds here
    assert SFIConfig(sink=4, recent=16, k_head=32, min_gain=1.1,
                     force_sparse=True).sparse_pays(60, 10**6)
    with pytest.raises(SFIConfigError, match="min_gain"):
        SFIConfig(min_gain=0.9)


@pytest.mark.parametrize("weights", [0, 800, 11_673, 80_397])
@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_the_break_even_with_weights_is_the_first_context_that_pays(weights, fraction):
    config = SFIConfig(k_head=None, k_fraction=fraction, min_skip=100, min_gain=1.2)
    first = next(t for t in range(1, 400_000) if config.sparse_pays(t, weights))
    assert config.sparse_from(weights) == first
    assert all(config.sparse_pays(t, weights) for t in range(first, first + 300))


def test_the_weights_are_counted_from_the_config_as_the_model_holds_them():
    """W from the config alone (what the vLLM plugin has) is within 1% of the model's own
    weights over its KV bytes per position, for each architecture the tests run."""
    from conftest import ARCHS

    from sfi.bench.throughput import kv_bytes_per_entry, weight_bytes
    from sfi.core.cost_model import weight_positions

    for arch in ARCHS:
        model = tiny_model(arch)
        measured = weight_bytes(model) / kv_bytes_per_entry(model)
        assert weight_positions(model.config) == pytest.approx(measured, rel=0.01), arch
    from transformers import Qwen2Config

    qwen = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936)
    assert weight_positions(qwen) == 80_397  # Qwen2.5-0.5B: dense below 10,579 tokens
    assert SFIConfig().sparse_from(80_397) == 10_579
    assert weight_positions(object()) == 0  # a config without the fields: the KV alone


def test_a_cache_turns_sparse_where_the_models_weights_say_it_pays():
    """SlowFastCache weighs the model it routes: dense steps until ``sparse_from(W)``."""
    from sfi.core.cost_model import weight_positions

    model = tiny_model("llama")
    weights = weight_positions(model.config)  # 800
    config = SFIConfig.paper(sink=2, recent=8, k_head=8, evidence_window=4, trigger="fixed",
                             period=50, min_gain=1.5)
    start = config.sparse_from(weights)
    assert start == 427  # (800 + T) >= 1.5 (800 + 18)
    ids = torch.randint(1, 256, (1, start - 3), generator=torch.Generator().manual_seed(5))
    run = lockstep(model, ids, config, steps=5)
    kinds = [step[0] for step in run.kinds[1:]]  # decode step i runs at start - 3 + i tokens
    assert kinds == ["dense", "dense", "slow", "fast", "fast"], kinds


@pytest.mark.parametrize("fraction", [0.1, 0.15, 0.5, 0.9])
@pytest.mark.parametrize("min_skip", [0, 100, 1536])
def test_the_break_even_of_a_fractional_budget_is_the_first_context_that_pays(fraction,
                                                                                min_skip):
    config = SFIConfig(k_head=None, k_fraction=fraction, min_skip=min_skip)
    first = next(t for t in range(1, 200_000) if config.sparse_pays(t))
    assert config.sparse_from() == first
    assert all(config.sparse_pays(t) for t in range(first, first + 300))


def test_a_budget_that_never_pays_has_no_break_even():
    assert SFIConfig(k_head=None, k_fraction=1.0, min_skip=1).sparse_from() is None


def test_a_negative_min_skip_is_refused():
    with pytest.raises(SFIConfigError, match="min_skip"):
        SFIConfig(min_skip=-1)


def test_each_row_turns_sparse_at_its_own_break_even_in_a_batch_as_alone():
    model = tiny_model("llama")
    config = SFIConfig.paper(sink=2, recent=8, k_head=8, min_skip=12, evidence_window=4,
                             trigger="fixed", period=50)
    start = config.sparse_from()  # 30 real tokens
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(1, 256, (1, 24), generator=g), torch.randint(1, 256, (1, 20),
                                                                               generator=g)
    ids = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros(2, 24, dtype=torch.long)
    ids[0], mask[0] = long[0], 1
    ids[1, 4:], mask[1, 4:] = short[0], 1
    steps = 14
    batch = lockstep(model, ids, config, steps=steps, attention_mask=mask)
    alone = [lockstep(model, seq, config, steps=steps) for seq in (long, short)]
    for row, prompt in enumerate((24, 20)):
        # decode step i (1-based) runs at a context of prompt + i real tokens
        kinds = [step[row] for step in batch.kinds[1:]]
        assert kinds == [step[0] for step in alone[row].kinds[1:]]
        dense = [k == "dense" for k in kinds]
        assert dense == [prompt + i < start for i in range(1, steps + 1)], kinds
        assert kinds[start - prompt - 1] == "slow"  # the first selection, where it pays
        assert "fast" in kinds[start - prompt:]
    # while dense, the batch reads everything: full attention's logits
    for step in range(1, start - 24):
        assert torch.allclose(batch.sfi_logits[step], batch.full_logits[step], atol=1e-5)


def test_generate_says_why_its_steps_were_dense():
    from sfi.cli.generate import _summary
    from sfi.core.cost_model import dense_reason

    config = SFIConfig(sink=4, recent=16, k_head=32)
    assert "shorter than 1,588 tokens" in dense_reason(config)
    reason = dense_reason(SFIConfig(), weight_positions=80_397)
    assert "shorter than 10,579 tokens" in reason and "min_gain" in reason
    assert "never pays" in dense_reason(SFIConfig(k_head=None, k_fraction=1.0))
    result = GenerateResult(text="", token_ids=[1, 2], prompt_tokens=40,
                            stats=DecodeStats(dense_steps=2, dense_reason=reason),
                            timing=Timing(), finish_reason="length", mode="sfi", config=config)
    assert "dense because the context is shorter than 10,579 tokens" in _summary(result)
    fast = GenerateResult(text="", token_ids=[1], prompt_tokens=4000,
                          stats=DecodeStats(fast_steps=1), timing=Timing(),
                          finish_reason="length", mode="sfi", config=config)
    assert "dense because" not in _summary(fast)


def test_both_engines_serve_the_layers_without_a_window():
    """The layers a fast step's reads are counted over and the probes go to: full-attention
    layers (and sliding ones without a window); the transformers cache builds its slab layers
    there, and the vLLM plugin's book places its probes among them."""
    from types import SimpleNamespace

    from sfi.core.cost_model import slow_fast_layers
    from sfi.core.scorers.registry import make_scorer
    from sfi.hf.cache_layers import build_layers
    from sfi.hf.slab import SlabLayer
    from sfi.vllm.requests import RequestBook, slot_capacity

    kinds = ["sliding_attention", "full_attention"] * 4  # Gemma 2's alternation
    gemma = SimpleNamespace(num_hidden_layers=8, sliding_window=16, layer_types=kinds)
    assert slow_fast_layers(gemma) == (1, 3, 5, 7)
    mistral = SimpleNamespace(num_hidden_layers=3, sliding_window=16)  # every layer slides
    assert slow_fast_layers(mistral) == ()
    unbounded = SimpleNamespace(num_hidden_layers=2, sliding_window=None, layer_types=kinds[:2])
    assert slow_fast_layers(unbounded) == (0, 1)  # sliding without a window: the whole context
    model = SimpleNamespace(config=gemma)
    slabs = [i for i, layer in enumerate(build_layers(model, 64)) if isinstance(layer, SlabLayer)]
    assert slabs == [1, 3, 5, 7]
    config = SFIConfig(sink=4, recent=16, k_head=32, coverage_layers=2, trigger="fixed")
    book = RequestBook(config, 2, slot_capacity(config, 256), make_scorer("sfi", config),
                       layers=slow_fast_layers(gemma))
    assert book.layers == (1, 3, 5, 7) and set(book.probes) <= {1, 3, 5, 7}
