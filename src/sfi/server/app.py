"""OpenAI-compatible HTTP API over the continuous-batching engine (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Extensions to the
OpenAI request: ``mode`` (``"sfi"`` or ``"full"``) and ``sfi`` (``k_head`` or ``k_fraction``);
each response carries an ``sfi`` object with the sequence's slow/fast step counts.
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sfi.errors import SFIError
from sfi.server.engine import Engine, GenerationRequest, KVBudgetError, QueueFullError


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)


class BudgetOverride(BaseModel):
    """The ``sfi`` extension of a request: this sequence's budget."""

    model_config = ConfigDict(extra="forbid", strict=True)
    k_head: int | None = Field(default=None, ge=0)
    k_fraction: float | None = Field(default=None, gt=0.0, le=1.0)


MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1000
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # what torch.Generator.manual_seed takes, as int64

# Fields OpenAI defines that sfi does not implement, with the values that mean "not used":
# a request may send those (clients often do), any other value is refused by name.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
}
# Fields OpenAI defines that do not change what sfi generates: accepted, not used.
NO_EFFECT = {"user", "metadata", "store", "stream_options", "service_tier"}


def _same(value: Any, off: Any) -> bool:
    """``value == off``, with ``False`` not equal to ``0`` and ``None`` only to itself."""
    if value is None or off is None or isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return type(value) in (int, float, str, list, dict) and value == off


def _valid_unicode(text: str, name: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return text


class _Common(BaseModel):
    """What both endpoints take. Strict types (``"3"`` is not a number); ``null`` means the
    default, as in OpenAI's API."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = None
    n: int | None = None
    mode: Literal["sfi", "full"] = "sfi"
    sfi: BudgetOverride | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(f"only n = 1 is supported (got {n}); send parallel requests")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(stops)})")
        for text in stops:
            if not text or len(text) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
            _valid_unicode(text, "stop")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_fields(self) -> None:
        """Refuse, by name, a field sfi does not implement or does not know."""
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name in NOT_SUPPORTED:
                if any(_same(value, off) for off in NOT_SUPPORTED[name]):
                    continue
                raise APIError(400, f"{name} is not supported by this server "
                               f"(send it unset or {NOT_SUPPORTED[name][-1]!r})", param=name,
                               code="unsupported_parameter")
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
        if self._asked_max_tokens is not None and self.max_completion_tokens is not None \
                and self._asked_max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one",
                           param="max_completion_tokens")

    @property
    def _asked_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) unless ``max_tokens`` was sent."""
        if self.max_completion_tokens is not None and self._asked_max_tokens is None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_Common):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, prompt: str) -> str:
        return _valid_unicode(prompt, "prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: str | list[TextPart]) -> str:
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return _valid_unicode(text, "content")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _not_blank(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if all(not m.content.strip() for m in messages):
            raise ValueError("every message is empty")
        return messages


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _peak_rss_bytes() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports kilobytes


log = logging.getLogger("sfi.server")


@dataclass
class ServerState:
    """What the routes need: the engine, the model's names and its context window, and the
    longest token's characters (a prompt over ``context_limit`` times it cannot fit)."""

    engine: Engine
    model_name: str
    context_limit: int | None
    max_token_chars: int = 64
    started: float = field(default_factory=time.time)

    @property
    def names(self) -> set[str]:
        return {self.model_name, "default"}


def _state(http: Request) -> ServerState:
    return http.app.state.sfi


# --- the response formats of the two endpoints -------------------------------------------------
def _usage(request: GenerationRequest) -> dict[str, int]:
    prompt, completion = len(request.prompt_ids), len(request.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sfi(request: GenerationRequest) -> dict[str, Any]:
    stats = request.stats.to_dict() if request.stats is not None else {}
    return {"mode": request.mode, **stats}


@dataclass
class CompletionFormat:
    """``/v1/completions``: ``text_completion`` objects, streamed as the same shape."""

    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, **extra}

    def opening(self, request: GenerationRequest) -> list[dict[str, Any]]:
        return []

    def delta(self, request: GenerationRequest, text: str) -> list[dict[str, Any]]:
        return [self._head(choices=[{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": None}])]

    def closing(self, request: GenerationRequest) -> list[dict[str, Any]]:
        return [self._head(choices=[{"index": 0, "text": "", "logprobs": None,
                                     "finish_reason": request.finish_reason}],
                           usage=_usage(request), sfi=_sfi(request))]

    def whole(self, request: GenerationRequest) -> dict[str, Any]:
        return self._head(choices=[{"index": 0, "text": request.text, "logprobs": None,
                                    "finish_reason": request.finish_reason}],
                          usage=_usage(request), sfi=_sfi(request))


@dataclass
class ChatFormat(CompletionFormat):
    """``/v1/chat/completions``: ``chat.completion`` objects, streamed as
    ``chat.completion.chunk`` deltas."""

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")

    def _head(self, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, **extra}

    def opening(self, request: GenerationRequest) -> list[dict[str, Any]]:
        return [self._head(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}])]

    def delta(self, request: GenerationRequest, text: str) -> list[dict[str, Any]]:
        return [self._head(choices=[{"index": 0, "delta": {"content": text},
                                     "finish_reason": None}])]

    def closing(self, request: GenerationRequest) -> list[dict[str, Any]]:
        return [self._head(choices=[{"index": 0, "delta": {},
                                     "finish_reason": request.finish_reason}],
                           usage=_usage(request), sfi=_sfi(request))]

    def whole(self, request: GenerationRequest) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": request.text},
                             "finish_reason": request.finish_reason, "logprobs": None}],
                "usage": _usage(request), "sfi": _sfi(request)}


# --- running a request ----------------------------------------------------------------------
def admit(state: ServerState, body: _Common, prompt_field: str, chars: int) -> None:
    """What can be checked before tokenizing: the model, the fields, and a prompt so long
    that no tokenization could fit it (``chars`` over the context times the longest token)."""
    if body.model not in state.names:
        raise APIError(404, f"the model {body.model!r} does not exist; this server has "
                       f"{state.model_name!r}", param="model", code="model_not_found")
    body.check_fields()
    limit = state.context_limit
    if limit and chars > limit * state.max_token_chars:
        raise APIError(400, f"the {prompt_field} has {chars} characters: more than the model's "
                       f"context of {limit} tokens can hold", param=prompt_field,
                       code="context_length_exceeded")


def prepare(state: ServerState, body: _Common, prompt_ids: list[int],
            prompt_field: str) -> GenerationRequest:
    """Check a tokenized request against the model and turn it into the engine's request."""
    limit = state.context_limit
    room = (limit - len(prompt_ids)) if limit else None
    if room is not None and room < 1:
        raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; the model's context "
                       f"is {limit}", param=prompt_field, code="context_length_exceeded")
    asked = body.token_limit
    max_tokens = asked if asked is not None else min(512, room or 512)
    if room is not None and max_tokens > room:
        raise APIError(400, f"max_tokens is {max_tokens} but only {room} tokens fit after "
                       f"the {len(prompt_ids)}-token prompt (context {limit})",
                       param="max_tokens" if body.max_tokens is not None
                       else "max_completion_tokens", code="context_length_exceeded")
    config = None
    if body.sfi is not None and (body.sfi.k_head is not None or body.sfi.k_fraction):
        try:
            config = replace(state.engine.config, k_head=body.sfi.k_head,
                             k_fraction=body.sfi.k_fraction)
        except SFIError as exc:
            raise APIError(400, str(exc), param="sfi") from None
    return GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
        stop=body.stops(), mode=body.mode, config=config)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def stream_events(engine: Engine, request: GenerationRequest, events: asyncio.Queue,
                        fmt: CompletionFormat) -> AsyncIterator[str]:
    """The server-sent events of one streamed request; cancels it if the client goes away."""
    try:
        for piece in fmt.opening(request):
            yield _sse(piece)
        while True:
            kind, payload = await events.get()
            if kind == "delta":
                for piece in fmt.delta(request, payload):
                    yield _sse(piece)
            elif kind == "done":
                for piece in fmt.closing(request):
                    yield _sse(piece)
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse({"error": {"message": f"generation failed: {payload}",
                                      "type": "server_error", "param": None, "code": None}})
                return
    finally:  # the client went away, or we are done
        if not request.done:
            engine.cancel(request)


async def respond(state: ServerState, request: GenerationRequest, stream: bool,
                  fmt: CompletionFormat, http: Request) -> Any:
    """Submit ``request`` to the engine; answer with one JSON body or a stream of events.
    Either way the request is cancelled as soon as its client goes away."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    request.on_event = lambda kind, payload: loop.call_soon_threadsafe(
        events.put_nowait, (kind, payload))
    engine = state.engine
    try:
        engine.submit(request)
    except QueueFullError:
        raise
    except KVBudgetError as exc:
        raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") \
            from None
    except SFIError as exc:  # stopped engine
        raise APIError(503, str(exc), "server_error", code="unavailable") from None
    if stream:
        return StreamingResponse(stream_events(engine, request, events, fmt),
                                 media_type="text/event-stream")
    try:
        checked = time.monotonic()
        while True:
            try:
                kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                kind = payload = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody is listening
            if kind == "error":
                raise APIError(500, f"generation failed: {payload}", "server_error")
            if kind == "done":
                return JSONResponse(fmt.whole(request))
    finally:
        if not request.done:
            engine.cancel(request)


DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is there


# --- the routes -------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request) -> Any:
    state = _state(http)
    admit(state, body, "prompt", len(body.prompt))
    ids = await run_in_threadpool(lambda: state.engine.tokenizer(body.prompt)["input_ids"])
    request = prepare(state, body, list(ids), "prompt")
    return await respond(state, request, bool(body.stream), CompletionFormat(state.model_name),
                         http)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, http: Request) -> Any:
    state = _state(http)
    admit(state, body, "messages", sum(len(m.content) for m in body.messages))
    messages = [m.model_dump() for m in body.messages]

    def tokenize() -> list[int]:
        ids = state.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    request = prepare(state, body, await run_in_threadpool(tokenize), "messages")
    return await respond(state, request, bool(body.stream), ChatFormat(state.model_name), http)


@router.get("/v1/models")
async def models(http: Request) -> dict[str, Any]:
    state = _state(http)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                        "created": int(state.started), "owned_by": "sfi"}]}


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """``ok`` while the engine's loop runs; 503 with the reason once it has died or stopped."""
    state = _state(http)
    engine = state.engine
    body = {"status": "ok" if engine.alive else "error", "model": state.model_name,
            "active": engine.active, "queued": engine.queue_depth}
    if not engine.alive:
        body["error"] = engine.failure or "the engine is not running"
    return JSONResponse(body, status_code=200 if engine.alive else 503)


@router.get("/metrics")
async def metrics(http: Request) -> PlainTextResponse:
    engine = _state(http).engine
    m = engine.metrics
    lines = []
    for name, kind, value, text in (
        ("sfi_requests_total", "counter", m.requests, "requests accepted"),
        ("sfi_requests_rejected_total", "counter", m.rejected, "requests refused (429)"),
        ("sfi_requests_cancelled_total", "counter", m.cancelled, "requests cancelled"),
        ("sfi_prompt_tokens_total", "counter", m.prompt_tokens, "prompt tokens prefilled"),
        ("sfi_generated_tokens_total", "counter", m.generated_tokens, "tokens generated"),
        ("sfi_decode_steps_total", "counter", m.decode_steps, "batched decode steps"),
        ("sfi_prefill_chunks_total", "counter", m.prefill_chunks, "prompt chunks prefilled"),
        ("sfi_slow_steps_total", "counter", m.slow_steps, "sequence-steps that were slow"),
        ("sfi_fast_steps_total", "counter", m.fast_steps, "sequence-steps that were fast"),
        ("sfi_dense_steps_total", "counter", m.dense_steps, "sequence-steps that were dense"),
        ("sfi_queue_depth", "gauge", engine.queue_depth, "requests waiting"),
        ("sfi_active_sequences", "gauge", engine.active, "sequences in the batch"),
        ("sfi_kv_tokens_reserved", "gauge", engine.kv_tokens_held,
         "KV tokens the running batch may hold (prompt + max_tokens per sequence)"),
        ("sfi_kv_slab_bytes", "gauge", engine.kv_bytes,
         "bytes of the running batch's slab (max_batch rows of KV, norms, compact buffers)"),
        ("sfi_batch_joins_total", "counter", m.joins, "sequences put into a running batch"),
        ("sfi_batch_copies_total", "counter", m.batch_copies,
         "joins that copied the batch (the slab lacked rows, positions or room)"),
        ("sfi_decode_tokens_per_second", "gauge", round(m.decode_tokens_per_second(), 3),
         "tokens per second over the last batched steps"),
        ("sfi_process_peak_rss_bytes", "gauge", _peak_rss_bytes(),
         "peak resident memory of the server process"),
    ):
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# --- errors in OpenAI's shape ------------------------------------------------------------------
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = "the request body is not valid JSON"
        where = ""
    message = message.removeprefix("Value error, ")
    return _error(400, f"{where}: {message}" if where else message, param=where or None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.kind, exc.param, exc.code)


async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
    return _error(429, f"the server is busy ({exc}); retry later", "rate_limit_error",
                  code="queue_full", headers={"Retry-After": "1"})


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind,
                  headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error(500, f"internal error: {type(exc).__name__}", "server_error")


async def _send_error(send: Send, status: int, message: str, kind: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
    response = _error(status, message, kind, code=code, headers=headers)
    await send({"type": "http.response.start", "status": status,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class Guard:
    """ASGI middleware in front of every route: the Host header (against DNS rebinding), the
    API key on ``/v1/*`` (constant-time comparison; ``/health`` and ``/metrics`` stay open), and
    the body size (413 past ``max_body_bytes``, counted as the body arrives)."""

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_hosts: list[str] | None,
                 max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.allowed_hosts = None if not allowed_hosts or "*" in allowed_hosts \
            else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.allowed_hosts is not None:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.lower() not in self.allowed_hosts:
                await _send_error(send, 400, f"the Host header {host!r} is not one this server "
                                  "answers to", "invalid_request_error", "invalid_host")
                return
        if self.api_key is not None and scope.get("path", "").startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await _send_error(send, 401, "a valid API key is needed: send it as "
                                  "'Authorization: Bearer <key>'", "invalid_request_error",
                                  "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _send_error(send, 413, f"the request body is over {self.max_body_bytes} bytes",
                              "invalid_request_error", "request_too_large")
            return
        body = b""
        more = scope.get("method") in ("POST", "PUT", "PATCH")
        while more:  # read the body here (at most max_body_bytes), then replay it
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, f"the request body is over {self.max_body_bytes} "
                                  "bytes", "invalid_request_error", "request_too_large")
                return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` first, then what the client sends (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to (byte-level and SentencePiece
    vocabularies spell each byte or character of a token with at least one symbol)."""
    try:
        return max(8, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary: a generous bound
        return 256


def create_app(engine: Engine, model_name: str, context_limit: int | None, *,
               api_key: str | None = None, allowed_hosts: list[str] | None = None,
               max_body_bytes: int = 4 * 2 ** 20) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name`` (and the alias ``default``).

    Args:
        api_key: when set, every ``/v1/*`` route wants ``Authorization: Bearer <api_key>``.
        allowed_hosts: Host header names answered (``["*"]`` or None: any).
        max_body_bytes: larger request bodies get 413.
    """
    if api_key is not None and not api_key:
        raise SFIError("the API key is empty")
    app = FastAPI(title="sfi", description="Slow-Fast Inference, OpenAI-compatible")
    app.state.sfi = ServerState(engine, model_name, context_limit,
                                longest_token_chars(engine.tokenizer))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts,
                       max_body_bytes=max_body_bytes)
    app.include_router(router)
    return app


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def serve(engine: Engine, app: FastAPI, host: str, port: int,
          graceful_timeout: float = 10.0) -> None:
    """Run ``app`` with uvicorn until SIGINT/SIGTERM; on the signal the engine stops first, so
    running streams end with an error event and waiting requests fail, and uvicorn then closes
    within ``graceful_timeout`` seconds."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.stop(wait=False)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=graceful_timeout)
    try:
        _Server(config).run()
    finally:
        engine.stop()
