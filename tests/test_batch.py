"""A left-padded batch decodes each sequence as if it were alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from helpers import lockstep

import sfi
from sfi import SFIConfig
from sfi.hf.slab import SlabLayer

CONFIG = dict(sink=3, recent=8, k_head=10, force_sparse=True)


def _padded(a: torch.Tensor, b: torch.Tensor):
    width = max(a.shape[1], b.shape[1])
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, seq in enumerate((a, b)):
        ids[row, width - seq.shape[1]:] = seq[0]
        mask[row, width - seq.shape[1]:] = 1
    return ids, mask


def test_batched_logits_equal_unbatched_with_different_refresh_steps():
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 256, (1, 70), generator=g), torch.randint(1, 256, (1, 45),
                                                                               generator=g)
    ids, mask = _padded(long, short)
    # the paper preset: refreshes come from the random trigger alone (no coverage refresh)
    config = SFIConfig.paper(**CONFIG, trigger="random", random_period_min=2,
                             random_period_max=6)
    batch = lockstep(model, ids, config, steps=20, attention_mask=mask)
    kinds = batch.kinds
    assert any(k[0] != k[1] for k in kinds), "the rows should refresh at different steps"
    assert any(k == ["fast", "slow"] or k == ["slow", "fast"] for k in kinds)
    # each row alone, fed the tokens the batch's full-attention reference chose for it
    for row, prompt in enumerate((long, short)):
        config_row = SFIConfig.paper(**CONFIG, trigger="random", random_period_min=2,
                                     random_period_max=6, seed=0)
        alone = _alone(model, prompt, batch, row, config_row)
        for step, (a, b) in enumerate(zip(alone.logits, batch.sfi_logits)):
            torch.testing.assert_close(a[0], b[row], atol=2e-5, rtol=1e-5,
                                       msg=f"row {row} step {step}")


@pytest.mark.parametrize("gap, probe, threshold", [
    (1, {}, 0.4), (2, {}, 0.4), (1, {"coverage_next": True}, 0.45),
    (1, {"coverage_copy": 0.2}, 1.0)])
def test_a_step_done_again_for_some_rows_leaves_each_row_as_alone(gap, probe, threshold):
    """coverage_retry runs a step again when a row's probes flag it: the batch's other rows
    (fast, or slow with their refresh done already) give their own logits in that pass, and
    the flagged row what it gives alone; a row flagged before its coverage refresh is due
    (``coverage_gap`` 2) keeps its flag through another row's redo. With ``coverage_next``
    the padded row's next pages are its own (they flag more: a higher ``threshold`` leaves
    the rows' steps apart); with ``coverage_copy`` alone (pages never flag) each row's copy
    flags are its own, and no step is done again."""
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 256, (1, 70), generator=g), torch.randint(1, 256, (1, 45),
                                                                               generator=g)
    ids, mask = _padded(long, short)
    retry = dict(CONFIG, trigger="random", random_period_min=3, random_period_max=8,
                 page_size=4, coverage_layers=2, coverage_threshold=threshold,
                 coverage_gap=gap, coverage_retry=True, **probe)
    batch = lockstep(model, ids, SFIConfig(**retry), steps=20, attention_mask=mask)
    assert any(k[0] != k[1] for k in batch.kinds)
    reasons = [batch.cache.stats(row).refresh_reasons for row in (0, 1)]
    flags = 1 if "coverage_copy" in probe else 2  # copies are fewer than misses
    assert all(r["coverage"] >= flags for r in reasons) and reasons[1]["period"] >= 1, reasons
    for row, prompt in enumerate((long, short)):
        alone = _alone(model, prompt, batch, row, SFIConfig(**retry, seed=0))
        assert alone.cache.stats().refresh_reasons == reasons[row]
        for step, (a, b) in enumerate(zip(alone.logits, batch.sfi_logits)):
            torch.testing.assert_close(a[0], b[row], atol=2e-5, rtol=1e-5,
                                       msg=f"row {row} step {step}")


def test_a_step_done_again_for_its_margin_leaves_each_row_as_alone():
    """retry_margin runs a step again for the rows whose next token was uncertain: in a
    padded batch each row's steps, logits and refresh reasons are those it has alone, and the
    rows are done again at different steps."""
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 256, (1, 70), generator=g), torch.randint(1, 256, (1, 45),
                                                                               generator=g)
    ids, mask = _padded(long, short)
    config = SFIConfig(**CONFIG, trigger="fixed", period=50, coverage_layers=0,
                       retry_margin=0.00025)  # the tiny model is near uniform
    batch = lockstep(model, ids, config, steps=20, attention_mask=mask)
    assert any(k[0] != k[1] for k in batch.kinds)
    reasons = [batch.cache.stats(row).refresh_reasons for row in (0, 1)]
    assert all(r["margin"] >= 1 for r in reasons), reasons
    for row, prompt in enumerate((long, short)):
        alone = _alone(model, prompt, batch, row, config)
        assert alone.cache.stats().refresh_reasons == reasons[row]
        for step, (a, b) in enumerate(zip(alone.logits, batch.sfi_logits)):
            torch.testing.assert_close(a[0], b[row], atol=2e-5, rtol=1e-5,
                                       msg=f"row {row} step {step}")


@pytest.mark.parametrize("scorer", ["sfi", "quest"])
def test_pages_start_at_each_sequence_so_padding_changes_nothing(scorer):
    """The default preset cuts the cache into pages (paged selection, Quest, the coverage
    probes' summaries). A row padded by 25 positions (not a multiple of the 16-token page)
    must be cut into the pages it gets alone: every step's logits, the selection and the
    coverage refreshes equal those of the row decoded alone."""
    from sfi.core.scorers.registry import make_scorer

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(9)
    long, short = torch.randint(1, 256, (1, 70), generator=g), torch.randint(1, 256, (1, 45),
                                                                               generator=g)
    ids, mask = _padded(long, short)
    config = SFIConfig(**CONFIG, trigger="fixed", period=7, coverage_threshold=0.02)
    assert config.page_size == 16 and config.coverage_layers > 0
    batch = lockstep(model, ids, config, steps=16, attention_mask=mask,
                     scorer=make_scorer(scorer, config))
    assert batch.cache.padding(1) == 25
    reasons = batch.cache.stats(1).refresh_reasons
    for row, prompt in enumerate((long, short)):
        alone = _alone(model, prompt, batch, row, config, make_scorer(scorer, config))
        for step, (a, b) in enumerate(zip(alone.logits, batch.sfi_logits)):
            torch.testing.assert_close(a[0], b[row], atol=2e-5, rtol=1e-5,
                                       msg=f"row {row} step {step}")
        assert alone.cache.stats(0).to_dict() == batch.cache.stats(row).to_dict()
    assert reasons.get("coverage", 0) > 0, "the probes should refresh the padded row"


def _alone(model, prompt, batch, row, config, scorer=None):
    """Decode ``prompt`` alone, feeding the tokens the batch fed to ``row``; its random trigger
    is seeded like the batch's row ``row``."""
    from sfi import SlowFastCache
    from sfi.core.triggers import make_trigger
    from sfi.hf.facts import cache_argument

    cache = SlowFastCache(model, config, scorer=scorer,
                          trigger_factory=lambda cfg, _: make_trigger(cfg, None, row))
    key = cache_argument(model)
    out, tokens = [], prompt
    position = torch.arange(prompt.shape[1])[None]
    with torch.inference_mode():
        for step in range(len(batch.sfi_logits)):
            out.append(model(input_ids=tokens, position_ids=position, use_cache=True,
                             **{key: cache}).logits[:, -1])
            tokens = batch.full_logits[step][row].argmax(-1).view(1, 1)
            position = position[:, -1:] + 1
    return SimpleNamespace(logits=out, cache=cache)


def test_padding_is_never_a_sink_nor_selected():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    ids, mask = _padded(torch.randint(1, 256, (1, 60), generator=g),
                        torch.randint(1, 256, (1, 30), generator=g))
    run = lockstep(model, ids, SFIConfig(**CONFIG, trigger="fixed", period=4), steps=6,
                   attention_mask=mask)
    cache = run.cache
    pad = cache.padding(1)
    assert pad == 30
    for layer in cache.layers:
        assert isinstance(layer, SlabLayer)
        chosen = cache.selected_positions(layer.layer_idx, 1)
        assert bool((chosen >= pad + 3).all())
        sinks = layer.compact_keys[1, :, :3]
        torch.testing.assert_close(sinks, layer.keys[1, :, pad: pad + 3])


def test_generate_batch_equals_each_prompt_alone(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    prompts = ["A long first prompt. It goes on! And on? Yes. " * 5, "Short one. Really."]
    config = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, min_refresh_gap=2)
    together = sfi.generate(model, tok, prompts, config=config, max_new_tokens=16)
    for prompt, batched in zip(prompts, together):
        alone = sfi.generate(model, tok, prompt, config=config, max_new_tokens=16)
        assert alone.token_ids == batched.token_ids
        assert alone.stats.to_dict() == batched.stats.to_dict()
