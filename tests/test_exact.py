"""Exact mode (``sfi.decoding.exact``): fast steps draft, dense forwards verify.

What must hold: greedy tokens equal full attention's; the cache after every verify holds
full attention's KV for every committed position and nothing of a draft; sampled tokens are
distributed as full attention's; the acceptance rule is the one of speculative sampling.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import sfi
from sfi import SFIConfig, SlowFastCache
from sfi.core.draft_length import DraftLength, ForwardCost, expected_tokens
from sfi.core.sequence_policy import DraftAcceptance
from sfi.decoding.decode_step import Sampling, token_distribution
from sfi.decoding.exact import ExactDecoder, greedy_verdict, speculative_verdict
from sfi.decoding.prefill import prefill
from sfi.decoding.prompts import encode_prompts
from sfi.hf.facts import cache_argument
from sfi.texts import essay

# a small memory, so that drafts depart from full attention and are rejected
# (min_skip=0: these short prompts draft from S + K + R on)
DRAFTING = dict(sink=2, recent=8, k_head=24, page_size=4, coverage_layers=0, min_skip=0,
                min_gain=1.0, draft_fallback=False, draft_tokens=4, draft_min=4, draft_max=4)


# --- the acceptance rules, against their transcription -------------------------------------------
def test_greedy_verdict_keeps_the_prefix_full_attention_agrees_with():
    target = torch.zeros(3, 4, 10)
    best = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [5, 2, 3, 4]])
    target.scatter_(-1, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    verdict = greedy_verdict(target, drafts)
    assert verdict.accepted.tolist() == [3, 1, 0]
    assert verdict.fix.tolist() == [4, 9, 5]  # the bonus, then full attention's corrections


def _transcribed(p, q, drafts, u):
    """Speculative sampling for one row, written out: (accepted, the distribution of the
    token at that position)."""
    g = drafts.shape[0]
    for j in range(g):
        d = int(drafts[j])
        if u[j] < min(1.0, float(p[j, d] / q[j, d])):
            continue
        residual = torch.clamp(p[j] - q[j], min=0)
        return j, residual / residual.sum()
    return g, p[g]


def test_speculative_verdict_is_the_rule_as_written():
    torch.manual_seed(3)
    b, g, v = 64, 4, 7
    p = torch.softmax(torch.randn(b, g + 1, v) * 2, -1)
    q = torch.softmax(torch.randn(b, g, v) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1).view(b, g)
    verdict = speculative_verdict(p, q, drafts, torch.Generator().manual_seed(11))
    u = torch.rand(b, g, generator=torch.Generator().manual_seed(11))  # the verdict's draws
    for row in range(b):
        accepted, distribution = _transcribed(p[row], q[row], drafts[row], u[row])
        assert int(verdict.accepted[row]) == accepted
        assert float(distribution[verdict.fix[row]]) > 0  # drawn where the rule allows
    assert 0 < verdict.accepted.float().mean() < g  # both outcomes were exercised


def test_speculative_sampling_reproduces_the_target_chain():
    """A Markov chain as the target and another as the drafter, rounds of three drafts until
    every row has three tokens: their joint law is the target's (and not the drafter's)."""
    torch.manual_seed(5)
    v, g, n, want = 4, 3, 100_000, 3
    target = torch.softmax(torch.randn(v, v) * 1.5, -1)  # p(next | previous)
    drafter = torch.softmax(torch.randn(v, v) * 1.5, -1)
    gen = torch.Generator().manual_seed(7)
    out = torch.zeros(n, want + g + 1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    last = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    several = 0
    while bool((count < want).any()):
        drafts, token = [], last
        for _ in range(g):
            token = torch.multinomial(drafter[token], 1, generator=gen).squeeze(-1)
            drafts.append(token)
        drafts = torch.stack(drafts, 1)
        prev = torch.cat([last[:, None], drafts], 1)
        verdict = speculative_verdict(target[prev], drafter[prev[:, :-1]], drafts, gen)
        several += int((verdict.accepted >= 2).sum())
        emitted = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
        emitted[rows, verdict.accepted] = verdict.fix
        live = count < want
        for j in range(g + 1):
            put = live & (j <= verdict.accepted)
            out[rows[put], count[put] + j] = emitted[put, j]
        count = torch.where(live, count + verdict.accepted + 1, count)
        last = verdict.fix
    assert several > n // 10  # rounds that kept several drafts were common
    index = (out[:, 0] * v + out[:, 1]) * v + out[:, 2]
    counts = torch.bincount(index, minlength=v ** 3).float()

    def chain(p):
        return (p[0][:, None, None] * p[:, :, None] * p[None]).flatten()

    assert _chi2_ok(counts, chain(target))
    assert not _chi2_ok(counts, chain(drafter))


def _chi2_ok(counts: torch.Tensor, probabilities: torch.Tensor, alpha: float = 1e-4) -> bool:
    """Pearson's chi-square test of ``counts`` against ``probabilities`` (bins with expected
    counts under 5 pooled): True unless rejected at ``alpha``."""
    n = counts.sum()
    expected = probabilities * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - alpha
    z = -_normal_quantile(alpha)
    quantile = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat <= quantile


def _normal_quantile(p: float) -> float:
    return math.sqrt(2) * float(torch.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)))


def test_draft_length_drafts_where_it_pays_and_falls_back_where_not():
    sure, unsure = [0.9], [0.1, 0.1]
    length = DraftLength(SFIConfig())
    assert length.choose(100, sure) == 0  # a dense step is measured first
    length.record_dense(0.100, sure)
    gamma = length.choose(100, sure)
    assert gamma == SFIConfig().draft_tokens
    length.record_round(gamma, draft_s=gamma * 0.020, verify_s=0.110)  # cheap drafts
    assert length.choose(100, sure) > 0
    assert length.choose(3, sure) <= 2  # never past the tokens still wanted
    slow = DraftLength(SFIConfig())
    slow.record_dense(0.100, unsure)
    gamma = slow.choose(100, unsure)
    for _ in range(slow.judged_after):  # drafts that cost a dense step each
        assert gamma > 0
        slow.record_round(gamma, draft_s=gamma * 0.090, verify_s=0.150)
        gamma = slow.choose(100, unsure)
    assert gamma == 0 and slow.dense_left == 16
    assert expected_tokens(3, 0.5) == pytest.approx(1.875)


def test_draft_length_weighs_each_rows_acceptance_and_the_verifys_length():
    """Gamma maximises the rows' mean expected tokens over the round's time, with a verify
    that costs more per position it verifies: against a brute-force search of that rate it
    is the best, where a verify of constant cost or the rows' mean acceptance would choose
    another."""
    config = SFIConfig(draft_fallback=False)
    draft, rows = 0.050, [0.97, 0.3]

    def verify(n: int) -> float:
        return 0.200 + 0.040 * n

    length = DraftLength(config)
    for gamma in (2, 4, 6, 4):
        length.record_round(gamma, draft_s=gamma * draft, verify_s=verify(gamma + 1))
    assert length.forward(9) == pytest.approx(verify(9))
    lengths = range(config.draft_min, config.draft_max + 1)

    def best(tokens, verify_s) -> int:
        return max(lengths, key=lambda g: tokens(g) / (g * draft + verify_s(g + 1)))

    def per_row(g: int) -> float:
        return sum(expected_tokens(g, a) for a in rows) / len(rows)

    chosen = length.choose(100, rows)
    assert chosen == best(per_row, verify) == 3
    assert best(per_row, lambda n: verify(5)) != chosen  # a verify as long as any other
    assert best(lambda g: expected_tokens(g, sum(rows) / 2), verify) != chosen


def test_forward_cost_fits_a_line_that_stays_physical():
    cost = ForwardCost()
    assert cost(3) is None
    cost.record(5, 0.4)
    assert cost(1) == cost(9) == pytest.approx(0.4)  # one length measured: no slope
    cost.record(1, 0.5)  # longer forwards measured faster (noise): no negative slope
    assert cost(1) == pytest.approx(cost(9))
    steep = ForwardCost()
    steep.record(1, 0.1)
    steep.record(2, 1.0)  # would put the base below 0: the cost stays proportional at most
    assert steep(4) <= 4 * steep(1) + 1e-9 and steep(0) >= -1e-9


def test_forward_cost_keeps_the_verifies_through_a_long_dense_run():
    cost = ForwardCost()
    cost.record(5, 0.6)  # a verify of 4 drafts
    for _ in range(200):  # a dense run (the fallback doubles them) measures only n = 1
        cost.record(1, 0.2)
    assert cost(5) == pytest.approx(0.6) and cost(1) == pytest.approx(0.2)
    assert cost(3) == pytest.approx(0.4)


def test_each_sequence_keeps_its_own_acceptance():
    one, other = DraftAcceptance(), DraftAcceptance()
    assert one.rate == pytest.approx(0.8)  # the prior
    for _ in range(5):
        one.record(4, 4)
        other.record(0, 4)
    assert one.rate > 0.9 and other.rate < 0.4
    other.record(4, 4)  # a round that accepts everything raises it
    assert other.rate > 0.4


# --- exactness on models -----------------------------------------------------------------------
def _first_gap(model, tokenizer, prompt: str, tokens: list[int], at: int) -> float:
    """Full attention's top-2 logit gap at new token ``at`` of ``prompt`` + ``tokens``."""
    ids = encode_prompts(tokenizer, [prompt], False, torch.device("cpu")).input_ids
    ids = torch.cat([ids, torch.tensor([tokens[:at]])], 1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _assert_same_tokens(model, tokenizer, prompt, exact, full):
    if exact == full:
        return
    at = next(i for i, (a, b) in enumerate(zip(exact, full)) if a != b)
    gap = _first_gap(model, tokenizer, prompt, full, at)
    assert gap < 1e-4, f"exact mode departs from full attention at token {at} (gap {gap})"


def test_greedy_exact_equals_full_attention_on_the_default_model(default_model):
    model, tokenizer = default_model
    prompts = [essay(1000, tokenizer), essay(800, tokenizer)[200:]]
    config = SFIConfig(**{**DRAFTING, "k_head": 128, "recent": 32, "page_size": 16})
    full = sfi.generate(model, tokenizer, prompts, mode="full", max_new_tokens=32)
    batch = sfi.generate(model, tokenizer, prompts, mode="exact", config=config,
                         max_new_tokens=32)
    alone = sfi.generate(model, tokenizer, prompts[1], mode="exact", config=config,
                         max_new_tokens=32)
    for prompt, f, e in zip(prompts, full, batch):
        _assert_same_tokens(model, tokenizer, prompt, e.token_ids, f.token_ids)
    _assert_same_tokens(model, tokenizer, prompts[1], alone.token_ids, full[1].token_ids)
    stats = [r.stats for r in (*batch, alone)]
    assert all(s.verify_steps > 0 for s in stats)
    assert any(s.accepted < s.drafted for s in stats)  # rejections were exercised
    assert batch[0].to_dict()["stats"]["exact"]["verify_steps"] == stats[0].verify_steps


@pytest.fixture
def poisoned_rewind(monkeypatch):
    """Every rewind first fills the positions it forgets with NaN: a draft's KV, or a
    verify's rejected positions, left in the cache would show up in the logits and the KV."""
    original = SlowFastCache.rewind

    def rewind(self, length):
        for layer in self._sfi_layers():
            layer._keys[:, :, length: layer.length] = float("nan")
            layer._values[:, :, length: layer.length] = float("nan")
        original(self, length)

    monkeypatch.setattr(SlowFastCache, "rewind", rewind)


def test_the_cache_holds_full_attentions_kv_after_every_verify(tiny_llama_with_tokenizer,
                                                                poisoned_rewind):
    model, tokenizer = tiny_llama_with_tokenizer
    prompts = [essay(160, tokenizer), essay(120, tokenizer)[40:]]
    encoded = encode_prompts(tokenizer, prompts, False, torch.device("cpu"))
    ids, mask = encoded.input_ids, encoded.attention_mask
    config = SFIConfig(**DRAFTING, trigger="fixed", period=6)
    with torch.inference_mode():
        cache = SlowFastCache(model, config, tokenizer=tokenizer)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = prefill(model, cache, ids, attention_mask=mask, positions=positions)
        decoder = ExactDecoder(model, cache)
        token, position, fed, ragged = logits.argmax(-1), positions[:, -1], [ids], 0
        acceptances = [DraftAcceptance(), DraftAcceptance()]  # each row's, replayed
        for _ in range(8):
            emitted = decoder.advance(token, position, mask, [True, True], room=64)
            for acceptance, count in zip(acceptances, emitted.counts.tolist()):
                acceptance.record(count - 1, 4)
            # each row's inputs fill the round's first slots; the rest are its holes
            fed.append(torch.cat([token[:, None], emitted.tokens[:, :-1]], 1))
            mask = torch.cat([mask, emitted.slots()], 1)
            ragged += int(emitted.counts.min() < emitted.tokens.shape[1])
            position = position + emitted.counts
            token = emitted.last
        everything = torch.cat(fed, 1)
        reference = DynamicCache(config=model.config)
        model(input_ids=everything, attention_mask=mask,
              position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              **{cache_argument(model): reference})
    stats = cache.stats()
    assert stats.verify_steps == 2 * 8 and 0 < stats.accepted < stats.drafted
    assert cache.get_seq_length() == everything.shape[1]
    assert ragged > 0  # the rows committed different numbers of tokens in some round
    assert [seq.acceptance for seq in cache.planner.sequences] == acceptances
    assert [cache.holes(r) for r in range(2)] == [
        [int(s) for s in (mask[r] == 0).nonzero()[:, 0] if s >= cache.padding(r)]
        for r in range(2)]
    real = mask.bool()[:, None, :, None]  # padding positions hold whatever was written
    for layer, (keys, values) in zip(cache.layers, _reference_kv(reference)):
        assert not torch.isnan(layer.keys).any() and not torch.isnan(layer.values).any()
        for r in range(2):  # a hole keeps nothing of the draft it held
            assert not layer.keys[r, :, cache.holes(r)].any()
        torch.testing.assert_close(layer.keys * real, keys * real, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values * real, values * real, atol=1e-4, rtol=1e-4)
    for row in range(2):  # the memories the verifies laid out lie in the middle region
        memory = cache.memory(row)
        assert memory is not None and memory.recent_start <= cache.get_seq_length()
        chosen = cache.selected_positions(1, row)
        assert bool(((chosen >= memory.sink_end) & (chosen < memory.recent_start)).all())


def _reference_kv(cache: DynamicCache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_sampled_tokens_are_distributed_as_full_attentions():
    """20,000 rows of one prompt in one batch (each row commits its own accepted drafts):
    the first three sampled tokens follow full attention's law, where the drafter's own law
    (lossy SFI) does not."""
    torch.manual_seed(0)
    v = 8
    model = tiny_model("llama", vocab_size=v, seed=1)
    prompt = torch.randint(0, v, (1, 40))
    config = SFIConfig(sink=1, recent=2, k_head=3, page_size=1, coverage_layers=0, min_skip=0,
                       min_gain=1.0, trigger="fixed", period=50, draft_fallback=False,
                       draft_tokens=3, draft_min=3, draft_max=3)
    law = _full_law(model, prompt, v, temperature=0.7)
    n = 20_000
    with torch.inference_mode():
        cache = SlowFastCache(model, config)
        head = DynamicCache(config=model.config)  # the prompt's head once, for every row
        model(input_ids=prompt[:, :36], **{cache_argument(model): head})
        cache.load_prefix([(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
                           for k, v in _reference_kv(head)])
        logits = prefill(model, cache, prompt[:, 36:].expand(n, -1), start=36)
        gen = torch.Generator().manual_seed(0)
        first = torch.multinomial(token_distribution(logits, 0.7, 1.0), 1, generator=gen)[:, 0]
        decoder = ExactDecoder(model, cache, Sampling(0.7, 1.0, gen))
        rows, token, position = [[t] for t in first.tolist()], first, torch.full((n,), 39)
        while min(len(r) for r in rows) < 3:
            emitted = decoder.advance(token, position, None, [len(r) < 3 for r in rows], room=8)
            for row, tokens in zip(rows, emitted.rows()):
                row.extend(tokens)
            position, token = position + emitted.counts, emitted.last
    drawn = torch.tensor([r[:3] for r in rows])
    assert cache.stats().verify_steps >= 1
    index = (drawn[:, 0] * v + drawn[:, 1]) * v + drawn[:, 2]
    counts = torch.bincount(index, minlength=v ** 3).float()
    assert _chi2_ok(counts, law.flatten())
    # the test can fail: the drafter's law (sparse attention alone) is rejected
    assert not _chi2_ok(counts, _sparse_law(model, prompt, v, config, 0.7).flatten())


def _full_law(model, prompt, v, temperature):
    """p(t1, t2, t3 | prompt) under full attention, ``[v, v, v]``."""
    with torch.inference_mode():
        p1 = torch.softmax(model(input_ids=prompt).logits[0, -1] / temperature, -1)
        one = torch.cat([prompt.expand(v, -1), torch.arange(v)[:, None]], 1)
        p2 = torch.softmax(model(input_ids=one).logits[:, -1] / temperature, -1)  # [v, v]
        two = torch.cat([prompt.expand(v * v, -1), torch.arange(v).repeat_interleave(v)[:, None],
                         torch.arange(v).repeat(v)[:, None]], 1)
        p3 = torch.softmax(model(input_ids=two).logits[:, -1] / temperature, -1).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def _sparse_law(model, prompt, v, config, temperature):
    """The same law with t2 and t3 from fast steps (lossy SFI's drafts)."""
    with torch.inference_mode():
        p1 = torch.softmax(model(input_ids=prompt).logits[0, -1] / temperature, -1)
        rows = v * v
        cache = SlowFastCache(model, config)
        prefill(model, cache, prompt.expand(rows, -1))
        t1 = torch.arange(v).repeat_interleave(v)
        t2 = torch.arange(v).repeat(v)
        from sfi.decoding.decode_step import decode_one

        l2 = decode_one(model, cache, t1, torch.full((rows,), 40))
        l3 = decode_one(model, cache, t2, torch.full((rows,), 41))
        p2 = torch.softmax(l2 / temperature, -1).view(v, v, v)[:, 0]  # [t1, t2]
        p3 = torch.softmax(l3 / temperature, -1).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_committed_inputs_walk_the_trigger_and_a_rejected_first_draft_refreshes():
    from sfi.core.sequence_policy import (
        ACCEPTANCE,
        SLOW,
        Memory,
        SequenceState,
        record_step,
        record_verified,
    )
    from sfi.core.triggers import FixedPeriodTrigger

    seq = SequenceState(pad=0, config=SFIConfig(min_refresh_gap=2),
                        trigger=FixedPeriodTrigger(4), scorer=None)
    seq.memory = Memory(pad=0, sink=4, sink_end=4, recent_start=10, k=5)
    record_verified(seq, [1, 2], refreshed=False, accepted=1)
    assert seq.steps_since_refresh == 2 and seq.refresh_due is None
    record_verified(seq, [3, 4, 5], refreshed=False, accepted=2)  # the 4th step fires
    assert seq.refresh_due == "period" and seq.steps_since_refresh == 5
    seq.refresh_due = ACCEPTANCE  # a verify refreshed for it (the plan's commit counts it)
    record_step(seq, SLOW, decode=False, memory=seq.memory, reason=ACCEPTANCE)
    record_verified(seq, [6, 7, 8], refreshed=True, accepted=2)
    assert seq.refresh_due is None and seq.steps_since_refresh == 2
    assert seq.stats.refresh_reasons[ACCEPTANCE] == 1
    record_verified(seq, [9], refreshed=False, accepted=0)  # rejected at the first draft
    assert seq.refresh_due == ACCEPTANCE
