"""Lockstep decoding of a model through a SlowFastCache and through the stock cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from sfi import SFIConfig, SlowFastCache
from sfi.hf.facts import cache_argument


@dataclass
class Lockstep:
    sfi_logits: list[torch.Tensor] = field(default_factory=list)
    full_logits: list[torch.Tensor] = field(default_factory=list)
    kinds: list[list[str]] = field(default_factory=list)  # per step, per row
    cache: SlowFastCache | None = None
    reference: DynamicCache | None = None


@torch.inference_mode()
def lockstep(model, input_ids: torch.Tensor, config: SFIConfig, steps: int,
             attention_mask: torch.Tensor | None = None, tokenizer=None,
             scorer=None) -> Lockstep:
    """Prefill and decode ``steps`` greedy tokens (chosen by full attention) through both caches."""
    out = Lockstep()
    out.cache = SlowFastCache(model, config, tokenizer=tokenizer, scorer=scorer)
    out.reference = DynamicCache(config=model.config)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    ids = input_ids
    key = cache_argument(model)
    for _step in range(steps + 1):
        kwargs = dict(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                      use_cache=True)
        a = model(**kwargs, **{key: out.cache}).logits[:, -1]
        b = model(**kwargs, **{key: out.reference}).logits[:, -1]
        out.sfi_logits.append(a)
        out.full_logits.append(b)
        out.kinds.append(list(out.cache.step_kinds()))
        ids = b.argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(ids.shape)], -1)
        positions = positions[:, -1:] + 1
    return out
