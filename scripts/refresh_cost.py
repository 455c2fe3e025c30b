"""What a refresh costs: the slow step (dense attention, the Selector, the pack) against a
full-attention step, in one process, on SmolLM2 with synthetic KV (issue 20's target).

    .venv/bin/python scripts/refresh_cost.py --context 16384             # sfi's own engine
    .venv-vllm/bin/python scripts/refresh_cost.py --context 16384 --vllm  # vLLM + SFI
    .venv-vllm/bin/python scripts/refresh_cost.py --context 16384 --vllm --profile

A fixed trigger of period 2 makes every other decode step slow (coverage probes off); the
medians of each kind are printed with their ratio to the baseline step (in sfi's engine, the
faster of full attention over transformers' DynamicCache and over its preallocated StaticCache;
stock vLLM in the same vLLM engine, warmed up first (``sfi.bench.vllm.warm_up``), the two taking
turns ``--rounds`` times, each over a prefill of its own; each round's ratio is printed, and
their median). ``--profile`` (vLLM + SFI) then decodes the steps once
more under :mod:`cProfile` and prints where the plugin's time goes: sfi's functions by
cumulative milliseconds per slow step (they run at slow steps; the profiler's own overhead
inflates the Python-heavy ones).
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
    from sfi.core.config import SFIConfig
    from sfi.decoding.decode_step import decode_one
    from sfi.decoding.prefill import prefill
    from sfi.decoding.prefix import prefix_kv

    model, tokenizer = sfi.load("default", weights="native")
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


def plugin(context: int, batch: int, steps: int, rounds: int, profile: bool = False) -> None:
    from sfi import SFIConfig
    from sfi.bench.throughput import benchmark_ids
    from sfi.bench.vllm import make_engine, time_decode, warm_up
    from sfi.models import load_tokenizer, resolve
    from sfi.vllm import configure

    tokenizer = load_tokenizer("default")
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2: layers x (K, V) x KV heads x head size x fp32
    llm = make_engine(resolve("default"), context + steps + 16, batch,
                      (context + steps + 16) * batch * per_token + (1 << 27))
    ids = _ids(benchmark_ids, tokenizer, context, batch).tolist()
    configure(None)
    warm_up(llm, ids[0])
    ratios = []
    for i in range(rounds):  # in turn, so that a slower minute of the machine falls on both
        configure(None)
        stock = statistics.median(time_decode(llm, ids, steps, 2))
        configure(SFIConfig(**SFI))
        times = sorted(time_decode(llm, ids, steps, 2))
        half = len(times) // 2
        fast, slow = statistics.median(times[:half]), statistics.median(times[half:])
        ratios.append(slow / stock)
        print(f"vLLM, {context} tokens, batch {batch}, round {i + 1}: stock step "
              f"{1000 * stock:.1f} ms; SFI slow step {1000 * slow:.1f} ms ({slow / stock:.2f}x); "
              f"fast step {1000 * fast:.1f} ms ({fast / stock:.2f}x)")
    print(f"slow step / stock step over {rounds} rounds: median {statistics.median(ratios):.2f}x "
          f"(from {min(ratios):.2f}x to {max(ratios):.2f}x)")
    if profile:
        _profile_plugin(llm, ids, steps)


def _profile_plugin(llm, ids: list[list[int]], steps: int, top: int = 25) -> None:
    """sfi's functions by cumulative time per slow step, over the slow steps among ``steps``
    decode steps (each step profiled alone, the slow ones kept; the first decode step, the
    prompt's selection, left out)."""
    import cProfile
    import pstats

    from vllm import SamplingParams

    from sfi.bench.vllm import cell_stats
    from sfi.vllm.metadata import book

    engine, requests = llm.llm_engine, book()
    earlier = {r.serial for r in requests.requests.values()}
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt}, params)
    kept: list[cProfile.Profile] = []
    decoded = 0
    while engine.has_unfinished_requests():
        before = cell_stats(requests, earlier).slow_steps
        profiler = cProfile.Profile()
        profiler.enable()
        outputs = engine.step()
        profiler.disable()
        if decoded > 1 and cell_stats(requests, earlier).slow_steps > before:
            kept.append(profiler)
        decoded += bool(outputs) and all(o.outputs and o.outputs[0].token_ids for o in outputs)
    if not kept:
        print("no slow step was profiled")
        return
    stats = pstats.Stats(kept[0])
    for profiler in kept[1:]:
        stats.add(profiler)
    rows = [(cumulative, function) for function, (_, _, _, cumulative, _)
            in stats.stats.items()  # type: ignore[attr-defined]
            if "/sfi/" in function[0]]
    print(f"sfi's functions, cumulative ms per slow step ({len(kept)} slow steps):")
    for cumulative, (path, line, name) in sorted(rows, reverse=True)[:top]:
        print(f"{1000 * cumulative / len(kept):8.1f}  {path.split('/sfi/', 1)[1]}:{line}({name})")


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="vLLM: stock and SFI decode in turn this many times, each over "
                             "its own prefill")
    parser.add_argument("--profile", action="store_true",
                        help="vLLM + SFI: then where the plugin's time goes (cProfile)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.profile and not args.vllm:
        parser.error("--profile profiles the vLLM plugin: add --vllm "
                     "(sfi's own engine: scripts/profile_step.py)")
    if args.vllm:
        plugin(args.context, args.batch, args.steps, args.rounds, args.profile)
    else:
        own_engine(args.context, args.batch, args.steps)


if __name__ == "__main__":
    main()
