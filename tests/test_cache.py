"""The mechanics: what is selected, what a fast step reads, and that no token is lost."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from helpers import lockstep
from transformers import DynamicCache

from sfi import SFIConfig, SlowFastCache
from sfi.hf.facts import cache_argument
from sfi.hf.slab import SlabLayer


def _layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, SlabLayer)]


def test_selected_positions_lie_in_the_middle_distinct_and_sized():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    config = SFIConfig(sink=4, recent=16, k_head=20, force_sparse=True, trigger="fixed", period=7)
    run = lockstep(model, ids, config, steps=15)
    cache = run.cache
    memory = cache.memory(0)
    last_refresh = max(i for i, kinds in enumerate(run.kinds) if kinds == ["slow"])
    assert last_refresh > 0  # a decode-time refresh, after the one at prefill
    total_then = ids.shape[1] + last_refresh  # cache length in the forward that refreshed
    assert memory.recent_start == max(0, total_then - config.recent)
    for layer in _layers(cache):
        chosen = cache.selected_positions(layer.layer_idx, 0)  # [H, k]
        middle = memory.recent_start - config.sink
        assert chosen.shape == (3, min(config.k_head, middle)) == (3, memory.k)
        for head in chosen:
            assert head.unique().numel() == head.numel()
            assert bool(((head >= config.sink) & (head < memory.recent_start)).all())


def test_budget_larger_than_the_middle_takes_all_of_it():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    run = lockstep(model, ids, SFIConfig(sink=4, recent=10, k_head=1000, force_sparse=True,
                                         trigger="bootstrap"),
                   steps=1)
    memory = run.cache.memory(0)
    for layer in _layers(run.cache):
        got = run.cache.selected_positions(layer.layer_idx, 0)
        assert torch.equal(got, torch.arange(4, memory.recent_start).expand(3, -1))


def test_fraction_budget():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    config = SFIConfig.paper(sink=4, recent=16, k_head=None, k_fraction=0.1, trigger="bootstrap")
    run = lockstep(model, ids, config, steps=2)
    assert run.cache.memory(0).k == 20  # ceil(0.1 * 200)
    assert run.kinds[1] == ["fast"]


def test_short_context_decodes_densely_until_the_budget_pays():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    # sparse pays from 22 tokens on (min_skip=0, min_gain=1: the paper's rule; the cost
    # model's own break-even is tests/test_cost_model.py's)
    config = SFIConfig(sink=2, recent=8, k_head=12, trigger="bootstrap", min_skip=0,
                       min_gain=1.0)
    run = lockstep(model, ids, config, steps=5)
    kinds = [k[0] for k in run.kinds]
    assert kinds == ["dense", "dense", "slow", "fast", "fast", "fast"]
    assert run.cache.stats().refresh_reasons["bootstrap"] == 1
    assert run.cache.stats().dense_steps == 1


def test_cache_keeps_every_token_and_grows_across_its_capacity():
    model = tiny_model("mistral")
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    # a budget that covers everything, so every layer's keys must equal the stock cache's
    config = SFIConfig(sink=2, recent=4, k_head=1000, force_sparse=True, trigger="fixed",
                       period=4)
    cache = SlowFastCache(model, config, max_cache_len=16)
    ref = DynamicCache(config=model.config)
    key = cache_argument(model)
    capacities = set()
    tokens = ids
    with torch.inference_mode():
        for _ in range(40):
            model(input_ids=tokens, **{key: cache}, use_cache=True)
            out = model(input_ids=tokens, **{key: ref}, use_cache=True)
            tokens = out.logits[:, -1:].argmax(-1)
            capacities.add(_layers(cache)[0].capacity)
    assert len(capacities) >= 2  # it grew (16 -> 32 -> 64)
    for layer, ref_layer in zip(_layers(cache), ref.layers):
        assert layer.keys.shape == ref_layer.keys.shape == (1, 3, 49, 16)
        torch.testing.assert_close(layer.keys, ref_layer.keys)
        torch.testing.assert_close(layer.values, ref_layer.values)
        torch.testing.assert_close(layer.key_norms, ref_layer.keys.norm(dim=-1))


def _poison_outside_memory(cache: SlowFastCache, layers: list[int] | None = None) -> None:
    """Overwrite every cached entry that is not sink, selected or recent with garbage (at
    ``layers``, by default every slow-fast layer)."""
    memory = cache.memory(0)
    for layer in _layers(cache):
        if layers is not None and layer.layer_idx not in layers:
            continue
        keep = torch.zeros(layer.keys.shape[:3], dtype=torch.bool)  # [B, H, T]
        keep[:, :, : memory.sink_count] = True
        keep[:, :, memory.recent_start:] = True
        chosen = cache.selected_positions(layer.layer_idx, 0)
        keep[0].scatter_(-1, chosen, True)
        garbage = torch.randn_like(layer.keys) * 50
        layer.keys[~keep] = garbage[~keep]
        layer.values[~keep] = garbage[~keep]


def _poison_run(poison_before_step: int, period: int, preset: str = "paper", **mechanisms):
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    config = SFIConfig.from_preset(preset, sink=3, recent=8, k_head=10, force_sparse=True,
                                   trigger="fixed", period=period, **mechanisms)
    clean = SlowFastCache(model, config)
    dirty = SlowFastCache(model, config)
    key = cache_argument(model)
    tokens = ids
    with torch.inference_mode():
        for step in range(poison_before_step + 1):
            if step == poison_before_step:
                _poison_outside_memory(dirty)
            a = model(input_ids=tokens, **{key: clean}, use_cache=True).logits[:, -1]
            b = model(input_ids=tokens, **{key: dirty}, use_cache=True).logits[:, -1]
            tokens = a.argmax(-1, keepdim=True)
    (kind,) = dirty.step_kinds()
    return kind, float((a - b).abs().max())


MECHANISMS = {"paper": {}, "pages, pins, hysteresis": dict(
    pool_kernel=5, page_size=4, pin_fraction=0.5, hysteresis=1.0, nms_strength=0.0),
    "default": dict(preset="default")}


@pytest.mark.parametrize("mechanisms", list(MECHANISMS.values()), ids=list(MECHANISMS))
def test_a_fast_step_reads_only_sink_selected_and_recent(mechanisms):
    kind, diff = _poison_run(poison_before_step=3, period=100, **mechanisms)
    assert kind == "fast"
    assert diff == 0.0


def test_a_slow_step_reads_everything():
    kind, diff = _poison_run(poison_before_step=3, period=3)
    assert kind == "slow"
    assert diff > 1e-2
