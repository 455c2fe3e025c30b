"""The masked cache that runs every eviction baseline, and its attention.

Each layer keeps the full KV ``[B, H, T, D]`` (as transformers' ``DynamicLayer``) plus
``keep [B, H, T]``: which positions each KV head may still attend to. A prefill (a multi-token
forward) attends densely, as every baseline's prefill does, then lets the policy compress
``keep`` from the evidence of the last queries. A decode step attends to ``keep`` (narrowed per
step by query-aware policies such as Quest), then lets the policy evict. ``history [B, H, T]``
accumulates the attention of every query, for H2O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from sfi.cache import set_active_layer
from sfi.errors import SFIError, UnsupportedModelError
from sfi.eviction.policies import EvictionPolicy
from sfi.kernels import additive_bias, attention_logits, dense_attention, dense_fallback
from sfi.scorers import Evidence

NEG_INF = float("-inf")
Observer = Callable[["EvictionLayer", torch.Tensor], None]


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scale: float,
                          softcap: float | None, chunk: int = 256) -> torch.Tensor:
    """Attention of causal queries summed per key: ``query [B, Hq, Q, D]`` (the last Q positions
    of the cache), ``keys [B, H, T, D]`` -> ``[B, H, T]`` summed over queries and the G query
    heads of each KV head. Computed ``chunk`` queries at a time."""
    b, hq, nq, d = query.shape
    h, t = keys.shape[1], keys.shape[-2]
    q = query.reshape(b, h, hq // h, nq, d)
    total = torch.zeros(b, h, t, device=keys.device)
    key_pos = torch.arange(t, device=keys.device)
    for start in range(0, nq, chunk):
        part = q[:, :, :, start:start + chunk]
        logits = attention_logits(part, keys[:, :, None], scale, softcap)  # [B, H, G, c, T]
        query_pos = torch.arange(t - nq + start, t - nq + start + part.shape[-2],
                                 device=keys.device)
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], NEG_INF)
        total += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return total


class EvictionLayer(DynamicLayer):
    """One layer's full KV, its keep mask and (when tracked) its attention history."""

    def __init__(self, owner: EvictionCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.keep: torch.Tensor | None = None  # [B, H, T] bool
        self.history: torch.Tensor | None = None  # [B, H, T] float32

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, L, D]`` keys/values; new positions are kept, with no history."""
        keys, values = super().update(key_states, value_states)
        b, h, new = key_states.shape[:3]
        fresh = torch.ones(b, h, new, dtype=torch.bool, device=keys.device)
        self.keep = fresh if self.keep is None else torch.cat([self.keep, fresh], dim=-1)
        if self.owner.track_attention:
            zeros = torch.zeros(b, h, new, device=keys.device)
            self.history = zeros if self.history is None else torch.cat([self.history, zeros],
                                                                        dim=-1)
        set_active_layer(self)
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.keep = self.history = None

    def crop(self, tokens_to_remove: int) -> None:
        raise SFIError("an EvictionCache cannot be cropped")

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
        """Attention of ``query [B, Hq, Q, D]`` -> ``([B, Q, Hq, D], None)``."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        softcap = kwargs.get("softcap")
        if query.shape[2] > 1:
            out, _ = dense_fallback(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, **kwargs)
            if self.owner.track_attention:
                self.history += accumulated_attention(query, self.keys, scale, softcap)
            policy = self.owner.policy
            if policy is not None:
                policy.after_prefill(self, self._evidence(query, policy.window, scale, softcap))
            return out, None
        return self._decode(query, scale, softcap), None

    def _evidence(self, query: torch.Tensor, window: int, scale: float,
                  softcap: float | None) -> Evidence | None:
        """The last ``window`` queries of a prefill as evidence over the whole cache."""
        if window <= 0:
            return None
        b, hq, nq, d = query.shape
        keys = self.keys
        h, t = keys.shape[1], keys.shape[-2]
        w = min(window, nq)
        q = query[:, :, -w:].reshape(b, h, hq // h, w, d)
        logits = attention_logits(q, keys[:, :, None], scale, softcap)  # [B, H, G, W, T]
        key_pos = torch.arange(t, device=keys.device)
        query_pos = torch.arange(t - w, t, device=keys.device)
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], NEG_INF)
        candidates = (key_pos < t - w).expand(b, t)
        return Evidence(logits=logits.reshape(b, h, -1, t),
                        key_norms=torch.linalg.vector_norm(keys.float(), dim=-1),
                        candidates=candidates, lo=torch.zeros(b, dtype=torch.long),
                        hi=torch.full((b,), t - w), layer_idx=self.layer_idx, queries=w,
                        query=q.reshape(b, h, -1, d), keys=keys, history=self.history)

    def _decode(self, query: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
        b, hq, _, d = query.shape
        keys, values = self.keys, self.values
        h = keys.shape[1]
        q = query.reshape(b, h, hq // h, d)
        allowed = self.keep
        policy = self.owner.policy
        narrowed = policy.step_mask(self, q) if policy is not None else None
        if narrowed is not None:
            allowed = allowed & narrowed
        self.owner.record_read(float(allowed.float().mean()))
        out, logits = dense_attention(q, keys, values, additive_bias(allowed)[:, :, None, :],
                                      scale, softcap)
        attention = torch.softmax(logits, dim=-1)  # [B, H, G, T]
        if self.history is not None:
            self.history += attention.sum(dim=2)
        if self.owner.observer is not None:
            self.owner.observer(self, attention)
        if policy is not None:
            policy.after_step(self, attention)
        return out.reshape(b, 1, hq, -1)


class EvictionCache(Cache):
    """A transformers ``Cache`` that decodes like an eviction baseline (quality, not speed).

    Args:
        model: a causal LM whose layers are all full attention (Llama, Qwen2, Qwen3, ...).
        policy: the baseline's rule (see :mod:`sfi.eviction.policies`); None attends to the whole
            cache (full attention, e.g. to record attention history or to observe a run).
        track_attention: accumulate every query's attention per key (defaults to what the
            policy needs).
        observer: called with ``(layer, attention [B, H, G, T])`` after every decode step of
            every layer (for analyses).
    """

    def __init__(self, model: torch.nn.Module, policy: EvictionPolicy | None = None,
                 track_attention: bool | None = None, observer: Observer | None = None):
        from sfi.attention import route_model

        config = route_model(model).get_text_config()
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(config, "sliding_window", None):
            raise UnsupportedModelError("the eviction baselines support models whose layers are "
                                        "all full attention")
        self.policy = policy
        self.track_attention = (track_attention if track_attention is not None
                                else bool(getattr(policy, "tracks_attention", False)))
        self.observer = observer
        self.num_layers = config.num_hidden_layers
        self._reads: list[float] = []
        super().__init__(layers=[EvictionLayer(self, i) for i in range(self.num_layers)])

    def load(self, keys_values: list[tuple[torch.Tensor, torch.Tensor]],
             history: list[torch.Tensor] | None = None) -> None:
        """Fill an empty cache with a shared prefill's KV (copied) and, when this cache tracks
        attention, that prefill's accumulated attention per layer ``[B, H, T]``."""
        if self.get_seq_length() != 0:
            raise SFIError("load needs an empty EvictionCache")
        if self.track_attention and history is None:
            raise SFIError("this policy needs the prefill's attention history; compute it with "
                           "sfi.eviction.cache.prefill_with_history")
        for idx, (layer, (k, v)) in enumerate(zip(self.layers, keys_values)):
            layer.update(k.clone(), v.clone())
            if self.track_attention:
                layer.history = history[idx].clone()
        set_active_layer(None)

    def record_read(self, fraction: float) -> None:
        self._reads.append(fraction)

    def retention(self) -> float:
        """Mean fraction of the cache attended per decode step (over layers and heads)."""
        return sum(self._reads) / len(self._reads) if self._reads else 1.0


@torch.inference_mode()
def prefill_with_history(model: torch.nn.Module, ids: torch.Tensor
                         ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Prefill ``ids [B, T]`` with full attention; return each layer's KV and the attention its
    keys received, summed over every prompt query and query head (H2O's prompt scores)."""
    from sfi.decode import cache_argument

    cache = EvictionCache(model, policy=None, track_attention=True)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    return ([(layer.keys, layer.values) for layer in cache.layers],
            [layer.history for layer in cache.layers])
