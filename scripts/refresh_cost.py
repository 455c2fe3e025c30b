"""What a refresh costs: the slow step (dense attention, the Selector, the pack) against a
full-attention step, in one process, on SmolLM2 with synthetic KV (issue 20's target).

    .venv/bin/python scripts/refresh_cost.py --context 16384             # sfi's own engine
    .venv-vllm/bin/python scripts/refresh_cost.py --context 16384 --vllm  # vLLM + SFI

A fixed trigger of period 2 makes every other decode step slow (coverage probes off); the
medians of each kind are printed with their ratio to the baseline step (in sfi's engine, the
faster of full attention over transformers' DynamicCache and over its preallocated StaticCache;
stock vLLM in the same vLLM engine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SFI = dict(trigger="fixed", period=2, coverage_layers=0)


def own_engine(context: int, batch: int, steps: int) -> None:
    import sfi
    from sfi.bench.throughput import benchmark_ids, make_bench_cache
    from sfi.config import SFIConfig
    from sfi.decode_step import decode_one
    from sfi.prefill import prefill
    from sfi.prefix import prefix_kv

    model, tokenizer = sfi.load("default")
    config = SFIConfig(**SFI)
    ids = _ids(benchmark_ids, tokenizer, context, batch)
    w = config.evidence_window
    prefix = prefix_kv(model, ids[:, :-w], True)
    modes = ("full", "full-static", "sfi")
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    with torch.inference_mode():
        runs = {}
        for mode in modes:
            cache = make_bench_cache(mode, model, tokenizer, config, prefix, context + steps + 8)
            token = prefill(model, cache, ids[:, -w:], start=context - w).argmax(-1)
            runs[mode] = [cache, token, torch.full((batch,), context)]
        for i in range(steps + 2):  # the modes take turns, so that they share the machine's moods
            for mode in modes:
                cache, token, position = runs[mode]
                begin = time.perf_counter()
                token = decode_one(model, cache, token, position).argmax(-1)
                elapsed = 1000 * (time.perf_counter() - begin)
                kinds = cache.step_kinds()
                kind = "slow" if "slow" in kinds else "fast" if "fast" in kinds else "dense"
                if i >= 2:
                    times[mode].setdefault(kind, []).append(elapsed)
                runs[mode] = [cache, token, position + 1]
    medians = {mode: {k: statistics.median(v) for k, v in kinds.items()}
               for mode, kinds in times.items()}
    dynamic, static = medians["full"]["dense"], medians["full-static"]["dense"]
    base = min(dynamic, static)
    print(f"sfi engine, {context} tokens, batch {batch}: full-attention step {base:.1f} ms "
          f"(the faster of DynamicCache {dynamic:.1f} and StaticCache {static:.1f}); "
          f"slow step {medians['sfi']['slow']:.1f} ms ({medians['sfi']['slow'] / base:.2f}x); "
          f"fast step {medians['sfi']['fast']:.1f} ms")


def plugin(context: int, batch: int, steps: int) -> None:
    from sfi import SFIConfig
    from sfi.bench.throughput import benchmark_ids
    from sfi.bench.vllm import make_engine, time_decode
    from sfi.models import load_tokenizer, resolve
    from sfi.vllm import configure

    tokenizer = load_tokenizer("default")
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2: layers x (K, V) x KV heads x head size x fp32
    llm = make_engine(resolve("default"), context + steps + 16, batch,
                      (context + steps + 16) * batch * per_token + (1 << 27))
    ids = _ids(benchmark_ids, tokenizer, context, batch).tolist()
    configure(None)
    stock = statistics.median(time_decode(llm, ids, steps, 2))
    configure(SFIConfig(**SFI))
    times = sorted(time_decode(llm, ids, steps, 2))
    half = len(times) // 2
    fast, slow = statistics.median(times[:half]), statistics.median(times[half:])
    print(f"vLLM, {context} tokens, batch {batch}: stock step {1000 * stock:.1f} ms; SFI slow "
          f"step {1000 * slow:.1f} ms ({slow / stock:.2f}x); fast step {1000 * fast:.1f} ms")


def _ids(benchmark_ids, tokenizer, context: int, batch: int) -> torch.Tensor:
    """``[batch, context]`` essay tokens (the essays repeated past their length)."""
    part = benchmark_ids(tokenizer, min(context, 8000), batch)
    return torch.cat([part] * (context // part.shape[1] + 1), dim=1)[:, :context]


def main() -> None:
    from sfi.runtime import keep_freed_memory

    keep_freed_memory()  # as the sfi command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--vllm", action="store_true", help="vLLM + SFI against stock vLLM")
    args = parser.parse_args()
    (plugin if args.vllm else own_engine)(args.context, args.batch, args.steps)


if __name__ == "__main__":
    main()
