"""OpenAI-compatible HTTP API over the continuous-batching engine (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Extensions to the
OpenAI request: ``mode`` (``"sfi"`` or ``"full"``) and ``sfi`` (``k_head`` or ``k_fraction``);
each response carries an ``sfi`` object with the sequence's slow/fast step counts.
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sfi.errors import SFIError
from sfi.server.engine import Engine, GenerationRequest, QueueFullError


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)


class BudgetOverride(BaseModel):
    """The ``sfi`` extension of a request: this sequence's budget."""

    model_config = ConfigDict(extra="forbid")
    k_head: int | None = Field(default=None, ge=0)
    k_fraction: float | None = Field(default=None, gt=0.0, le=1.0)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    mode: Literal["sfi", "full"] = "sfi"
    sfi: BudgetOverride | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Common):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


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


@dataclass
class ServerState:
    """What the routes need: the engine, the model's names and its context window."""

    engine: Engine
    model_name: str
    context_limit: int | None
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
def prepare(state: ServerState, body: _Common, prompt_ids: list[int]) -> GenerationRequest:
    """Check a request against the model and turn it into the engine's request."""
    if body.model not in state.names:
        raise APIError(404, f"the model {body.model!r} does not exist; this server has "
                       f"{state.model_name!r}", param="model", code="model_not_found")
    limit = state.context_limit
    room = (limit - len(prompt_ids)) if limit else None
    if room is not None and room < 1:
        raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; the model's context "
                       f"is {limit}", param="messages", code="context_length_exceeded")
    max_tokens = body.max_tokens if body.max_tokens is not None else min(512, room or 512)
    if room is not None and max_tokens > room:
        raise APIError(400, f"max_tokens is {max_tokens} but only {room} tokens fit after "
                       f"the {len(prompt_ids)}-token prompt (context {limit})",
                       param="max_tokens", code="context_length_exceeded")
    config = None
    if body.sfi is not None and (body.sfi.k_head is not None or body.sfi.k_fraction):
        try:
            config = replace(state.engine.config, k_head=body.sfi.k_head,
                             k_fraction=body.sfi.k_fraction)
        except SFIError as exc:
            raise APIError(400, str(exc), param="sfi") from None
    return GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens,
                             temperature=body.temperature, top_p=body.top_p, seed=body.seed,
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
                yield _sse({"error": {"message": str(payload)}})
                return
    finally:  # the client went away, or we are done
        if not request.done:
            engine.cancel(request)


async def respond(state: ServerState, request: GenerationRequest, stream: bool,
                  fmt: CompletionFormat) -> Any:
    """Submit ``request`` to the engine; answer with one JSON body or a stream of events."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    request.on_event = lambda kind, payload: loop.call_soon_threadsafe(
        events.put_nowait, (kind, payload))
    engine = state.engine
    engine.submit(request)
    if stream:
        return StreamingResponse(stream_events(engine, request, events, fmt),
                                 media_type="text/event-stream")
    try:
        while True:
            kind, payload = await events.get()
            if kind == "error":
                raise APIError(500, f"generation failed: {payload}", "server_error")
            if kind == "done":
                return JSONResponse(fmt.whole(request))
    finally:
        if not request.done:
            engine.cancel(request)


# --- the routes -------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request) -> Any:
    state = _state(http)
    request = prepare(state, body, state.engine.tokenizer(body.prompt)["input_ids"])
    return await respond(state, request, body.stream, CompletionFormat(body.model))


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, http: Request) -> Any:
    state = _state(http)
    messages = [m.model_dump() for m in body.messages]
    ids = state.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    request = prepare(state, body, list(ids))
    return await respond(state, request, body.stream, ChatFormat(body.model))


@router.get("/v1/models")
async def models(http: Request) -> dict[str, Any]:
    state = _state(http)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                        "created": int(state.started), "owned_by": "sfi"}]}


@router.get("/health")
async def health(http: Request) -> dict[str, Any]:
    state = _state(http)
    return {"status": "ok", "model": state.model_name, "active": state.engine.active,
            "queued": state.engine.queue_depth}


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
        ("sfi_slow_steps_total", "counter", m.slow_steps, "sequence-steps that were slow"),
        ("sfi_fast_steps_total", "counter", m.fast_steps, "sequence-steps that were fast"),
        ("sfi_dense_steps_total", "counter", m.dense_steps, "sequence-steps that were dense"),
        ("sfi_queue_depth", "gauge", engine.queue_depth, "requests waiting"),
        ("sfi_active_sequences", "gauge", engine.active, "sequences in the batch"),
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
    return _error(400, f"{where}: {message}" if where else message, param=where or None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.kind, exc.param, exc.code)


async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
    return _error(429, f"the server is busy ({exc}); retry later", "rate_limit_error",
                  code="queue_full", headers={"Retry-After": "1"})


def create_app(engine: Engine, model_name: str, context_limit: int | None) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name`` (and the alias ``default``)."""
    app = FastAPI(title="sfi", description="Slow-Fast Inference, OpenAI-compatible")
    app.state.sfi = ServerState(engine, model_name, context_limit)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.include_router(router)
    return app
