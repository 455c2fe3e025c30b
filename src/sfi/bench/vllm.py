"""Decode throughput of stock vLLM and vLLM + SFI, beside sfi's own engine and llama.cpp.

vLLM runs in this process. Eager, one engine serves both modes, SFI switched on and off
between cells (:func:`sfi.vllm.configure`), so they share the weights, the KV pool and the
kernels; compiled (CUDA graphs), stock vLLM runs in an engine without the plugin and vLLM + SFI
in one started with SFI on (:func:`run_vllm_bench`).
For each (context, batch) every mode prefills the same essay prompts, then the steps in which
every row decodes are timed (``LLMEngine.step``: scheduling, forward, sampling), after
``warmup`` untimed ones; each engine first decodes a short request untimed (:func:`warm_up`).
sfi's own engine (transformers, :func:`sfi.bench.throughput.measure_cell`) runs full attention,
SFI and SFI's fast step alone with the same configuration on the same token ids (a real prefill
of the same prompts, or ``own_kv="synthetic"``: random KV of their shape, for contexts past what
the model was trained on); llama.cpp (``llama-cpp-python`` on the model's GGUF, its own
quantization, full KV, the same threads) runs the same token ids at batch 1 when it is
installed.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sfi.bench.llama_cpp import decode_times, gguf_weights
from sfi.bench.throughput import (
    benchmark_ids,
    kv_bytes_per_entry,
    machine,
    measure_bandwidth,
    measure_cell,
    step_rates,
)
from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.decoding.prefix import prefix_kv
from sfi.errors import SFIError

VLLM_MODES = ("vllm", "vllm+sfi")
OWN_MODES = ("full", "sfi", "sfi-fast-only")  # sfi's engine beside them
OWN_KV = ("prefill", "synthetic")  # what sfi's engine decodes from


@dataclass
class EngineRow:
    """One (engine, mode, context, batch) measurement; times in milliseconds."""

    engine: str
    mode: str
    context: int
    batch: int
    decode_tok_s: float
    step_ms: float
    steps: int
    fast_fraction: float | None
    speedup_vs_own_full: float | None = None
    speedup_vs_vllm: float | None = None
    coverage_rate: float | None = None  # coverage refreshes per decode step (SFI rows)


def make_engine(path: str | Path, max_model_len: int, max_num_seqs: int, kv_bytes: int,
                dtype: str = "float32", eager: bool = True, attention_backend: str | None = None,
                plugin: bool = True):
    """An in-process vLLM engine with room for ``kv_bytes`` of KV; ``plugin``: with the SFI
    backend installed (inert until :func:`sfi.vllm.configure`), else with none of it (stock
    vLLM). ``eager=False`` lets vLLM compile the model and capture CUDA graphs (on GPUs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the bench goes past 8K
    # vLLM drops torch to one thread unless OMP_NUM_THREADS is set; both engines get as many
    # as torch has now
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    from vllm import LLM

    from sfi.vllm import backend

    backend.install() if plugin else backend.uninstall()
    extra = {"attention_backend": attention_backend} if attention_backend else {}
    return LLM(model=str(path), dtype=dtype, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False, seed=0,
               enforce_eager=eager, distributed_executor_backend="uni",
               kv_cache_memory_bytes=kv_bytes, **extra)


def close_engine(llm: Any) -> None:
    """Shut an in-process engine down, so that another can start in this process."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def time_decode(llm: Any, prompts: Sequence[list[int]], new_tokens: int, warmup: int
                ) -> list[float]:
    """Seconds of each step in which every request decodes (after ``warmup`` of them)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=warmup + new_tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                           params)
    started: set[str] = set()
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(started) == len(prompts)
        begin = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - begin
        started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
        if decoding and not any(o.finished for o in outputs):
            times.append(elapsed)
    return times[warmup:]


WARMUP_PROMPT = 512  # tokens of the untimed request that starts an engine's decoding


def warm_up(llm: Any, prompt: list[int]) -> None:
    """Decode a short request (the first :data:`WARMUP_PROMPT` tokens of ``prompt``), untimed:
    the first request a process decodes with vLLM can run slower throughout, not only in its
    first steps (decoding one request twice with vLLM's CPU build: 1.25x on Qwen2.5-0.5B at 4K,
    2x on SmolLM2 at 16K), which would be charged to whichever mode is timed first."""
    time_decode(llm, [prompt[:WARMUP_PROMPT]], 4, 2)


def llama_cpp_row(gguf: str | Path, prompt: list[int], new_tokens: int, warmup: int,
                  threads: int) -> EngineRow:
    """llama.cpp decoding greedily after ``prompt`` (:func:`sfi.bench.llama_cpp.decode_times`);
    the row's ``mode`` is the GGUF's weight type (:func:`~sfi.bench.llama_cpp.gguf_weights`)."""
    times = decode_times(gguf, prompt, new_tokens, warmup, threads)
    return EngineRow(engine="llama.cpp", mode=gguf_weights(gguf), context=len(prompt), batch=1,
                     decode_tok_s=round(len(times) / sum(times), 3),
                     step_ms=round(1000 * statistics.median(times), 3), steps=len(times),
                     fast_fraction=None)


def cell_stats(book: Any, earlier: Collection[int]) -> DecodeStats:
    """The merged decode statistics of the requests in ``book`` (a
    :class:`sfi.vllm.requests.RequestBook`) but those whose serial numbers are in ``earlier``
    (the requests it held before a cell ran): a finished request leaves the book only when its
    slot or its key is taken again, so an earlier cell's requests may still be there."""
    return DecodeStats.merge([r.seq.stats for r in book.requests.values()
                              if r.serial not in earlier])


def vllm_row(mode: str, context: int, batch: int, times: list[float],
             fast_fraction: float | None, coverage_rate: float | None = None) -> EngineRow:
    return EngineRow(engine="vllm", mode=mode, context=context, batch=batch,
                     decode_tok_s=round(batch * len(times) / sum(times), 3),
                     step_ms=round(1000 * statistics.median(times), 3), steps=len(times),
                     fast_fraction=fast_fraction, coverage_rate=coverage_rate)


def run_vllm_bench(path: str | Path, model: Any, tokenizer: Any, *, contexts: Sequence[int],
                   batches: Sequence[int], new_tokens: int, config: SFIConfig,
                   own_engine: bool = True, own_kv: str = "prefill",
                   ggufs: Sequence[str | Path] = (), warmup: int = 2,
                   dtype: str = "float32", eager: bool = True,
                   attention_backend: str | None = None,
                   progress: Callable[[str], None] | None = None,
                   on_row: Callable[[EngineRow], None] | None = None) -> dict[str, Any]:
    """Every (context, batch) on stock vLLM, vLLM + SFI and (``own_engine``: ``model`` is the
    transformers model) sfi's own full, SFI and SFI fast-only modes (from a real prefill of the
    same prompts, or with ``own_kv="synthetic"`` random KV of their shape), and llama.cpp on
    each of ``ggufs`` at batch 1 (a row each, named by its weight type);
    returns ``{"rows": [...], ...}`` with ratios within each cell. ``dtype``, ``eager`` and
    ``attention_backend`` are vLLM's (bfloat16, not eager, on GPUs). ``on_row`` is handed each
    row as soon as it is measured.

    Eager, one engine serves both vLLM modes, SFI switched on and off between them (with SFI
    off its builders return vLLM's metadata: stock vLLM's code path). Compiled, each mode has
    an engine of its own, started with its setting (CUDA graphs follow what the backend
    declares at engine start): vLLM + SFI, then stock vLLM without the plugin installed."""
    from sfi.vllm import backend, configure

    if own_kv not in OWN_KV:
        raise SFIError(f"own_kv must be one of {', '.join(OWN_KV)}, got {own_kv!r}")
    say = progress or (lambda _msg: None)
    longest = max(contexts) + warmup + new_tokens + 2
    from transformers import AutoConfig

    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    per_position = kv_bytes_per_entry(AutoConfig.from_pretrained(str(path)), element)
    # whole blocks of up to 512 positions and one more per sequence (vLLM's block sizes): a
    # short context's pool would otherwise be refused as too small for max_model_len
    positions = (math.ceil(longest / 512) + 1) * 512
    kv_bytes = int(per_position * positions * max(batches) * 1.25)
    cells = [(context, batch) for context in contexts for batch in batches]
    ids = {cell: benchmark_ids(tokenizer, *cell) for cell in cells}
    measured: dict[tuple[int, int], list[EngineRow]] = {cell: [] for cell in cells}

    def record(cell: tuple[int, int], row: EngineRow) -> None:
        measured[cell].append(row)
        if on_row:
            on_row(row)

    def time_mode(llm: Any, mode: str, cell: tuple[int, int]) -> None:
        say(f"context {cell[0]}, batch {cell[1]}: {mode}")
        before = backend.book() if mode == "vllm+sfi" else None
        earlier = {r.serial for r in before.requests.values()} if before is not None else set()
        times = time_decode(llm, ids[cell].tolist(), new_tokens, warmup)
        rates = (None, None)
        if mode == "vllm+sfi":  # decode steps only (the book counts prompt chunks too)
            requests = backend.book()
            if requests is None:
                raise SFIError("vLLM + SFI ran no SFI step: the engine did not run sfi's "
                               "attention backend")
            rates = step_rates(cell_stats(requests, earlier))
        record(cell, vllm_row(mode, *cell, times, *rates))

    engine = dict(max_model_len=longest, max_num_seqs=max(batches), kv_bytes=kv_bytes,
                  dtype=dtype, eager=eager, attention_backend=attention_backend)
    first = ids[cells[0]][0].tolist()
    if eager:
        configure(None)
        llm = make_engine(path, **engine)
        warm_up(llm, first)
        for cell in cells:
            for mode in VLLM_MODES:
                configure(config if mode == "vllm+sfi" else None)
                time_mode(llm, mode, cell)
        close_engine(llm)
    else:  # vLLM + SFI first: an engine made after one without the plugin, in the same
        # process, was seen to run the SFI backend without the model's input ids
        for mode in reversed(VLLM_MODES):
            configure(config if mode == "vllm+sfi" else None)  # before the engine starts
            llm = make_engine(path, **engine, plugin=mode == "vllm+sfi")
            warm_up(llm, first)
            for cell in cells:
                time_mode(llm, mode, cell)
            close_engine(llm)
            del llm  # (before the next engine takes the memory)
    bandwidth = measure_bandwidth(device=model.device) if own_engine else None
    rows: list[EngineRow] = []
    for context, batch in cells:
        cell = measured[(context, batch)]
        prompts = ids[(context, batch)]
        if own_engine:
            say(f"context {context}, batch {batch}: sfi engine, {own_kv} KV")
            prefix = prefix_kv(model, prompts[:, :-config.evidence_window],
                               own_kv == "synthetic")
            for mode in OWN_MODES:
                say(f"context {context}, batch {batch}: sfi engine, {mode}")
                row = measure_cell(model, tokenizer, mode, config, prompts, prefix,
                                   kv=own_kv, new_tokens=new_tokens, warmup=warmup,
                                   bandwidth=bandwidth)
                record((context, batch), EngineRow(
                    engine="sfi", mode=mode, context=context, batch=batch,
                    decode_tok_s=row.decode_tok_s, step_ms=row.step_ms, steps=new_tokens,
                    fast_fraction=row.fast_fraction, coverage_rate=row.coverage_rate))
            del prefix
        for gguf in ggufs if batch == 1 else ():
            say(f"context {context}, batch 1: llama.cpp, {Path(gguf).name}")
            record((context, batch), llama_cpp_row(gguf, prompts[0].tolist(), new_tokens,
                                                   warmup, torch.get_num_threads()))
        base = {(r.engine, r.mode): r.decode_tok_s for r in cell}
        for r in cell:
            r.speedup_vs_vllm = round(r.decode_tok_s / base[("vllm", "vllm")], 3)
            own = base.get((r.engine, "full" if r.engine == "sfi" else "vllm"))
            r.speedup_vs_own_full = round(r.decode_tok_s / own, 3) if own else None
        rows.extend(cell)
    configure(None)
    import vllm
    from vllm.platforms import current_platform

    device = current_platform.device_name
    if current_platform.is_cuda():
        device = current_platform.get_device_name()
    return {"vllm": vllm.__version__, "device": device, "machine": machine(), "dtype": dtype,
            "eager": eager, "config": config.to_dict(),
            "own_kv": own_kv if own_engine else None,
            "bandwidth_gb_s": round(bandwidth, 2) if bandwidth else None,
            "new_tokens": new_tokens, "rows": [asdict(r) for r in rows]}
