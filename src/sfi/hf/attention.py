"""The attention function registered with transformers as ``"sfi"``.

transformers calls it for every attention layer of a routed model, without the cache. It finds
the step in progress (``sfi.hf.context``, set by the routing hook for the duration of a forward)
and hands the call to the cache layer that serves this ``layer_idx``: a layer that implements
``attend`` (the slow-fast layer, the eviction baselines' layer) carries out the step's plan.
Everywhere else (another cache, no cache, a layer that keeps its own sliding window) it is
attention as the model computes it: SDPA, or the model's eager function for soft-capped logits.

It imports neither cache: the layers bring their own behaviour (:class:`AttendingLayer`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from sfi.hf.context import StepContext, current_step

ATTENTION_NAME = "sfi"


def dense_fallback(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
                   ) -> tuple[torch.Tensor, Any]:
    """Attention as the model would compute it without sfi: SDPA, or the model's own eager
    function where SDPA cannot (soft-capped logits, as in Gemma 2)."""
    if kwargs.get("softcap") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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


class WritesInAttention:
    """Mixin for the caches whose layers attend (:class:`AttendingLayer`): inside a compiled
    step ``update`` of such a layer writes nothing and returns the new position's
    ``[B, H, 1, D]``, which the step's attention operator writes (:func:`attention_step`), so
    that the step stays one graph; elsewhere (another layer, such as a sliding window's, or
    an eager step) transformers' ``update``."""

    def writes_in_attention(self, layer_idx: int) -> bool:
        """Whether the attention operator writes layer ``layer_idx``'s new position (its cache
        layer attends)."""
        return hasattr(self.layers[layer_idx], "attend")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling() and self.writes_in_attention(layer_idx):
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def sfi_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                  ) -> tuple[torch.Tensor, Any]:
    """``query [B, Hq, Q, D]`` (RoPE applied), ``key``/``value`` ``[B, H, T, D]`` after the cache
    update -> ``([B, Q, Hq, D], None)``.

    Inside a compiled one-token step (:mod:`sfi.decoding.compiled`) the call is one opaque operator,
    :func:`attention_step`, so that the step stays one graph; ``key``/``value`` are then the
    new position's when the cache left its write to the layer (``SlowFastCache.update``)."""
    if torch.compiler.is_compiling() and query.shape[2] == 1 and kwargs.get("softcap") is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        layer_idx = getattr(module, "layer_idx", -1)
        return attention_step(query, key, value, attention_mask, layer_idx, scale), None
    return _attention(module, query, key, value, attention_mask, scaling=scaling,
                      dropout=dropout, **kwargs)


@torch.compiler.disable
def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
               ) -> tuple[torch.Tensor, Any]:
    """:func:`sfi_attention` run eagerly (never traced: the plan it carries out changes from
    step to step)."""
    step = current_step()
    layer = step.layer(getattr(module, "layer_idx", -1)) if step is not None else None
    attend = getattr(layer, "attend", None)
    if attend is None:
        return dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
    return attend(step, module, query, key, value, attention_mask, scaling=scaling,
                  dropout=dropout, **kwargs)


@torch.library.custom_op("sfi::attention_step", mutates_args=())
def attention_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, layer_idx: int, scale: float
                   ) -> torch.Tensor:
    """One token's attention in a compiled step, as an operator the compiler calls as it is:
    ``query [B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``.

    A layer of the step in progress that attends (the slow-fast and eviction caches) first
    writes ``key``/``value`` ``[B, H, 1, D]`` (its cache's ``update`` left that to it), then
    carries out the step's plan for the layer; any other cache has written them already and
    ``key``/``value`` ``[B, H, T, D]`` are attended densely with PyTorch's SDPA kernel, the
    query heads grouped by KV head (traced instead, transformers' SDPA call becomes a
    decomposition that repeats the keys per query head, which is slower).
    Not pure: it reads and writes the cache; every call's output is used, so none is dropped
    or merged."""
    step = current_step()
    layer = step.layer(layer_idx) if step is not None else None
    if getattr(layer, "attend", None) is not None:
        # the compiled graph reuses its buffers once the operator returns, and a coverage
        # probe keeps its layer's query until the step ends: the layer gets a copy of its own
        query = query.clone()
        key, value = layer.update(key, value)
        out, _ = layer.attend(step, None, query, key, value, attention_mask, scaling=scale)
        return out
    b, hq, _, d = query.shape  # one query per row: grouped by KV head, no key copied
    grouped = query.reshape(b, key.shape[1], hq // key.shape[1], d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value,
                                                           attn_mask=attention_mask,
                                                           scale=scale)
    return out.reshape(b, 1, hq, -1)


@attention_step.register_fake
def _attention_step_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, layer_idx: int, scale: float
                          ) -> torch.Tensor:
    b, hq, q, _ = query.shape
    return query.new_empty(b, q, hq, value.shape[-1])


def register_attention() -> None:
    """Register ``"sfi"`` with transformers' attention and mask interfaces (idempotent).

    The mask registration matters: without it transformers skips mask creation for a custom
    attention name and a padded prefill would attend to padding.
    """
    AttentionInterface.register(ATTENTION_NAME, sfi_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
