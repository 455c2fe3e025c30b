"""Repairing slow steps (``SFIConfig.repair_tokens``): a slow step first re-runs the positions
that sparse steps wrote (or that came after one) since the last repair, so that after it the
cache holds full attention's KV again."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import sfi
from sfi import SFIConfig, SlowFastCache
from sfi.decoding.decode_step import decode_one
from sfi.decoding.exact import ExactDecoder
from sfi.errors import SFIError
from sfi.hf.facts import cache_argument

SPARSE = dict(sink=2, recent=4, k_head=4, force_sparse=True, trigger="fixed", period=5,
              coverage_layers=0)


def _prefill(model, cache, ids, mask=None):
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    kwargs = {} if mask is None else dict(attention_mask=mask, position_ids=positions)
    out = model(input_ids=ids, use_cache=True, **{cache_argument(model): cache}, **kwargs)
    return out.logits[:, -1]


@torch.inference_mode()
def _teacher_forced(model, config: SFIConfig, ids: torch.Tensor, steps: int, seed: int = 3):
    """Decode ``steps`` random tokens through a SlowFastCache and a DynamicCache in lockstep:
    per step, both logits, row 0's kind, the largest KV difference over all layers and every
    row's kind."""
    cache, full = SlowFastCache(model, config), DynamicCache(config=model.config)
    _prefill(model, cache, ids)
    _prefill(model, full, ids)
    tokens = torch.randint(0, 256, (steps, ids.shape[0]),
                           generator=torch.Generator().manual_seed(seed))
    rows = []
    for step in range(steps):
        position = torch.full((ids.shape[0],), ids.shape[1] + step)
        a = decode_one(model, cache, tokens[step], position)
        b = decode_one(model, full, tokens[step], position)
        kv = max(float((mine.keys - theirs.keys).abs().max())
                 for mine, theirs in zip(cache.layers, full.layers))
        rows.append((a, b, cache.step_kinds()[0], kv, cache.step_kinds()))
    return rows, cache


def test_a_repairing_slow_step_leaves_full_attentions_kv():
    """After each slow step the whole cache equals full attention's and so does the slow
    step's output; without the repair the KV the fast steps wrote stays different (the
    check can fail)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    repaired, cache = _teacher_forced(model, SFIConfig(**SPARSE, repair_tokens=16), ids, 22)
    plain, _ = _teacher_forced(model, SFIConfig(**SPARSE), ids, 22)
    slow = [i for i, row in enumerate(repaired) if row[2] == "slow"]
    assert len(slow) >= 3 and [r[2] for r in plain] == [r[2] for r in repaired]
    for i in slow:
        a, b, _, kv, _ = repaired[i]
        assert kv < 1e-5, (i, kv)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert max(plain[i][3] for i in slow) > 1e-3  # the drift the repair removes
    assert max((plain[i][0] - plain[i][1]).abs().max() for i in slow) > 1e-3
    stats = cache.stats()
    fast_before = sum(1 for row in repaired[: slow[-1]] if row[2] == "fast")
    assert stats.repaired_tokens == fast_before  # each fast step's position re-run once
    assert stats.to_dict()["repaired_tokens"] == stats.repaired_tokens
    steps = stats.decode_steps
    reads = stats.fast_read_fraction * stats.fast_steps + stats.slow_steps + stats.dense_steps
    assert stats.read_fraction == pytest.approx(reads / steps)  # a block reads the KV once


def test_a_repair_longer_than_repair_tokens_re_runs_the_last_ones():
    """With a cap below the steps between slow steps, a slow step re-runs the cap's worth (the
    KV stays away from full attention's, the last positions closer)."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    rows, cache = _teacher_forced(model, SFIConfig(**SPARSE, repair_tokens=2), ids, 16)
    slow_after_fast = [i for i, row in enumerate(rows) if row[2] == "slow" and i > 0]
    assert slow_after_fast
    assert cache.stats().repaired_tokens == 2 * len(slow_after_fast)


def test_full_budget_with_repairs_generates_full_attentions_tokens(tiny_llama_with_tokenizer):
    """The invariant with repairs on: a budget covering the whole context is full attention
    (repaired blocks included)."""
    model, tok = tiny_llama_with_tokenizer
    prompt = "The cat sat on the mat. It was happy! Was it? " * 6
    full = sfi.generate(model, tok, prompt, max_new_tokens=24, mode="full")
    config = SFIConfig(sink=4, recent=8, k_head=4096, force_sparse=True, trigger="fixed",
                       period=6, repair_tokens=32)
    repaired = sfi.generate(model, tok, prompt, max_new_tokens=24, config=config)
    assert repaired.token_ids == full.token_ids
    assert repaired.stats.repaired_tokens > 0 and repaired.stats.fast_steps > 0


@torch.inference_mode()
def test_batched_repairs_equal_unbatched():
    """Two left-padded rows whose slow steps coincide (a fixed trigger): the batch's repair
    blocks give each row what it gives alone."""
    model = tiny_model("mistral")
    config = SFIConfig(**SPARSE, repair_tokens=16)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
               for n in (36, 30)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p])
                       for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long),
                                   torch.ones(len(p), dtype=torch.long)]) for p in prompts])
    tokens = torch.randint(0, 256, (14, 2), generator=torch.Generator().manual_seed(7))
    batch = SlowFastCache(model, config)
    _prefill(model, batch, ids, mask)
    alone = [SlowFastCache(model, config) for _ in prompts]
    for cache, p in zip(alone, prompts):
        _prefill(model, cache, p[None])
    kinds = []
    for step in range(tokens.shape[0]):
        mask = torch.cat([mask, mask.new_ones(2, 1)], dim=-1)
        position = mask.sum(-1) - 1
        together = decode_one(model, batch, tokens[step], position, mask)
        kinds.append(batch.step_kinds())
        for row, cache in enumerate(alone):
            own = decode_one(model, cache, tokens[step, row: row + 1], position[row: row + 1])
            torch.testing.assert_close(together[row], own[0], atol=2e-5, rtol=1e-5)
    assert ("slow", "slow") in kinds[1:] and batch.stats().repaired_tokens > 0


@pytest.mark.parametrize("seed", [4, 5, 6, 7])
def test_rows_refreshing_at_different_steps_are_all_repaired(seed):
    """Rows whose slow steps differ (seeded random triggers): at a repair every row re-runs
    the block, the fast ones reading densely (``lagged``), and every row's KV and logits are
    full attention's after it: the block is the longest drift of any row (each began after
    the last repair), whichever row's step is slow."""
    model = tiny_model("qwen3")
    config = SFIConfig(sink=2, recent=16, k_head=4, force_sparse=True, coverage_layers=0,
                       trigger="random", random_period_min=2, random_period_max=5,
                       repair_tokens=16)
    config = config.replace(seed=seed)
    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(seed))
    rows, cache = _teacher_forced(model, config, ids, 20)
    mixed = [i for i, (_, _, _, _, kinds) in enumerate(rows) if {"slow", "lagged"} <= set(kinds)]
    assert mixed, [r[4] for r in rows]
    for i, (a, b, _, kv, kinds) in enumerate(rows):
        # a repair ran (a fast row read densely), or every row refreshed (with nothing drifted
        # or repaired); a row refreshing alone with nothing drifted repairs nothing
        if "lagged" in kinds or set(kinds) == {"slow"}:
            assert kv < 1e-5, (i, kinds, kv)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert cache.stats(0).repaired_tokens == cache.stats(2).repaired_tokens > 0


@torch.inference_mode()
def test_a_prompts_last_tokens_are_kept_for_repairs():
    """A prefilled row keeps its prompt's last real tokens (none of its padding), so that a
    row joining a batch does not shorten the batch's repairs."""
    model = tiny_model("llama")
    cache = SlowFastCache(model, SFIConfig(**SPARSE, repair_tokens=6))
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1: three real tokens
    _prefill(model, cache, ids, mask)
    assert cache.planner.sequences[0].inputs == ids[0, -6:].tolist()
    assert cache.planner.sequences[1].inputs == ids[1, -3:].tolist()


def test_repairs_are_refused_where_they_cannot_run():
    model = tiny_model("llama")
    cache = SlowFastCache(model, SFIConfig(trigger="fixed", repair_tokens=8))
    with pytest.raises(SFIError, match="exact mode's verify writes full attention's KV"):
        ExactDecoder(model, cache)
    cache.close()
    with pytest.raises(sfi.SFIConfigError, match="repair_tokens must be"):
        SFIConfig(repair_tokens=-1)
    with pytest.raises(sfi.SFIConfigError, match="repair_tokens and coverage_retry cannot"):
        SFIConfig(repair_tokens=8, coverage_retry=True)
    with pytest.raises(sfi.SFIConfigError, match="repair_tokens and retry_margin cannot"):
        SFIConfig(repair_tokens=8, retry_margin=0.1)
    with pytest.raises(sfi.SFIConfigError, match="retry_margin must be <= 1"):
        SFIConfig(retry_margin=1.5)


@torch.inference_mode()
def test_a_slow_step_outside_sfis_loops_says_it_did_not_repair(caplog, monkeypatch):
    from sfi import notices

    monkeypatch.setattr(notices, "_said", set())
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = SlowFastCache(model, SFIConfig(**SPARSE, repair_tokens=16))
    _prefill(model, cache, ids)
    key = cache_argument(model)
    with caplog.at_level(logging.WARNING, logger="sfi"):
        for step in range(8):  # model calls of its own, as model.generate makes
            model(input_ids=torch.tensor([[step + 1]]), use_cache=True, **{key: cache})
    assert cache.stats().slow_steps > 0
    assert cache.stats().repaired_tokens == 0
    assert any("without re-running the positions" in r.message for r in caplog.records)


def test_a_slow_row_refreshes_at_its_own_sparse_layers_whatever_other_rows_read():
    """A repairing step's block refreshes a slow row at every layer past its own
    ``dense_layers``, even where a fast row of the batch with more dense layers reads densely."""
    from types import SimpleNamespace

    from sfi.core.sequence_policy import FAST, SLOW
    from sfi.hf.plan import REPAIR, StepPlan

    plan = StepPlan(query_length=4, total_length=100, decode=True, kinds=(SLOW, FAST),
                    reasons=("sentence", None), tokens=(1, 2), dense=None,
                    slow=SimpleNamespace(rows=SimpleNamespace(indices=(0,))), fast=None,
                    pad_bias=None, compact_width=8, dense_layers=(0, 2), phase=REPAIR)
    assert [plan.selects_at(layer) for layer in range(3)] == [True, True, True]
    late = dataclasses.replace(plan, dense_layers=(2, 0))
    assert [late.selects_at(layer) for layer in range(3)] == [False, False, True]
    assert not dataclasses.replace(plan, slow=None).selects_at(0)
