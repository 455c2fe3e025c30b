"""sfi's invariants on a CUDA device, through the transformers path (no vLLM needed):

    python scripts/cuda_check.py MODEL_FOLDER [--device cuda] [--context 2048] [--steps 24]

MODEL_FOLDER is any HF decoder (``scripts/random_model.py qwen2.5-0.5b FOLDER`` writes one with
random weights); it is run in float32, so that the comparisons measure sfi and not bf16. Every
step feeds the same fixed token ids to both sides (teacher forcing), so a near tie in a
random-weight model's logits cannot make the two runs diverge. Checks, each printed with its
largest logit difference, and the exit status 1 if one fails:

1. a budget that covers the whole context reproduces full attention (``DynamicCache``) at every
   step, fast steps included, with the Selector on the side stream (``overlap_selection``,
   CUDA's default) and inline;
2. a small budget is not full attention (the fast steps really read a subset);
3. two rows of different lengths decoded as one left-padded batch give each row's logits alone.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from sfi import SFIConfig, SlowFastCache
from sfi.hf.facts import cache_argument

ATOL, RTOL = 2e-3, 1e-3


@torch.inference_mode()
def decode(model, cache, prompt: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor
           ) -> tuple[list[torch.Tensor], list[tuple[str, ...]]]:
    """Prefill ``prompt [B, T]`` then feed ``forced [B, N]`` one column a step: the last
    position's logits of every forward (``N + 1`` tensors ``[B, V]``) and the step kinds."""
    key = cache_argument(model)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, logits, kinds = prompt, [], []
    for step in range(forced.shape[1] + 1):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{key: cache})
        logits.append(out.logits[:, -1].float())
        kinds.append(tuple(cache.step_kinds()) if isinstance(cache, SlowFastCache) else ())
        if step == forced.shape[1]:
            break
        ids = forced[:, step:step + 1]
        mask = torch.cat([mask, mask.new_ones(ids.shape)], -1)
        positions = positions[:, -1:] + 1
    return logits, kinds


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=ATOL, rtol=RTOL) for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, args.context), generator=g).to(device)
    forced = torch.randint(0, vocab, (1, args.steps), generator=g).to(device)
    mask = torch.ones_like(prompt)
    failures = []

    def report(name: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    full, _ = decode(model, DynamicCache(config=model.config), prompt, mask, forced)
    budget = args.context + args.steps + 64
    for overlap in (True, False):
        config = SFIConfig(sink=4, recent=64, k_head=budget, force_sparse=True, trigger="fixed",
                           period=5, overlap_selection=overlap)
        got, kinds = decode(model, SlowFastCache(model, config), prompt, mask, forced)
        fast = sum(k == ("fast",) for k in kinds)
        report(f"whole-context budget = full attention (overlap_selection={overlap})",
               close(got, full) and fast >= args.steps // 2,
               f"{fast}/{len(kinds)} fast steps, largest |logit difference| "
               f"{largest_difference(got, full):.2e}")

    small = SFIConfig(sink=4, recent=64, k_head=128, force_sparse=True, trigger="fixed",
                      period=6)
    got, kinds = decode(model, SlowFastCache(model, small), prompt, mask, forced)
    fast_steps = [i for i, k in enumerate(kinds) if k == ("fast",)]
    gap = max(float((got[i] - full[i]).abs().max()) for i in fast_steps) if fast_steps else 0.0
    report("a small budget is not full attention", bool(fast_steps) and gap > 1e-3,
           f"{len(fast_steps)} fast steps, largest |logit difference| {gap:.2e}")

    short = args.context * 3 // 4
    rows = [prompt[:, args.context - short:], prompt]
    alone = [decode(model, SlowFastCache(model, small), r, torch.ones_like(r), forced)[0]
             for r in rows]
    padded = torch.zeros(2, args.context, dtype=prompt.dtype, device=device)
    pad_mask = torch.zeros_like(padded)
    for i, r in enumerate(rows):
        padded[i, args.context - r.shape[1]:] = r[0]
        pad_mask[i, args.context - r.shape[1]:] = 1
    batched, _ = decode(model, SlowFastCache(model, small), padded, pad_mask,
                        forced.expand(2, -1).contiguous())
    for i in range(2):
        mine = [step[i:i + 1] for step in batched]
        report(f"batched row {i} ({rows[i].shape[1]} tokens) = alone", close(mine, alone[i]),
               f"largest |logit difference| {largest_difference(mine, alone[i]):.2e}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
