"""OpenAI-compatible HTTP API over the continuous-batching engine (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Extensions to the
OpenAI request: ``mode`` (``"sfi"``, ``"full"`` or ``"exact"``; unset: the server's default)
and ``sfi`` (``k_head`` or ``k_fraction``); each response carries an ``sfi`` object with the
sequence's slow/fast step counts (exact mode's drafts and acceptance under ``exact``).
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sfi.decoding.decode import MODES
from sfi.decoding.prompts import chat_ids
from sfi.errors import PromptError, SFIError
from sfi.server.engine import Engine
from sfi.server.guard import Access, Guard, is_loopback
from sfi.server.requests import QueueFullError
from sfi.server.responses import ChatFormat, CompletionFormat, ServerState, admit, prepare, respond
from sfi.server.schemas import APIError, ChatRequest, CompletionRequest, error_response

__all__ = ["create_app", "is_loopback", "serve"]

log = logging.getLogger("sfi.server")


def _state(http: Request) -> ServerState:
    return http.app.state.sfi


def _peak_rss_bytes() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports kilobytes


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
        try:
            return chat_ids(state.engine.tokenizer, messages)
        except PromptError as exc:  # a model without a chat template
            raise APIError(400, str(exc), param="messages") from None

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
        ("sfi_dense_steps_total", "counter", m.dense_steps,
         "sequence-steps that were dense (exact mode's verifies included)"),
        ("sfi_exact_verify_steps_total", "counter", m.exact_verify_steps,
         "exact mode: sequence-verifies (one dense forward checks a row's drafts)"),
        ("sfi_exact_drafted_total", "counter", m.exact_drafted,
         "exact mode: tokens drafted by fast steps"),
        ("sfi_exact_accepted_total", "counter", m.exact_accepted,
         "exact mode: drafts that full attention accepted"),
        ("sfi_exact_dense_steps_total", "counter", m.exact_dense_steps,
         "exact mode: sequence-steps decoded densely where drafting did not pay"),
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
    return error_response(400, f"{where}: {message}" if where else message, param=where or None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.kind, exc.param, exc.code)


async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
    return error_response(429, f"the server is busy ({exc}); retry later", "rate_limit_error",
                          code="queue_full", headers={"Retry-After": "1"})


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          kind, headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to (byte-level and SentencePiece
    vocabularies spell each byte or character of a token with at least one symbol)."""
    try:
        return max(8, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary: a generous bound
        return 256


def create_app(engine: Engine, model_name: str, context_limit: int | None, *,
               api_key: str | None = None, allowed_hosts: list[str] | None = None,
               max_body_bytes: int = 4 * 2 ** 20, default_mode: str = "sfi") -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name`` (and the alias ``default``).

    Args:
        default_mode: the mode of a request that sends none (``sfi``, ``full`` or ``exact``).
        api_key: when set, every ``/v1/*`` route wants ``Authorization: Bearer <api_key>``.
        allowed_hosts: Host header names answered (``["*"]`` or None: any).
        max_body_bytes: larger request bodies get 413.
    """
    if default_mode not in MODES:
        raise SFIError(f"unknown default mode {default_mode!r}; choose from {', '.join(MODES)}")
    access = Access(api_key, None if allowed_hosts is None else tuple(allowed_hosts),
                    max_body_bytes)
    app = FastAPI(title="sfi", description="Slow-Fast Inference, OpenAI-compatible")
    app.state.sfi = ServerState(engine, model_name, context_limit,
                                longest_token_chars(engine.tokenizer), default_mode)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(Guard, access=access)
    app.include_router(router)
    return app


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
