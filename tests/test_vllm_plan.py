"""The vLLM plugin's pure parts (no vLLM needed): the per-request decisions mirror the
transformers path's planner, requests are told apart by their first block, slots are reused,
paged reads undo a kernel's packed layout, and ``SFI_VLLM`` is parsed strictly.

The plugin inside a running vLLM engine is tested in ``tests_vllm/`` (its own environment)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

import sfi
from sfi import SFIConfig
from sfi.core.memory_tensors import memory_positions
from sfi.core.refresh_selection import SelectionRule, select
from sfi.core.scorers.registry import make_scorer
from sfi.core.sequence_policy import refresh_memory
from sfi.core.triggers import token_classes
from sfi.errors import SFIConfigError
from sfi.vllm.paged import (
    BLOCKS,
    CHANNELS,
    DIM_MAJOR,
    MAX_RUNS,
    CacheLayout,
    empty_like_cache,
    logits_in_place,
    probe_layout,
    read_blocks,
    read_positions,
    read_prefix,
    read_range,
)
from sfi.vllm.refresh_inputs import RequestRefresh, read_refresh, window_selections
from sfi.vllm.requests import (
    DENSE,
    FAST,
    NO_TOKEN,
    SELECT,
    SLOW,
    RequestBook,
    slot_capacity,
)
from sfi.vllm.settings import parse_config

SMALL = dict(sink=2, recent=8, k_head=16, coverage_layers=0, min_skip=0,
             min_gain=1.0)


def book(config: SFIConfig, slots: int = 4, classes=None) -> RequestBook:
    return RequestBook(config, slots, slot_capacity(config, 4096), make_scorer("sfi", config),
                       classes)


def run_request(requests: RequestBook, key: int, prompt: int, new_tokens: int,
                chunk: int | None = None, generated: list[int] | None = None) -> list[str]:
    """The kinds of one request's steps: its prompt in chunks, then ``new_tokens - 1`` decode
    steps (the first new token comes from the prefill, as in vLLM and sfi.generate), each
    decode step's input the previous ``generated`` token."""
    kinds, done = [], 0
    while done < prompt:
        q = min(chunk or prompt, prompt - done)
        done += q
        kinds.append(requests.plan([key], [q], [done], [0])[0].kind)
    for step in range(1, new_tokens):
        token = generated[step - 1] if generated else NO_TOKEN
        kinds.append(requests.plan([key], [1], [prompt + step], [token])[0].kind)
    return kinds


def test_the_books_fast_steps_count_what_their_probes_read():
    """Every fast row of the plugin that no probe flagged is probed at each probe layer (none
    is flagged here: nothing runs the probes), which reads the page
    summaries, the pages' keys and, for lack of the kernel's log-sum-exp, the memory's keys
    again: a fast step's reads are the memory's and those, no more."""
    from sfi.core.cost_model import probe_reads

    config = SFIConfig(**{**SMALL, "trigger": "fixed", "period": 50, "coverage_layers": 2})
    requests = RequestBook(config, 4, slot_capacity(config, 4096), make_scorer("sfi", config),
                           layers=range(4))
    plain = RequestBook(replace(config, coverage_layers=0), 4, slot_capacity(config, 4096),
                        make_scorer("sfi", config), layers=range(4))
    for book_ in (requests, plain):
        run_request(book_, 0, 200, 6)
    probed, alone = requests.requests[0].seq.stats, plain.requests[0].seq.stats
    assert probed.fast_steps == alone.fast_steps > 0
    first, last = config.sink + config.k_head + config.recent, \
        requests.requests[0].seq.memory.read(206)  # the memory grows with the recent window
    low = min(2 * (probe_reads(config, t) + first / 2) / t / 4 for t in range(200, 207))
    high = max(2 * (probe_reads(config, t) + last / 2) / t / 4 for t in range(200, 207))
    gained = probed.fast_read_fraction - alone.fast_read_fraction
    assert low <= gained <= high, (low, gained, high)


@pytest.mark.parametrize("prompt, trigger", [
    (60, dict(trigger="fixed", period=5)),  # selects from the prompt, refreshes every 5 steps
    (20, dict(trigger="fixed", period=4)),  # too short at first: dense, then a slow bootstrap
    (60, dict(trigger="random", random_period_min=2, random_period_max=6, seed=3)),
    (60, dict(trigger="bootstrap")),
    (60, dict(trigger="sentence", refresh_interval=12, min_refresh_gap=2)),
])
def test_decisions_match_the_transformers_planner(tiny_llama_with_tokenizer, prompt, trigger):
    """Same config, same prompt length: the book's slow/fast/dense counts and refresh reasons
    equal what sfi.generate's planner recorded."""
    model, tokenizer = tiny_llama_with_tokenizer
    config = SFIConfig(**SMALL, **trigger)
    ids = torch.randint(300, 5000, (prompt,), generator=torch.Generator().manual_seed(0))
    text = tokenizer.decode(ids)
    prompt_tokens = len(tokenizer(text)["input_ids"])
    result = sfi.generate(model, tokenizer, text, max_new_tokens=24, config=config)
    assert result.finish_reason == "length"
    requests = book(config, classes=token_classes(tokenizer))
    kinds = run_request(requests, key=7, prompt=prompt_tokens, new_tokens=24,
                        generated=list(result.token_ids))
    ours = requests.requests[7].seq.stats
    theirs = result.stats
    assert (ours.slow_steps, ours.fast_steps, ours.dense_steps) == \
        (theirs.slow_steps, theirs.fast_steps, theirs.dense_steps)
    assert ours.refresh_reasons == theirs.refresh_reasons
    assert kinds[0] == DENSE and (SELECT in kinds) == (prompt_tokens >= 26)


def test_chunked_prompt_selects_like_a_whole_one():
    config = SFIConfig(**SMALL, trigger="fixed", period=5)
    whole = run_request(book(config), 1, prompt=64, new_tokens=12)
    chunked = run_request(book(config), 1, prompt=64, new_tokens=12, chunk=10)
    assert chunked[:7] == [DENSE] * 7
    assert chunked[7:] == whole[1:]


def test_lengths_follow_the_memory():
    """A select row's slot holds sinks + K + the recent window + the new token; each fast
    step adds one; a slow step's refresh packs up to and with its own token."""
    config = SFIConfig(**SMALL, trigger="fixed", period=3)
    requests = book(config)
    requests.plan([5], [40], [40])
    first = requests.plan([5], [1], [41])[0]
    assert first.kind == SELECT and first.memory == refresh_memory(40, 0, 2, 8, 16)
    assert first.length == 2 + 16 + 8 + 1 and first.evidence == 16
    second = requests.plan([5], [1], [42])[0]
    assert second.kind == FAST and second.length == first.length + 1
    assert second.memory == first.memory  # the memory a fast row reads (its copy probe's)
    slow = requests.plan([5], [1], [43])[0]  # the third step since the prompt's selection
    assert slow.kind == SLOW and slow.reason == "period"
    assert slow.length == 2 + 16 + 8 and slow.memory.recent_start == 43 - 8
    assert requests.plan([5], [1], [44])[0].length == slow.length + 1


def test_requests_are_told_apart_by_their_first_block():
    config = SFIConfig(**SMALL, trigger="fixed", period=50)
    requests = book(config, slots=2)
    requests.plan([3, 9], [40, 30], [40, 30])
    plans = requests.plan([3, 9], [1, 1], [41, 31])
    assert [p.kind for p in plans] == [SELECT, SELECT]
    assert plans[0].slot != plans[1].slot
    # rows sharing a first block are no request's own (a warm-up batch): stock attention
    assert [p.kind for p in requests.plan([0, 0], [1, 1], [90, 90])] == [DENSE, DENSE]
    # request 9 finished; a new request starts on block 9 (its context is all new): fresh state
    plans = requests.plan([3, 9], [1, 35], [42, 35])
    assert [p.kind for p in plans] == [FAST, DENSE]
    assert requests.requests[9].prompt_length == 35 and requests.requests[9].seq.memory is None


def test_slots_of_finished_requests_are_reused():
    config = SFIConfig(**SMALL, trigger="fixed", period=50)
    requests = book(config, slots=2)
    requests.plan([1, 2], [40, 40], [40, 40])
    requests.plan([1, 2], [1, 1], [41, 41])
    # 1 and 2 finished; 3 and 4 take their slots
    requests.plan([3, 4], [40, 40], [40, 40])
    assert requests.stats.slots_reused == 2
    assert sorted(s.slot for s in requests.requests.values()) == [0, 1]
    # a third live request finds no slot: full attention to its end, the others unchanged
    plans = requests.plan([3, 4, 5], [1, 1, 40], [41, 41, 40])
    assert [(p.kind, p.slot) for p in plans] == [(SELECT, 0), (SELECT, 1), (DENSE, None)]
    for t in range(41, 60):
        plans = requests.plan([3, 4, 5], [1, 1, 1], [t + 1, t + 1, t])
        assert [p.kind for p in plans] == [FAST, FAST, DENSE] and plans[2].record == 0
    assert requests.stats.unslotted == 1
    # full attention by choice (no slot), not because sparse reads would not pay
    assert requests.requests[5].seq.stats.dense_reason is None
    requests.plan([6], [40], [40])  # 3, 4 and 5 finished: 5 is forgotten, 6 takes 3's slot
    assert sorted(requests.requests) == [4, 6] and requests.requests[6].slot == 0


def test_request_serials_are_never_reused_in_a_book():
    """Layers keep per-slot state (selection, norms, coverage page bounds) told apart by
    request serial: a new request in a slot must not pass for the one that held it before."""
    config = SFIConfig(**SMALL, trigger="fixed", period=50)
    requests = book(config, slots=1)
    requests.plan([5], [40], [40])
    first = requests.requests[5].serial
    requests.plan([5], [30], [30])  # key 5's request ended: its block starts a new one
    assert requests.requests[5].slot == 0 and requests.requests[5].serial != first


def test_the_plugins_slots_are_set_in_sfi_vllm():
    from sfi.vllm.settings import DEFAULT_SLOTS, active_slots, configure, parse_settings

    assert parse_settings("k_head=64,slots=3")[1] == 3
    assert parse_settings("k_head=64")[1] is None
    with pytest.raises(SFIConfigError, match="slots must be a whole number"):
        parse_settings("slots=0")
    with pytest.raises(SFIConfigError, match="draft_tokens set exact mode's drafts"):
        parse_settings("k_head=64,draft_tokens=6")  # not run by the plugin: refused, not ignored
    with pytest.raises(SFIConfigError, match="coverage_retry runs a step or positions again"):
        parse_settings("coverage_retry=true")  # the transformers path's alone
    with pytest.raises(SFIConfigError, match="coverage_retry runs a step or positions again"):
        configure(SFIConfig(coverage_retry=True))
    with pytest.raises(SFIConfigError, match="repair_tokens runs a step or positions again"):
        parse_settings("repair_tokens=96")
    with pytest.raises(SFIConfigError, match="retry_margin runs a step or positions again"):
        parse_settings("retry_margin=0.1")
    assert parse_settings("coverage_next=true")[0].coverage_next  # both engines' probe
    assert parse_settings("coverage_copy=0.5")[0].coverage_copy == 0.5  # both engines' probe
    assert not parse_settings("coverage_retry=false")[0].coverage_retry
    try:
        configure(SFIConfig(), slots=3)
        assert active_slots(256) == 3 and active_slots(2) == 2
        configure(SFIConfig())
        assert active_slots(256) == DEFAULT_SLOTS
    finally:
        configure(None)


def test_a_memory_that_outgrows_its_slot_refreshes():
    config = SFIConfig(**SMALL, trigger="bootstrap")
    requests = book(config)
    capacity = requests.capacity
    kinds = run_request(requests, 1, prompt=40, new_tokens=capacity)
    assert kinds.count(SLOW) >= 1 and requests.stats.reasons.get("capacity", 0) >= 1
    lengths = [requests.plan([1], [1], [40 + capacity + i])[0].length for i in range(40)]
    assert max(lengths) <= capacity


def packed(natural: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``natural [NB, H, bs, D]`` stored the way a kernel packs it (``order``)."""
    nb, h, bs, d = natural.shape
    flat = torch.empty(nb, h, bs * d)
    flat[:, :, order] = natural.reshape(nb, h, bs * d)
    return flat.view(nb, h, bs, d)


@pytest.mark.parametrize("transposed", [False, True])
def test_paged_reads_return_each_position(transposed):
    nb, h, bs, d = 6, 3, 4, 5
    natural = torch.randn(nb, h, bs, d)
    order = None
    half = natural
    if transposed:  # dimension-major blocks, as vLLM's CPU kernel stores keys
        order = torch.arange(bs * d).view(d, bs).t().reshape(-1)
        half = packed(natural, order)
    block_row = torch.tensor([4, 1, 5, 0], dtype=torch.int32)
    expected = torch.cat([natural[b] for b in block_row.tolist()], dim=1)  # [H, 16, D]
    assert torch.equal(read_prefix(half, block_row, 14, order), expected[:, :14])
    positions = torch.tensor([[0, 5, 13], [3, 4, 12], [1, 2, 15]])
    got = read_positions(half, block_row, positions, order)
    assert torch.equal(got, torch.stack([expected[i, positions[i]] for i in range(h)]))
    # several requests at once (the probes of a step's fast rows) read what each alone reads
    rows = torch.stack([block_row, torch.tensor([2, 3, 0, 5], dtype=torch.int32)])
    for layout in ((order, DIM_MAJOR) if transposed else (None,)):
        alone = [read_prefix(half, row, 16, layout) for row in rows]
        assert torch.equal(read_blocks(half, rows, layout), torch.stack(alone))
    both = torch.stack([positions, positions.flip(-1)])
    for layout in ((order, DIM_MAJOR) if transposed else (None,)):  # the named layout reads
        # what its permutation reads
        got = read_positions(half, block_row, positions, layout)
        assert torch.equal(got, torch.stack([expected[i, positions[i]] for i in range(h)]))
        assert torch.equal(read_positions(half, rows, both, layout),
                           torch.stack([read_positions(half, row, p, layout)
                                        for row, p in zip(rows, both)]))


@pytest.mark.parametrize("layout", [None, DIM_MAJOR, "permuted"])
def test_logits_read_in_place_equal_those_of_a_copy(layout):
    """A slow row's logits computed on the key half of a cache ``[NB, H, bs, 2D]`` where the
    keys lie (one product per run of consecutive blocks) equal those over a copy of its keys:
    one run, several, a last block partly written; none where they cannot be (more than
    MAX_RUNS runs, a permuted layout). A range read is the prefix's slice."""
    torch.manual_seed(4)
    nb, h, bs, d, g = 40, 2, 4, 8, 3
    natural = torch.randn(nb, h, bs, d)
    cache = torch.zeros(nb, h, bs, 2 * d)
    order = None if layout is None else torch.arange(bs * d).view(d, bs).t().reshape(-1)
    if layout == "permuted":
        order = torch.randperm(bs * d)
    half = CacheLayout(BLOCKS).halves(cache)[0]  # the key half of the CPU kernel's blocks
    half.copy_(natural if order is None else packed(natural, order))
    named = order if layout == "permuted" else layout
    q = torch.randn(h, g, d)
    rows = {"one run": torch.arange(3, 13), "three runs": torch.tensor([7, 8, 9, 2, 3, 20, 21]),
            "scattered": torch.arange(MAX_RUNS + 2) * 2}
    for name, block_row in rows.items():
        total = len(block_row) * bs - 3
        keys = torch.cat([natural[b] for b in block_row.tolist()], dim=1)[:, :total]
        expected = torch.einsum("hgd,htd->hgt", q, keys) * 0.3
        got = logits_in_place(half, block_row.int(), total, q, 0.3, None, named)
        capped = logits_in_place(half, block_row.int(), total, q, 0.3, 2.0, named)
        if name == "scattered" or layout == "permuted":
            assert got is None and capped is None, name
        else:
            torch.testing.assert_close(got, expected, msg=name)
            torch.testing.assert_close(capped, 2.0 * torch.tanh(expected / 2.0), msg=name)
        for start, end in ((0, total), (5, total), (bs, 2 * bs + 1), (total, total)):
            assert torch.equal(read_range(half, block_row, start, end, named),
                               keys[:, start:end]), (name, start, end)


def test_a_refresh_read_since_the_last_one_equals_one_read_from_scratch():
    """What a refresh keeps of a request between refreshes (its key norms, its page bounds in a
    probe layer) and reads anew (only the keys written since) gives, refresh after refresh and
    after the cache is cut back, the norms, bounds and logits of reading everything; a query
    grouped per KV head as the selection groups it."""
    from sfi.core.pages import page_bounds

    torch.manual_seed(5)
    nb, h, bs, d, hq = 30, 2, 4, 8, 6
    cache = torch.zeros(nb, h, bs, 2 * d)
    half = CacheLayout(BLOCKS, DIM_MAJOR).halves(cache)[0]
    natural = torch.randn(nb, h, bs, d)
    order = torch.arange(bs * d).view(d, bs).t().reshape(-1)
    half.copy_(packed(natural, order))
    block_row = torch.arange(nb)
    keys = natural.transpose(0, 1).reshape(h, nb * bs, d)  # [H, T, D] in the request's order
    memory = refresh_memory(100, 0, 2, 8, 12)
    norms = pages = None
    for end in (17, 18, 30, 30, 67, 33, 50, 5):  # the last three: cut back and grown again
        query = torch.randn(1, hq, d)
        refresh, pages = read_refresh(memory, query, end, None, norms, pages, 8, half, block_row,
                                      DIM_MAJOR, False, 0.25, None)
        norms = refresh.key_norms
        assert refresh.keys is None
        torch.testing.assert_close(norms, keys[:, :end].norm(dim=-1))
        low, high = page_bounds(keys[None, :, :end], 8)
        assert torch.equal(pages.low[:, :, :pages.count], low)
        assert torch.equal(pages.high[:, :, :pages.count], high)
        expected = torch.einsum("hgd,htd->hgt", query[0].view(h, hq // h, d), keys[:, :end])
        torch.testing.assert_close(refresh.logits, expected * 0.25)
    # a scorer that reads keys, or several evidence queries: the keys, and no logits
    for queries, read_keys in ((torch.randn(1, hq, d), True), (torch.randn(4, hq, d), False)):
        refresh, _ = read_refresh(memory, queries, 40, None, None, None, None, half, block_row,
                                  DIM_MAJOR, read_keys, 0.25, None)
        assert refresh.logits is None and torch.equal(refresh.keys, keys[:, :40])


def write_per_position(cache, keys, values, slots):
    """A cache op storing each position's key channels, then its value channels (as vLLM's
    FlashAttention and Triton backends do: ``kv_cache.transpose(1, 2).split(D, -1)``)."""
    key_cache, value_cache = cache.transpose(1, 2).split(keys.shape[-1], dim=-1)
    bs = cache.shape[2]
    key_cache[slots // bs, slots % bs] = keys
    value_cache[slots // bs, slots % bs] = values


def write_per_head_block(cache, keys, values, slots):
    """A cache op storing a head's keys dimension-major, then its values (vLLM's CPU kernel)."""
    nb, h, bs, two_d = cache.shape
    d = two_d // 2
    flat = cache.view(nb, h, 2, bs * d)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, bs)
        flat[block, :, 0, offset::bs] = keys[i]
        flat[block, :, 1, offset * d: (offset + 1) * d] = values[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positions_outside_heads", [False, True])
def test_a_probed_layout_reads_back_what_the_cache_op_wrote(dtype, positions_outside_heads):
    nb, h, bs, d = 5, 2, 16, 8
    for write, split, keys_layout in ((write_per_position, CHANNELS, None),
                                      (write_per_head_block, BLOCKS, DIM_MAJOR)):
        layout = probe_layout(write, bs, d, dtype)
        assert (layout.split, layout.keys, layout.values) == (split, keys_layout, None)
        cache = torch.zeros(nb, h, bs, 2 * d, dtype=dtype)
        if positions_outside_heads:  # vLLM's NHD physical order behind the logical view
            cache = torch.zeros(nb, bs, h, 2 * d, dtype=dtype).transpose(1, 2)
        if split == BLOCKS and positions_outside_heads:
            continue  # the CPU kernel's cache is contiguous
        keys, values = torch.randn(2, nb * bs, h, d).to(dtype)
        write(cache, keys, values, torch.arange(nb * bs))
        block_row = torch.tensor([3, 0, 4, 1, 2])
        order = block_row[:, None] * bs + torch.arange(bs)  # the request's slots, in order
        key_half, value_half = layout.halves(cache)
        got = read_prefix(key_half, block_row, 70, layout.keys)  # [H, T, D]
        assert torch.equal(got, keys[order.reshape(-1)[:70]].transpose(0, 1))
        positions = torch.tensor([[0, 17, 69], [5, 40, 79]])
        got = read_positions(value_half, block_row, positions, layout.values)
        expected = values[order.reshape(-1)[positions], torch.arange(h)[:, None]]
        assert torch.equal(got, expected)


def test_the_plugins_buffer_keeps_the_caches_physical_order():
    cache = torch.zeros(7, 16, 2, 64).transpose(1, 2)  # logical [NB, H, bs, 2D], NHD storage
    buffer = empty_like_cache(cache, 3)
    assert buffer.shape == (3, 2, 16, 64)
    assert [buffer.stride(i) > buffer.stride(j) for i, j in ((0, 2), (2, 1), (1, 3))] == \
        [True] * 3
    assert empty_like_cache(torch.zeros(7, 2, 16, 64), 3).is_contiguous()


def select_refreshes(scorer, rule, layer_idx, refreshes, scale, softcap):
    """Each refresh's ``[H, k]`` slots as the plugin selects them: one selection per number of
    evidence queries (``window_selections``), all its requests at once."""
    chosen = [None] * len(refreshes)
    for part in window_selections(scorer, rule, layer_idx, refreshes, scale, softcap):
        slots = select(scorer, part.evidence, part.k, rule, part.pins, part.previous)
        for row, i in enumerate(part.members):
            chosen[i] = slots[row, :, : refreshes[i].memory.k]
    return chosen


def select_one(scorer, memory, queries, keys, rule=None, previous=None):
    refresh = RequestRefresh(memory, queries, keys, previous)
    return select_refreshes(scorer, rule or SelectionRule(), 0, [refresh], 0.25, None)[0]


def test_selection_lies_in_the_middle_and_covers_it_with_a_full_budget():
    torch.manual_seed(0)
    config = SFIConfig(**SMALL)
    scorer = make_scorer("sfi", config)
    keys, queries = torch.randn(3, 60, 16), torch.randn(4, 6, 16)
    memory = refresh_memory(60, 0, 2, 8, 16)
    selected = select_one(scorer, memory, queries, keys, SelectionRule(config.page_size))
    assert selected.shape == (3, 16)
    assert bool(((selected >= memory.sink_end) & (selected < memory.recent_start)).all())
    assert bool((selected.diff(dim=-1) > 0).all())
    everything = refresh_memory(60, 0, 2, 8, 1000)
    selected = select_one(scorer, everything, queries, keys)
    assert torch.equal(memory_positions(everything, selected, 60), torch.arange(60).expand(3, -1))


@pytest.mark.parametrize("rule", [SelectionRule(), SelectionRule(page=4, hysteresis=1.0)],
                         ids=["tokens", "pages+hysteresis"])
def test_refreshes_selected_together_equal_each_alone(rule):
    """Requests of different lengths and evidence windows (a first selection from 4 prompt
    queries, decode-time refreshes from one query, one with a previous selection and pins)
    select in one call what each selects alone."""
    torch.manual_seed(1)
    scorer = make_scorer("sfi", SFIConfig(**SMALL))
    first = refresh_memory(50, 0, 2, 8, 12)
    pinned = replace(refresh_memory(70, 0, 2, 8, 12), pinned=3)
    refreshes = [RequestRefresh(first, torch.randn(4, 6, 16), torch.randn(3, 50, 16)),
                 RequestRefresh(refresh_memory(64, 0, 2, 8, 12), torch.randn(1, 6, 16),
                                torch.randn(3, 64, 16)),
                 RequestRefresh(pinned, torch.randn(1, 6, 16), torch.randn(3, 70, 16),
                                previous=torch.arange(10, 22).expand(3, -1)),
                 RequestRefresh(refresh_memory(40, 0, 2, 8, 12), torch.randn(4, 6, 16),
                                torch.randn(3, 40, 16))]
    together = select_refreshes(scorer, rule, 0, refreshes, 0.25, None)
    for refresh, chosen in zip(refreshes, together):
        alone = select_refreshes(scorer, rule, 0, [refresh], 0.25, None)[0]
        assert torch.equal(chosen, alone)
    # the decode-time rows given their logits (as the plugin computes them in place) and
    # their key norms, without their keys, select the same
    given = [r if r.queries.shape[0] > 1 else replace(
        r, keys=None, key_norms=r.keys.norm(dim=-1),
        logits=logits_in_place(r.keys[None], torch.tensor([0]), r.keys.shape[1],
                               r.queries[0].view(3, 2, 16), 0.25, None))
        for r in refreshes]
    assert [r.keys is None for r in given] == [False, True, True, False]
    for chosen, again in zip(together, select_refreshes(scorer, rule, 0, given, 0.25, None)):
        assert torch.equal(chosen, again)
    kept = together[2][:, :3]  # the pinned positions: the previous selection's first three
    assert torch.equal(kept, torch.arange(10, 13).expand(3, -1))


def test_hysteresis_keeps_more_of_the_previous_selection():
    torch.manual_seed(2)
    scorer = make_scorer("sfi", SFIConfig(**SMALL))
    memory, keys = refresh_memory(80, 0, 2, 8, 16), torch.randn(3, 80, 16)
    before = select_one(scorer, memory, torch.randn(1, 6, 16), keys)
    query = torch.randn(1, 6, 16)
    plain = select_one(scorer, memory, query, keys, SelectionRule(), before)
    sticky = select_one(scorer, memory, query, keys, SelectionRule(hysteresis=1.0), before)

    def shared(a, b):
        return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b))

    assert shared(sticky, before) > shared(plain, before)


def test_a_coverage_miss_refreshes_after_the_gap_as_in_the_planner():
    config = SFIConfig(**{**SMALL, "coverage_layers": 4, "coverage_gap": 3}, trigger="bootstrap")
    requests = RequestBook(config, 2, slot_capacity(config, 4096), make_scorer("sfi", config),
                           layers=range(12))
    assert requests.probes == (1, 4, 7, 10)  # spread over the layers, as the planner does
    kinds = run_request(requests, 7, 60, 3)
    assert kinds[-2:] == [SELECT, FAST]
    flags = [slot == requests.requests[7].slot for slot in range(2)]
    requests.apply_coverage_flags(flags)  # a probe layer flagged step 62
    plans = [requests.plan([7], [1], [60 + i], [0])[0] for i in (3, 4)]
    assert [(p.kind, p.reason) for p in plans] == [(SLOW, "coverage"), (FAST, None)]
    requests.apply_coverage_flags(flags)  # flagged right after a refresh:
    seq = requests.requests[7].seq
    before = seq.stats.fast_read_sum
    plans = [requests.plan([7], [1], [60 + i], [0])[0] for i in (5, 6)]  # waits for the gap
    assert [(p.kind, p.reason) for p in plans] == [(FAST, None), (SLOW, "coverage")]
    # the waiting fast step is not probed again (as in the planner) and reads its memory alone
    assert not plans[0].probed
    assert seq.stats.fast_read_sum - before == pytest.approx(plans[0].memory.read(65) / 65)
    assert requests.plan([7], [1], [67], [0])[0].probed  # refreshed: probed again


def test_the_plugin_takes_every_option_but_those_that_run_a_step_again():
    """Each engine's list: the vLLM plugin accepts every ``SFIConfig`` field by name but exact
    mode's drafts (refused by name even at their defaults) and the options that run a step or
    positions again (refused by name when on: vLLM schedules each step once)."""
    from sfi.vllm.settings import EXACT_FIELDS, REDO_FIELDS, parse_settings

    assert set(EXACT_FIELDS) == {"draft_tokens", "draft_min", "draft_max", "draft_fallback"}
    assert set(REDO_FIELDS) == {"coverage_retry", "retry_margin", "stop_margin", "repair_tokens"}
    config = SFIConfig()
    for field in fields(SFIConfig):
        value = getattr(config, field.name)
        if value is None:  # unset (k_fraction beside k_head): nothing to name
            continue
        text = f"{field.name}={str(value).lower() if isinstance(value, bool) else value}"
        if field.name in EXACT_FIELDS:
            with pytest.raises(SFIConfigError, match=field.name):
                parse_settings(text)
        else:
            assert getattr(parse_settings(text)[0], field.name) == value, field.name
    on = {"coverage_retry": "true", "retry_margin": "0.1", "stop_margin": "1.0",
          "repair_tokens": "64"}
    for name, value in on.items():
        with pytest.raises(SFIConfigError, match=f"{name} runs a step or positions again"):
            parse_settings(f"{name}={value}")


def test_configure_refuses_exact_modes_drafts_changed_from_their_defaults():
    """``sfi.vllm.configure`` (a configuration built in Python) refuses exact mode's drafts
    where they differ from the defaults, which every ``SFIConfig`` carries, and the options
    that run a step again, as ``SFI_VLLM`` does."""
    from sfi.vllm.settings import active_config, configure

    try:
        for changed in (dict(draft_tokens=6), dict(draft_fallback=False),
                        dict(retry_margin=0.1)):
            with pytest.raises(SFIConfigError, match=next(iter(changed))):
                configure(SFIConfig(**changed))
        configure(SFIConfig(k_head=512))
        assert active_config() == SFIConfig(k_head=512)
    finally:
        configure(None)


def test_sfi_vllm_is_parsed_strictly():
    config = parse_config("k_head=512, trigger=fixed, period=16")
    assert (config.k_head, config.period, config.trigger) == (512, 16, "fixed")
    assert parse_config("") == SFIConfig()  # the plugin's default is the library's
    assert parse_config("preset=paper") == SFIConfig.from_preset("paper")
    assert parse_config("coverage_layers=0").coverage_layers == 0
    assert parse_config("dense_layers=2, pin_fraction=0.25, hysteresis=0.5") == SFIConfig(
        dense_layers=2, pin_fraction=0.25, hysteresis=0.5)  # every field (no refusals left)
    with pytest.raises(SFIConfigError, match="field of SFIConfig"):
        parse_config("k_heads=3")


def test_the_plugin_is_inert_without_configuration(monkeypatch):
    from sfi.vllm import register
    from sfi.vllm.settings import active_config

    monkeypatch.delenv("SFI_VLLM", raising=False)
    before = active_config()
    register()  # without SFI_VLLM: nothing imported from vLLM, nothing configured
    assert active_config() == before


def test_a_benchmark_cells_rates_count_only_its_own_requests():
    """``sfi bench-vllm`` merges the stats of the requests a cell ran: those of an earlier cell
    that are still in the book (they leave it only when their slot or key is taken) stay out."""
    from sfi.bench.vllm import cell_stats

    requests = book(SFIConfig(**SMALL, trigger="fixed", period=4), slots=4)
    run_request(requests, key=1, prompt=60, new_tokens=9)  # an earlier cell: fast and slow
    earlier = {r.serial for r in requests.requests.values()}
    run_request(requests, key=2, prompt=20, new_tokens=5)  # this cell: too short, all dense
    assert 1 in requests.requests  # the earlier request is still in the book
    own = cell_stats(requests, earlier)
    assert own.decode_steps == 4 and own.fast_steps == 0
    assert cell_stats(requests, set()).fast_steps > 0  # what merging the whole book counted


def test_probe_layers_scored_together_equal_each_layer_alone():
    """The plugin scores the pages of every probe layer of a step in one call per row
    (``sfi.vllm.probes``): the same scores as each (layer, row) alone, -inf past a row's
    pages, where the layers of a row hold different numbers of pages too."""
    from sfi.core.coverage import page_scores
    from sfi.vllm.probes import ProbeLayer, _scores

    g = torch.Generator().manual_seed(8)
    nl, n, h, gq, d = 3, 2, 2, 3, 4
    counts = [[5, 2], [5, 4], [3, 2]]  # [layer][row] pages
    query = torch.randn(nl, n, h, gq, d, generator=g)
    layers = [ProbeLayer(query[j], torch.empty(0), torch.empty(0), None,
                         tuple(torch.randn(1, h, c, 2 * d, generator=g) for c in counts[j]),
                         tuple(torch.rand(1, h, c, generator=g) > 0.3 for c in counts[j]),
                         (), 1.0, None)
              for j in range(nl)]
    got = _scores(layers, query).view(nl, n, h, -1)
    assert got.shape[-1] == 5
    for j, layer in enumerate(layers):
        for i in range(n):
            alone = page_scores(query[j, i: i + 1], layer.boxes[i], layer.outside[i])[0]
            c = counts[j][i]
            torch.testing.assert_close(got[j, i, :, :c], alone)
            assert torch.isneginf(got[j, i, :, c:]).all()


def _probe_alone(layer, md, c):
    """One probe layer's flags checked alone, with the shared primitives (what the plugin did
    in each probe layer before its probes were checked together)."""
    from sfi.core.coverage import (
        copy_runs_out,
        page_scores,
        pages_miss,
        with_next_pages,
    )
    from sfi.core.kernels import attention_logits
    from sfi.core.memory_tensors import MemoryTensors
    from sfi.core.pages import probe_page
    from sfi.vllm.paged import read_blocks, read_positions

    plans, q = md.step.probe_plans, layer.query
    n, h = q.shape[:2]
    logits = attention_logits(q, read_blocks(layer.memory_keys, md.step.probe_blocks,
                                             layer.layout),
                              layer.scale, layer.softcap)
    unwritten = torch.arange(logits.shape[-1]) >= torch.tensor([p.length for p in plans])[:, None]
    lse = torch.logsumexp(logits.masked_fill(unwritten[:, None, None], float("-inf")), -1)
    scores = torch.full((n, h, max(b.shape[2] for b in layer.boxes)), float("-inf"))
    for i in range(n):
        scores[i, :, : layer.boxes[i].shape[2]] = page_scores(q[i: i + 1], layer.boxes[i],
                                                             layer.outside[i])[0]
    memories = [p.memory for p in plans]
    width = max(m.sink_count + m.k for m in memories)
    positions = torch.full((n, h, width), -1, dtype=torch.long)
    for r, m in enumerate(memories):
        positions[r, :, m.sink_count: m.sink_count + m.k] = layer.selected[r]
    at = MemoryTensors.of(memories, "cpu")
    held = at.selected_slots(width, at.sink_count)
    raised = None
    if c.coverage_next:
        scores, raised = with_next_pages(scores, logits[..., :width], positions, held,
                                         page=probe_page(c))
    blocks = md.block_table.index_select(0, torch.tensor([p.row for p in plans]))
    found = pages_miss(q, scores, lse,
                       lambda pos: read_positions(layer.cache_keys, blocks, pos, layer.layout),
                       page=probe_page(c), top=c.coverage_top, threshold=c.coverage_threshold,
                       scale=layer.scale, softcap=layer.softcap,
                       length=torch.tensor([p.total for p in plans]), raised=raised,
                       heads=c.coverage_heads)
    if c.coverage_copy:
        found = found | copy_runs_out(logits[..., :width], lse, positions, held, at.hi,
                                      share=c.coverage_copy)
    return found


def test_probe_layers_checked_together_flag_what_each_layer_alone_flags():
    """``sfi.vllm.probes.check_probes`` (every probe layer of a step at once, after its last
    layer) flags the slots that checking each layer alone flags: rows of different lengths
    and page counts, several probe layers of different scales and caps (checked in groups),
    with and without ``coverage_copy`` and ``coverage_next``, both ``coverage_heads``, at
    thresholds that flag many rows and few."""
    import random
    from types import SimpleNamespace

    from sfi.core.sequence_policy import Memory
    from sfi.vllm.probes import ProbeLayer, check_probes

    torch.manual_seed(0)
    rng = random.Random(0)
    bs, per_slot, h, gq, d, page, slots, blocks = 4, 6, 2, 2, 8, 4, 4, 64
    flagged = checked = 0
    for _ in range(96):  # enough trials that a raised page decides some verdicts
        n, nl = rng.randint(1, 3), rng.randint(1, 4)
        used = rng.sample(range(slots), n)
        plans = []
        for row, slot in enumerate(used):
            total, k = rng.randint(40, 60), rng.randint(2, 8)
            memory = Memory(pad=0, sink=2, sink_end=2, recent_start=total - 5, k=k)
            plans.append(SimpleNamespace(row=row, slot=slot, total=total, memory=memory,
                                         length=min(2 + k + 5 + rng.randint(0, 3),
                                                    per_slot * bs)))
        c = SimpleNamespace(page_size=page, coverage_top=rng.randint(1, 3),
                            coverage_threshold=rng.choice([0.05, 0.5, 0.9]),
                            coverage_copy=rng.choice([0, 0.5, 0.9]),
                            coverage_next=rng.random() < 0.5,
                            coverage_heads=rng.choice(["mean", "max"]))
        step = SimpleNamespace(
            probe_plans=plans, probe_slot_index=torch.tensor(used),
            probe_blocks=torch.tensor([[p.slot * per_slot + j for j in range(per_slot)]
                                       for p in plans]))
        md = SimpleNamespace(step=step, book=SimpleNamespace(config=c),
                             block_table=torch.stack([torch.randperm(blocks)[:16]
                                                      for _ in range(n)]))
        layers = []
        for _ in range(nl):
            boxes, outside, selected = [], [], []
            for p in plans:
                count = rng.randint(0, p.total // page)
                low = torch.randn(1, h, count, d)
                boxes.append(torch.cat([low, low + torch.rand(1, h, count, d)], -1))
                outside.append(torch.rand(1, h, count) > 0.4)
                selected.append(torch.randint(p.memory.sink_end, p.memory.recent_start,
                                              (h, p.memory.k)))
            layers.append(ProbeLayer(torch.randn(n, h, gq, d) * 3,
                                     torch.randn(slots * per_slot, h, bs, d),
                                     torch.randn(blocks, h, bs, d), None, tuple(boxes),
                                     tuple(outside), tuple(selected),
                                     rng.choice([0.3, 0.5]), rng.choice([None, 5.0])))
        expected = torch.zeros(n, dtype=torch.bool)
        for layer in layers:
            expected |= _probe_alone(layer, md, c)
        assert torch.equal(check_probes(layers, md), expected)
        flagged, checked = flagged + int(expected.sum()), checked + n
    assert flagged > 4 and checked - flagged > 4, (flagged, checked)  # both verdicts seen
