"""From a checked request to an answer: the server's state, the two endpoints' response
formats, ``admit`` (before tokenizing) and ``prepare`` (after), and ``respond``: one JSON body,
or server-sent events, the request cancelled as soon as its client goes away."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sfi.errors import SFIError
from sfi.server.engine import Engine
from sfi.server.requests import GenerationRequest, KVBudgetError, QueueFullError
from sfi.server.schemas import APIError, RequestFields


@dataclass
class ServerState:
    """What the routes need: the engine, the model's names and its context window, the
    longest token's characters (a prompt over ``context_limit`` times it cannot fit), and the
    mode of a request that names none."""

    engine: Engine
    model_name: str
    context_limit: int | None
    max_token_chars: int = 64
    default_mode: str = "sfi"
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
def admit(state: ServerState, body: RequestFields, prompt_field: str, chars: int) -> None:
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


def prepare(state: ServerState, body: RequestFields, prompt_ids: list[int],
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
        stop=body.stops(), mode=body.mode or state.default_mode, config=config)


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
