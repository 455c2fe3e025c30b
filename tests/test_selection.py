"""The retrieval-safe selection mechanisms, each against a direct transcription of its rule:
pooled evidence, whole pages, a pinned set that survives refreshes, hysteresis."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from helpers import lockstep

from sfi import SFIConfig, SFIConfigError, SFIError, SlowFastCache
from sfi.core.selector import (
    hysteresis_keep,
    pool_positions,
    selection_order,
    top_k_positions,
)

gen = torch.Generator().manual_seed(3)


def _candidates(b: int, t: int, lo: int, hi: int) -> torch.Tensor:
    c = torch.zeros(b, t, dtype=torch.bool)
    c[:, lo:hi] = True
    return c


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("kernel", [3, 9])
def test_pooling_is_a_window_max_or_mean_renormalised(mode, kernel):
    b, h, t = 2, 3, 40
    cand = _candidates(b, t, 4, 33)
    f = torch.rand(b, h, t, generator=gen) * cand[:, None]
    f = f / f.sum(-1, keepdim=True)
    got = pool_positions(f, cand, kernel, mode)
    want = torch.zeros_like(f)
    for i in range(t):
        window = f[..., max(0, i - kernel // 2): i + kernel // 2 + 1]
        want[..., i] = window.amax(-1) if mode == "max" else window.mean(-1)
    want = want * cand[:, None]
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(got, want)


def test_pooling_lifts_the_neighbours_of_a_peak():
    t = 30
    cand = _candidates(1, t, 0, t)
    f = torch.full((1, 1, t), 0.01)
    f[0, 0, 15] = 1.0
    pooled = pool_positions(f / f.sum(), cand, 5, "max")
    assert bool((pooled[0, 0, 13:18] == pooled[0, 0, 15]).all())
    assert float(pooled[0, 0, 12]) < float(pooled[0, 0, 13])


@pytest.mark.parametrize("seed", range(5))
def test_pages_come_whole_and_rank_by_their_best_token(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, t, page = 2, 4, 200, 16
    lo, hi = 5, 180
    cand = _candidates(b, t, lo, hi)
    scores = torch.randn(b, h, t, generator=g)
    k = torch.tensor([64, 40])
    chosen, _ = top_k_positions(scores, cand, k, page=page)
    for row in range(b):
        for head in range(h):
            got = chosen[row, head, : int(k[row])].tolist()
            assert len(set(got)) == len(got) and all(lo <= p < hi for p in got)
            pages = {}
            for p in got:
                pages.setdefault(p // page, []).append(p)
            partial = [pg for pg, members in pages.items()
                       if len(members) < len(range(max(lo, pg * page), min(hi, pg * page + page)))]
            assert len(partial) <= 1  # whole pages, but for the last one taken
            # the pages taken are the best by their best candidate
            best = {}
            for pg in range((hi - 1) // page + 1):
                span = range(max(lo, pg * page), min(hi, (pg + 1) * page))
                if len(span):
                    best[pg] = max(float(scores[row, head, p]) for p in span)
            ranked = sorted(best, key=lambda pg: -best[pg])
            whole = [pg for pg in pages if pg not in partial]
            assert set(whole) == set(ranked[: len(whole)])
            if partial:
                assert partial[0] == ranked[len(whole)]


def test_kept_positions_come_first_even_when_they_rank_last():
    b, h, t = 1, 2, 60
    cand = _candidates(b, t, 0, t)
    scores = torch.arange(t, dtype=torch.float32).expand(b, h, t).clone()  # later is better
    keep = torch.zeros(b, h, t, dtype=torch.bool)
    keep[..., [0, 1, 2]] = True
    order, _ = selection_order(scores, cand, torch.tensor([5]), keep=keep)
    assert order[0, 0].tolist() == [2, 1, 0, 59, 58]


def test_hysteresis_keeps_what_still_ranks_within_the_wider_top():
    b, h, t, k = 1, 1, 100, 10
    cand = _candidates(b, t, 0, t)
    scores = torch.arange(t, dtype=torch.float32).flip(0).expand(b, h, t).clone()  # 0 is best
    previous = torch.zeros(b, h, t, dtype=torch.bool)
    previous[..., [12, 19, 25, 60]] = True  # ranks 12, 19, 25 and 60
    kept = hysteresis_keep(scores, cand, torch.tensor([k]), previous, hysteresis=1.0)
    assert torch.nonzero(kept[0, 0]).flatten().tolist() == [12, 19]  # within the top 2K = 20
    chosen, _ = top_k_positions(scores, cand, torch.tensor([k]), keep=kept)
    assert chosen[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 19]


def test_a_refresh_keeps_pins_only_of_rows_that_had_a_memory():
    """``selection_inputs`` (both engines' refresh inputs): of each row's old selection (held
    in slots ``[start, start + count)``), the new memory's ``pinned`` first are kept pinned,
    none where the row had no memory (``count`` 0); hysteresis sees the whole old selection;
    without pins or hysteresis nothing is kept."""
    from sfi.core.refresh_selection import HeldSelection, selection_inputs

    n, h, t = 2, 2, 12
    logits = torch.randn(n, h, 1, t)
    norms = torch.rand(n, h, t)
    lo, hi = torch.tensor([2, 2]), torch.tensor([10, 10])
    positions = torch.tensor([[0, 5, 7, 9], [0, 3, 4, 6]])[:, None].expand(n, h, 4)
    held = HeldSelection(positions, start=torch.tensor([1, 1]), count=torch.tensor([3, 0]))
    pinned = torch.tensor([2, 2])
    evidence, previous = selection_inputs(logits, 0, lo, hi, pinned, key_norms=norms,
                                          held=held, hysteresis=True)
    assert evidence.candidates[0].tolist() == [2 <= p < 10 for p in range(t)]
    assert torch.nonzero(previous.pinned[0, 0]).flatten().tolist() == [5, 7]
    assert not previous.pinned[1].any()  # no memory before: nothing pinned
    assert torch.nonzero(previous.selected[0, 1]).flatten().tolist() == [5, 7, 9]
    assert not previous.selected[1].any()
    _, none = selection_inputs(logits, 0, lo, hi, torch.tensor([0, 0]), key_norms=norms,
                               held=held)
    assert none is None
    _, unheld = selection_inputs(logits, 0, lo, hi, pinned, key_norms=norms)
    assert unheld is None


MECHANISMS = dict(pool_kernel=5, page_size=8, pin_fraction=0.5, hysteresis=1.0, nms_strength=0.0,
                  dense_layers=1)


def test_pinned_positions_survive_every_refresh():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(8))
    config = SFIConfig(sink=2, recent=8, k_head=32, force_sparse=True, trigger="fixed", period=2,
                       **MECHANISMS)
    run = lockstep(model, ids, config, steps=1)
    sparse = [layer for layer in range(len(run.cache.layers))
              if not run.cache.reads_densely(layer, 0)]
    assert sparse == [1]  # the first layer is dense
    pinned = {layer: run.cache.selected_positions(layer, 0)[:, :16].clone() for layer in sparse}
    assert run.cache.memory(0).pinned == 16
    # keep decoding: the cache refreshes every other step from one query's evidence
    from sfi.hf.facts import cache_argument

    key, token = cache_argument(model), run.full_logits[-1].argmax(-1, keepdim=True)
    position = torch.tensor([[ids.shape[1] + 1]])
    refreshes = 0
    with torch.inference_mode():
        for _ in range(12):
            out = model(input_ids=token, position_ids=position, use_cache=True,
                        **{key: run.cache})
            refreshes += run.cache.step_kinds() == ("slow",)
            token, position = out.logits[:, -1:].argmax(-1), position + 1
    assert refreshes >= 5
    for layer, before in pinned.items():
        now = run.cache.selected_positions(layer, 0)
        assert torch.equal(now[:, :16], before)  # still held, in the same (pinned) slots
        assert now.shape[-1] == 32


def test_every_mechanism_keeps_full_budget_exact():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    config = SFIConfig(sink=4, recent=8, k_head=4096, force_sparse=True, trigger="fixed",
                       period=4, **MECHANISMS)
    run = lockstep(model, ids, config, steps=16)
    kinds = [k[0] for k in run.kinds]
    assert kinds.count("fast") >= 10 and kinds.count("slow") >= 3
    for step, (a, b) in enumerate(zip(run.sfi_logits, run.full_logits)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {step}")


def test_dense_layers_read_everything_and_count_in_the_read_fraction():
    from test_cache import _poison_outside_memory

    from sfi.hf.facts import cache_argument

    model = tiny_model("llama")  # two layers: the first dense, the second slow-fast
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    config = SFIConfig(sink=3, recent=8, k_head=10, force_sparse=True, trigger="fixed",
                       period=100, dense_layers=1)
    key = cache_argument(model)
    results = {}
    for poison in ("none", "sparse layer", "dense layer"):
        from sfi import SlowFastCache

        cache = SlowFastCache(model, config)
        tokens = ids
        with torch.inference_mode():
            for step in range(4):
                if step == 3 and poison == "sparse layer":
                    _poison_outside_memory(cache, layers=[1])
                elif step == 3 and poison == "dense layer":  # neither sink nor recent there
                    keys = cache.layers[0].keys
                    keys[:, :, 10:60] = torch.randn_like(keys[:, :, 10:60]) * 50
                logits = model(input_ids=tokens, use_cache=True, **{key: cache}).logits[:, -1]
                tokens = logits.argmax(-1, keepdim=True)
        results[poison] = logits
        assert cache.step_kinds() == ("fast",) and cache.reads_densely(0, 0)
    assert torch.equal(results["none"], results["sparse layer"])  # layer 1 is sparse
    assert float((results["none"] - results["dense layer"]).abs().max()) > 1e-3  # layer 0 not
    stats = cache.stats()
    memory = cache.memory(0)
    sparse = memory.read(ids.shape[1] + 3) / (ids.shape[1] + 3)
    assert stats.fast_read_fraction > (1 + sparse) / 2 - 0.05  # half the layers read it all


def test_page_summaries_follow_the_cache_as_it_grows():
    from sfi.core.pages import page_bounds

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(5))
    run = lockstep(model, ids, SFIConfig(sink=2, recent=4, k_head=8, force_sparse=True,
                                         trigger="fixed", period=3), steps=1)
    layer = run.cache.layers[1]
    first = [t.clone() for t in layer.page_summaries(8)]
    from sfi.hf.facts import cache_argument

    token = run.full_logits[-1].argmax(-1, keepdim=True)
    with torch.inference_mode():
        for position in range(39, 52):  # crosses page boundaries
            model(input_ids=token, position_ids=torch.tensor([[position]]), use_cache=True,
                  **{cache_argument(model): run.cache})
            low, high = layer.page_summaries(8)
            want_low, want_high = page_bounds(layer.keys, 8)
            assert torch.equal(low, want_low) and torch.equal(high, want_high)
    assert first[0].shape[2] == 5 and low.shape[2] == 7


def _every_memory_flagged(rows: int, retry: bool, **more):
    """Ten lockstep steps of ``rows`` sequences of a tiny Llama whose coverage probes flag
    every fast memory (threshold 0, a refresh allowed at every step)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (rows, 80), generator=torch.Generator().manual_seed(3))
    config = SFIConfig(sink=2, recent=4, k_head=6, force_sparse=True, trigger="fixed",
                       period=50, page_size=4, coverage_layers=2, coverage_threshold=0.0,
                       coverage_gap=1, coverage_retry=retry, **more)
    return lockstep(model, ids, config, steps=10)


@pytest.mark.parametrize("retry", [False, True])
def test_coverage_retry_takes_the_flagged_step_densely(retry):
    """With probes that flag every fast memory, a flagged step refreshes at the next step; with
    coverage_retry the flagged step itself is done again as its slow step, so every step is
    full attention's, and the cache holds each position once."""
    run = _every_memory_flagged(1, retry)
    kinds = [k[0] for k in run.kinds]
    assert run.cache.get_seq_length() == run.reference.get_seq_length() == 90
    coverage = run.cache.stats().refresh_reasons["coverage"]
    if retry:
        assert kinds == ["slow"] * 11 and coverage == 10
        for step, (a, b) in enumerate(zip(run.sfi_logits, run.full_logits)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {step}")
    else:
        assert kinds == ["slow", "fast"] * 5 + ["slow"] and coverage == 5


def _margin_run(margin: float):
    """Ten steps of a tiny Llama without probes, with ``retry_margin=margin``."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    config = SFIConfig(sink=2, recent=4, k_head=6, force_sparse=True, trigger="fixed",
                       period=50, page_size=4, coverage_layers=0, retry_margin=margin)
    return lockstep(model, ids, config, steps=10)


def test_retry_margin_does_an_uncertain_fast_step_again_densely():
    """A fast step whose next token's margin (its probability over the second's) is under
    ``retry_margin`` is done again at once as the row's slow step (reason ``margin``): at a
    margin of 1 every step is full attention's and the cache holds each position once; at a
    margin that only the least certain fast step falls under, that step is the first done
    again (its token from the second pass) and the steps before it are what they are without
    the lever."""
    from sfi.hf.planner import top_margin

    plain = _margin_run(0.0)
    kinds = [k[0] for k in plain.kinds]
    assert kinds == ["slow"] + ["fast"] * 10
    assert plain.cache.stats().refresh_reasons["margin"] == 0
    every = _margin_run(1.0)
    assert [k[0] for k in every.kinds] == ["slow"] * 11
    stats = every.cache.stats()  # each step counted once, as its second pass
    assert stats.refresh_reasons["margin"] == 10
    assert (stats.slow_steps, stats.fast_steps) == (10, 0)
    assert every.cache.read_fraction()[0] == 1.0
    assert every.cache.get_seq_length() == every.reference.get_seq_length() == 90
    for step, (a, b) in enumerate(zip(every.sfi_logits, every.full_logits)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {step}")
    margins = [float(top_margin(logits)[0][0]) for logits in plain.sfi_logits]
    first, second = sorted(range(1, 11), key=lambda i: margins[i])[:2]
    some = _margin_run((margins[first] + margins[second]) / 2)
    assert [k[0] for k in some.kinds][:first] == kinds[:first]
    assert some.kinds[first][0] == "slow"
    for a, b in zip(some.sfi_logits[:first], plain.sfi_logits[:first]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the step's token comes from its second pass (dense, over the fast steps' KV)
    assert not torch.allclose(some.sfi_logits[first], plain.sfi_logits[first])
    assert some.cache.stats().refresh_reasons["margin"] >= 1


def test_stop_margin_does_a_fast_step_that_would_end_the_text_again_densely():
    """A fast step whose most likely next token is one of the model's end-of-sequence ids (its
    lead under ``stop_margin``; 1.0: any lead) is done again at once as the row's slow step
    (reason ``stop``); steps whose top token is anything else are what they are without the
    lever; a row whose input ended already is not checked again; a model that names no
    end-of-sequence id is refused, not silently left unchecked."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))

    def run(margin: float):
        config = SFIConfig(sink=2, recent=4, k_head=6, force_sparse=True, trigger="fixed",
                           period=50, page_size=4, coverage_layers=0, stop_margin=margin)
        return lockstep(model, ids, config, steps=10)

    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    with pytest.raises(SFIError, match="stop_margin needs the model's end-of-sequence id"):
        run(1.0)
    plain = run(0.0)
    assert [k[0] for k in plain.kinds] == ["slow"] + ["fast"] * 10
    tops = [int(logits[0].argmax()) for logits in plain.sfi_logits]
    first = 3  # the fast step whose token is made the model's end of text
    model.generation_config.eos_token_id = tops[first]
    checked = run(1.0)
    kinds = [k[0] for k in checked.kinds]
    stops = [i for i in range(1, 11) if tops[i] == tops[first]]
    assert kinds[:first] == ["slow"] + ["fast"] * (first - 1) and kinds[first] == "slow"
    for a, b in zip(checked.sfi_logits[:first], plain.sfi_logits[:first]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    reasons = checked.cache.stats().refresh_reasons
    assert 1 <= reasons["stop"] <= len(stops) and reasons["margin"] == 0
    assert checked.cache.get_seq_length() == checked.reference.get_seq_length() == 90
    none = run(1e-9)  # a lead no real step falls under: nothing done again
    assert [k[0] for k in none.kinds] == ["slow"] + ["fast"] * 10
    with pytest.raises(SFIConfigError, match="repair_tokens and stop_margin cannot"):
        SFIConfig(repair_tokens=8, stop_margin=0.5)


def test_a_row_that_ended_already_is_not_checked_again():
    """A batch keeps decoding its ended rows: a row whose input is an end-of-sequence id is not
    done again for predicting another; a row about to end is; a row whose margin is also under
    ``retry_margin`` counts as ``margin``."""
    from types import SimpleNamespace

    from sfi.core.sequence_policy import FAST
    from sfi.hf.planner import Planner

    planner = Planner(stops={7})
    check = SimpleNamespace(config=SFIConfig(stop_margin=1.0), steps_since_refresh=0)
    both = SimpleNamespace(config=SFIConfig(stop_margin=1.0, retry_margin=1.0),
                           steps_since_refresh=0)
    planner.sequences = [check, check, both]
    plan = SimpleNamespace(phase=None, decode=True, kinds=(FAST, FAST, FAST), tokens=(3, 7, 3))
    logits = torch.zeros(3, 1, 10)
    logits[:, 0, 7] = 5.0  # every row's top token is the end of text
    rows, reasons = planner.redo_rows(plan, (), logits)
    assert rows == {0, 2} and reasons == {0: "stop", 2: "margin"}


def test_a_step_flagged_by_its_probes_counts_as_coverage_not_margin():
    """With coverage_retry and retry_margin both on, a step the probes flag is done again for
    them (reason coverage), once, whatever its margin."""
    run = _every_memory_flagged(1, True, retry_margin=1.0)
    reasons = run.cache.stats().refresh_reasons
    assert [k[0] for k in run.kinds] == ["slow"] * 11
    assert (reasons["coverage"], reasons["margin"]) == (10, 0)


def test_retry_margin_is_refused_where_a_step_cannot_be_done_again():
    """A model with sliding-window layers cannot forget a step; a model without output logits
    gives no margin: both are said, not ignored."""
    from transformers import AutoModelForCausalLM, MistralConfig

    sliding = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=24)).eval()
    with pytest.raises(SFIError, match="retry_margin needs every layer of the model"):
        SlowFastCache(sliding, SFIConfig(trigger="fixed", retry_margin=0.1))
    from sfi.hf.facts import cache_argument

    base = tiny_model("llama").model  # hidden states out, no logits
    config = SFIConfig(sink=2, recent=4, k_head=6, force_sparse=True, coverage_layers=0,
                       trigger="fixed", retry_margin=0.1)
    cache = SlowFastCache(base, config)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    key = cache_argument(base)
    with torch.inference_mode():
        base(input_ids=ids, use_cache=True, **{key: cache})
        with pytest.raises(SFIError, match="retry_margin needs the model's output logits"):
            base(input_ids=ids[:, :1], use_cache=True, position_ids=torch.tensor([[40]]),
                 **{key: cache})


def test_top_margin():
    from sfi.hf.planner import top_margin

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    margins, tops = top_margin(logits)
    torch.testing.assert_close(margins, torch.tensor([0.2, 0.7]))
    assert tops.tolist() == [0, 2]
    assert [t.tolist() for t in top_margin(torch.zeros(2, 1))] == [[1.0, 1.0], [0, 0]]


def test_a_flag_outlives_another_rows_redo(monkeypatch):
    """A row whose probes flag its memory but which is not done again (here: redo_rows keeps
    row 0 alone) keeps its flag through row 0's second pass and refreshes at its next step,
    as without coverage_retry."""
    from sfi.hf.planner import Planner

    redo_rows = Planner.redo_rows
    def row_0_alone(self, plan, missed, logits=None):
        flagged, reasons = redo_rows(self, plan, missed, logits)
        return flagged & {0}, {row: why for row, why in reasons.items() if row == 0}

    monkeypatch.setattr(Planner, "redo_rows", row_0_alone)
    run = _every_memory_flagged(2, True)
    assert [k[0] for k in run.kinds] == ["slow"] * 11  # row 0: every step done again
    assert [k[1] for k in run.kinds] == ["slow", "fast"] * 5 + ["slow"]  # row 1: as before
    assert run.cache.stats(1).refresh_reasons["coverage"] == 5


def test_incremental_page_summaries_equal_summarising_from_scratch():
    """Both engines' probes keep page bounds this way (the slab per layer, the vLLM plugin per
    request): update by update, grown past their room, with shifted pages and after a cut,
    they are the bounds and boxes of the whole cache."""
    from sfi.core.pages import PageSummaries, page_bounds, page_boxes, page_count

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 70, 4, generator=g)
    shift = torch.tensor([0, 3])
    for rows_shift in (None, shift):
        aligned = None if rows_shift is None else tuple(rows_shift.tolist())
        pages = PageSummaries(8, aligned)
        for t in (5, 8, 9, 30, 30, 31, 64, 70):  # room grows from 1 page (t = 5)
            pages.update(keys[:, :, :t], rows_shift)
            low, high = page_bounds(keys[:, :, :t], 8, rows_shift)
            assert pages.done == t and pages.count == page_count(t, 8, rows_shift)
            assert torch.equal(pages.low[:, :, :pages.count], low)
            assert torch.equal(pages.high[:, :, :pages.count], high)
            # (a row's page past its last position has no bounds: NaN boxes, as from scratch)
            torch.testing.assert_close(pages.boxes[:, :, :pages.count], page_boxes(low, high),
                                       rtol=0, atol=0, equal_nan=True)
        if rows_shift is None:  # given only the keys from the partial page on (the plugin)
            tail = PageSummaries(8)
            for t in (5, 8, 9, 30, 31, 64, 70):
                start = tail.reads_from
                tail.update(keys[:, :, start:t], start=start)
                low, high = page_bounds(keys[:, :, :t], 8)
                assert torch.equal(tail.low[:, :, :tail.count], low)
                assert torch.equal(tail.high[:, :, :tail.count], high)
            with pytest.raises(ValueError, match="cannot summarise page"):
                PageSummaries(8).update(keys[:, :, 8:20], start=8)
        changed = keys.clone()
        changed[:, :, 40:] = 10.0  # positions 40.. rewritten after a cut back to 40
        pages.forget_after(40)
        pages.update(changed, rows_shift)
        assert torch.equal(pages.high[:, :, :pages.count], page_bounds(changed, 8, rows_shift)[1])
    assert PageSummaries(8, (0, 3)).matches(8, (0, 3)) and not PageSummaries(8).matches(8, (0, 3))


def reader(keys: torch.Tensor):
    """A :data:`sfi.core.coverage.KeyReader` of ``keys [n, H, T, D]`` (all n rows)."""
    from sfi.core.coverage import batch_reader

    return batch_reader(keys, torch.arange(keys.shape[0]))


def test_a_memory_missing_a_heavy_page_is_flagged():
    from sfi.core.coverage import page_scores, probe_layers, unheld_pages
    from sfi.core.pages import page_bounds, page_boxes
    from sfi.step.probes import ProbeCheck, ProbedMemories, ProbeEvidence, ProbeRule, flagged_rows

    g = torch.Generator().manual_seed(9)
    n, h, gq, d, page, pages = 2, 2, 3, 8, 4, 10
    keys = torch.randn(n, h, pages * page, d, generator=g) * 0.1
    query = torch.randn(n, h, gq, d, generator=g)
    keys[:, 0, 21] = query[:, 0].sum(1) * 3  # a key the query wants, in page 5
    low, high = page_bounds(keys, page)
    lo, hi = torch.tensor([4, 4]), torch.tensor([36, 36])  # pages 1..8 are the middle
    # row 0 holds page 5 (and 1..3) at both heads; row 1 holds pages 1..3 only
    memory = torch.tensor([[5 * page, page, 2 * page, 3 * page]]).repeat(n, h, 1)
    memory[1, :, 0] = 3 * page + 1
    held = torch.ones(n, 4, dtype=torch.bool)
    scale = d ** -0.5
    logits = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [n, H, G, T]
    in_memory = torch.zeros(n, h, pages * page, dtype=torch.bool)
    for row in range(n):
        for head in range(h):
            for start in memory[row, head].tolist():
                in_memory[row, head, (start // page) * page: (start // page + 1) * page] = True
    in_memory[..., 36:] = True  # the recent window
    lse = torch.logsumexp(logits.masked_fill(~in_memory[:, :, None], float("-inf")), dim=-1)
    outside = unheld_pages(memory, held, lo, hi, pages=pages, page=page)
    scores = page_scores(query, page_boxes(low, high), outside)
    quiet = torch.zeros_like(scores).masked_fill(~outside, float("-inf"))  # a layer that misses
    quiet_lse = lse + 50  # nothing: its memory outweighs any page

    def flagged(threshold: float, layers: int) -> set[int]:
        checks = ProbeCheck()
        rows = ProbedMemories((0, 1), held, hi, keys.shape[-2])
        rule = ProbeRule(page=page, top=2, threshold=threshold)
        for layer in range(layers):  # the heavy page is seen by the last layer only
            last = layer == layers - 1
            checks.add(rule, rows, ProbeEvidence(query, scores if last else quiet,
                                                 (reader(keys),), lse if last else quiet_lse,
                                                 scale=scale))
        missing, copying = flagged_rows(checks.check())
        assert checks.check() == [] and copying == set()  # checked once
        return missing

    assert flagged(0.3, layers=1) == {1}
    assert flagged(0.3, layers=3) == {1}  # any probe layer's miss flags the row
    # with a threshold above what the heavy page takes, nothing is flagged
    assert flagged(0.9999, layers=1) == set()
    assert probe_layers(2, list(range(24)), dense_layers=2) == (7, 18)
    assert probe_layers(3, [0, 1], dense_layers=0) == (0, 1)


def test_the_page_after_the_most_attended_selected_position_is_read_first():
    """``coverage_next``: a copy that runs past the held page is caught by reading the page
    after it, which the page bound alone ranks below pages of wide keys; where no page is
    raised, the probe reads the ``top`` pages the bound ranks, no more."""
    from sfi.core.coverage import missing_rows, page_scores, unheld_pages, with_next_pages
    from sfi.core.pages import page_bounds, page_boxes

    g = torch.Generator().manual_seed(2)
    n, h, gq, d, page, pages = 1, 1, 2, 8, 4, 10
    keys = torch.randn(n, h, pages * page, d, generator=g) * 0.1
    query = torch.randn(n, h, gq, d, generator=g)
    wanted = query[0, 0].sum(0)
    keys[0, 0, 15] = wanted * 2  # the copy's source now: the last position of held page 3
    keys[0, 0, 16] = wanted * 2  # where it goes next: page 4, held by nothing
    for first in (24, 28):  # pages 6 and 7: wide boxes, low logits
        signs = torch.randint(0, 2, (d,), generator=g) * 2.0 - 1
        keys[0, 0, first: first + 4] = torch.stack([signs, -signs, signs.roll(1),
                                                    -signs.roll(1)]) * 4
    keys[0, 0, 0] = wanted * 2.2  # the sink: the most attended slot, never a copy's source
    memory = torch.tensor([[[0, 12, 13, 14, 15]]])  # a sink, then held page 3
    held = torch.tensor([[False, True, True, True, True]])
    lo, hi = torch.tensor([1]), torch.tensor([36])
    scale = d ** -0.5
    memory_logits = torch.matmul(query, keys[:, :, memory[0, 0]].transpose(-1, -2)) * scale
    recent = torch.matmul(query, keys[:, :, 36:].transpose(-1, -2)) * scale
    lse = torch.logsumexp(torch.cat([memory_logits, recent], -1), dim=-1)
    outside = unheld_pages(memory, held, lo, hi, pages=pages, page=page)
    scores = page_scores(query, page_boxes(*page_bounds(keys, page)), outside)
    assert sorted(scores[0, 0].topk(2).indices.tolist()) == [6, 7]  # the bound's choice
    ranked, raised = with_next_pages(scores, memory_logits, memory, held, page=page)
    assert int(ranked[0, 0].argmax()) == 4 and raised.tolist() == [[True]]
    others = torch.arange(pages) != 4
    assert torch.equal(ranked[..., others], scores[..., others])  # nothing else moves

    def flagged(s: torch.Tensor, top: int, up: torch.Tensor | None = None) -> bool:
        return bool(missing_rows(query, s, [reader(keys)], lse, page=page, top=top,
                                 threshold=0.2, scale=scale, length=keys.shape[-2],
                                 raised=up)[0])

    assert not flagged(scores, top=2) and flagged(scores, top=3)  # page 4 ranks third
    assert flagged(ranked, top=2, up=raised)  # the raised page, read beside the bound's 2
    assert not flagged(scores, top=2, up=torch.tensor([[False]]))  # not raised: 2 read
    # a page the memory holds is not raised, nor is any where no selected slot is held
    held_next = scores.masked_fill(torch.arange(pages) == 4, float("-inf"))
    kept, up = with_next_pages(held_next, memory_logits, memory, held, page=page)
    assert torch.equal(kept, held_next) and not up.any()
    kept, up = with_next_pages(scores, memory_logits, memory, torch.zeros_like(held), page=page)
    assert torch.equal(kept, scores) and not up.any()
    shifted, _ = with_next_pages(scores, memory_logits, memory, held, page=page,
                                 shift=torch.tensor([1]))
    assert int(shifted[0, 0].argmax()) == 5  # position 15 + 1 lies in page 4, the next is 5


def test_a_copy_about_to_run_past_the_memory_flags_its_row():
    """``coverage_copy``: a query head that gives most of its attention to a selected position
    whose next position the memory lacks flags its row; not where the next position is held,
    lies in the recent window, or the share is below the threshold, nor for a sink."""
    from sfi.core.coverage import copy_runs_out

    memory = torch.tensor([[[0, 12, 13, 14, 15]]])  # a sink, then held page 3
    held = torch.tensor([[False, True, True, True, True]])

    def flags(slot: int, hi: int = 36, share: float = 0.5, strength: float = 6.0) -> bool:
        logits = torch.zeros(1, 1, 2, 5)
        logits[0, 0, 1, slot] = strength  # the second query head copies from this slot
        lse = torch.logsumexp(torch.cat([logits, torch.zeros(1, 1, 2, 4)], -1), dim=-1)
        return bool(copy_runs_out(logits, lse, memory, held, torch.tensor([hi]),
                                  share=share)[0])

    assert flags(4)  # position 15: position 16 is in no held page
    assert not flags(2)  # position 13: 14 is held
    assert not flags(4, hi=16)  # 16 is the recent window's first position
    assert not flags(4, share=0.999)  # the head gives less than that
    assert not flags(4, strength=1.0)  # a share of 0.25: no copy
    assert not flags(0)  # the sink takes it: sinks are never a copy's source
    # two rows, two KV heads: only row 1's second head copies from the end of its held run
    # (row 0's first head copies from position 15 too, but row 0 holds 16 in that head)
    memories = torch.tensor([[[0, 12, 13, 15, 16], [0, 12, 13, 14, 15]],
                             [[0, 12, 13, 14, 15], [0, 12, 13, 14, 15]]])
    logits = torch.zeros(2, 2, 2, 5)
    logits[0, 0, 0, 3] = logits[1, 1, 1, 4] = logits[1, 0, 0, 2] = 6.0
    lse = torch.logsumexp(logits, dim=-1)
    rows = copy_runs_out(logits, lse, memories, held.expand(2, -1), torch.tensor([36, 36]),
                         share=0.5)
    assert rows.tolist() == [False, True]
    assert not copy_runs_out(logits, lse, memories, held.expand(2, -1), torch.tensor([36, 16]),
                             share=0.5).any()  # row 1's recent window starts at 16
    assert not copy_runs_out(logits[..., :0], lse, memories[..., :0], held[:, :0].expand(2, -1),
                             torch.tensor([36, 36]), share=0.5).any()  # no compact slot


def test_copy_flags_are_kept_apart_and_never_redo_a_step():
    """The rows :func:`copy_runs_out` flags come back apart from the pages' misses, and with
    ``coverage_retry`` a copy flag refreshes the next step, as without it: the step it was
    raised in was served (its source is held), so it is not done again."""
    from sfi.step.probes import ProbeCheck, ProbedMemories, ProbeEvidence, ProbeRule, flagged_rows

    checks = ProbeCheck()
    h, g, d, t, page = 1, 1, 4, 32, 4
    scores = torch.full((2, h, t // page), float("-inf"))  # no page to read
    memory = torch.tensor([[[0, 10, 20]], [[0, 10, 20]]])  # row 1 copies from 10; 11 unheld
    logits = torch.tensor([[[[0.0, 0.0, 0.0]]], [[[0.0, 9.0, 0.0]]]])
    checks.add(ProbeRule(page=page, top=1, threshold=0.5, copy_share=0.5),
               ProbedMemories((0, 1), torch.tensor([[False, True, True]] * 2),
                              torch.tensor([t, t]), t),
               ProbeEvidence(torch.zeros(2, h, g, d), scores, (reader(torch.zeros(2, h, t, d)),),
                             torch.logsumexp(logits, -1), logits, memory))
    assert flagged_rows(checks.check()) == (set(), {1})
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))
    copy = dict(sink=2, recent=4, k_head=8, force_sparse=True, trigger="bootstrap", page_size=4,
                coverage_layers=2, coverage_gap=1, coverage_threshold=1.0, coverage_copy=0.05)
    once = lockstep(model, ids, SFIConfig(**copy), steps=12)
    retried = lockstep(model, ids, SFIConfig(**copy, coverage_retry=True), steps=12)
    assert once.cache.stats().refresh_reasons["coverage"] >= 2
    assert retried.cache.stats().refresh_reasons == once.cache.stats().refresh_reasons
    for a, b in zip(once.sfi_logits, retried.sfi_logits):
        torch.testing.assert_close(a, b)


def test_coverage_refreshes_are_counted_and_keep_full_budget_exact():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))
    small = SFIConfig(sink=2, recent=4, k_head=8, force_sparse=True, trigger="bootstrap",
                      page_size=4, coverage_layers=1, coverage_gap=2)
    run = lockstep(model, ids, small, steps=16)
    reasons = run.cache.stats().refresh_reasons
    assert reasons["coverage"] >= 1 and reasons["sentence"] == 0
    assert run.cache.stats().slow_steps == reasons["coverage"]  # every later refresh is one
    full = lockstep(model, ids, SFIConfig(sink=2, recent=4, k_head=4096, force_sparse=True,
                                          trigger="bootstrap", coverage_layers=2), steps=8)
    for a, b in zip(full.sfi_logits, full.full_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_a_retrieval_head_that_misses_flags_its_row_only_when_heads_judge_alone():
    """One query head of a KV head would give the pages read 15% of its attention, the other
    1%: their mean (8%) stays under a 10% threshold, the largest does not."""
    from sfi.core.coverage import misses

    query = torch.zeros(1, 1, 2, 4)  # [n, H, G, D]: every logit 0
    keys, real = torch.zeros(1, 1, 1, 4), torch.ones(1, 1, 1, dtype=torch.bool)
    shares = torch.tensor([0.15, 0.01])
    lse = torch.log((1 - shares) / shares).view(1, 1, 2)  # sigmoid(0 - lse) = share
    judged = {heads: misses(query, keys, real, lse, threshold=0.1, scale=1.0, heads=heads)
              for heads in ("mean", "max")}
    assert judged == {"mean": torch.tensor([False]), "max": torch.tensor([True])}
    with pytest.raises(SFIError, match="coverage_heads"):
        SFIConfig(coverage_heads="min")


@pytest.mark.parametrize("heads", ["mean", "max"])
def test_coverage_heads_reaches_the_verdict(heads, monkeypatch):
    """The transformers path hands ``coverage_heads`` from the config through the plan's
    probes to the verdict (the vLLM plugin's: test_vllm_plan's probes-together test)."""
    import sfi.core.coverage as coverage

    seen = []
    judge = coverage.misses

    def spy(*args, **kwargs):
        seen.append(kwargs["heads"])
        return judge(*args, **kwargs)

    monkeypatch.setattr(coverage, "misses", spy)
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))
    config = SFIConfig(sink=2, recent=4, k_head=8, force_sparse=True, trigger="bootstrap",
                       page_size=4, coverage_layers=2, coverage_heads=heads)
    lockstep(tiny_model("qwen2"), ids, config, steps=4)
    assert seen and set(seen) == {heads}


def test_a_fast_steps_reads_count_what_its_probes_read():
    """The read fraction counts, at each probe layer, the page summaries (one entry a page)
    and the keys of the pages read (half an entry a position): the reads the paper's accounting
    leaves out."""
    from sfi.core.sequence_policy import Memory, SequenceState, fast_read_fraction
    from sfi.core.triggers import FixedPeriodTrigger

    config = SFIConfig(page_size=16, coverage_top=2)
    seq = SequenceState(pad=0, config=config, trigger=FixedPeriodTrigger(4), scorer=None)
    seq.memory = Memory(pad=0, sink=4, sink_end=4, recent_start=1024 - 256, k=100)
    total, layers = 1024, range(24)
    plain = fast_read_fraction(seq, total, layers)
    assert plain == pytest.approx((4 + 100 + 256) / 1024)
    per_layer = 1024 / 16 + 2 * 16 / 2  # summaries of 64 pages, keys of 2 pages
    probed = fast_read_fraction(seq, total, layers, probes=8)
    assert probed == pytest.approx(plain + 8 * per_layer / 1024 / 24)
    seq.config = SFIConfig(page_size=16, coverage_top=2, coverage_next=True)  # one page more
    assert fast_read_fraction(seq, total, layers, probes=8) == pytest.approx(
        plain + 8 * (per_layer + 8) / 1024 / 24)


def test_the_planner_counts_its_probes_reads_in_each_fast_step():
    """The same steps with two probe layers and without (probes that never flag: the same
    decisions): the fast steps' reads differ by what the probes read, no more."""
    from sfi.core.cost_model import probe_reads

    model = tiny_model("qwen2")  # 2 layers
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))
    base = dict(sink=2, recent=4, k_head=8, force_sparse=True, trigger="bootstrap",
                page_size=4, coverage_threshold=1.0, coverage_copy=0.0)
    probed = lockstep(model, ids, SFIConfig(**base, coverage_layers=2), steps=8).cache.stats()
    plain = lockstep(model, ids, SFIConfig(**base, coverage_layers=0), steps=8).cache.stats()
    assert probed.fast_steps == plain.fast_steps > 0 and probed.refresh_reasons == \
        plain.refresh_reasons
    config = SFIConfig(**base)
    extra = [2 * probe_reads(config, t) / t / 2 for t in range(80, 90)]  # 2 of 2 layers
    gained = probed.fast_read_fraction - plain.fast_read_fraction
    assert min(extra) <= gained <= max(extra), (gained, extra)


def test_copy_flags_reach_the_planner_as_coverage_refreshes():
    """``coverage_copy`` alone (the pages' threshold out of reach) refreshes rows, counted as
    ``coverage``; without it the same run has none."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))

    def coverage(copy: float) -> int:
        config = SFIConfig(sink=2, recent=4, k_head=8, force_sparse=True, trigger="bootstrap",
                           page_size=4, coverage_layers=2, coverage_gap=2,
                           coverage_threshold=1.0, coverage_copy=copy)
        return lockstep(model, ids, config, steps=16).cache.stats().refresh_reasons["coverage"]

    assert coverage(0.0) == 0
    assert coverage(0.05) >= 1


def test_the_page_bound_is_its_definition_and_bounds_every_logit():
    from sfi.core.pages import page_bounds
    from sfi.core.scorers.quest import bound_scores

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        t = int(torch.randint(20, 90, (1,), generator=g))
        keys = torch.randn(2, 3, t, 16, generator=g) * 3
        query = torch.randn(2, 3, 4, 16, generator=g)
        low, high = page_bounds(keys, 8)
        direct = torch.maximum(query[:, :, :, None] * low[:, :, None],
                               query[:, :, :, None] * high[:, :, None]).sum(-1)  # [B,H,G,P]
        torch.testing.assert_close(bound_scores(query, low, high), direct.sum(2), atol=1e-4,
                                   rtol=1e-5)
        # a query that carries gradients (a forward outside no_grad) is ranked the same
        graded = bound_scores(query.clone().requires_grad_(), low, high)
        assert torch.equal(graded, bound_scores(query, low, high)) and not graded.requires_grad
        logits = torch.matmul(query, keys.transpose(-1, -2))  # [B, H, G, T]
        pages = torch.arange(t) // 8
        for p in range(low.shape[2]):
            assert bool((logits[..., pages == p].amax(-1) <= direct[..., p] + 1e-4).all())


def test_a_padded_row_is_cut_into_the_pages_it_has_alone():
    """Pages start at each row's first token: a row padded by ``pad`` positions has, from page
    (pad + shift) / page on, the boxes of its keys alone, incrementally summarised too."""
    from sfi.core.pages import page_bounds, page_count, page_shift

    g = torch.Generator().manual_seed(3)
    page, t, pads = 8, 61, torch.tensor([0, 5, 11, 16])
    keys = torch.randn(4, 2, t, 4, generator=g)
    shift = page_shift(pads, page)
    assert shift.tolist() == [0, 3, 5, 0]
    low, high = page_bounds(keys, page, shift)
    assert low.shape[2] == page_count(t, page, shift) == 9
    later_low, _ = page_bounds(keys, page, shift, first=4)
    torch.testing.assert_close(later_low, low[:, :, 4:])
    for row, pad in enumerate(pads.tolist()):
        alone_low, alone_high = page_bounds(keys[row: row + 1, :, pad:], page)
        first = (pad + int(shift[row])) // page
        n = alone_low.shape[2]
        torch.testing.assert_close(low[row, :, first: first + n], alone_low[0])
        torch.testing.assert_close(high[row, :, first: first + n], alone_high[0])


def test_the_unheld_pages_kept_between_refreshes_are_those_of_each_step(monkeypatch):
    """A probe layer keeps its unheld-page mask from one refresh to the next; at every probe
    of a padded batch with refreshes, it equals the mask computed afresh."""
    from sfi.core.coverage import unheld_pages
    from sfi.hf.layer_attention import SlowFastAttention

    kept = SlowFastAttention._unheld_pages
    checked = []

    def checking(self, probe, memory, shift, pages):
        outside = kept(self, probe, memory, shift, pages)
        t = probe.target
        fresh = unheld_pages(memory, t.held, t.lo, t.hi, pages=pages, page=probe.rule.page,
                             shift=shift)
        assert torch.equal(outside, fresh)
        checked.append(int(fresh.sum()))
        return outside

    monkeypatch.setattr(SlowFastAttention, "_unheld_pages", checking)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 256, (2, 90), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :21] = 0  # a padded row: its pages are shifted
    config = SFIConfig(sink=3, recent=8, k_head=10, force_sparse=True, trigger="fixed",
                       period=5, coverage_threshold=1.0)
    run = lockstep(tiny_model("llama"), ids, config, steps=24, attention_mask=mask)
    assert ["slow", "slow"] in run.kinds and len(checked) > 20 and max(checked) > 0


def test_the_evidence_bias_is_each_rows_own_causal_window():
    """Both engines' evidence bias from one function: row b's last W queries end at
    ``ends[b]``; each sees its row's keys from ``starts[b]`` up to itself, and nothing when it
    lies outside the row's own window."""
    from sfi.core.kernels import evidence_bias

    ends, starts, windows = torch.tensor([9, 12, 12]), torch.tensor([0, 3, 0]), \
        torch.tensor([3, 2, 3])
    bias = evidence_bias(ends, 3, 12, starts=starts, windows=windows)
    assert bias.shape == (3, 3, 12)
    for b in range(3):
        for j in range(3):
            query = int(ends[b]) - 3 + j
            for key in range(12):
                seen = int(starts[b]) <= key <= query and j >= 3 - int(windows[b])
                assert (bias[b, j, key] == 0) == seen, (b, j, key)
    plain = evidence_bias(torch.tensor([5]), 2, 5)  # no starts, no windows: causal only
    assert torch.equal(plain == 0, torch.arange(5)[None, None, :] <= torch.tensor([3, 4])[None, :,
                                                                                          None])


def test_memory_tensors_hold_each_memorys_geometry_and_its_selected_slots():
    """Both engines' view of their rows' memories: every field, and the selected slots of a
    buffer with S sink slots per row (the transformers path's) or one that packs each row's
    own sinks first (the plugin's)."""
    from sfi.core.memory_tensors import MemoryTensors
    from sfi.core.sequence_policy import Memory, refresh_memory

    memories = [refresh_memory(100, 0, 4, 16, 10), refresh_memory(100, 98, 4, 16, 10),
                Memory(pad=3, sink=2, sink_end=5, recent_start=40, k=3, pinned=1)]
    t = MemoryTensors.of(memories, "cpu")
    for name, field in (("pad", "pad"), ("sink", "sink"), ("lo", "sink_end"),
                        ("hi", "recent_start"), ("k", "k"), ("pinned", "pinned")):
        assert getattr(t, name).tolist() == [getattr(m, field) for m in memories], name
    assert t.sink_count.tolist() == [m.sink_count for m in memories] == [4, 0, 2]
    assert t.k.tolist() == [10, 0, 3]
    by_sink = t.selected_slots(16, t.sink)
    packed = t.selected_slots(16, t.sink_count)
    for row, m in enumerate(memories):
        assert by_sink[row].nonzero().flatten().tolist() == list(range(m.sink, m.sink + m.k))
        assert packed[row].nonzero().flatten().tolist() == list(
            range(m.sink_count, m.sink_count + m.k))


def test_a_memorys_positions_and_mask_are_its_sinks_selected_and_recent_window():
    from sfi.core.memory_tensors import memory_mask, memory_positions
    from sfi.core.sequence_policy import Memory

    memory = Memory(pad=3, sink=2, sink_end=5, recent_start=40, k=2)
    selected = torch.tensor([[7, 30], [12, 13]])
    positions = memory_positions(memory, selected, 44)
    assert positions.tolist() == [[3, 4, 7, 30, 40, 41, 42, 43], [3, 4, 12, 13, 40, 41, 42, 43]]
    mask = memory_mask(memory, selected, 44)
    assert mask.shape == (2, 44)
    for head in range(2):
        assert mask[head].nonzero().flatten().tolist() == positions[head].tolist()


def test_page_shifts_of_python_pads_are_page_shift_of_the_tensor():
    from sfi.core.pages import page_shift, page_shifts

    for pads in ([0, 3, 17, 32], [0, 0], [16, 32], [5]):
        shift = page_shift(torch.tensor(pads), 16)
        assert page_shifts(pads, 16) == (None if shift is None else tuple(shift.tolist()))
    assert page_shifts([0, 16], 16) is None and page_shifts([1], 16) == (15,)
