"""``sfi serve`` (the OpenAI-compatible server) and ``sfi loadtest``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sfi.cli.common import err, load_model, one_format, print_table
from sfi.cli.options import (
    CompileOpt,
    JsonOpt,
    ModelOpt,
    WeightsOpt,
    int_list,
    note,
    old_spellings,
    sfi_options,
)
from sfi.core.config import SFIConfig
from sfi.errors import SFIError


@sfi_options
def serve_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    weights: WeightsOpt = "auto",
    compile: CompileOpt = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    max_batch: Annotated[int, typer.Option(help="sequences decoded together at most")] = 8,
    max_queue: Annotated[int, typer.Option(
        help="requests waiting for a busy slot before 429")] = 64,
    api_key: Annotated[str | None, typer.Option(
        envvar="SFI_API_KEY", help="require 'Authorization: Bearer KEY' on /v1/*")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="the model's name in the API (default: --model, or a folder's last part)")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        metavar="HOST", help="a Host header name to answer (repeatable; '*' = any; default: "
        "the loopback names when --host is loopback, else any)")] = None,
    max_body_mb: Annotated[float, typer.Option(help="larger request bodies get 413")] = 4.0,
    request_timeout: Annotated[float | None, typer.Option(
        help="seconds a request may take before it fails")] = 600.0,
    prefill_chunk: Annotated[int, typer.Option(
        help="a joining prompt is prefilled this many tokens at a time, between decode steps "
             "of the running streams (0: whole prompts)")] = 128,
    max_stall_ms: Annotated[float, typer.Option(
        help="milliseconds of prefill chunks between two decode steps of running streams "
             "(at least one chunk)")] = 400.0,
    max_kv_tokens: Annotated[int | None, typer.Option(
        help="KV tokens (prompt + max_tokens per sequence) the running batch may hold; "
             "requests that do not fit wait")] = None,
    mode: Annotated[str, typer.Option(
        help="the mode of a request that sends none: sfi (lossy, fastest), full (dense) or "
             "exact (full attention's tokens, drafted by fast steps)")] = "sfi",
) -> None:
    """An OpenAI-compatible server with continuous batching over slow-fast decoding."""

    from dataclasses import asdict

    from sfi.decoding.decode import MODES
    from sfi.hf.facts import context_length
    from sfi.server.app import create_app, serve
    from sfi.server.engine import Engine, EngineLimits
    from sfi.server.guard import Access

    if mode not in MODES:
        raise SFIError(f"--mode must be one of {', '.join(MODES)} (got {mode!r})")
    if prefill_chunk < 0:
        raise SFIError(f"--prefill-chunk must be >= 0 (0: one forward), got {prefill_chunk}")
    # the library's own checks, before the model loads
    limits = EngineLimits(max_batch, max_queue, request_timeout, prefill_chunk or None,
                          max_stall_ms / 1000, max_kv_tokens)
    access = Access.listening_on(host, api_key, allowed_host, int(max_body_mb * 2 ** 20))
    if access.open_to_anyone(host):
        err.print(f"[yellow]warning:[/] listening on {host} without --api-key: anyone who can "
                  "reach this port can use the model")
    name = served_model_name or (Path(model).name if Path(model).exists() else model)
    weights = one_format(weights)
    if weights == "fp16" and max_batch > 1:
        from sfi.weights.fp16_linear import BATCH_ONE

        note(BATCH_ONE)
    loaded_model, tokenizer = load_model(model, False, weights=weights, compile=compile,
                                         batch=max_batch)
    engine = Engine(loaded_model, tokenizer, config or SFIConfig(), **asdict(limits))
    app_ = create_app(engine, name, context_length(loaded_model), api_key=access.api_key,
                      allowed_hosts=list(access.allowed_hosts or ()),
                      max_body_bytes=access.max_body_bytes, default_mode=mode)
    engine.start()
    serve(engine, app_, host, port)


LOADTEST_KEYS = ("requests", "errors", "requests_per_s", "tokens_per_s", "ttft_p50_ms",
                 "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "join_stall_ms",
                 "server_peak_rss_mb")


@old_spellings(max_new_tokens="--max-tokens")
def loadtest_cmd(
    url: Annotated[str, typer.Option(help="a running sfi serve (loopback)")] =
        "http://127.0.0.1:8000",
    clients: Annotated[int, typer.Option(help="concurrent streaming clients")] = 4,
    duration: Annotated[float, typer.Option(help="seconds to keep sending")] = 60.0,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per request (the requests' "
                                                "max_tokens)")] = 64,
    mode: Annotated[str, typer.Option(help="sfi | full | exact")] = "sfi",
    prompt_chars: Annotated[str, typer.Option(
        help="prompt length in characters; several (comma-separated) mix short and long "
             "requests across the clients")] = "4000",
    model: Annotated[str, typer.Option(help="model name to send")] = "default",
    api_key: Annotated[str | None, typer.Option(
        envvar="SFI_API_KEY", help="the server's API key, if it has one")] = None,
    as_json: JsonOpt = False,
) -> None:
    """N concurrent streaming clients against a running server, for a bounded time."""
    from urllib.parse import urlparse

    from sfi.bench.loadtest import run_loadtest

    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise SFIError(f"loadtest sends traffic to loopback addresses only, not {host!r}")
    if clients < 1 or duration <= 0 or max_new_tokens < 1 or \
            mode not in ("sfi", "full", "exact"):
        raise SFIError("--clients and --max-new-tokens must be >= 1, --duration > 0, "
                       "--mode sfi|full|exact")
    lengths = int_list("--prompt-chars", prompt_chars)
    result = run_loadtest(url, clients, duration, max_new_tokens, mode, lengths, model, api_key)
    if as_json:
        print(json.dumps(result))
        return
    print_table(f"loadtest: {clients} clients, mode {mode}, {duration:g} s",
                 [k.replace("_", " ") for k in LOADTEST_KEYS], [[result[k] for k in LOADTEST_KEYS]])
