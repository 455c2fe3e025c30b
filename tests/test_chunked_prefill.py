"""Chunked prefill: a prompt prefilled in chunks continues exactly like one prefilled at once,
and the server interleaves a joining prompt's chunks with the running batch's decode steps."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest
import torch
from serverkit import CONFIG, Server

import sfi
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill, prompt_chunks
from sfi.errors import SFIError
from sfi.hf.methods import build_cache
from sfi.hf.slowfast_cache import SlowFastCache


@pytest.mark.parametrize("length, chunk, window", [
    (100, 512, 16), (512, 512, 16), (513, 512, 16), (1030, 512, 16), (1000, 100, 16),
    (40, 16, 16), (17, 16, 16), (33, 16, 32)])
def test_prompt_chunks(length, chunk, window):
    bounds = prompt_chunks(length, chunk, window)
    assert bounds[0] == 0 and bounds[-1] == length
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert all(s > 0 for s in sizes)
    assert all(s <= chunk for s in sizes[:-1])
    assert sizes[-1] >= min(window, length) and sizes[-1] <= max(chunk, window) + chunk


def test_chunked_prefill_continues_like_one_prefill(tiny):
    model, _ = tiny
    torch.manual_seed(0)
    ids = torch.randint(5, 2000, (1, 300))
    config = sfi.SFIConfig(sink=2, recent=16, k_head=40, force_sparse=True, trigger="fixed",
                           period=5, coverage_layers=0)

    def run(chunk: int | None) -> tuple[list[torch.Tensor], list]:
        cache = SlowFastCache(model, config, tokenizer=tiny[1], max_cache_len=400)
        bounds = prompt_chunks(ids.shape[1], chunk, config.evidence_window)
        for start, end in itertools.pairwise(bounds):
            cache.prompt_continues = end < ids.shape[1]
            logits = prefill(model, cache, ids[:, start:end], start=start)
        cache.prompt_continues = False
        outs, selections = [logits], [cache.selected_positions(0, 0)]
        token = logits.argmax(-1)
        for i in range(12):
            logits = decode_one(model, cache, token, torch.tensor([ids.shape[1] + i]))
            outs.append(logits)
            selections.append(cache.selected_positions(0, 0))
            token = logits.argmax(-1)
        assert cache.step_kinds() in (("fast",), ("slow",))
        return outs, selections

    whole, whole_sel = run(None)
    chunked, chunked_sel = run(64)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert [s.tolist() for s in whole_sel] == [s.tolist() for s in chunked_sel]


def test_server_interleaves_chunks_with_decode_steps(tiny):
    model, tok = tiny
    prompt = "A long prompt that will need several chunks. " * 30
    with Server(model, tok, prefill_chunk=32, max_stall=0.0) as running:
        engine = running.engine
        trace: list[tuple[str, int]] = []
        advance, step, join = engine._advance_join, engine._step, engine._join_batch

        def traced_advance():
            trace.append(("chunk", engine.active))
            advance()

        def traced_step(lane):
            trace.append(("step", engine.active))
            step(lane)

        def traced_join(*args):
            trace.append(("join", engine.active))
            join(*args)
            slab_rows.append(engine._lanes[0].cache.layers[0].reserved)

        engine._advance_join, engine._step, engine._join_batch = (traced_advance, traced_step,
                                                                  traced_join)
        streamed, slab_rows = {}, []

        def stream():
            with httpx.stream("POST", f"{running.url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "Short one.", "max_tokens": 120,
                                    "temperature": 0, "stream": True}) as r:
                streamed["lines"] = [line for line in r.iter_lines() if line]

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.time() + 30
        while not engine.active and time.time() < deadline:
            time.sleep(0.01)
        r = httpx.post(f"{running.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                             "temperature": 0})
        t.join(timeout=60)
        assert r.status_code == 200
        expected = sfi.generate(model, tok, prompt, config=CONFIG, max_new_tokens=6).text
        assert r.json()["choices"][0]["text"] == expected
        chunks_while_decoding = [i for i, (kind, active) in enumerate(trace)
                                 if kind == "chunk" and active > 0]
        assert len(chunks_while_decoding) >= 5  # the long prompt came in several chunks
        for i in chunks_while_decoding:  # ... each followed by a decode step (max_stall 0)
            assert trace[i + 1][0] == "step", trace[i - 2: i + 3]
        rebuilds = [i for i, (kind, _) in enumerate(trace) if kind == "join"]
        assert rebuilds and all(trace[i + 1][0] == "step" for i in rebuilds)
        assert streamed["lines"][-1] == "data: [DONE]"
        assert slab_rows == [4, 4]  # the batch holds a slab of max_batch rows from its start
        # the long prompt joined a batch shorter than itself, with no room: one copy
        assert engine.metrics.joins == 1 and engine.metrics.batch_copies == 1


def test_kv_budget_admits_what_fits_and_refuses_what_never_can(tiny):
    model, tok = tiny
    prompt = "Twenty or so tokens of prompt for the budget test. " * 2
    need = len(tok(prompt)["input_ids"]) + 40
    with Server(model, tok, max_kv_tokens=need + 10) as running:  # room for one at a time
        engine = running.engine
        most = []
        step = engine._step

        def watched(lane):
            most.append(engine.active)
            step(lane)

        engine._step = watched
        codes = []

        def fire():
            codes.append(httpx.post(f"{running.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
            }).status_code)

        threads = [threading.Thread(target=fire) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert codes == [200, 200, 200]
        assert max(most) == 1  # never two sequences beside each other
        r = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["sfi", "full"])
def test_generate_prefills_in_chunks_like_one_forward(tiny_llama_with_tokenizer, mode):
    """``prefill_chunk`` cuts the prompt (a left-padded batch here) into forwards and reports
    each; the tokens are those of one forward."""
    model, tok = tiny_llama_with_tokenizer
    prompts = ["One two three. Four five six! " * 12, "Seven eight. " * 20]
    config = sfi.SFIConfig(sink=2, recent=8, k_head=6, force_sparse=True) if mode == "sfi" \
        else None
    whole = sfi.generate(model, tok, prompts, mode=mode, config=config, max_new_tokens=10)
    progress: list[tuple[int, int]] = []
    chunked = sfi.generate(model, tok, prompts, mode=mode, config=config, max_new_tokens=10,
                           prefill_chunk=32,
                           on_prefill=lambda done, total: progress.append((done, total)))
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    total = progress[-1][1]
    assert len(progress) >= 2  # the padding (the shorter prompt's) all in the first chunk
    assert [done for done, _ in progress] == sorted({done for done, _ in progress})
    assert progress[-1] == (total, total)


def test_prefill_keeps_the_callers_chunking(tiny):
    """A caller that chunks the prompt itself (the server) sets ``prompt_continues``; one
    ``prefill`` call must leave it as the caller set it."""
    model, tok = tiny
    cache = SlowFastCache(model, sfi.SFIConfig(sink=2, recent=16, k_head=40, force_sparse=True),
                          tokenizer=tok, max_cache_len=200)
    cache.prompt_continues = True
    prefill(model, cache, torch.randint(5, 2000, (1, 100)), start=0, chunk=32)
    assert cache.prompt_continues is True
    with pytest.raises(SFIError, match="holds no selection"):
        cache.selected_positions(0, 0)  # no chunk made the first selection


def test_prefill_restores_the_flag_after_a_failed_chunk(tiny):
    model, tok = tiny
    cache = SlowFastCache(model, sfi.SFIConfig(sink=2, recent=16, k_head=40, force_sparse=True),
                          tokenizer=tok, max_cache_len=200)

    def fail(done: int, total: int) -> None:
        raise RuntimeError("out of memory, say")

    with pytest.raises(RuntimeError, match="out of memory"):
        prefill(model, cache, torch.randint(5, 2000, (1, 100)), start=0, chunk=32,
                on_progress=fail)
    assert cache.prompt_continues is False  # a later forward still makes the first selection


def test_prefill_refuses_what_chunks_cannot_do(tiny):
    model, tok = tiny
    ids = torch.randint(5, 2000, (2, 100))
    with pytest.raises(SFIError, match="prefill it in one forward"):
        prefill(model, build_cache(model, tok, "snapkv", budget=0.5, context=100), ids[:1],
                start=0, chunk=32)
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1] = 0
    with pytest.raises(SFIError, match="all padding"):
        prefill(model, build_cache(model, tok, "full"), ids, attention_mask=mask, chunk=32)
    with pytest.raises(SFIError, match="no tokens"):
        prefill(model, build_cache(model, tok, "full"), ids[:, :0])


def test_a_joining_prompts_chunks_fit_the_stall():
    """Between two decode steps a chunk takes what fits in the time left at the last chunk's
    speed (``prefill_chunk`` at most), the whole rest when nobody waits, and the prompt's last
    chunk keeps at least the evidence window."""
    from sfi.server.lanes import Join, chunk_tokens

    join = Join(request=None, cache=None, ids=torch.zeros(1, 1000), window=16)
    assert chunk_tokens(join, 128, None) == 128  # nobody decodes
    assert chunk_tokens(join, 128, 0.3) == 128  # no speed measured yet
    join.seconds_per_token = 0.005
    assert chunk_tokens(join, 128, 0.3) == 60 and chunk_tokens(join, None, 0.3) == 60
    assert chunk_tokens(join, 128, 2.0) == 128 and chunk_tokens(join, 128, -0.1) == 0
    assert join.next_end(60) == 60 and join.next_end(None) == 1000
    join.prefilled = 900
    assert join.next_end(90) == 984  # 16 left for the last chunk
    join.prefilled = 980
    assert join.next_end(10) == 984  # 4 now, so that the last holds the window
    join.prefilled = 984
    assert join.next_end(10) == 1000  # the rest is no more than the window
