"""Baseline scorers behind the Selector's interface, against transcriptions of their rules."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from helpers import lockstep

from sfi import SFIConfig, SFIError
from sfi.core.scorers import Evidence, key_norms_of, make_evidence
from sfi.core.scorers.registry import make_scorer
from sfi.core.scorers.snapkv import SnapKVScorer
from sfi.core.scorers.tova import TOVAScorer


def _evidence(g=3, w=4, t=20, b=1, h=2, seed=0):
    torch.manual_seed(seed)
    cand = torch.zeros(b, t, dtype=torch.bool)
    cand[:, 2:16] = True
    return Evidence(logits=torch.randn(b, h, g * w, t), key_norms=torch.ones(b, h, t),
                    candidates=cand, lo=torch.full((b,), 2), hi=torch.full((b,), 16),
                    layer_idx=0, queries=w)


def test_snapkv_is_pooled_mean_attention():
    ev = _evidence()
    scores = SnapKVScorer(kernel=5).score(ev)
    attention = torch.softmax(ev.logits, -1).mean(-2)  # mean over (query head, query) rows
    for h in range(2):
        for j in range(20):
            window = attention[0, h, max(0, j - 2): j + 3]
            assert scores[0, h, j] == pytest.approx(float(window.mean()), abs=1e-6)
    maxed = SnapKVScorer(kernel=7, pooling="max").score(ev)
    assert maxed[0, 0, 10] == pytest.approx(float(attention[0, 0, 7:14].max()), abs=1e-6)
    with pytest.raises(ValueError, match="odd"):
        SnapKVScorer(kernel=4)


def test_tova_is_the_last_query_averaged_over_heads():
    ev = _evidence(g=3, w=4)
    scores = TOVAScorer().score(ev)
    attention = torch.softmax(ev.logits, -1).reshape(1, 2, 3, 4, 20)
    torch.testing.assert_close(scores, attention[:, :, :, -1].mean(2))
    single = _evidence(g=3, w=1)
    torch.testing.assert_close(TOVAScorer().score(single),
                               torch.softmax(single.logits, -1).mean(2))


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_scorers_drive_the_same_mechanics(name):
    model = tiny_model("llama")
    config = SFIConfig.paper(sink=2, recent=6, k_head=9, force_sparse=True, trigger="fixed",
                             period=4,
                       evidence_window=8)
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(9))
    run = lockstep(model, ids, config, steps=6, scorer=make_scorer(name, config))
    assert run.cache.scorer.__class__.__name__.lower().startswith(name)
    memory = run.cache.memory(0)
    for layer in run.cache.layers:
        chosen = run.cache.selected_positions(layer.layer_idx, 0)
        assert chosen.shape == (3, 9)
        assert bool(((chosen >= 2) & (chosen < memory.recent_start)).all())
    assert [k[0] for k in run.kinds].count("fast") >= 4


def test_unknown_scorer():
    with pytest.raises(SFIError, match="unknown scorer 'h3o'"):
        make_scorer("h3o", SFIConfig())


def test_make_evidence_is_the_one_builder():
    """Key norms from the keys (a dim-major view reads the same), candidates from [lo, hi), the
    keys kept only beside evidence queries."""
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 10, 4)
    logits = torch.randn(2, 3, 5, 10)
    lo, hi = torch.tensor([2, 3]), torch.tensor([8, 6])
    plain = make_evidence(logits, 0, lo, hi, keys=keys)
    dim_major = keys.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    assert dim_major.stride(-1) != 1
    torch.testing.assert_close(key_norms_of(dim_major), keys.norm(dim=-1))
    torch.testing.assert_close(plain.key_norms, keys.norm(dim=-1))
    assert plain.candidates[0].nonzero().flatten().tolist() == list(range(2, 8))
    assert plain.candidates[1].nonzero().flatten().tolist() == [3, 4, 5]
    assert plain.keys is None and plain.query is None
    query = torch.randn(2, 3, 5, 4)
    with_query = make_evidence(logits, 0, lo, hi, keys=keys, query=query, queries=5)
    assert with_query.keys is keys and with_query.queries == 5
    with pytest.raises(ValueError, match="needs keys or key_norms"):
        make_evidence(logits, 0, lo, hi)
