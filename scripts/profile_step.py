"""Where one decode step's time goes: PyTorch's profiler over a few steps of one bench mode.

    .venv/bin/python scripts/profile_step.py --model qwen2.5-0.5b --weights int8 \
        --context 8192 --mode sfi-fast-only

Builds the mode's cache as ``sfi bench`` does, on synthetic KV of the context's shape (the
step's time does not depend on the values; ``--prefill`` runs a real prefill of essay text
instead), decodes ``--warmup`` steps (the compile, with ``--weights int8``/``fp16`` or
``--compile``), then profiles ``--steps`` more and prints per step: the median wall time, the
time inside the attention operators (``sfi::attention_step``: each layer's attention in a
compiled step), the compiled regions together, and the operators that took the most time of
their own (in a compiled step, inductor's kernels are one entry, ``Call CompiledFxGraph``;
the attention's matrix products are ``aten::bmm``). The profiler adds to each step: compare
parts within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sfi
from sfi.bench.throughput import benchmark_ids, make_bench_cache, timed_steps
from sfi.core.config import SFIConfig
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import prefix_kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--weights", default="native")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--mode", default="sfi-fast-only",
                        choices=["full", "full-static", "sfi", "sfi-fast-only"])
    parser.add_argument("--prefill", action="store_true", help="a real prefill, not random KV")
    parser.add_argument("--warmup", type=int, default=6, choices=range(1, 1000),
                        metavar="N")
    parser.add_argument("--steps", type=int, default=4, choices=range(1, 1000), metavar="N")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    sfi.runtime.keep_freed_memory()
    model, tokenizer = sfi.load(args.model, device="cpu", weights=args.weights,
                                compile=args.compile)  # the profiler records the CPU
    config = SFIConfig()
    ids = benchmark_ids(tokenizer, args.context, 1)
    w = config.evidence_window
    with torch.inference_mode():
        prefix = prefix_kv(model, ids[:, :-w], synthetic=not args.prefill)
        cache = make_bench_cache(args.mode, model, tokenizer, config, prefix,
                                 args.context + args.warmup + args.steps + 8)
        token = prefill(model, cache, ids[:, -w:], start=args.context - w).argmax(-1)
        position = torch.full((1,), args.context)
        begin = time.perf_counter()
        warm, token, position = timed_steps(model, cache, token, position, args.warmup)
        print(f"{args.model}, weights {args.weights}, {args.mode}, context {args.context}: "
              f"warm-up {time.perf_counter() - begin:.1f} s "
              f"(last warm step {1000 * warm[-1][0]:.1f} ms)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            timed, _, _ = timed_steps(model, cache, token, position, args.steps)
    n = len(timed)
    kinds = sorted({k for _, k in timed})
    print(f"step: median {1000 * statistics.median(t for t, _ in timed):.1f} ms over {n} "
          f"profiled steps ({', '.join(kinds)})")
    events = prof.key_averages()
    total = {e.key: e for e in events}

    def per_step(name: str) -> float:
        event = total.get(name)
        return event.cpu_time_total / 1000 / n if event is not None else 0.0

    attention = per_step("sfi::attention_step")
    if attention:
        print(f"  attention operators (sfi::attention_step, all layers): {attention:.1f} ms")
    compiled = sum(e.cpu_time_total for e in events
                   if e.key.startswith("Torch-Compiled Region")) / 1000 / n
    if compiled:
        print(f"  compiled regions (every graph the step ran, attention operators included): "
              f"{compiled:.1f} ms")
    print(f"  top {args.top} operators by their own time, ms per step:")
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    for e in ranked:
        print(f"    {e.self_cpu_time_total / 1000 / n:7.2f}  {e.count // n:5d} calls  "
              f"{e.key[:80]}")


if __name__ == "__main__":
    main()
