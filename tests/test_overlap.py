"""A compact rebuild that is not ready yet: its rows read densely, then switch when it lands.

This exercises, on CPU, the mechanism the CUDA side stream uses (docs/method.md section 4)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sfi import SFIConfig, SlowFastCache
from sfi.core.overlap import InlineRebuilder, StackingRebuilder, StagedCompact, make_rebuilder
from sfi.hf.facts import cache_argument


class DeferredRebuilder:
    """Computes a rebuild at once but reports it unfinished until ``release()``."""

    def __init__(self) -> None:
        self.released = False
        self.submitted = 0

    def release(self) -> None:
        self.released = True

    asynchronous = True

    def submit(self, refresh, inputs) -> StagedCompact:
        self.submitted += 1
        keys, values, positions = refresh.run()
        return StagedCompact(refresh.rows, keys, values, positions, refresh.width,
                             lambda: self.released, lambda: None)

    def flush(self) -> None:
        return None

    def discard(self) -> None:
        return None


def test_rows_read_densely_until_their_rebuild_is_ready():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(0))
    config = SFIConfig.paper(sink=2, recent=6, k_head=6, force_sparse=True, trigger="bootstrap")
    sparse = SlowFastCache(model, config)
    deferred = DeferredRebuilder()
    sparse.rebuilder = deferred
    reference = SlowFastCache(model, SFIConfig(**{**config.to_dict(), "k_head": 1000}))
    key = cache_argument(model)
    tokens, diffs = ids, []
    with torch.inference_mode():
        for step in range(6):
            if step == 3:
                deferred.release()
            a = model(input_ids=tokens, use_cache=True, **{key: sparse}).logits[:, -1]
            b = model(input_ids=tokens, use_cache=True, **{key: reference}).logits[:, -1]
            diffs.append(float((a - b).abs().max()))
            tokens = b.argmax(-1, keepdim=True)
            if step >= 1:  # planned fast; lagged (read densely) while the rebuild runs
                assert sparse.step_kinds() == (("lagged",) * 2 if step < 3 else ("fast",) * 2)
    assert deferred.submitted == 2  # the first selection of two layers, after prefill
    stats = sparse.stats()
    assert (stats.lagged_steps, stats.fast_steps) == (4, 6)  # 2 rows x steps 1-2, and 3-5
    assert 0 < stats.fast_read_fraction < 1 and stats.read_fraction > stats.fast_read_fraction
    # fast steps 1-2: the selection is still "running", so they read densely = full attention
    assert diffs[1] < 1e-5 and diffs[2] < 1e-5
    # from step 3 on the rebuild has landed: the small memory is read, and it differs
    assert min(diffs[3:]) > 1e-3
    for attention, layer in zip(sparse.attention, sparse.layers):
        assert attention.pending is None and layer.compact_positions is not None


def test_stacked_over_layers_on_cpu():
    assert isinstance(make_rebuilder(torch.device("cpu"), overlap=True), StackingRebuilder)


def _decode(model, cache, ids, steps):
    """Prefill ``ids`` then ``steps`` greedy steps; the last logits and every layer's memory."""
    key = cache_argument(model)
    tokens, logits = ids, []
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=tokens, use_cache=True, **{key: cache}).logits[:, -1]
            logits.append(out)
            tokens = out.argmax(-1, keepdim=True)
    return torch.stack(logits), [layer.compact_positions.clone() for layer in cache.layers]


def test_refreshes_stacked_over_layers_equal_each_layer_alone():
    """The CPU default (every layer's refresh selected in one call at the forward's end) gives
    the logits and memories of selecting each layer at once, with hysteresis and pins."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(3))
    config = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed",
                       period=3, coverage_layers=0, hysteresis=0.5, pin_fraction=0.25)
    stacked, inline = SlowFastCache(model, config), SlowFastCache(model, config)
    stacked.rebuilder = StackingRebuilder()
    inline.rebuilder = InlineRebuilder()
    a, memories_a = _decode(model, stacked, ids, 8)
    b, memories_b = _decode(model, inline, ids, 8)
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(memories_a, memories_b))
    assert stacked.stats().slow_steps >= 2


def test_a_forward_that_fails_leaves_no_refresh_behind():
    """Refreshes waiting for the end of a forward that raised are dropped at the next forward:
    the layers keep the memories the planner last committed."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(4))
    config = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed",
                       period=2, coverage_layers=0)
    cache = SlowFastCache(model, config)
    _, before = _decode(model, cache, ids, 2)  # prefill (first selection), one fast step
    last_layer = model.model.layers[-1]
    original = last_layer.forward

    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    last_layer.forward = failing
    key = cache_argument(model)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids[:, -1:], use_cache=True, **{key: cache})  # a slow step
    finally:
        last_layer.forward = original
    assert cache.rebuilder._waiting  # the slow step's refreshes never reached the end
    with torch.inference_mode():
        cache.begin_forward(ids[:, -1:], None, 1, 1, ids.device)
    assert not cache.rebuilder._waiting
    for attention, layer, memory in zip(cache.attention, cache.layers, before):
        attention.settle(wait=True)
        assert attention.pending is None and torch.equal(layer.compact_positions, memory)


def test_a_stacked_refresh_frees_its_memory_once_dropped():
    """A landed refresh's packed tensors go with the last reference to it: no reference cycle
    keeps them until the cycle collector runs (the vLLM plugin drops them at once)."""
    import gc
    import weakref

    from sfi.core.overlap import Refresh
    from sfi.core.refresh_selection import SelectionGroup, SelectionRule
    from sfi.core.rows import Rows
    from sfi.core.scorers import make_evidence
    from sfi.core.scorers.registry import make_scorer

    n, h, t = 1, 2, 32
    evidence = make_evidence(torch.randn(n, h, 1, t), 0, torch.tensor([2]), torch.tensor([24]),
                             key_norms=torch.rand(n, h, t))
    group = SelectionGroup(make_scorer("sfi", SFIConfig()), SelectionRule(), None)
    refresh = Refresh(Rows((0,), 1, torch.device("cpu")), evidence, (group,), torch.tensor([4]),
                      torch.tensor([0]), None,
                      lambda slots: (torch.zeros(1000), torch.zeros(1000), slots), 8)
    rebuilder = StackingRebuilder()
    gc.disable()
    try:
        staged = rebuilder.submit(refresh, [])
        assert rebuilder.waiting and not staged.ready()
        rebuilder.flush()
        assert staged.ready() and not rebuilder.waiting
        keys = weakref.ref(staged.keys)
        del staged
        assert keys() is None
    finally:
        gc.enable()
