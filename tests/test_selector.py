"""Each Selector stage against a direct transcription of docs/method.md section 3."""

from __future__ import annotations

import math

import pytest
import torch

from sfi import SFIConfig
from sfi.core.scorers import Evidence
from sfi.core.selector import (
    SFISelector,
    best_pages_slots,
    compact_slots,
    evidence_distribution,
    exclusivity,
    fuse,
    fusion_weight,
    prior_distribution,
    rank_keys,
    selection_order,
    soft_nms,
    top_k_positions,
)

T, LO, HI = 40, 4, 30


def region(t=T, lo=LO, hi=HI, b=1):
    cand = torch.zeros(b, t, dtype=torch.bool)
    cand[:, lo:hi] = True
    return cand, torch.full((b,), lo), torch.full((b,), hi)


def test_evidence_is_power_mean_of_restricted_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 2, 5, T)
    cand, _, _ = region()
    f = evidence_distribution(logits, cand, alpha=0.5)
    for h in range(2):
        expected = []
        for i in range(T):
            if not LO <= i < HI:
                expected.append(0.0)
                continue
            rows = [math.exp(logits[0, h, r, i]) / float(torch.exp(logits[0, h, r]).sum())
                    for r in range(5)]
            expected.append((sum(p ** 0.5 for p in rows) / 5) ** 2)
        total = sum(expected)
        torch.testing.assert_close(f[0, h], torch.tensor(expected) / total, atol=1e-6, rtol=1e-5)
    geometric = evidence_distribution(logits, cand, alpha=0.0)
    assert torch.allclose(geometric.sum(-1), torch.ones(1, 2))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
def test_evidence_ignores_rows_that_see_nothing(alpha):
    """A padding query (a row of a batch whose evidence window is shorter than another's)
    sees no key: the evidence is that of the other rows, whatever the power mean."""
    logits = torch.randn(1, 1, 3, T)
    cand, _, _ = region()
    blind = logits.clone()
    blind[0, 0, 2] = float("-inf")
    f_two = evidence_distribution(logits[:, :, :2], cand, alpha)
    torch.testing.assert_close(evidence_distribution(blind, cand, alpha), f_two)
    given = torch.softmax(blind, dim=-1)  # the engine's own softmax: NaN there too
    torch.testing.assert_close(evidence_distribution(blind, cand, alpha, given), f_two)


def test_prior_transcribes_the_formula():
    torch.manual_seed(1)
    norms = torch.rand(1, 2, T) + 0.5
    cand, lo, hi = region()
    kw = dict(gamma=0.5, w_norm=1.0, w_pos=0.7, power=1.8, eta=0.4, beta=-math.log(0.6) / 0.9)
    r = prior_distribution(norms, cand, lo, hi, **kw)
    for h in range(2):
        logs = []
        for i in range(LO, HI):
            u = (i - LO) / (HI - LO - 1)
            pos = -kw["beta"] * u ** 1.8 + (0.4 * math.log(1 - u) if u < 1 else -math.inf)
            logs.append(1.0 * (-0.5 * math.log(norms[0, h, i])) + 0.7 * pos)
        m = max(logs)
        z = sum(math.exp(x - m) for x in logs)
        expected = torch.zeros(T)
        expected[LO:HI] = torch.tensor([math.exp(x - m) / z for x in logs])
        torch.testing.assert_close(r[0, h], expected, atol=1e-6, rtol=1e-5)
    assert r[0, :, HI - 1].eq(0).all()  # log(1 - u) = -inf at the far end


def test_prior_weight_zero_is_uniform():
    cand, lo, hi = region()
    r = prior_distribution(torch.rand(1, 1, T) + 0.1, cand, lo, hi, gamma=0.5, w_norm=0.0,
                           w_pos=0.0, power=1.8, eta=0.4, beta=0.5)
    torch.testing.assert_close(r[0, 0, LO:HI], torch.full((HI - LO,), 1 / (HI - LO)))


def _kl(p, q):
    mask = p > 0
    return float((p[mask] * (p[mask] / q[mask]).log()).sum())


def test_lambda_closed_form_matches_numerical_minimisation():
    torch.manual_seed(2)
    f = torch.softmax(torch.randn(1, 1, 30) * 2, -1).double()
    r = torch.softmax(torch.randn(1, 1, 30), -1).double()
    lam = float(fusion_weight(f, r, cap=1.0))
    grid = torch.linspace(0, 1, 20001, dtype=torch.float64)
    sq = [float(((f - g * (f - r)) ** 2).sum()) for g in grid]
    best = float(grid[int(torch.tensor(sq).argmin())])
    assert lam == pytest.approx(best, abs=1e-4)
    # and s = (1 - lambda) f + lambda r minimises (1 - lambda) KL(f||s) + lambda KL(r||s)
    s = fuse(f, r, torch.tensor([[lam]], dtype=torch.float64))
    objective = lambda q: (1 - lam) * _kl(f[0, 0], q) + lam * _kl(r[0, 0], q)  # noqa: E731
    for other in (0.8 * s + 0.2 * f, 0.8 * s + 0.2 * r, torch.full_like(s, 1 / 30)):
        assert objective(s[0, 0]) <= objective(other[0, 0]) + 1e-12


def test_lambda_is_clipped_and_zero_when_equal():
    f = torch.tensor([[[0.9, 0.05, 0.05]]])
    r = torch.tensor([[[0.1, 0.45, 0.45]]])
    assert float(fusion_weight(f, r, cap=0.35)) == pytest.approx(0.35)
    assert float(fusion_weight(f, f, cap=0.35)) == 0.0
    assert float(fusion_weight(f, r, cap=0.0)) == 0.0


def test_soft_nms_keeps_maxima_and_pushes_neighbours():
    cand, _, _ = region(t=12, lo=0, hi=12)
    logs = torch.tensor([[[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 0.0]]])
    out = soft_nms(logs, cand, radius=1, strength=1.0)
    assert out[0, 0, 1] == 5.0 and out[0, 0, 9] == 3.0  # local maxima unchanged
    assert out[0, 0, 2] == 4.0 - (5.0 - 4.0)
    assert out[0, 0, 10] == 1.0 - (3.0 - 1.0)
    assert out[0, 0, 0] == 0.0 - 5.0
    # a transcription: l'(i) = l(i) - max(0, max_{|j-i|<=r} l(j) - l(i))
    for i in range(12):
        m = max(logs[0, 0, max(0, i - 1): i + 2])
        assert out[0, 0, i] == logs[0, 0, i] - max(0.0, float(m - logs[0, 0, i]))
    torch.testing.assert_close(soft_nms(logs, cand, radius=1, strength=0.0), logs)


def test_soft_nms_ignores_positions_outside_the_region():
    cand, _, _ = region(t=6, lo=2, hi=6)
    logs = torch.tensor([[[9.0, 9.0, 1.0, 0.5, 0.2, 0.1]]])
    out = soft_nms(logs, cand, radius=1)
    assert out[0, 0, 2] == 1.0  # the 9s next to it are not candidates


def test_exclusivity_discounts_shared_positions():
    cand, _, _ = region(t=2, lo=0, hi=2)
    # position 0 is wanted by all three heads, position 1 only by head 0
    logs = torch.tensor([[[2.0, 2.0], [2.0, -5.0], [2.0, -5.0]]])
    out = exclusivity(logs, cand, temperature=2.0, strength=0.85)
    rho = torch.softmax(logs / 2.0, dim=1)
    torch.testing.assert_close(out, logs + 0.85 * rho.log())
    assert out[0, 0, 1] > out[0, 0, 0]  # head 0 now prefers its exclusive position
    assert torch.equal(exclusivity(logs[:, :2], cand), logs[:, :2])  # skipped with <= 2 KV heads
    assert torch.equal(exclusivity(logs, cand, strength=0.0), logs)


def test_top_k_is_sorted_distinct_in_region_and_sized():
    torch.manual_seed(3)
    cand = torch.zeros(2, T, dtype=torch.bool)
    cand[0, 4:30] = True
    cand[1, 10:14] = True  # only 4 candidates
    scores = torch.randn(2, 3, T)
    scores[0, 0, 5] = float("-inf")  # a candidate with zero mass is still a candidate
    k = torch.tensor([26, 4])
    pos, valid = top_k_positions(scores, cand, k)
    for b in range(2):
        n = int(k[b])
        assert valid[b].sum() == n
        for h in range(3):
            chosen = pos[b, h, :n]
            assert chosen.unique().numel() == n
            assert bool(cand[b, chosen].all())
            assert torch.equal(chosen, chosen.sort().values)
    torch.testing.assert_close(pos[0, 1, :26], torch.arange(4, 30))  # everything when K = |M|


def test_top_k_picks_the_best():
    cand = torch.ones(1, 10, dtype=torch.bool)
    scores = torch.arange(10.0).view(1, 1, 10)
    pos, _ = top_k_positions(scores, cand, torch.tensor([3]))
    assert pos[0, 0].tolist() == [7, 8, 9]


def test_selector_composes_the_stages():
    torch.manual_seed(4)
    cfg = SFIConfig.paper()
    cand, lo, hi = region(b=2)
    ev = Evidence(logits=torch.randn(2, 4, 3, T), key_norms=torch.rand(2, 4, T) + 0.5,
                  candidates=cand, lo=lo, hi=hi, layer_idx=0)
    out = SFISelector(cfg).score(ev)
    f = evidence_distribution(ev.logits, cand, cfg.alpha)
    r = prior_distribution(ev.key_norms, cand, lo, hi, gamma=cfg.gamma, w_norm=cfg.w_norm,
                           w_pos=cfg.w_pos, power=cfg.pos_power, eta=cfg.eta, beta=cfg.beta)
    s = fuse(f, r, fusion_weight(f, r, cfg.lambda_cap_multi))  # 3 rows -> the R > 1 cap
    expected = exclusivity(soft_nms(s.log().masked_fill(~cand[:, None], float("-inf")), cand),
                           cand)
    torch.testing.assert_close(out, expected)
    assert torch.isinf(out[:, :, :LO]).all() and torch.isinf(out[:, :, HI:]).all()


@pytest.mark.parametrize("page", [2, 4, 16])
@pytest.mark.parametrize("shifted", [False, True], ids=["aligned", "shifted"])
def test_whole_pages_found_in_page_space_equal_the_smallest_rank_keys(page, shifted):
    """selection_order's page-space path (no pinned or kept positions) takes the same positions
    in the same order as the k smallest rank keys over every position: ties, -inf scores,
    scattered candidates and partial pages included."""
    generator = torch.Generator().manual_seed(page + 100 * shifted)
    for trial in range(40):
        b, t = 1 + trial % 3, int(torch.randint(20, 300, (), generator=generator))
        scores = torch.randn(b, 3, t, generator=generator)
        if trial % 3 == 0:
            scores = scores.round()  # ties between pages
        if trial % 5 == 0:
            scores[..., ::7] = float("-inf")
        if trial % 4 == 0:
            candidates = torch.rand(b, t, generator=generator) < 0.5
        else:
            lo = torch.randint(0, t // 3, (b,), generator=generator)
            hi = torch.randint(t // 2, t + 1, (b,), generator=generator)
            positions = torch.arange(t)
            candidates = (positions >= lo[:, None]) & (positions < hi[:, None])
        k = (torch.rand(b, generator=generator) * candidates.sum(-1)).long()
        shift = torch.randint(1, page, (b,), generator=generator) if shifted else None
        order, valid = selection_order(scores, candidates, k, page, shift=shift)
        keys = rank_keys(scores, candidates, page, shift)
        expected = torch.topk(keys, int(k.max()), dim=-1, largest=False).indices
        hidden = ~valid[:, None, :]
        assert torch.equal(order.masked_fill(hidden, -1), expected.masked_fill(hidden, -1))


@pytest.mark.parametrize("page,shifted", [(4, False), (16, False), (8, True)])
def test_whole_pages_in_position_order_equal_the_sorted_selection(page, shifted):
    """best_pages_slots (pages put in position order, no sort of positions) gives what
    compact_slots makes of selection_order: the same slots, first candidate past each row's k."""
    generator = torch.Generator().manual_seed(7 + page + 100 * shifted)
    for trial in range(40):
        b, t = 1 + trial % 3, int(torch.randint(20, 300, (), generator=generator))
        scores = torch.randn(b, 3, t, generator=generator)
        if trial % 3 == 0:
            scores = scores.round()
        if trial % 5 == 0:
            scores[..., ::7] = float("-inf")
        if trial % 4 == 0:
            candidates = torch.rand(b, t, generator=generator) < 0.5
            candidates[:, 0] = True
        else:
            lo = torch.randint(0, t // 3, (b,), generator=generator)
            hi = torch.randint(t // 2, t + 1, (b,), generator=generator)
            positions = torch.arange(t)
            candidates = (positions >= lo[:, None]) & (positions < hi[:, None])
        k = (torch.rand(b, generator=generator) * candidates.sum(-1)).long().clamp(min=1)
        shift = torch.randint(1, page, (b,), generator=generator) if shifted else None
        order, valid = selection_order(scores, candidates, k, page, shift=shift)
        expected = compact_slots(order, valid, candidates, torch.zeros_like(k))
        assert torch.equal(best_pages_slots(scores, candidates, k, page, shift), expected)
