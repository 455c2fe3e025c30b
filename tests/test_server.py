"""The OpenAI-compatible server, over real HTTP on 127.0.0.1, with the official client."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import httpx
import pytest
from serverkit import CONFIG, Server

import sfi

PROMPTS = ["The first prompt. It is long enough! " * 4, "Second one. Short.",
           "A third prompt, of middle length. Yes. " * 2, "Four."]


def test_completion_matches_generate(server, tiny):
    model, tok = tiny
    out = server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12,
                                             temperature=0)
    expected = sfi.generate(model, tok, PROMPTS[0], config=CONFIG, max_new_tokens=12)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == expected.new_tokens
    assert out.usage.prompt_tokens == expected.prompt_tokens
    extra = out.model_extra["sfi"]
    assert extra["fast_steps"] == expected.stats.fast_steps
    assert extra["slow_steps"] == expected.stats.slow_steps


def test_concurrent_requests_match_sequential(server, tiny):
    model, tok = tiny
    expected = [sfi.generate(model, tok, p, config=CONFIG, max_new_tokens=10).text
                for p in PROMPTS]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        out = server.client().completions.create(model="tiny", prompt=PROMPTS[i],
                                                 max_tokens=10, temperature=0)
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == expected
    assert server.engine.metrics.decode_steps > 0


def test_full_mode_and_budget_override(server, tiny):
    model, tok = tiny
    full = server.client().completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8,
                                              temperature=0, extra_body={"mode": "full"})
    assert full.model_extra["sfi"]["fast_steps"] == 0
    assert full.model_extra["sfi"]["dense_steps"] > 0
    expected = sfi.generate(model, tok, PROMPTS[2], mode="full", max_new_tokens=8)
    assert full.choices[0].text == expected.text
    wide = server.client().completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8,
                                              temperature=0, extra_body={"sfi": {"k_head": 500}})
    assert wide.choices[0].text == expected.text  # a budget covering everything = full


def test_exact_requests_equal_full_attention(tiny):
    """Exact requests (a padded batch of their own, rounds of drafts and verifies) give full
    attention's replies while a lossy request runs beside them; the server's default mode
    applies to requests that name none, and /metrics counts the drafts."""
    model, tok = tiny
    full = [sfi.generate(model, tok, p, mode="full", max_new_tokens=16).text for p in PROMPTS]
    lossy = sfi.generate(model, tok, PROMPTS[0], config=CONFIG, max_new_tokens=16).text
    results: dict[tuple[int, str | None], object] = {}

    def ask(i: int, mode: str | None) -> None:
        extra = {} if mode is None else {"mode": mode}
        results[i, mode] = running.client().completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=16, temperature=0, extra_body=extra)

    # every round drafts (no timing-driven fallback to dense steps), four drafts at a time
    drafting = replace(CONFIG, draft_fallback=False, draft_min=4, draft_max=4)
    with Server(*tiny, default_mode="exact", config=drafting) as running:
        threads = [threading.Thread(target=ask, args=(i, None)) for i in range(len(PROMPTS))]
        threads.append(threading.Thread(target=ask, args=(0, "sfi")))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(f"{running.url}/metrics").text
    assert [results[i, None].choices[0].text for i in range(len(PROMPTS))] == full
    assert results[0, "sfi"].choices[0].text == lossy
    replies = [results[i, None].model_extra["sfi"] for i in range(len(PROMPTS))]
    assert all(r["mode"] == "exact" and r["exact"]["verify_steps"] >= 1 for r in replies)
    counted = dict(line.split(" ") for line in metrics.splitlines() if line[:1] != "#")
    drafted = float(counted["sfi_exact_drafted_total"])
    assert drafted >= sum(r["exact"]["drafted"] for r in replies)
    assert drafted > float(counted["sfi_exact_accepted_total"])  # rejections were exercised


def test_a_server_that_repairs_serves_exact_requests(tiny):
    """With ``repair_tokens`` in the server's configuration its lossy requests repair their
    slow steps (as ``sfi.generate`` does) and an exact request, whose verify writes full
    attention's KV already, still gets full attention's reply."""
    model, tok = tiny
    repairing = replace(CONFIG, trigger="fixed", period=4, repair_tokens=16)
    full = sfi.generate(model, tok, PROMPTS[1], mode="full", max_new_tokens=12).text
    lossy = sfi.generate(model, tok, PROMPTS[1], config=repairing, max_new_tokens=12)
    assert lossy.stats.repaired_tokens > 0
    with Server(*tiny, config=repairing) as running:
        client = running.client()
        exact = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                          temperature=0, extra_body={"mode": "exact"})
        repaired = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                             temperature=0)
    assert exact.choices[0].text == full
    assert repaired.choices[0].text == lossy.text
    assert repaired.model_extra["sfi"]["repaired_tokens"] == lossy.stats.repaired_tokens


def test_streaming_completion_and_chat(server):
    client = server.client()
    pieces = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8,
                                            temperature=0, stream=True))
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8,
                                      temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")
    chat = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there."}], max_tokens=6,
        temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chat)
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there."}], max_tokens=6,
        temperature=0)
    assert text == plain.choices[0].message.content
    assert plain.usage.completion_tokens >= 1


def test_stop_seed_and_sampling(server):
    client = server.client()
    a = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, seed=5,
                                  temperature=0.9, top_p=0.9)
    b = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, seed=5,
                                  temperature=0.9, top_p=0.9)
    assert a.choices[0].text == b.choices[0].text
    greedy = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10,
                                       temperature=0).choices[0].text
    if len(greedy.strip()) > 2:
        stop = greedy.strip()[1:3]
        cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10,
                                        temperature=0, stop=[stop])
        assert stop not in cut.choices[0].text
        assert cut.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "stream": True}
    before = server.engine.metrics.cancelled
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.time() + 10
    while (server.engine.active or server.engine.metrics.cancelled == before) \
            and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.active == 0
    assert server.engine.metrics.cancelled == before + 1


@pytest.mark.parametrize("body, status, fragment", [
    ("{not json", 400, "not valid JSON"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "  "}]}, 400, "empty"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "word " * 2100}, 400, "context"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "sfi": {"k_fraction": 2}}, 400, "k_fraction"),
    ({"model": "tiny", "prompt": "hi", "mode": "fastest"}, 400, "mode"),
])
def test_bad_input_gets_an_openai_error(server, body, status, fragment):
    path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}{path}", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] or fragment == error.get("param")
    assert {"message", "type", "param", "code"} <= set(error)


def test_models_health_metrics(server):
    assert server.client().models.list().data[0].id == "tiny"
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split(" ")
            values[name] = float(value)
    assert values["sfi_requests_total"] >= 1
    assert {"sfi_fast_steps_total", "sfi_slow_steps_total", "sfi_queue_depth",
            "sfi_decode_tokens_per_second", "sfi_generated_tokens_total",
            "sfi_kv_slab_bytes"} <= set(values)
    assert values["sfi_batch_copies_total"] <= values["sfi_batch_joins_total"]


def test_queue_full_answers_429(tiny):
    with Server(*tiny, max_batch=1, max_queue=1) as small:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0}
        codes: list[int] = []

        def fire() -> None:
            codes.append(httpx.post(f"{small.url}/v1/completions", json=body,
                                    timeout=120).status_code)

        threads = [threading.Thread(target=fire) for _ in range(5)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert 429 in codes and 200 in codes
        r = httpx.post(f"{small.url}/v1/completions", json=body, timeout=120)
        assert r.status_code in (200, 429)
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
        assert small.engine.metrics.rejected >= 1


@pytest.mark.model
def test_default_model_chat_and_completion(default_model):
    model, tok = default_model
    with Server(model, tok, name="default") as running:
        client = running.client()
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Name a color."}],
            max_tokens=12, temperature=0)
        expected = sfi.generate(model, tok, "Name a color.", chat=True, config=CONFIG,
                                max_new_tokens=12)
        assert chat.choices[0].message.content == expected.text
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Name a color."}],
            max_tokens=12, temperature=0, stream=True))
        assert streamed == expected.text
        done = client.completions.create(model="default", prompt="The sky is", max_tokens=8,
                                         temperature=0)
        assert done.choices[0].text == sfi.generate(model, tok, "The sky is", config=CONFIG,
                                                    max_new_tokens=8).text


def test_loadtest_reports_its_figures(server):
    from sfi.bench.loadtest import run_loadtest

    result = run_loadtest(server.url, clients=2, duration=2.0, max_tokens=6, mode="sfi",
                          prompt_chars=300, model="tiny")
    assert result["errors"] == 0, result["error_samples"]
    assert result["requests"] >= 2 and result["tokens_per_s"] > 0
    assert result["ttft_p50_ms"] > 0 and result["itl_p50_ms"] > 0
    assert result["server_peak_rss_mb"] > 0
    assert result["join_stall_ms"] is not None and result["itl_max_ms"] >= result["itl_p99_ms"]


def test_join_stall_counts_gaps_that_overlap_a_join():
    from sfi.bench.loadtest import join_stall

    gaps = [(0.0, 0.1), (0.1, 0.9), (0.9, 1.0), (2.0, 3.5)]
    assert join_stall(gaps, [(0.5, 0.6)]) == pytest.approx(0.8)
    assert join_stall(gaps, [(1.2, 1.8)]) == 0.0
    assert join_stall(gaps, [(0.95, 2.5)]) == pytest.approx(1.5)
