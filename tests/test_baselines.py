"""Eviction baselines and their scorers, each against a transcription of its rule
(``docs/method.md``, the baselines), and the masked cache's invariants on tiny models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from sfi import SFIConfig
from sfi.core.scorers import Evidence
from sfi.core.scorers.h2o import H2OScorer
from sfi.core.scorers.quest import QuestScorer
from sfi.core.scorers.recency import RecencyScorer
from sfi.core.scorers.registry import make_scorer
from sfi.errors import SFIError
from sfi.hf.eviction import EvictionCache, make_policy
from sfi.hf.eviction.policies import H2O, TOVA, PyramidKV, Quest, SnapKV, StreamingLLM
from sfi.hf.facts import cache_argument

gen = torch.Generator().manual_seed(0)


def fake_layer(b=1, h=2, t=40, d=8, layer_idx=0, layers=4, history=False):
    return SimpleNamespace(
        length=t, keep=torch.ones(b, h, t, dtype=torch.bool),
        keys=torch.randn(b, h, t, d, generator=gen), layer_idx=layer_idx,
        num_layers=layers,
        history=torch.rand(b, h, t, generator=gen) if history else None)


def window_evidence(layer, g=2, w=4):
    """Evidence of the last ``w`` queries of ``g`` query heads per KV head, causal."""
    b, h, t, d = layer.keys.shape
    logits = torch.randn(b, h, g, w, t, generator=gen)
    causal = torch.arange(t)[None, :] > torch.arange(t - w, t)[:, None]
    logits = logits.masked_fill(causal, float("-inf")).reshape(b, h, g * w, t)
    return Evidence(logits=logits, key_norms=layer.keys.norm(dim=-1),
                    candidates=(torch.arange(t) < t - w).expand(b, t),
                    lo=torch.zeros(b), hi=torch.full((b,), t - w), layer_idx=layer.layer_idx,
                    queries=w, query=torch.randn(b, h, g * w, d, generator=gen), keys=layer.keys)


def kept(layer, b=0, h=0) -> set[int]:
    return set(torch.nonzero(layer.keep[b, h]).flatten().tolist())


def test_streamingllm_keeps_sinks_and_a_sliding_window():
    layer = fake_layer(t=40)
    policy = StreamingLLM(capacity=12, sink=4)
    policy.after_prefill(layer, None)
    assert kept(layer) == set(range(4)) | set(range(32, 40))
    layer.length, layer.keep = 41, torch.cat([layer.keep, torch.ones(1, 2, 1, dtype=bool)], -1)
    policy.after_step(layer, torch.rand(1, 2, 2, 41))
    assert kept(layer) == set(range(4)) | set(range(33, 41))


def snapkv_reference(ev: Evidence, kernel: int, keep: int, h: int) -> set[int]:
    """SnapKV by hand: mean attention over the window rows, average-pooled with the kernel
    (windows clipped at the edges), top ``keep`` before the window, plus the window."""
    attention = torch.softmax(ev.logits[0, h], dim=-1)  # [rows, T]
    s = attention.mean(dim=0)
    t, w = s.shape[0], ev.queries
    pooled = [s[max(0, j - kernel // 2): j + kernel // 2 + 1].mean() for j in range(t)]
    ranked = sorted(range(t - w), key=lambda j: -float(pooled[j]))
    return set(ranked[:keep]) | set(range(t - w, t))


def test_snapkv_matches_its_rule():
    layer = fake_layer(t=60)
    ev = window_evidence(layer, w=4)
    SnapKV(capacity=20, window=4).after_prefill(layer, ev)
    for h in range(2):
        assert kept(layer, h=h) == snapkv_reference(ev, 5, 16, h)


def test_snapkv_keeps_everything_that_fits():
    layer = fake_layer(t=30)
    SnapKV(capacity=30, window=4).after_prefill(layer, window_evidence(layer, w=4))
    assert bool(layer.keep.all())


def test_pyramidkv_budgets_shrink_with_depth_and_fall_back_to_snapkv():
    policy = PyramidKV(capacity=132, window=32, beta=20)  # C - w = 100: min 5, max 195
    budgets = [policy.layer_budget(fake_layer(layer_idx=i, layers=4), 1000) for i in range(4)]
    assert budgets == [195, 195 - 190 // 3, 195 - 2 * 190 // 3, 5]
    assert policy.layer_budget(fake_layer(layer_idx=3, layers=4), 200) == 100  # no room
    layer = fake_layer(t=300, layer_idx=3, layers=4)
    ev = window_evidence(layer, w=32)
    policy.after_prefill(layer, ev)
    assert kept(layer) == snapkv_reference(ev, 5, 5, 0)


def test_h2o_heavy_hitters_plus_recent_then_evicts_the_lightest():
    layer = fake_layer(t=40, history=True)
    policy = H2O(capacity=10)
    policy.after_prefill(layer, None)
    for h in range(2):
        hist = layer.history[0, h]
        heavy = sorted(range(35), key=lambda j: -float(hist[j]))[:5]
        assert kept(layer, h=h) == set(heavy) | set(range(35, 40))
    # one decode step: a token joins, the lightest older token goes
    layer.length = 41
    layer.keep = torch.cat([layer.keep, torch.ones(1, 2, 1, dtype=bool)], -1)
    layer.history = torch.cat([layer.history, torch.zeros(1, 2, 1)], -1)
    before = [kept(layer, h=h) for h in range(2)]
    policy.after_step(layer, torch.rand(1, 2, 2, 41))
    for h in range(2):
        candidates = [j for j in before[h] if j < 41 - 5]
        lightest = min(candidates, key=lambda j: float(layer.history[0, h, j]))
        assert kept(layer, h=h) == before[h] - {lightest}
        assert len(kept(layer, h=h)) == 10


def test_tova_shares_one_choice_per_layer_and_never_drops_the_newest():
    layer = fake_layer(t=30)
    ev = window_evidence(layer, g=2, w=3)
    TOVA(capacity=8).after_prefill(layer, ev)
    attention = torch.softmax(ev.logits[0].reshape(2, 2, 3, 30)[:, :, -1], dim=-1)  # [H, G, T]
    score = attention.mean(dim=(0, 1))
    assert kept(layer, h=0) == kept(layer, h=1) == set(torch.topk(score, 8).indices.tolist())
    layer.length = 31
    layer.keep = torch.cat([layer.keep, torch.ones(1, 2, 1, dtype=bool)], -1)
    step = torch.rand(1, 2, 2, 31)
    step[..., 30] = 0.0  # the newest token is the least attended, and still stays
    before = kept(layer)
    TOVA(capacity=8).after_step(layer, step)
    mean = step.mean(dim=(1, 2))[0]
    lowest = min((j for j in before if j != 30), key=lambda j: float(mean[j]))
    assert kept(layer) == (before | {30}) - {lowest} and kept(layer, h=1) == kept(layer)


def quest_bound(q: torch.Tensor, keys: torch.Tensor, page: int) -> list[float]:
    """Quest's page bound by hand for one KV head: sum over query heads and dims of
    max(q_d min_d, q_d max_d) over each page's keys."""
    bounds = []
    for start in range(0, keys.shape[0], page):
        block = keys[start:start + page]
        low, high = block.min(dim=0).values, block.max(dim=0).values
        bounds.append(float(sum(torch.maximum(qh * low, qh * high).sum() for qh in q)))
    return bounds


def test_quest_reads_the_top_pages_by_its_bound_plus_the_current_one():
    layer = fake_layer(t=70, layer_idx=2)
    q = torch.randn(1, 2, 3, 8, generator=gen)
    mask = Quest(capacity=32, page=16).step_mask(layer, q)
    for h in range(2):
        bounds = quest_bound(q[0, h], layer.keys[0, h], 16)
        pages = [*sorted(range(len(bounds) - 1), key=lambda p: -bounds[p])[:1], len(bounds) - 1]
        expected = {j for p in pages for j in range(p * 16, min(70, p * 16 + 16))}
        assert set(torch.nonzero(mask[0, h]).flatten().tolist()) == expected
    assert Quest(capacity=32).step_mask(fake_layer(t=70, layer_idx=1), q) is None  # dense
    assert Quest(capacity=100).step_mask(layer, q) is None  # everything fits


def test_quest_bound_is_an_upper_bound_and_the_scorer_spreads_it_over_pages():
    layer = fake_layer(t=50)
    ev = window_evidence(layer, g=3, w=2)
    scores = QuestScorer(page=16).score(ev)  # [B, H, T]
    last = ev.query[0].reshape(2, 3, 2, 8)[:, :, -1]  # [H, G, D]
    for h in range(2):
        bounds = quest_bound(last[h], layer.keys[0, h], 16)
        expected = torch.tensor([bounds[j // 16] for j in range(50)])
        assert torch.allclose(scores[0, h], expected, atol=1e-4)
        for g in range(3):  # each head's own bound holds for every key in the page
            dots = layer.keys[0, h] @ last[h, g]
            single = quest_bound(last[h, g:g + 1], layer.keys[0, h], 16)
            assert all(float(dots[j]) <= single[j // 16] + 1e-5 for j in range(50))


def test_h2o_and_recency_scorers():
    layer = fake_layer(t=20, history=True)
    ev = window_evidence(layer, g=2, w=3)
    summed = torch.softmax(ev.logits, dim=-1).sum(dim=-2)
    assert torch.allclose(H2OScorer().score(ev), summed, atol=1e-6)
    with_history = Evidence(**{**ev.__dict__, "history": layer.history})
    assert torch.allclose(H2OScorer().score(with_history), summed + layer.history, atol=1e-6)
    recency = RecencyScorer().score(ev)
    assert bool((recency[..., 1:] > recency[..., :-1]).all())


def test_pyramidkv_is_not_an_sfi_scorer_and_unknown_names_fail():
    with pytest.raises(SFIError, match="its own budget"):
        make_scorer("pyramidkv", SFIConfig())
    with pytest.raises(SFIError, match="unknown eviction baseline"):
        make_policy("lru", 10)
    with pytest.raises(SFIError, match="at least 1 token"):
        make_policy("snapkv", 0)


@torch.inference_mode()
def _decode_logits(model, cache, ids, steps=6):
    key = cache_argument(model)
    out = model(input_ids=ids, use_cache=True, **{key: cache})
    logits, token = [out.logits[:, -1]], out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps):
        position = torch.tensor([[ids.shape[1] + i]])
        out = model(input_ids=token, position_ids=position, use_cache=True, **{key: cache})
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(logits)


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "pyramidkv", "h2o", "tova", "quest"])
def test_a_budget_that_covers_everything_is_full_attention(name):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    full = _decode_logits(model, EvictionCache(model, None), ids)
    from transformers import DynamicCache

    reference = _decode_logits(model, DynamicCache(config=model.config), ids)
    assert torch.allclose(full, reference, atol=1e-4)
    cache = EvictionCache(model, make_policy(name, 1000))
    assert torch.allclose(_decode_logits(model, cache, ids), reference, atol=1e-4)
    assert cache.retention() == 1.0


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "pyramidkv", "h2o", "tova"])
def test_evicted_entries_are_never_read_again(name):
    """Poison every evicted key and value: the next steps' logits do not change."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(2))
    clean = EvictionCache(model, make_policy(name, 40))
    clean_logits = _decode_logits(model, clean, ids, steps=1)
    poisoned = EvictionCache(model, make_policy(name, 40))
    key = cache_argument(model)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{key: poisoned})
        for layer in poisoned.layers:
            gone = ~layer.keep[..., None]
            layer.keys.masked_fill_(gone, 1e4)
            layer.values.masked_fill_(gone, -1e4)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        step = model(input_ids=token, position_ids=torch.tensor([[120]]), use_cache=True,
                     **{key: poisoned}).logits[:, -1]
    assert not bool(poisoned.layers[0].keep.all())
    assert torch.allclose(step, clean_logits[1], atol=1e-4)
    assert 0.3 < poisoned.retention() < 0.36  # 40 of 121 tokens
