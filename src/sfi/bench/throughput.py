"""Decode throughput of slow-fast decoding against full attention, in one process.

For each (context, batch) the prompt is prefilled once (or filled with synthetic KV) and every
mode continues that same prefix:

- ``full``: transformers' stock ``DynamicCache`` and SDPA, the model as users run it today;
- ``full-static``: full attention over a preallocated ``StaticCache`` (the strongest fair
  baseline);
- ``sfi``: slow-fast decoding with the given configuration, greedy on real text so that the
  sentence triggers fire at their natural rate;
- ``sfi-fast-only``: the same with no refresh after the first selection (the ceiling).

Each mode runs the last W prompt tokens as one forward (SFI makes its first selection there),
then decodes ``new_tokens`` tokens, timing every step. The floor of a step is the bytes it must
read (weights + the KV entries it attends) over the memory bandwidth measured on the spot.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from sfi.cache import SlowFastCache
from sfi.config import SFIConfig
from sfi.decode import cache_argument, context_length
from sfi.errors import SFIError
from sfi.prefix import load_prefix, prefix_kv

MODES: tuple[str, ...] = ("full", "full-static", "sfi", "sfi-fast-only")


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
    floor_ms: float
    speedup_vs_full: float | None = None
    speedup_vs_full_static: float | None = None


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: the best of a few sums over a tensor larger than caches."""
    data = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding
    tables, of which a step reads one row per token (counted when tied to the output layer)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


def kv_bytes_per_entry(model: torch.nn.Module) -> int:
    """Bytes of one cached position across all layers and KV heads (keys and values)."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element


def benchmark_ids(tokenizer: Any, context: int, batch: int) -> torch.Tensor:
    """``[batch, context]`` token ids of essay text, each row from a different place."""
    from sfi.texts import essays

    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - context) // max(batch, 1))
    if len(ids) < context:
        raise SFIError(f"the essays hold {len(ids)} tokens; a context of {context} was asked")
    return torch.tensor([ids[b * stride: b * stride + context] for b in range(batch)])


def _make_cache(mode: str, model: torch.nn.Module, tokenizer: Any, config: SFIConfig,
                prefix: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> Any:
    if mode == "full":
        cache = DynamicCache(config=model.config)
    elif mode == "full-static":
        cache = StaticCache(config=model.config, max_cache_len=capacity)
    else:
        if mode == "sfi-fast-only":
            config = SFIConfig(**{**config.to_dict(), "trigger": "bootstrap"})
        cache = SlowFastCache(model, config, tokenizer=tokenizer, max_cache_len=capacity)
    load_prefix(cache, prefix)
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_run(model: torch.nn.Module, cache: Any, tail: torch.Tensor, start: int,
               new_tokens: int, warmup: int = 2) -> list[tuple[float, str]]:
    """Run the last prompt tokens ``tail [B, W]`` (from position ``start``), then decode greedily;
    returns ``(seconds, kind)`` per decode step (kind: fast, slow or dense), after ``warmup``
    untimed steps (first-touch allocations)."""
    key = cache_argument(model)
    device = tail.device
    positions = torch.arange(start, start + tail.shape[1], device=device).expand_as(tail)
    out = model(input_ids=tail, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{key: cache})
    token = out.logits[:, -1:].argmax(-1)
    position = positions[:, -1:] + 1
    steps = []
    for _ in range(warmup + new_tokens):
        _sync(device)
        begin = time.perf_counter()
        out = model(input_ids=token, position_ids=position, use_cache=True, **{key: cache})
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        steps.append((time.perf_counter() - begin, _step_kind(cache)))
        position = position + 1
    return steps[warmup:]


def _step_kind(cache: Any) -> str:
    if not isinstance(cache, SlowFastCache):
        return "dense"
    plan = cache.plan
    if plan.slow:
        return "slow"
    return "fast" if plan.fast else "dense"


def _median_ms(steps: list[tuple[float, str]], kind: str) -> float | None:
    times = [t for t, k in steps if k == kind]
    return round(1000 * statistics.median(times), 3) if times else None


def estimate_bytes(model: torch.nn.Module, context: int, batch: int, copies: int = 2) -> int:
    """Peak memory of one (context, batch) cell: the prefix KV plus ``copies`` caches of it
    (one mode's cache, and the stock cache's concatenation copy)."""
    return kv_bytes_per_entry(model) * context * batch * (1 + copies)


def run_bench(model: torch.nn.Module, tokenizer: Any, *, contexts: Sequence[int],
              batches: Sequence[int], new_tokens: int, config: SFIConfig,
              modes: Sequence[str] = MODES, synthetic_kv: bool = False,
              memory_limit: int | None = None, warmup: int = 2,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every (mode, context, batch); returns ``{"rows": [...], "skipped": [...], ...}``."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SFIError(f"unknown bench mode(s) {', '.join(unknown)}; choose from "
                       f"{', '.join(MODES)}")
    limit = context_length(model)
    if not synthetic_kv and limit is not None and max(contexts) + warmup + new_tokens > limit:
        raise SFIError(f"a context of {max(contexts)} plus {warmup} warm-up and {new_tokens} new "
                       "tokens exceeds the "
                       f"model's {limit}; use --synthetic-kv for throughput-only sweeps beyond it")
    bandwidth = measure_bandwidth()
    weights = weight_bytes(model)
    per_entry = kv_bytes_per_entry(model)
    window = config.evidence_window
    rows: list[BenchRow] = []
    skipped: list[dict[str, Any]] = []
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
            prefix = prefix_kv(model, ids[:, :-window], synthetic_kv)
            cell: list[BenchRow] = []
            for mode in modes:
                if progress:
                    progress(f"context {context}, batch {batch}: {mode}")
                cache = _make_cache(mode, model, tokenizer, config, prefix,
                                    context + warmup + new_tokens + 1)
                steps = decode_run(model, cache, ids[:, -window:], context - window, new_tokens,
                                   warmup)
                sparse = isinstance(cache, SlowFastCache)
                read = cache.stats().fast_read_fraction if sparse else None
                entries = config.sink + config.budget(context) + config.recent if sparse \
                    else context
                floor = (weights + per_entry * min(entries, context) * batch) / bandwidth / 1e6
                total = sum(t for t, _ in steps)
                cell.append(BenchRow(
                    mode=mode, context=context, batch=batch,
                    kv="synthetic" if synthetic_kv else "prefill", new_tokens=new_tokens,
                    decode_tok_s=round(batch * len(steps) / total, 3),
                    step_ms=round(1000 * statistics.median(t for t, _ in steps), 3),
                    fast_step_ms=_median_ms(steps, "fast"),
                    slow_step_ms=_median_ms(steps, "slow"),
                    dense_step_ms=_median_ms(steps, "dense"),
                    slow_fraction=round(sum(k == "slow" for _, k in steps) / len(steps), 4),
                    fast_read_fraction=round(read, 4) if read is not None else None,
                    floor_ms=round(floor, 3)))
                del cache
            by_mode = {r.mode: r for r in cell}
            for row in cell:
                for base, attr in (("full", "speedup_vs_full"),
                                   ("full-static", "speedup_vs_full_static")):
                    if base in by_mode:
                        setattr(row, attr, round(row.decode_tok_s / by_mode[base].decode_tok_s, 3))
            rows.extend(cell)
            del prefix
    return {
        "bandwidth_gb_s": round(bandwidth, 2),
        "weight_bytes": weights,
        "kv_bytes_per_token": per_entry,
        "config": config.to_dict(),
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Tokens/s against context length per mode, one panel per batch size (log-scale x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for mode in MODES:
            points = sorted((r["context"], r["decode_tok_s"]) for r in rows
                            if r["mode"] == mode and r["batch"] == batch)
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        kv = {r["kv"] for r in rows}
        ax.set_title(f"batch {batch} ({', '.join(sorted(kv))} KV)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
