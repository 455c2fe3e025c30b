"""Where a decode step's time goes, in sfi's own engine (SmolLM2, synthetic KV, one process).

    .venv/bin/python scripts/step_split.py --context 16384 --batch 1

Runs the default preset with a fixed trigger of period 2 (every other step slow) and prints
the median fast and slow step with the wall time of their parts, measured by wrapping the
functions that do them: the layers' SFI attention (``SlowFastAttention.decode``), within it the
dense attention of a slow step, the refresh (the Selector's scoring, the selection, the
pack), and the coverage probes. Beside them, the same model's dense step at a 256-token
context: what a step costs before attention has anything to read (the weights, the model's
small operations and Python), a floor that no KV-sparsity method on this engine can go under.
The wrappers add a few microseconds per call; compare parts within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import sfi
from sfi.bench.throughput import benchmark_ids, make_bench_cache
from sfi.core import refresh_selection
from sfi.core.config import SFIConfig
from sfi.core.selector import SFISelector
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import prefix_kv
from sfi.hf import layer_attention

spent: dict[str, float] = {}


def timed(owner: object, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that each call adds its wall time to ``spent[label]``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def steps(model, tokenizer, config: SFIConfig, context: int, batch: int, count: int,
          mode: str = "sfi") -> list[tuple[float, dict[str, float], tuple[str, ...]]]:
    ids = benchmark_ids(tokenizer, context, batch)
    w = config.evidence_window
    prefix = prefix_kv(model, ids[:, :-w], True)
    out = []
    with torch.inference_mode():
        cache = make_bench_cache(mode, model, tokenizer, config, prefix, context + count + 8)
        token = prefill(model, cache, ids[:, -w:], start=context - w).argmax(-1)
        position = torch.full((batch,), context)
        for _ in range(count):
            spent.clear()
            start = time.perf_counter()
            token = decode_one(model, cache, token, position).argmax(-1)
            kinds = cache.step_kinds() if hasattr(cache, "step_kinds") else ("dense",)
            out.append((time.perf_counter() - start, dict(spent), tuple(kinds)))
            position = position + 1
    return out[4:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=28)
    args = parser.parse_args()
    model, tokenizer = sfi.load("default", weights="native")
    floor = steps(model, tokenizer, SFIConfig(), 256, args.batch, 16, mode="full-static")
    print(f"dense step at 256 tokens (full-static): "
          f"{1000 * statistics.median(s for s, _, _ in floor):.1f} ms")
    timed(layer_attention.SlowFastAttention, "decode", "SFI attention (all layers)")
    timed(layer_attention, "dense_attention", "  dense attention")
    timed(layer_attention.SlowFastAttention, "_refresh", "  refresh")
    timed(SFISelector, "score", "    Selector scoring")
    timed(refresh_selection, "select", "    selection (scoring included)")
    timed(layer_attention.SlowFastAttention, "_probe_coverage", "  coverage probes")
    config = replace(SFIConfig(), trigger="fixed", period=2)
    rows = steps(model, tokenizer, config, args.context, args.batch, args.steps)
    for kind in ("fast", "slow"):
        mine = [(s, parts) for s, parts, kinds in rows if kind in kinds]
        if not mine:
            continue
        print(f"{kind} step at {args.context} tokens, batch {args.batch} ({len(mine)} steps): "
              f"{1000 * statistics.median(s for s, _ in mine):.1f} ms")
        for label in sorted({k for _, parts in mine for k in parts}):
            value = statistics.median(parts.get(label, 0.0) for _, parts in mine)
            print(f"  {label}: {1000 * value:.2f} ms")


if __name__ == "__main__":
    main()
