"""Sequences join a running batch after their own prefill and leave when done (merge/keep)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sfi import SFIConfig, SlowFastCache
from sfi.errors import SFIError
from sfi.hf.facts import cache_argument

CONFIG = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed", period=3)


def _step(model, cache, tokens, positions):
    key = cache_argument(model)
    return model(input_ids=tokens, position_ids=positions, use_cache=True,
                 **{key: cache}).logits[:, -1]


def _alone(model, prompt, steps, config=CONFIG, dense_only=False):
    """Logits of ``prompt`` decoded alone, greedily, for ``steps`` steps after prefill."""
    cache = SlowFastCache(model, config, dense_only=dense_only)
    out, tokens = [], prompt
    positions = torch.arange(prompt.shape[1])[None]
    for _ in range(steps + 1):
        logits = _step(model, cache, tokens, positions)
        out.append(logits[0])
        tokens, positions = logits.argmax(-1, keepdim=True), positions[:, -1:] + 1
    return out


def _follow(model, cache, tokens, positions, *expected):
    """Decode greedily; at step i, row r's logits must equal ``expected[r][i]``."""
    for wanted in zip(*expected):
        logits = _step(model, cache, tokens, positions)
        for row, want in enumerate(wanted):
            torch.testing.assert_close(logits[row], want, atol=2e-5, rtol=1e-5)
        tokens, positions = logits.argmax(-1, keepdim=True), positions + 1
    return tokens, positions


@torch.inference_mode()
def test_join_and_leave_give_each_sequence_its_lone_logits():
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(7)
    first, second = torch.randint(1, 256, (1, 50), generator=g), torch.randint(1, 256, (1, 30),
                                                                                 generator=g)
    alone_first = _alone(model, first, 12)
    alone_second = _alone(model, second, 6, dense_only=True)

    batch = SlowFastCache(model, CONFIG)
    logits = _step(model, batch, first, torch.arange(50)[None])
    torch.testing.assert_close(logits[0], alone_first[0])
    tokens, positions = logits.argmax(-1, keepdim=True), torch.tensor([[50]])
    # the first sequence decodes alone for three steps
    tokens, positions = _follow(model, batch, tokens, positions, alone_first[1:4])

    joiner = SlowFastCache(model, CONFIG, dense_only=True)  # a full-attention request
    joined = _step(model, joiner, second, torch.arange(30)[None])
    torch.testing.assert_close(joined[0], alone_second[0])
    batch.merge(joiner)
    assert [batch.padding(r) for r in range(batch.batch_size)] == [0, 53 - 30]
    tokens = torch.cat([tokens, joined.argmax(-1, keepdim=True)])
    positions = torch.cat([positions, torch.tensor([[30]])])
    # both decode together
    tokens, positions = _follow(model, batch, tokens, positions, alone_first[4:10],
                                alone_second[1:7])
    assert batch.stats(1).dense_steps == 6 and batch.stats(1).fast_steps == 0
    assert batch.stats(0).fast_steps > 0

    batch.keep([0])  # the second leaves: the first goes on alone, nothing recomputed
    assert [batch.padding(r) for r in range(batch.batch_size)] == [0]
    _follow(model, batch, tokens[:1], positions[:1], alone_first[10:13])


@torch.inference_mode()
def test_leaving_trims_shared_padding():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(8)
    long, short = torch.randint(1, 256, (1, 40), generator=g), torch.randint(1, 256, (1, 12),
                                                                               generator=g)
    alone_short = _alone(model, short, 4)
    batch = SlowFastCache(model, CONFIG)
    a = _step(model, batch, long, torch.arange(40)[None])
    other = SlowFastCache(model, CONFIG)
    b = _step(model, other, short, torch.arange(12)[None])
    batch.merge(other)
    batch.keep([1])  # the long one leaves; the short one's 28 pads are trimmed
    assert batch.get_seq_length() == 12 and batch.padding(0) == 0
    del a
    _follow(model, batch, b.argmax(-1, keepdim=True), torch.tensor([[12]]), alone_short[1:5])


@torch.inference_mode()
def test_each_sequence_keeps_its_own_config_and_scorer_in_a_merged_batch():
    """Sink, recent window, budget, evidence window, trigger period and scorer all differ
    between the two sequences; merged, each still gets the logits it gets alone."""
    from sfi.core.scorers.registry import make_scorer

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(11)
    first, second = torch.randint(1, 256, (1, 60), generator=g), torch.randint(1, 256, (1, 41),
                                                                                 generator=g)
    config_a = SFIConfig.paper(sink=2, recent=6, k_head=8, evidence_window=4, force_sparse=True,
                         trigger="fixed", period=3)
    config_b = SFIConfig.paper(sink=5, recent=9, k_head=13, evidence_window=10, force_sparse=True,
                         trigger="fixed", period=4)
    scorer_b = make_scorer("snapkv", config_b)
    steps = 13
    alone_a = _alone(model, first, steps, config=config_a)
    cache_b = SlowFastCache(model, config_b, scorer=scorer_b)
    alone_b, tokens, positions = [], second, torch.arange(41)[None]
    for _ in range(steps + 1):
        logits = _step(model, cache_b, tokens, positions)
        alone_b.append(logits[0])
        tokens, positions = logits.argmax(-1, keepdim=True), positions[:, -1:] + 1

    batch = SlowFastCache(model, config_a)
    joiner = SlowFastCache(model, config_b, scorer=scorer_b)
    a = _step(model, batch, first, torch.arange(60)[None])
    b = _step(model, joiner, second, torch.arange(41)[None])
    batch.merge(joiner)
    assert batch.memory(0).sink == 2 and batch.memory(1).sink == 5
    tokens = torch.cat([a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)])
    kinds = []
    for step in range(1, steps + 1):
        logits = _step(model, batch, tokens, torch.tensor([[60 + step - 1], [41 + step - 1]]))
        torch.testing.assert_close(logits[0], alone_a[step], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1], alone_b[step], atol=2e-5, rtol=1e-5)
        kinds.append(batch.step_kinds())
        tokens = logits.argmax(-1, keepdim=True)
    assert ("slow", "fast") in kinds and ("fast", "slow") in kinds  # they refresh apart
    assert ("slow", "slow") in kinds  # and together (step 12), packing two sink sizes at once
    assert batch.memory(0).k == 8 and batch.memory(1).k == 13
    for layer in range(len(batch.layers)):
        chosen = batch.selected_positions(layer, 1)
        assert chosen.shape[-1] == 13 and bool((chosen >= batch.padding(1) + 5).all())


@torch.inference_mode()
def test_a_slow_row_refreshes_only_at_the_layers_it_reads_sparsely(monkeypatch):
    """Merged with a row whose config keeps no layer dense, a row that keeps its first layer
    dense refreshes its memory at the other layers only (its compact buffer at layer 0 is
    never read) and is probed there only, and each row still gets its lone logits."""
    from sfi.hf.layer_attention import SlowFastAttention

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(13)
    first, second = torch.randint(1, 256, (1, 50), generator=g), torch.randint(1, 256, (1, 37),
                                                                                 generator=g)
    config_a = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed",
                         period=50)
    config_b = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed",
                         period=3, dense_layers=1)
    steps = 10
    alone_a = _alone(model, first, steps, config=config_a)
    alone_b = _alone(model, second, steps, config=config_b)
    batch, joiner = SlowFastCache(model, config_a), SlowFastCache(model, config_b)
    a = _step(model, batch, first, torch.arange(50)[None])
    b = _step(model, joiner, second, torch.arange(37)[None])
    batch.merge(joiner)
    refreshed: list[tuple[int, tuple[int, ...]]] = []
    refresh = SlowFastAttention._refresh

    def spy(self, step, slow, *args, **kwargs):
        refreshed.append((self.layer_idx, slow.rows.indices))
        return refresh(self, step, slow, *args, **kwargs)

    monkeypatch.setattr(SlowFastAttention, "_refresh", spy)
    probed: list[tuple[int, tuple[int, ...]]] = []
    probe = SlowFastAttention._probe_coverage

    def probe_spy(self, step, plan, what, *args):
        probed.append((self.layer_idx, what.target.rows.indices))
        return probe(self, step, plan, what, *args)

    monkeypatch.setattr(SlowFastAttention, "_probe_coverage", probe_spy)
    tokens = torch.cat([a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)])
    b_alone_slow = 0
    for step in range(1, steps + 1):
        refreshed.clear()
        logits = _step(model, batch, tokens, torch.tensor([[50 + step - 1], [37 + step - 1]]))
        torch.testing.assert_close(logits[0], alone_a[step], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1], alone_b[step], atol=2e-5, rtol=1e-5)
        if batch.step_kinds() == ("fast", "slow"):
            b_alone_slow += 1
            assert sorted(layer for layer, _ in refreshed) == list(range(1, len(batch.layers)))
        tokens = logits.argmax(-1, keepdim=True)
    assert b_alone_slow >= 1
    assert {layer for layer, rows in probed if 1 in rows} == {1}  # its probes: sparse layers
    assert {layer for layer, rows in probed if 0 in rows} == {0, 1}
    with pytest.raises(SFIError, match="reads layer 0 densely"):
        batch.selected_positions(0, 1)
    assert batch.selected_positions(1, 1).shape[-1] == 8


@torch.inference_mode()
def test_a_reserved_slab_takes_joins_and_leaves_without_copying_the_batch():
    """Rows join into a slab reserved in advance and leave by giving their row back: a shorter
    joiner is written into a free row, a leaver's row is filled from below, the trimmed
    padding becomes room that lets a longer joiner in without moving anyone; through all of
    it every sequence gets the logits it gets alone."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(12)
    a, b, c, d = (torch.randint(1, 256, (1, n), generator=g) for n in (40, 12, 25, 36))
    alone = {name: _alone(model, prompt, 16) for name, prompt in
             (("a", a), ("b", b), ("c", c), ("d", d))}

    def prefill(prompt):
        cache = SlowFastCache(model, CONFIG, max_cache_len=96)
        logits = _step(model, cache, prompt, torch.arange(prompt.shape[1])[None])
        return cache, logits.argmax(-1, keepdim=True)

    batch, token_a = prefill(a)
    with pytest.raises(SFIError, match="rows >= 1"):
        batch.reserve(0)
    batch.reserve(3)
    layer = batch.layers[0]
    slab = layer._slab["_keys"]
    assert slab.shape[0] == 3 and layer.rows == 1 and layer.relayouts == 1
    rows = {"a": (token_a, 40, 1)}  # name: (last token, position, next step of its own)

    def follow(steps):
        names = list(rows)
        tokens = torch.cat([rows[n][0] for n in names])
        positions = torch.tensor([[rows[n][1]] for n in names])
        for i in range(steps):
            logits = _step(model, batch, tokens, positions)
            for row, name in enumerate(names):
                torch.testing.assert_close(logits[row], alone[name][rows[name][2] + i],
                                           atol=2e-5, rtol=1e-5)
            tokens, positions = logits.argmax(-1, keepdim=True), positions + 1
        for row, name in enumerate(names):
            rows[name] = (tokens[row: row + 1], int(positions[row]), rows[name][2] + steps)

    def join(name, prompt):
        cache, token = prefill(prompt)
        batch.merge(cache)
        rows[name] = (token, prompt.shape[1], 1)

    follow(2)
    join("b", b)  # shorter: a free row, 30 positions of padding, a stays in place
    join("c", c)
    assert layer._slab["_keys"] is slab and layer.rows == 3
    follow(3)
    batch.keep([1, 2])  # a leaves: b and c move up a row; their shared padding is trimmed
    del rows["a"]
    assert layer._slab["_keys"] is slab and layer.origin == 17
    assert [batch.padding(r) for r in range(2)] == [13, 0]
    follow(2)
    join("d", d)  # 6 longer than the batch (30): 6 of the 17 positions left of the origin
    assert layer._slab["_keys"] is slab and layer.origin == 11
    assert [batch.padding(r) for r in range(3)] == [19, 6, 0]
    follow(3)
    batch.keep([2, 0])  # out of order: c leaves, d before b
    del rows["c"]
    rows = {"d": rows["d"], "b": rows["b"]}
    assert layer._slab["_keys"] is slab and layer.rows == 2
    follow(2)
    assert layer.relayouts == 1  # the reserve, and no copy since
    e = torch.randint(1, 256, (1, 60), generator=g)
    alone["e"] = _alone(model, e, 4)
    before = [batch.padding(r) for r in range(2)]
    shift = 60 - batch.get_seq_length()
    assert shift > layer.origin
    join("e", e)  # longer than the room left of the origin: copied
    assert layer.relayouts == 2 and layer.origin == 0
    assert [batch.padding(r) for r in range(3)] == [p + shift for p in before] + [0]
    follow(3)
