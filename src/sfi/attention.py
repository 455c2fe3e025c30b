"""The attention function registered with transformers as ``"sfi"``.

transformers calls it for every attention layer of a routed model, without the cache. It finds
the step in progress (``sfi.context``, set by the routing hook for the duration of a forward)
and hands the call to the cache layer that serves this ``layer_idx``: a layer that implements
``attend`` (the slow-fast layer, the eviction baselines' layer) carries out the step's plan.
Everywhere else (another cache, no cache, a layer that keeps its own sliding window) it is
attention as the model computes it: SDPA, or the model's eager function for soft-capped logits.

It imports neither cache: the layers bring their own behaviour (:class:`AttendingLayer`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sfi.context import StepContext, current_step
from sfi.kernels import dense_fallback

ATTENTION_NAME = "sfi"


class AttendingLayer:
    """The layer protocol: a cache layer that carries out the step in progress.

    The attention function hands such a layer every call for its ``layer_idx``. A forward of
    several queries (a prefill) attends densely, as the model would, and then lets the layer
    act on it (:meth:`after_prefill`: a first selection, a compression); a one-token step is the
    layer's own (:meth:`decode`). Shapes: ``query [B, Hq, Q, D]`` (RoPE applied), ``key``,
    ``value`` ``[B, H, T, D]`` after the cache update.
    """

    def attend(self, step: StepContext, module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
        """``([B, Q, Hq, D], None)``, as transformers expects of an attention function."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        softcap = kwargs.get("softcap")
        if query.shape[2] > 1:
            out, _ = dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, **kwargs)
            self.after_prefill(step, query, scale, softcap)
            return out, None
        b, hq, _, d = query.shape
        h = key.shape[1]
        out = self.decode(step, query.reshape(b, h, hq // h, d), scale, softcap)
        return out.reshape(b, 1, hq, -1), None

    def after_prefill(self, step: StepContext, query: torch.Tensor, scale: float,
                      softcap: float | None) -> None:
        """Act on a prefill's queries (the whole cache is written already)."""
        raise NotImplementedError

    def decode(self, step: StepContext, q: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
        """One decode step of the queries grouped by KV head: ``q [B, H, G, D]`` ->
        ``[B, H, G, D]``."""
        raise NotImplementedError


@torch.compiler.disable
def sfi_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                  ) -> tuple[torch.Tensor, Any]:
    """``query [B, Hq, Q, D]`` (RoPE applied), ``key``/``value`` ``[B, H, T, D]`` after the cache
    update -> ``([B, Q, Hq, D], None)``. Never traced by ``torch.compile``: the plan it
    carries out changes from step to step (:mod:`sfi.compiled`)."""
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
