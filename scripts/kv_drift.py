"""How much of SFI's teacher-forced KL is drift: the KV of decoded positions, computed from
sparse attention, against the error of each step's own sparse read.

    .venv/bin/python scripts/kv_drift.py --model qwen2.5-0.5b --context 8192 --seeds 0,1 \
        --prefill-cache runs/prefills

A decoded token's keys and values at layer l > 0 come from its hidden state, which depends on
the attention of the layers below it at the step that wrote it: after a fast step they differ
from full attention's, and every later step (slow ones included, which read densely) reads
them. Teacher-forced on the ``fidelity`` task's samples (``sfi eval --tasks fidelity``: an
essay context, then its real continuation), full attention decodes each sample once
(``sfi.eval.fidelity.teacher_forced_logits``: its logits, and every position's KV), and the
method three times:

- ``none``: SFI as it is (what ``sfi eval --tasks fidelity`` measures);
- ``slow``: after each slow step, the decoded positions' KV in SFI's cache is overwritten with
  full attention's, and the slow step's own logits are full attention's: what a slow step that
  also re-ran the tokens since the last one densely would give (teacher-forced, a dense
  forward over the same tokens writes full attention's KV). One difference: the step's refresh
  here selects from its own query over the KV before the repair, where such a slow step would
  select from the re-run block's queries;
- ``every``: the KV repaired after every step: what is left is each fast step's own read.

Prints per run KL(full || SFI) per token, averaged, top-1 agreement with full attention, the
slow steps, the measured read fraction (``SlowFastCache.read_fraction``, slow steps counted as
dense reads; the re-runs a repair would add are not counted), and the KL on the decode steps
that were slow and on the rest apart (the prefill's token, dense, in neither). SFI methods
only (``sfi``, ``sfi:PRESET``, ``sfi[...]``): the repair writes into SFI's slab.

``--block-cost`` measures instead what such a repair would cost: the wall time of a forward of
1, 8, 16 and 24 tokens through SFI's cache at the context (exact mode's verify path, dense over
the whole cache; synthetic KV), medians of four, three rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sfi
from sfi.bench.throughput import benchmark_ids, machine
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import SharedPrefill, prefix_kv
from sfi.eval.fidelity import agreement, teacher_forced_logits
from sfi.eval.runner import WINDOW
from sfi.eval.tasks import make_sample
from sfi.hf.decode_cache import FullCache
from sfi.hf.facts import cache_argument
from sfi.hf.methods import build_cache, parse_method
from sfi.hf.plan import DENSE_STEP, VERIFY
from sfi.hf.slowfast_cache import SlowFastCache

VARIANTS = ("none", "slow", "every")


def repair(cache: SlowFastCache, full: FullCache, start: int, end: int) -> None:
    """Rewrite ``cache``'s positions ``[start, end)`` (one unpadded row) with ``full``'s KV,
    through each slab layer's own ``truncate`` and ``append`` (key norms and page summaries
    follow). The compact buffer is left as it is: it holds decoded positions only once they
    are older than the recent window, and by then a slow step (at most ``refresh_interval``
    steps apart, fewer than the window's R) has repaired them before they were gathered."""
    for layer, dense in zip(cache.layers, full.layers):
        layer.truncate(start)
        layer.append(dense.keys[:, :, start:end], dense.values[:, :, start:end])


@torch.inference_mode()
def run(model: torch.nn.Module, tokenizer, ids: torch.Tensor, context: int, method: str,
        budget: float, variant: str, prefix: SharedPrefill, full: FullCache,
        full_logits: torch.Tensor) -> dict:
    """One teacher-forced run of ``variant`` over ``ids [1, context + N]``, against full
    attention's teacher-forced ``full`` cache (every position's KV) and ``full_logits
    [N, V]``."""
    cache = build_cache(model, tokenizer, parse_method(method), budget=budget, context=context)
    if not isinstance(cache, SlowFastCache):
        raise SystemExit(f"--method {method!r}: the repair needs an SFI method (sfi, sfi:paper, "
                         "sfi[...])")
    prefix.load(cache)
    ours = [prefill(model, cache, ids[:, context - WINDOW: context], start=context - WINDOW)]
    slow = []
    for step in range(1, ids.shape[1] - context):
        token = ids[0, context + step - 1: context + step]
        position = torch.tensor([context + step - 1], device=ids.device)
        logits = decode_one(model, cache, token, position)
        is_slow = "slow" in cache.step_kinds()
        if is_slow:
            slow.append(step)
        if variant == "every" or (variant == "slow" and is_slow):
            repair(cache, full, context, context + step)
        ours.append(full_logits[step: step + 1] if variant == "slow" and is_slow else logits)
    kl, top1 = agreement(F.log_softmax(full_logits, dim=-1),
                         F.log_softmax(torch.cat(ours).float(), dim=-1))
    fast = [float(kl[i]) for i in range(1, kl.shape[0]) if i not in set(slow)]
    return {"variant": variant, "kl": float(kl.mean()), "top1": top1,
            "slow_steps": len(slow), "read": cache.read_fraction()[0],
            "kl_fast": statistics.mean(fast),
            "kl_slow": statistics.mean(float(kl[i]) for i in slow) if slow else None}


@torch.inference_mode()
def block_cost(model: torch.nn.Module, tokenizer, context: int) -> None:
    """Print the wall time of dense forwards of 1, 8, 16 and 24 tokens through SFI's cache."""
    device = next(model.parameters()).device
    ids = benchmark_ids(tokenizer, context + 64, 1).to(device)
    cache = build_cache(model, tokenizer, "sfi", capacity=context + 64)
    cache.load_prefix(prefix_kv(model, ids[:, : context - WINDOW], synthetic=True))
    prefill(model, cache, ids[:, context - WINDOW: context], start=context - WINDOW)
    times: dict[int, list[float]] = {}
    for _ in range(3):
        for n in (1, 8, 16, 24):
            round_times = []
            for _ in range(4):
                cache.phase = VERIFY if n > 1 else DENSE_STEP
                begin = time.perf_counter()
                model(input_ids=ids[:, context: context + n],
                      position_ids=torch.arange(context, context + n, device=device)[None],
                      use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                round_times.append(time.perf_counter() - begin)
                cache.phase = None
                cache.rewind(context)
            times.setdefault(n, []).append(statistics.median(round_times))
    one = statistics.median(times[1])
    for n, seconds in times.items():
        print(f"{n:2d} tokens: {', '.join(f'{1000 * s:.1f}' for s in seconds)} ms "
              f"({statistics.median(seconds) / one:.2f}x one token)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512, help="teacher-forced tokens")
    parser.add_argument("--method", default="sfi")
    parser.add_argument("--budget", type=float, default=0.15)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--prefill-cache", default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--out", default=None,
                        help="also write every run to this JSON file, with the settings (the "
                             "`kv-drift` table of docs/studies.md renders it)")
    parser.add_argument("--block-cost", action="store_true",
                        help="time dense forwards of 1-24 tokens instead (what a repair costs)")
    args = parser.parse_args()
    model, tokenizer = sfi.load(args.model, weights="native")
    if args.block_cost:
        block_cost(model, tokenizer, args.context)
        return
    device = next(model.parameters()).device
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for seed in (int(s) for s in args.seeds.split(",")):
        sample = make_sample("fidelity", tokenizer, args.context, seed,
                             continuation=args.tokens)
        ids = torch.tensor([sample.prompt_ids], device=device)
        prefix = SharedPrefill(model, ids[:, : args.context - WINDOW], store=args.prefill_cache)
        full = FullCache(config=model.config)
        full_logits, _ = teacher_forced_logits(model, full, prefix, ids, args.context, WINDOW)
        for variant in VARIANTS:
            row = run(model, tokenizer, ids, args.context, args.method, args.budget, variant,
                      prefix, full, full_logits)
            row["seed"] = seed
            results[variant].append(row)
            print(json.dumps(row) if args.json else
                  f"seed {seed} {variant:5s} KL {row['kl']:.4f} top-1 {100 * row['top1']:.1f}% "
                  f"slow steps {row['slow_steps']} read {100 * row['read']:.1f}% "
                  f"(KL fast {row['kl_fast']:.4f}, slow "
                  f"{row['kl_slow'] if row['kl_slow'] is None else round(row['kl_slow'], 4)})",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": args.model, "context": args.context, "tokens": args.tokens,
            "method": args.method, "budget": args.budget, "machine": machine(),
            "command": "python scripts/kv_drift.py " + " ".join(sys.argv[1:]),
            "rows": [r for rows in results.values() for r in rows]}, indent=1) + "\n")
    if not args.json:
        for variant, rows in results.items():
            print(f"{variant:5s} mean KL {statistics.mean(r['kl'] for r in rows):.4f}  top-1 "
                  f"{100 * statistics.mean(r['top1'] for r in rows):.1f}%  over {len(rows)} "
                  "samples")


if __name__ == "__main__":
    main()
