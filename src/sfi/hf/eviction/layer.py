"""One layer of the eviction baselines' masked cache, and its attention.

The layer keeps the full KV ``[B, H, T, D]`` (as transformers' ``DynamicLayer``) plus
``keep [B, H, T]``: which positions each KV head may still attend to, and (when tracked)
``history [B, H, T]``, the attention every query gave each key (H2O). A prefill attends densely,
as every baseline's prefill does, then lets the policy compress ``keep`` from the evidence of
the last queries. A decode step attends to ``keep`` (narrowed per step by query-aware policies
such as Quest), then lets the policy evict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicLayer

from sfi.core.kernels import additive_bias, causal_mask, dense_attention, window_logits
from sfi.core.scorers import Evidence, make_evidence
from sfi.errors import SFIError
from sfi.hf.attention import AttendingLayer
from sfi.hf.context import StepContext

Observer = Callable[["EvictionLayer", torch.Tensor], None]


class Policy(Protocol):
    """What the layer asks of an eviction rule (``sfi.hf.eviction.policies``)."""

    window: int

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None: ...

    def step_mask(self, layer: EvictionLayer, query: torch.Tensor) -> torch.Tensor | None: ...

    def after_step(self, layer: EvictionLayer, attention: torch.Tensor) -> None: ...


@dataclass
class EvictionStep:
    """The plan of one forward through an eviction cache: the rule, whether it is a decode
    step, an optional observer of every decode step's attention, and where each layer records
    the fraction it read."""

    policy: Policy | None
    decode: bool = False
    observer: Observer | None = None
    reads: list[float] = field(default_factory=list)


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scale: float,
                          softcap: float | None, chunk: int = 256) -> torch.Tensor:
    """Attention of causal queries summed per key: ``query [B, Hq, Q, D]`` (the last Q positions
    of the cache), ``keys [B, H, T, D]`` -> ``[B, H, T]`` summed over queries and the G query
    heads of each KV head. Computed ``chunk`` queries at a time."""
    b, nq = query.shape[0], query.shape[2]
    h, t = keys.shape[1], keys.shape[-2]
    total = torch.zeros(b, h, t, device=keys.device)
    for start in range(0, nq, chunk):
        part = query[:, :, start:start + chunk]
        bias = additive_bias(causal_mask(t, part.shape[2], keys.device,
                                         first_query=t - nq + start))
        logits = window_logits(part, keys, bias, scale, softcap)  # [B, H, G * c, T]
        total += torch.softmax(logits, dim=-1).sum(dim=2)
    return total


class EvictionLayer(AttendingLayer, DynamicLayer):
    """One layer's full KV, its keep mask and (when tracked) its attention history."""

    def __init__(self, layer_idx: int, num_layers: int, track_attention: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_layers = num_layers
        self.track_attention = track_attention
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
        if self.track_attention:
            zeros = torch.zeros(b, h, new, device=keys.device)
            self.history = zeros if self.history is None else torch.cat([self.history, zeros],
                                                                        dim=-1)
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.keep = self.history = None

    def crop(self, tokens_to_remove: int) -> None:
        raise SFIError("an EvictionCache cannot be cropped")

    def after_prefill(self, step: StepContext, query: torch.Tensor, scale: float,
                      softcap: float | None) -> None:
        """Accumulate the prompt's attention (H2O) and let the policy compress."""
        plan: EvictionStep = step.plan
        if self.track_attention:
            self.history += accumulated_attention(query, self.keys, scale, softcap)
        if plan.policy is not None:
            plan.policy.after_prefill(self, self._evidence(query, plan.policy.window, scale,
                                                           softcap))

    def _evidence(self, query: torch.Tensor, window: int, scale: float,
                  softcap: float | None) -> Evidence | None:
        """The last ``window`` queries of a prefill as evidence over the whole cache."""
        if window <= 0:
            return None
        b, _, nq, d = query.shape
        keys = self.keys
        h, t = keys.shape[1], keys.shape[-2]
        w = min(window, nq)
        q = query[:, :, -w:]
        logits = window_logits(q, keys, additive_bias(causal_mask(t, w, keys.device)), scale,
                               softcap)
        return make_evidence(logits, self.layer_idx, torch.zeros(b, dtype=torch.long),
                             torch.full((b,), t - w), keys=keys, queries=w,
                             query=q.reshape(b, h, -1, d), history=self.history)

    def decode(self, step: StepContext, q: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
        """Attend to the kept entries (narrowed for this query by the policy), then evict:
        ``q [B, H, G, D]`` -> ``[B, H, G, D]``."""
        plan: EvictionStep = step.plan
        keys, values = self.keys, self.values
        allowed = self.keep
        narrowed = plan.policy.step_mask(self, q) if plan.policy is not None else None
        read = 0.0
        if narrowed is not None:
            allowed = allowed & narrowed
            read = plan.policy.side_reads(keys.shape[-2]) / keys.shape[-2]
        plan.reads.append(float(allowed.float().mean()) + read)
        out, logits, _ = dense_attention(q, keys, values, additive_bias(allowed)[:, :, None, :],
                                      scale, softcap)
        attention = torch.softmax(logits, dim=-1)  # [B, H, G, T]
        if self.history is not None:
            self.history += attention.sum(dim=2)
        if plan.observer is not None:
            plan.observer(self, attention)
        if plan.policy is not None:
            plan.policy.after_step(self, attention)
        return out
