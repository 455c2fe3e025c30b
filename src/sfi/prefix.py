"""A prompt's KV computed once and continued by several caches (benchmarks, evaluations)."""

from __future__ import annotations

import torch

from sfi.caches import KV, DecodeCache, FullCache
from sfi.decode import prefill
from sfi.eviction.cache import prefill_with_history
from sfi.hf import text_config


@torch.inference_mode()
def prefix_kv(model: torch.nn.Module, ids: torch.Tensor, synthetic: bool) -> KV:
    """KV of ``ids [B, T]`` for every layer: a real prefill, or random tensors of the right
    shape."""
    cfg = text_config(model)
    if synthetic:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        shape = (ids.shape[0], cfg.num_key_value_heads, ids.shape[1], head_dim)
        gen = torch.Generator(device=param.device).manual_seed(0)
        return [(torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype),
                 torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype))
                for _ in range(cfg.num_hidden_layers)]
    cache = FullCache(config=model.config)
    prefill(model, cache, ids)
    return [(layer.keys, layer.values) for layer in cache.layers]


class SharedPrefill:
    """One real prefill of ``ids [1, T]``, continued by any number of caches.

    With ``history`` it also keeps, per layer, the attention each key received from every
    prompt query ``[1, H, T]`` (what H2O's eviction starts from); that costs a second pass of
    query-key products over the prompt, so ask for it only when a method needs it.
    """

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, history: bool = False):
        self.length = ids.shape[1]
        self.history: list[torch.Tensor] | None = None
        if history:
            self.kv, self.history = prefill_with_history(model, ids)
        else:
            self.kv = prefix_kv(model, ids, synthetic=False)

    def load(self, cache: DecodeCache) -> None:
        """Fill the empty ``cache`` with a copy of this prefill."""
        cache.load_prefix(self.kv, self.history)
