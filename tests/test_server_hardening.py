"""The server as a hostile client finds it: every bad request gets a 4xx in OpenAI's error
shape, one request's failure fails only that request, nothing hangs, and the keys, hosts and
sizes it is configured with hold."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serverkit import CONFIG, Server, _free_port

import sfi
from sfi.decoding.stopping import StopChecker

PROMPT = "The first prompt. It is long enough! " * 4
VALID = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


def post(server, body, path="/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers,
                      timeout=kw.pop("timeout", 60), **kw)


def openai_error(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), r.text
    return error


def stream_text(server, body) -> tuple[str, list[dict]]:
    """The streamed completion's text, and every event."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
    return text, events


# --- values that used to pass validation and then break the engine for everyone -------------
def test_extreme_sampling_values_fail_nothing(server):
    reference = post(server, VALID).json()["choices"][0]["text"]
    extreme = [{**VALID, "temperature": 1e-39},  # greedy
               {**VALID, "temperature": 0.8, "top_p": 1e-46, "seed": 1},  # the top token only
               {**VALID, "seed": -(2 ** 63), "temperature": 0.5}]
    streamed = {}
    long_stream = threading.Thread(target=lambda: streamed.update(
        zip(("text", "events"), stream_text(server, {**VALID, "max_tokens": 60}))))
    long_stream.start()
    during = [post(server, body) for body in extreme]
    assert post(server, {**VALID, "seed": 2 ** 63}).status_code == 400
    long_stream.join(timeout=60)
    assert [r.status_code for r in during] == [200, 200, 200], [r.text for r in during]
    assert "choices" in streamed["events"][-1], streamed["events"][-1]  # it ran to its end
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    alone = [post(server, body).json()["choices"][0]["text"] for body in extreme[:2]]
    assert alone == [reference, reference]


def test_a_failing_prefill_fails_only_its_request(tiny, monkeypatch):
    import sfi.server.lanes as engine_module  # where a joining prompt's chunks are prefilled

    with Server(*tiny) as running:
        original = engine_module.prefill

        def faulty(model, cache, ids, **kwargs):
            if running.engine._join.request.max_tokens == 7:
                raise RuntimeError("injected fault")
            return original(model, cache, ids, **kwargs)

        monkeypatch.setattr(engine_module, "prefill", faulty)
        results = {}

        def run(name, body):
            results[name] = post(running, body)

        threads = [threading.Thread(target=run, args=("good", {**VALID, "max_tokens": 30})),
                   threading.Thread(target=run, args=("bad", {**VALID, "max_tokens": 7}))]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=60)
        assert results["bad"].status_code == 500
        assert "injected fault" in openai_error(results["bad"])["message"]
        assert results["good"].status_code == 200
        assert httpx.get(f"{running.url}/health").status_code == 200


def test_health_reports_a_stopped_engine(tiny):
    with Server(*tiny) as running:
        assert httpx.get(f"{running.url}/health").status_code == 200
        running.engine.stop()
        r = httpx.get(f"{running.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        refused = post(running, VALID)
        assert refused.status_code == 503 and openai_error(refused)["type"] == "server_error"


def test_engine_stop_ends_running_streams(tiny):
    with Server(*tiny) as running:
        done = {}

        def consume():
            done["text"], done["events"] = stream_text(running, {**VALID, "max_tokens": 1500})

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.time() + 30
        while running.engine.active == 0 and time.time() < deadline:
            time.sleep(0.02)
        running.engine.stop(wait=False)
        t.join(timeout=30)
        assert not t.is_alive()
        last = done["events"][-1]
        assert last["error"]["type"] == "server_error"
        assert "shutting down" in last["error"]["message"]


def test_request_timeout_fails_the_request(tiny):
    with Server(*tiny, request_timeout=0.5) as running:
        r = post(running, {**VALID, "max_tokens": 1500})
        assert r.status_code == 500 and "limit of 0.5 s" in openai_error(r)["message"]
        deadline = time.time() + 5
        while running.engine.active and time.time() < deadline:
            time.sleep(0.02)
        assert running.engine.active == 0


def test_non_streamed_request_is_cancelled_when_its_client_leaves(server):
    before = server.engine.metrics.cancelled
    with pytest.raises(httpx.ReadTimeout):
        post(server, {**VALID, "max_tokens": 1500}, timeout=1.0)
    deadline = time.time() + 10
    while server.engine.metrics.cancelled == before and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.metrics.cancelled == before + 1
    deadline = time.time() + 5
    while server.engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.active == 0


# --- stop strings ---------------------------------------------------------------------------
class CharTokenizer:
    """One token per character."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(t) for t in tokens)


def test_stop_checker_holds_back_a_possible_stop_string():
    checker = StopChecker(CharTokenizer(), eos=(), stop=("STOP",), max_tokens=100)
    settled = []
    for ch in "abc STx ST STOP tail":
        checker.push(ord(ch))
        settled.append(checker.settled_text)
        if checker.done:
            break
    assert checker.text == "abc STx ST "
    assert "abc ST" not in settled[:6]  # "ST" held back until "x" showed it was not a stop
    assert all(checker.text.startswith(s) for s in settled)
    with pytest.raises(sfi.SFIError, match="non-empty"):
        StopChecker(CharTokenizer(), eos=(), stop=("",))


def test_stop_string_never_leaks_into_the_stream(server):
    greedy = post(server, {**VALID, "max_tokens": 24}).json()["choices"][0]["text"]
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 6]
    body = {**VALID, "max_tokens": 24, "stop": [stop]}
    whole = post(server, body).json()["choices"][0]
    streamed, _ = stream_text(server, body)
    assert whole["finish_reason"] == "stop" and stop not in whole["text"]
    assert streamed == whole["text"]


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], [""], ["x" * 1001]])
def test_stop_lists_are_bounded(server, stop):
    r = post(server, {**VALID, "stop": stop})
    assert r.status_code == 400 and openai_error(r)["param"] == "stop"


# --- keys, hosts, sizes ---------------------------------------------------------------------
def test_api_key(tiny):
    with Server(*tiny, api_key="s3cret") as running:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = post(running, VALID, headers=headers)
            assert r.status_code == 401 and openai_error(r)["code"] == "invalid_api_key"
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        assert httpx.get(f"{running.url}/health").status_code == 200
        ok = running.client(api_key="s3cret").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")


def test_host_header_is_checked(tiny):
    with Server(*tiny, allowed_hosts=["127.0.0.1", "localhost"]) as running:
        assert post(running, VALID).status_code == 200
        r = post(running, VALID, headers={"Host": "evil.example:8000"})
        assert r.status_code == 400 and openai_error(r)["code"] == "invalid_host"


def test_body_size_limit(tiny):
    with Server(*tiny, max_body_bytes=20_000) as running:
        big = {**VALID, "prompt": "word " * 5000}
        r = post(running, big)
        assert r.status_code == 413 and openai_error(r)["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 4096):
                yield body[i: i + 4096]

        r = httpx.post(f"{running.url}/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and openai_error(r)["code"] == "request_too_large"
        assert post(running, VALID).status_code == 200


def test_far_too_long_prompt_is_refused_before_tokenizing(server, monkeypatch):
    state = server.server.config.app.state.sfi
    calls = []
    tokenizer = server.engine.tokenizer
    monkeypatch.setattr(server.engine, "tokenizer",
                        lambda *a, **k: calls.append(1) or tokenizer(*a, **k))
    r = post(server, {**VALID, "prompt": "x" * (2048 * state.max_token_chars + 1)})
    assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded"
    assert openai_error(r)["param"] == "prompt" and not calls


def test_no_spurious_429_while_slots_are_free(tiny):
    with Server(*tiny, max_batch=2, max_queue=0) as running:
        codes = []
        for _ in range(3):
            codes.append(post(running, VALID).status_code)
        assert codes == [200, 200, 200]


# --- error shapes, unsupported and unknown fields, strict types, nulls ----------------------
@pytest.mark.parametrize("path, method, status", [
    ("/v1/nothing", "POST", 404), ("/v1/completions", "GET", 405), ("/nowhere", "GET", 404)])
def test_routing_errors_in_openai_shape(server, path, method, status):
    r = httpx.request(method, f"{server.url}{path}", timeout=10)
    assert r.status_code == status
    openai_error(r)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', None),
    ('{"model": "tiny", "prompt": "a \\ud800 b"}', "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ({**VALID, "logprobs": 2}, "logprobs"),
    ({**VALID, "echo": True}, "echo"),
    ({**VALID, "best_of": 3}, "best_of"),
    ({**VALID, "tools": [{"type": "function"}]}, "tools"),
    ({**VALID, "response_format": {"type": "json_object"}}, "response_format"),
    ({**VALID, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({**VALID, "n": 2}, "n"),
    ({**VALID, "max_tokens": "3"}, "max_tokens"),
    ({**VALID, "temperature": True}, "temperature"),
    ({**VALID, "favourite_colour": "blue"}, "favourite_colour"),
    ({**VALID, "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
])
def test_refused_by_name(server, body, param):
    path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    if param is not None:
        assert error["param"] == param, error


def test_nulls_and_neutral_values_are_accepted(server):
    reference = post(server, VALID).json()["choices"][0]["text"]
    body = {**VALID, "top_p": None, "stop": None, "seed": None, "n": None, "stream": None,
            "logprobs": None, "echo": False, "best_of": 1, "frequency_penalty": 0,
            "presence_penalty": 0.0, "user": "someone", "stream_options": None}
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    alias = post(server, {k: v for k, v in {**VALID, "max_completion_tokens": 8}.items()
                          if k != "max_tokens"})
    assert alias.status_code == 200 and alias.json()["choices"][0]["text"] == reference
    chat = post(server, {"model": "tiny", "max_tokens": 4, "temperature": None,
                         "messages": [{"role": "user",
                                       "content": [{"type": "text", "text": "Hello"}]}]},
                "/v1/chat/completions")
    assert chat.status_code == 200, chat.text


# --- a seeded storm of malformed and adversarial requests -----------------------------------
def _storm(seed: int, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    junk_values = [None, True, -1, 0, 2 ** 70, -1e308, 1e-320, "", "x" * 300, [], {}, [1, "a"],
                   {"a": {"b": [None]}}, "\u0000", 3.5, "NaN", [[[[[]]]]]]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed",
              "stop", "stream", "n", "mode", "sfi", "logprobs", "tools", "echo", "best_of",
              "max_completion_tokens", "unknown_field"]
    out = []
    for i in range(n):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        kind = i % 5
        if kind == 0:  # raw bytes that are not JSON, or not UTF-8
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            out.append((path, raw))
            continue
        body: dict = dict(VALID) if path.endswith("/completions") and "chat" not in path else \
            {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(fields)] = rng.choice(junk_values)
        if kind == 1:
            body["model"] = rng.choice(["gpt-4", "", None, 5])
        elif kind == 2:
            body["messages" if "chat" in path else "prompt"] = rng.choice(
                [None, 5, [], "", [{"role": "wizard", "content": "x"}],
                 [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}]])
        elif kind == 3:
            body["stop"] = [rng.choice(["", "ab", 7, None])] * rng.randrange(0, 9)
            body["max_tokens"] = rng.choice([0, -5, 10 ** 9, "8", 1.5])
        else:
            body[rng.choice(["temperature", "top_p"])] = rng.choice([-1, 3, "1", float("inf")])
        text = json.dumps(body, allow_nan=True)
        out.append((path, text.encode()))
    return out


def test_fuzz_storm_leaves_the_server_healthy(server):
    before = post(server, VALID).json()["choices"][0]["text"]
    answers = []
    for path, raw in _storm(seed=20261130, n=100):
        r = post(server, raw, path, timeout=30)
        answers.append((r.status_code, raw))
        assert 400 <= r.status_code < 500, (r.status_code, raw, r.text)
        openai_error(r)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert post(server, VALID).json()["choices"][0]["text"] == before
    assert len(answers) == 100


# --- sfi serve: SIGTERM ends streams and the process --------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tiny, tmp_path_factory) -> Path:
    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("tiny-served")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sigterm_ends_streams_and_exits(tiny_folder):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfi", "serve", "--model", str(tiny_folder), "--port", str(port),
         "--served-model-name", "tiny", "--k-head", str(CONFIG.k_head), "--force-sparse"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny"]  # not the folder's path
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**VALID, "max_tokens": 1800, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        proc.send_signal(signal.SIGTERM)
        assert "shutting down" in events[-1], events[-3:]
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
