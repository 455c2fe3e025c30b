"""The attention function registered with transformers as ``"sfi"``: fast or slow per sequence.

For one layer and one forward pass it follows the cache's :class:`~sfi.cache.StepPlan`:

- prefill (several queries): SDPA over the whole prompt, then, for the sequences whose context
  is long enough, a first selection from the last W prompt queries;
- ``dense`` sequences: attention over the whole cache;
- ``slow`` sequences: the same dense attention, whose logits are the evidence from which the
  scorer (the SFI Selector by default) refreshes the compact buffer;
- ``fast`` sequences: attention over the compact buffer (sink + selected, contiguous) and the
  recent window read in place: O(S + K + R) entries per KV head, whatever the context length.

With any other cache (or a layer that keeps its own sliding window) it is plain SDPA (the model's
eager function where SDPA cannot, e.g. soft-capped logits).
Shapes: B sequences, Hq query heads, H KV heads, G = Hq / H, T cache length, D head size.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from sfi.cache import SlowFastCache, SlowFastLayer, SlowRows, StepPlan, take_active_layer
from sfi.errors import SFIError, UnsupportedModelError
from sfi.eviction.cache import EvictionLayer
from sfi.kernels import attention_logits, dense_attention, dense_fallback, fast_attention
from sfi.rows import Rows
from sfi.scorers import Evidence
from sfi.selector import top_k_positions

ATTENTION_NAME = "sfi"


def refresh_selection(layer: SlowFastLayer, slow: SlowRows, logits: torch.Tensor,
                      queries: int = 1, query: torch.Tensor | None = None) -> None:
    """Score the middle region from ``logits [n, H, N, T]`` (of the evidence queries
    ``query [n, H, N, D]``) and rebuild the compact buffer.

    The rebuild goes through the cache's rebuilder: inline (committed at once), or on a CUDA
    side stream (committed when the layer next runs and finds it ready)."""
    layer.settle(wait=True)  # a newer refresh supersedes a pending one
    key_norms = slow.rows.take(layer.key_norms)
    cached_keys = slow.rows.take(layer.keys) if query is not None else None

    def rebuild() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        evidence = Evidence(logits=logits, key_norms=key_norms, candidates=slow.candidates,
                            lo=slow.lo, hi=slow.hi, layer_idx=layer.layer_idx, queries=queries,
                            query=query, keys=cached_keys)
        scores = layer.owner.scorer.score(evidence)
        positions, _ = top_k_positions(scores, slow.candidates, slow.k)
        keys, values = layer.pack(slow, positions)
        return keys, values, positions

    inputs = [logits, key_norms, slow.candidates, slow.lo, slow.hi, slow.k, slow.sink_positions,
              layer.storage_keys, layer.storage_values]
    if query is not None:
        inputs += [query, cached_keys]
    layer.pending = layer.owner.rebuilder.submit(slow.rows, rebuild, inputs)
    layer.settle()


def _select_after_prefill(layer: SlowFastLayer, slow: SlowRows, query: torch.Tensor,
                          scale: float, softcap: float | None) -> None:
    """First selection of a sequence: evidence from the last W queries of the prompt."""
    bias = slow.evidence_bias  # [n, 1, W, T]
    n, w = len(slow.rows), bias.shape[2]
    keys = slow.rows.take(layer.keys)
    h, d = keys.shape[1], keys.shape[-1]
    q = slow.rows.take(query[:, :, -w:]).reshape(n, h, -1, w, d)  # [n, H, G, W, D]
    logits = attention_logits(q, keys[:, :, None], scale, softcap)  # [n, H, G, W, T]
    logits = (logits + bias[:, :, None]).reshape(n, h, -1, keys.shape[-2])
    refresh_selection(layer, slow, logits, queries=w, query=q.reshape(n, h, -1, d))


def _decode_step(layer: SlowFastLayer, plan: StepPlan, query: torch.Tensor, scale: float,
                 softcap: float | None) -> torch.Tensor:
    """One decode step of one layer for the whole batch: ``[B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``."""
    b, hq, _, d = query.shape
    keys, values = layer.keys, layer.values
    h = keys.shape[1]
    q = query.reshape(b, h, hq // h, d)
    out = q.new_empty(b, h, hq // h, values.shape[-1])
    rebuilding = layer.settle()  # rows whose compact rebuild is still running read densely

    def dense(rows: Rows, refresh: SlowRows | None = None) -> None:
        if plan.pad_bias is None and plan.padded:  # rows still rebuilding in a padded batch
            plan.pad_bias = layer.owner.pad_bias(keys.shape[-2], keys.device)
        bias = rows.take(plan.pad_bias) if plan.pad_bias is not None else None
        o, logits = dense_attention(rows.take(q), rows.take(keys), rows.take(values), bias, scale,
                                    softcap)
        rows.put(out, o)
        if refresh is not None:
            refresh_selection(layer, refresh, logits, query=rows.take(q))

    if plan.dense:
        dense(plan.dense)
    if plan.slow:
        dense(plan.slow.rows, plan.slow)
    if plan.fast:
        fast, width = plan.fast, layer.owner.compact_capacity
        rows = fast.rows
        layer.ensure_compact()
        o = fast_attention(rows.take(q),
                           rows.take(layer.compact_keys[:, :, :width]),
                           rows.take(layer.compact_values[:, :, :width]), fast.compact_bias,
                           rows.take(keys[:, :, fast.read_start:]),
                           rows.take(values[:, :, fast.read_start:]), fast.recent_bias,
                           scale, softcap)
        rows.put(out, o)
        if rebuilding is not None:
            lagging = rows.intersect(rebuilding)
            if lagging:
                dense(lagging)
    return out.reshape(b, 1, hq, -1)


def sfi_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                  ) -> tuple[torch.Tensor, None]:
    """The function transformers calls for every attention layer once routed to ``"sfi"``.

    ``query [B, Hq, Q, D]`` (RoPE applied), ``key``/``value`` ``[B, H, T, D]`` after the cache
    update; returns ``([B, Q, Hq, D], None)``.
    """
    layer = take_active_layer(getattr(module, "layer_idx", -1))
    if isinstance(layer, EvictionLayer):
        return layer.attend(module, query, key, value, attention_mask, scaling=scaling,
                            dropout=dropout, **kwargs)
    plan = layer.owner.plan if layer is not None else None
    if plan is None:
        return dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
    if plan.total_length != layer.length:
        raise SFIError(
            "this SlowFastCache was not planned for this forward pass: call the model it was "
            "built with (its forward hook plans each step), not a submodule")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    if query.shape[2] > 1:
        out = dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                             scaling=scaling, **kwargs)
        if plan.slow is not None:
            _select_after_prefill(layer, plan.slow, query, scale, softcap)
        return out
    return _decode_step(layer, plan, query, scale, softcap), None


def register_attention() -> None:
    """Register ``"sfi"`` with transformers' attention and mask interfaces (idempotent).

    The mask registration matters: without it transformers skips mask creation for a custom
    attention name and a padded prefill would attend to padding.
    """
    AttentionInterface.register(ATTENTION_NAME, sfi_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _plan_before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: let a SlowFastCache plan the step from the input tokens."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, SlowFastCache):
        return
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    shaped = input_ids if input_ids is not None else embeds
    if shaped is None:
        return
    cache.begin_forward(input_ids, kwargs.get("attention_mask"), shaped.shape[0], shaped.shape[1],
                        shaped.device)


def route_model(model: torch.nn.Module) -> Any:
    """Route ``model``'s attention through ``"sfi"`` and hook its forward; returns its config.

    For any cache other than a SlowFastCache the ``"sfi"`` function is SDPA, so routing does not
    change what the model computes elsewhere.
    """
    config = getattr(model, "config", None)
    can_route = getattr(model, "_can_set_attn_implementation", None)
    routable = can_route() if callable(can_route) else getattr(
        model, "_supports_attention_backend", False)
    if config is None or not routable:
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route its attention through transformers' "
            "AttentionInterface, so sfi cannot make its decode steps sparse")
    register_attention()
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    if not getattr(model, "_sfi_hooked", False):
        model.register_forward_pre_hook(_plan_before_forward, with_kwargs=True)
        model._sfi_hooked = True
    return config
