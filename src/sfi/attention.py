"""The attention function registered with transformers as ``"sfi"``.

transformers calls it for every attention layer of a routed model, without the cache. It finds
the step in progress (``sfi.context``, set by the routing hook for the duration of a forward)
and hands the call to the cache layer that serves this ``layer_idx``: a layer that implements
``attend`` (the slow-fast layer, the eviction baselines' layer) carries out the step's plan.
Everywhere else (another cache, no cache, a layer that keeps its own sliding window) it is
attention as the model computes it: SDPA, or the model's eager function for soft-capped logits.

It imports neither cache: the layers bring their own behaviour.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sfi.context import current_step
from sfi.kernels import dense_fallback

ATTENTION_NAME = "sfi"


def sfi_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                  ) -> tuple[torch.Tensor, Any]:
    """``query [B, Hq, Q, D]`` (RoPE applied), ``key``/``value`` ``[B, H, T, D]`` after the cache
    update -> ``([B, Q, Hq, D], None)``."""
    step = current_step()
    layer = step.layer(getattr(module, "layer_idx", -1)) if step is not None else None
    attend = getattr(layer, "attend", None)
    if attend is None:
        return dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
    return attend(step, module, query, key, value, attention_mask, scaling=scaling,
                  dropout=dropout, **kwargs)


def register_attention() -> None:
    """Register ``"sfi"`` with transformers' attention and mask interfaces (idempotent).

    The mask registration matters: without it transformers skips mask creation for a custom
    attention name and a padded prefill would attend to padding.
    """
    AttentionInterface.register(ATTENTION_NAME, sfi_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
