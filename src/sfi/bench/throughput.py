"""Decode throughput of slow-fast decoding against full attention, in one process.

For each (context, batch) the prompt is prefilled once (or filled with synthetic KV) and every
mode continues that same prefix:

- ``full``: transformers' stock ``DynamicCache`` and SDPA, the model as users run it today;
- ``full-static``: full attention over a preallocated ``StaticCache`` (the strongest fair
  baseline);
- ``sfi``: slow-fast decoding with the given configuration, greedy on real text so that the
  sentence triggers fire at their natural rate;
- ``sfi-fast-only``: the same with no refresh after the first selection, sparse at every
  context (``force_sparse``: the fast step's ceiling, where the cost model would decode densely);
- ``sfi-exact``: exact mode (``sfi.decoding.exact``: fast steps draft, dense forwards verify),
  real text only (acceptance is a property of the text); its row says whether its tokens equal
  ``full``'s of the same cell, its acceptance and its drafts per verify.

Each mode runs the last W prompt tokens as one forward (SFI makes its first selection there),
then decodes ``new_tokens`` tokens, timing every step. The floor of a step is the bytes it must
read (weights + the KV entries it attends) over the memory bandwidth measured on the spot.
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from sfi.bench.llama_cpp import NO_FLASH_ATTN, decode_times, gguf_weights
from sfi.core.config import SFIConfig
from sfi.core.cost_model import kv_elements_per_position
from sfi.core.decode_stats import DecodeStats
from sfi.core.triggers import COVERAGE
from sfi.decoding.decode_step import decode_one
from sfi.decoding.exact import ExactDecoder
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import SharedPrefill, prefix_kv
from sfi.errors import SFIError
from sfi.hf.decode_cache import KV, DecodeCache
from sfi.hf.facts import context_length
from sfi.hf.methods import build_cache
from sfi.weights.layout import PackedLinear, stored_weight_positions
from sfi.weights.reduction import ReducedLinear

MODES: tuple[str, ...] = ("full", "full-static", "sfi", "sfi-fast-only", "sfi-exact")


@dataclass
class BenchRow:
    """One (mode, context, batch) measurement; times in milliseconds."""

    mode: str
    context: int
    batch: int
    kv: str
    new_tokens: int
    decode_tok_s: float
    step_ms: float
    fast_step_ms: float | None
    slow_step_ms: float | None
    dense_step_ms: float | None
    slow_fraction: float
    fast_read_fraction: float | None
    fast_fraction: float | None  # the rows' decode steps that were fast (warmup included)
    coverage_rate: float | None  # refreshes the coverage probes caused, per decode step
    floor_ms: float
    speedup_vs_full: float | None = None
    speedup_vs_full_static: float | None = None
    weights: str = "native"
    speedup_vs_native: float | None = None
    acceptance: float | None = None
    tokens_per_verify: float | None = None
    mean_draft: float | None = None
    exact_dense_steps: int | None = None
    same_tokens_as_full: bool | None = None


def machine() -> dict[str, Any]:
    """What a benchmark ran on, kept with its rows: the CPU's model name (``/proc/cpuinfo``, or
    ``platform.processor()`` elsewhere), the vector instructions PyTorch dispatches to
    (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ...), the cores torch
    uses and torch's version. Figures move with all four."""
    name = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(errors="replace"), re.M)
        name = found.group(1).strip() if found else name
    return {"cpu": name, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def measure_bandwidth(megabytes: int = 512, repeats: int = 5,
                      device: torch.device | str = "cpu") -> float:
    """Read bandwidth in GB/s of the memory ``device`` decodes from (host memory, or a GPU's):
    the best of a few sums over a tensor larger than its caches."""
    device = torch.device(device)
    data = torch.ones(megabytes * (1 << 20) // 4, device=device)
    # a GPU reads 512 MB in about 0.1 ms: time 20 sums at once, after one that loads the kernel
    sums = 20 if device.type == "cuda" else 1
    best = float("inf")
    for _ in range(repeats + (device.type == "cuda")):
        _sync(device)
        start = time.perf_counter()
        for _ in range(sums):
            data.sum()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / sums)
    return data.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding
    tables, of which a step reads one row per token (counted when tied to the output layer)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        if isinstance(module, (PackedLinear, ReducedLinear)):  # stored apart from parameters
            total += module.stored_bytes()
        for p in module.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


def kv_bytes_per_entry(model: torch.nn.Module, element: int | None = None) -> int:
    """Bytes of one cached position across all layers and KV heads (keys and values) of a
    model or its config, ``element`` bytes per number (default: the model's weights')."""
    if element is None:
        element = next(model.parameters()).element_size()
    return kv_elements_per_position(model) * element


def benchmark_ids(tokenizer: Any, context: int, batch: int) -> torch.Tensor:
    """``[batch, context]`` token ids of essay text, each row from a different place."""
    from sfi.texts import essays

    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - context) // max(batch, 1))
    if len(ids) < context:
        raise SFIError(f"the essays hold {len(ids)} tokens; a context of {context} was asked")
    return torch.tensor([ids[b * stride: b * stride + context] for b in range(batch)])


def make_bench_cache(mode: str, model: torch.nn.Module, tokenizer: Any, config: SFIConfig,
                     prefix: KV, capacity: int) -> DecodeCache:
    """The cache of one bench mode, loaded with a copy of ``prefix``."""
    if mode == "sfi-fast-only":  # no refresh after the first selection, sparse wherever
        config = replace(config, trigger="bootstrap", coverage_layers=0, force_sparse=True)
    method = "sfi" if mode.startswith("sfi") else mode
    cache = build_cache(model, tokenizer, method, config=config if method == "sfi" else None,
                        capacity=capacity)
    cache.load_prefix(prefix)
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_kind(kinds: tuple[str, ...]) -> str:
    """One label for a batched step: slow if any row refreshed, else fast if any row read its
    compact memory, else lagged (fast rows that read some layers densely), else dense."""
    for kind in ("slow", "fast", "lagged"):
        if kind in kinds:
            return kind
    return "dense"


@torch.inference_mode()
def decode_run(model: torch.nn.Module, cache: DecodeCache, tail: torch.Tensor, start: int,
               new_tokens: int, warmup: int = 2, tokens: list[torch.Tensor] | None = None
               ) -> list[tuple[float, str]]:
    """Run the last prompt tokens ``tail [B, W]`` (from position ``start``), then decode greedily;
    returns ``(seconds, kind)`` per decode step (see :func:`step_kind`), after ``warmup``
    untimed steps (first-touch allocations). ``tokens`` receives each step's ``[B]``."""
    token = prefill(model, cache, tail, start=start).argmax(-1)
    position = torch.full((tail.shape[0],), start + tail.shape[1], device=tail.device)
    steps, _, _ = timed_steps(model, cache, token, position, warmup + new_tokens, tokens)
    return steps[warmup:]


@torch.inference_mode()
def timed_steps(model: torch.nn.Module, cache: DecodeCache, token: torch.Tensor,
                position: torch.Tensor, count: int, tokens: list[torch.Tensor] | None = None
                ) -> tuple[list[tuple[float, str]], torch.Tensor, torch.Tensor]:
    """``count`` greedy decode steps from ``token [B]`` at ``position [B]``, each timed:
    ``([(seconds, kind)], the next token [B], its position [B])``; ``tokens`` receives each
    step's input ``[B]``."""
    device = token.device
    steps = []
    for _ in range(count):
        if tokens is not None:
            tokens.append(token)
        _sync(device)
        begin = time.perf_counter()
        token = decode_one(model, cache, token, position).argmax(-1)
        _sync(device)
        steps.append((time.perf_counter() - begin, step_kind(cache.step_kinds())))
        position = position + 1
    return steps, token, position


@torch.inference_mode()
def exact_run(model: torch.nn.Module, cache: DecodeCache, tail: torch.Tensor, start: int,
              new_tokens: int, warmup: int = 2) -> tuple[float, torch.Tensor]:
    """Exact mode's :func:`decode_run`: ``(seconds, tokens [B, 1 + warmup + new_tokens])``,
    the seconds for ``new_tokens`` per row at the rate measured from the round after every
    row has ``warmup`` more tokens (the first dense steps) until every row has them all (a
    row's tokens past ``1 + warmup + new_tokens`` are not counted)."""
    device = tail.device
    token = prefill(model, cache, tail, start=start).argmax(-1)
    position = torch.full((tail.shape[0],), start + tail.shape[1] - 1, device=device)
    decoder = ExactDecoder(model, cache)
    want = 1 + warmup + new_tokens
    rows: list[list[int]] = [[t] for t in token.tolist()]
    begin, timed_from = None, None
    if warmup == 0:
        _sync(device)
        begin, timed_from = time.perf_counter(), [1] * len(rows)

    def wanted() -> tuple[list[bool], int]:
        return [len(r) < want for r in rows], want - min(len(r) for r in rows)

    for emitted in decoder.rounds(token, position, None, wanted):
        for row, tokens in zip(rows, emitted.rows()):
            row.extend(tokens)
        if min(len(r) for r in rows) >= want:
            break
        if begin is None and min(len(r) for r in rows) > warmup:  # (before the next round)
            _sync(device)
            begin, timed_from = time.perf_counter(), [len(r) for r in rows]
    _sync(device)
    seconds = time.perf_counter() - begin
    produced = sum(want - t for t in timed_from) / len(rows)
    return seconds * new_tokens / produced, torch.tensor([r[:want] for r in rows], device=device)


def llama_cpp_row(model: torch.nn.Module, gguf: Path, prompt: list[int], *, new_tokens: int,
                  warmup: int, bandwidth: float, flash_attn: bool = True) -> BenchRow:
    """llama.cpp on ``gguf`` after ``prompt`` (real prefill), as a bench row named
    ``llama.cpp <weight type>`` (``llama.cpp <weight type> no-fa`` with flash attention off);
    its floor is the GGUF's bytes and its F16 KV over ``bandwidth``."""
    times = decode_times(gguf, prompt, new_tokens, warmup, torch.get_num_threads(), flash_attn)
    median = round(1000 * statistics.median(times), 3)
    kv = kv_bytes_per_entry(model, element=2) * len(prompt)
    return BenchRow(
        mode=f"llama.cpp {gguf_weights(gguf)}" + ("" if flash_attn else f" {NO_FLASH_ATTN}"),
        context=len(prompt), batch=1, kv="prefill",
        new_tokens=len(times), decode_tok_s=round(len(times) / sum(times), 3), step_ms=median,
        fast_step_ms=None, slow_step_ms=None, dense_step_ms=median, slow_fraction=0.0,
        fast_read_fraction=None, fast_fraction=None, coverage_rate=None,
        floor_ms=round(1000 * (gguf.stat().st_size + kv) / (bandwidth * 1e9), 3),
        weights=gguf_weights(gguf))


def _median_ms(steps: list[tuple[float, str]], kind: str) -> float | None:
    times = [t for t, k in steps if k == kind]
    return round(1000 * statistics.median(times), 3) if times else None


def estimate_bytes(model: torch.nn.Module, context: int, batch: int, copies: int = 2) -> int:
    """Peak memory of one (context, batch) cell: the prefix KV plus ``copies`` caches of it
    (one mode's cache, and the stock cache's concatenation copy)."""
    return kv_bytes_per_entry(model) * context * batch * (1 + copies)


def measure_cell(model: torch.nn.Module, tokenizer: Any, mode: str, config: SFIConfig,
                 ids: torch.Tensor, prefix: KV, *, kv: str, new_tokens: int, warmup: int,
                 bandwidth: float, tokens: dict[str, torch.Tensor] | None = None) -> BenchRow:
    """One mode on one (context, batch): decode ``new_tokens`` steps after the prefix of
    ``ids [B, context]`` and time each; the floor is the bytes a step must read (weights + the
    KV entries it attends) over ``bandwidth`` GB/s. ``tokens`` keeps each mode's greedy tokens
    of the cell (``sfi-exact`` compares its own with ``full``'s)."""
    batch, context = ids.shape
    window = config.evidence_window
    cache = make_bench_cache(mode, model, tokenizer, config, prefix,
                             context + warmup + new_tokens + 1)
    tail, start = ids[:, -window:], context - window
    if mode == "sfi-exact":
        return _exact_row(model, cache, config, tail, start, kv=kv, new_tokens=new_tokens,
                          warmup=warmup, bandwidth=bandwidth, tokens=tokens)
    made: list[torch.Tensor] = []
    steps = decode_run(model, cache, tail, start, new_tokens, warmup, tokens=made)
    if tokens is not None:
        tokens[mode] = torch.stack(made, 1)
    sparse = mode.startswith("sfi")
    stats = cache.stats() if sparse else None
    read = stats.fast_read_fraction if stats else None
    fast, coverage = step_rates(stats)
    total = sum(t for t, _ in steps)
    return BenchRow(
        mode=mode, context=context, batch=batch, kv=kv, new_tokens=new_tokens,
        decode_tok_s=round(batch * len(steps) / total, 3),
        step_ms=round(1000 * statistics.median(t for t, _ in steps), 3),
        fast_step_ms=_median_ms(steps, "fast"),
        slow_step_ms=_median_ms(steps, "slow"),
        dense_step_ms=_median_ms(steps, "dense"),
        slow_fraction=round(sum(k == "slow" for _, k in steps) / len(steps), 4),
        fast_read_fraction=round(read, 4) if read is not None else None,
        fast_fraction=fast, coverage_rate=coverage,
        floor_ms=_floor_ms(model, config, context, batch, bandwidth, sparse))


def step_rates(stats: DecodeStats | None) -> tuple[float | None, float | None]:
    """Of the rows' decode steps: the fraction that were fast, and the coverage refreshes
    (the probes' misses that refreshed) per step."""
    if stats is None or not stats.decode_steps:
        return None, None
    steps = stats.decode_steps
    return (round(stats.fast_steps / steps, 4),
            round(stats.refresh_reasons.get(COVERAGE, 0) / steps, 4))


def _floor_ms(model: torch.nn.Module, config: SFIConfig, context: int, batch: int,
              bandwidth: float, sparse: bool) -> float:
    """The bytes a step must read (weights + the KV entries it attends) over ``bandwidth``;
    sparse where the engine decodes sparse, with the same weights term (``min_gain``)."""
    sparse = sparse and config.sparse_pays(context, stored_weight_positions(model))
    entries = config.sink + config.budget(context) + config.recent if sparse else context
    floor = weight_bytes(model) + kv_bytes_per_entry(model) * min(entries, context) * batch
    return round(floor / bandwidth / 1e6, 3)


def _exact_row(model: torch.nn.Module, cache: DecodeCache, config: SFIConfig,
               tail: torch.Tensor, start: int, *, kv: str, new_tokens: int, warmup: int,
               bandwidth: float, tokens: dict[str, torch.Tensor] | None) -> BenchRow:
    seconds, made = exact_run(model, cache, tail, start, new_tokens, warmup)
    stats = cache.stats()
    batch = tail.shape[0]
    full = (tokens or {}).get("full")
    same = None if full is None else bool(torch.equal(full, made[:, : full.shape[1]]))
    return BenchRow(
        mode="sfi-exact", context=start + tail.shape[1], batch=batch, kv=kv,
        new_tokens=new_tokens, decode_tok_s=round(batch * new_tokens / seconds, 3),
        step_ms=round(1000 * seconds / new_tokens, 3), fast_step_ms=None, slow_step_ms=None,
        dense_step_ms=None, slow_fraction=0.0, fast_read_fraction=None, fast_fraction=None,
        coverage_rate=None,
        floor_ms=_floor_ms(model, config, start + tail.shape[1], batch, bandwidth, False),
        acceptance=round(stats.acceptance_rate, 4),
        tokens_per_verify=round(stats.tokens_per_verify, 3),
        mean_draft=round(stats.mean_draft, 3),
        exact_dense_steps=stats.exact_dense_steps, same_tokens_as_full=same)


def add_speedups(cell: list[BenchRow]) -> None:
    """Fill each row's tokens/s ratio over ``full`` and ``full-static`` of the same cell."""
    by_mode = {r.mode: r for r in cell}
    for row in cell:
        for base, attr in (("full", "speedup_vs_full"),
                           ("full-static", "speedup_vs_full_static")):
            if base in by_mode:
                setattr(row, attr, round(row.decode_tok_s / by_mode[base].decode_tok_s, 3))


def run_bench(model: torch.nn.Module, tokenizer: Any, *, contexts: Sequence[int],
              batches: Sequence[int], new_tokens: int, config: SFIConfig,
              modes: Sequence[str] = MODES, synthetic_kv: bool = False,
              memory_limit: int | None = None, warmup: int = 2,
              ggufs: Sequence[Path] = (), flash_attn: Sequence[bool] = (True,),
              weights: str = "native", store: Path | None = None,
              progress: Callable[[str], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every (mode, context, batch); returns ``{"rows": [...], "skipped": [...], ...}``.
    At batch 1 each GGUF in ``ggufs`` (the same model) also decodes the cell's token ids in
    llama.cpp (:func:`llama_cpp_row`), once per ``flash_attn`` setting.

    Rows are named ``weights`` (the model's weight format) and handed to ``on_row`` as each
    cell ends, so a long run that stops keeps what it measured. With ``store`` (a folder) each
    cell's real prefill is kept on disk and read back by the next run of the same cell
    (:class:`sfi.decoding.prefix.SharedPrefill`)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SFIError(f"unknown bench mode(s) {', '.join(unknown)}; choose from "
                       f"{', '.join(MODES)}")
    if synthetic_kv and "sfi-exact" in modes:
        raise SFIError("sfi-exact needs real text (its speed is its acceptance, which synthetic "
                       "KV says nothing of): drop --synthetic-kv or the mode")
    limit = context_length(model)
    if not synthetic_kv and limit is not None and max(contexts) + warmup + new_tokens > limit:
        raise SFIError(f"a context of {max(contexts)} plus {warmup} warm-up and {new_tokens} new "
                       "tokens exceeds the "
                       f"model's {limit}; use --synthetic-kv for throughput-only sweeps beyond it")
    bandwidth = measure_bandwidth(device=model.device)
    rows: list[BenchRow] = []
    skipped: list[dict[str, Any]] = []
    kv = "synthetic" if synthetic_kv else "prefill"
    for context in contexts:
        for batch in batches:
            need = estimate_bytes(model, context + warmup + new_tokens, batch)
            if memory_limit is not None and need > memory_limit:
                skipped.append({"context": context, "batch": batch, "reason":
                                f"needs about {need / 1e9:.1f} GB of KV, over the "
                                f"{memory_limit / 1e9:.1f} GB limit"})
                continue
            if progress:
                progress(f"context {context}, batch {batch}: "
                         f"{'synthetic KV' if synthetic_kv else 'prefill'}")
            ids = benchmark_ids(tokenizer, context, batch).to(next(model.parameters()).device)
            head = ids[:, :-config.evidence_window]
            prefix = (prefix_kv(model, head, synthetic=True) if synthetic_kv
                      else SharedPrefill(model, head, store=store).kv)
            cell: list[BenchRow] = []
            made: dict[str, torch.Tensor] = {}
            for mode in modes:
                if progress:
                    progress(f"context {context}, batch {batch}: {mode}")
                cell.append(measure_cell(model, tokenizer, mode, config, ids, prefix, kv=kv,
                                         new_tokens=new_tokens, warmup=warmup,
                                         bandwidth=bandwidth, tokens=made))
            for gguf in ggufs if batch == 1 else ():
                for fa in flash_attn:
                    if progress:
                        progress(f"context {context}, batch 1: llama.cpp, {gguf.name}, flash "
                                 f"attention {'on' if fa else 'off'}")
                    cell.append(llama_cpp_row(model, gguf, ids[0].tolist(),
                                              new_tokens=new_tokens, warmup=warmup,
                                              bandwidth=bandwidth, flash_attn=fa))
            add_speedups(cell)
            for row in cell:
                if not row.mode.startswith("llama.cpp"):  # those name their GGUF's weights
                    row.weights = weights
                if on_row:
                    on_row(asdict(row))
            rows.extend(cell)
            del prefix
    return {
        "machine": machine(),
        "bandwidth_gb_s": round(bandwidth, 2),
        "weight_bytes": weight_bytes(model),
        "kv_bytes_per_token": kv_bytes_per_entry(model),
        "config": config.to_dict(),
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }
