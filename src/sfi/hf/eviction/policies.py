"""The eviction rules of the usual training-free KV baselines (``docs/method.md``, the baselines).

Each policy owns a budget ``capacity``: C, the tokens each KV head keeps (attends to, for Quest).
Scoring comes from the same scorers SFI's slow steps can use (``sfi.core.scorers``); a policy only
decides when to score and what to keep. Shapes: B sequences, H KV heads, G query heads per KV
head, T cache length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sfi.core.pages import page_bounds
from sfi.core.scorers import Evidence
from sfi.core.scorers.quest import bound_scores
from sfi.core.scorers.snapkv import SnapKVScorer
from sfi.errors import SFIError
from sfi.hf.eviction.layer import EvictionLayer


def keep_top(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, H, T]`` bool: the ``k`` best-scoring ``candidates`` (``[B, T]`` or ``[B, H, T]``)
    of each head."""
    if candidates.dim() == 2:
        candidates = candidates[:, None, :].expand_as(scores)
    chosen = torch.zeros_like(candidates)
    k = min(k, int(candidates.sum(dim=-1).min()))
    if k <= 0:
        return chosen
    ranked = scores.float().masked_fill(~candidates, float("-inf"))
    return chosen.scatter(-1, torch.topk(ranked, k, dim=-1).indices, True)


def _positions(layer: EvictionLayer) -> torch.Tensor:
    return torch.arange(layer.length, device=layer.keep.device)


@dataclass
class EvictionPolicy:
    """No-op base: keeps everything. ``window`` is how many prefill queries the one-off
    selection scores with (0: none needed); ``tracks_attention`` asks the cache to accumulate
    every query's attention (H2O)."""

    capacity: int
    window: int = 0
    tracks_attention: bool = False

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise SFIError(f"an eviction budget must be at least 1 token, got {self.capacity}")

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None:
        """Compress ``layer.keep`` once the prompt is in the cache."""

    def step_mask(self, layer: EvictionLayer, query: torch.Tensor) -> torch.Tensor | None:
        """``[B, H, T]`` positions this decode step may read (query ``[B, H, G, D]``)."""
        return None

    def side_reads(self, length: int) -> float:
        """KV entries per KV head that a decode step whose :meth:`step_mask` narrowed a layer
        of ``length`` positions read beside the positions it attends (to choose them)."""
        return 0.0

    def after_step(self, layer: EvictionLayer, attention: torch.Tensor) -> None:
        """Evict after a decode step whose attention was ``[B, H, G, T]``."""


@dataclass
class StreamingLLM(EvictionPolicy):
    """The first ``sink`` tokens and the last C - sink, sliding as decoding goes on."""

    sink: int = 4

    def _slide(self, layer: EvictionLayer) -> None:
        pos = _positions(layer)
        layer.keep &= (pos < self.sink) | (pos >= layer.length - (self.capacity - self.sink))

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None:
        self._slide(layer)

    def after_step(self, layer: EvictionLayer, attention: torch.Tensor) -> None:
        self._slide(layer)


@dataclass
class SnapKV(EvictionPolicy):
    """Once after prefill: the top C - w positions by pooled observation-window attention, plus
    the last w prompt tokens; every generated token is kept."""

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    def layer_budget(self, layer: EvictionLayer, length: int) -> int:
        return self.capacity - self.window

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None:
        t = layer.length
        if evidence is None or t <= self.capacity:
            return
        scores = SnapKVScorer(self.kernel, self.pooling).score(evidence)
        chosen = keep_top(scores, evidence.candidates, self.layer_budget(layer, t))
        layer.keep &= chosen | (_positions(layer) >= t - evidence.queries)


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's score with budgets that shrink linearly with depth: layer l keeps
    max - l (max - min) // (L - 1) positions, min = (C - w) // beta, max = 2 (C - w) - min;
    SnapKV's flat budget where the pyramid does not fit the prompt."""

    beta: int = 20

    def layer_budget(self, layer: EvictionLayer, length: int) -> int:
        flat = self.capacity - self.window
        low = flat // self.beta
        high = 2 * flat - low
        n_layers = layer.num_layers
        if high > length - self.window or n_layers < 2:
            return flat
        return high - layer.layer_idx * (high - low) // (n_layers - 1)


@dataclass
class H2O(EvictionPolicy):
    """Heavy hitters: the top C/2 older positions by attention accumulated over every query
    (prompt and decode), plus the last C/2; re-applied at every step."""

    tracks_attention: bool = True

    @property
    def recent(self) -> int:
        return self.capacity - self.capacity // 2

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None:
        t = layer.length
        if t <= self.capacity:
            return
        pos = _positions(layer)
        older = (pos < t - self.recent).expand(layer.keep.shape[0], t)
        scores = layer.history
        layer.keep &= keep_top(scores, older, self.capacity // 2) | (pos >= t - self.recent)

    def after_step(self, layer: EvictionLayer, attention: torch.Tensor) -> None:
        older = layer.keep & (_positions(layer) < layer.length - self.recent)
        over = layer.keep.sum(dim=-1) > self.capacity  # [B, H]; one token joined this step
        if not bool(over.any()):
            return
        victim = layer.history.masked_fill(~older, float("inf")).argmin(dim=-1, keepdim=True)
        layer.keep.scatter_(-1, victim, ~over[..., None] & layer.keep.gather(-1, victim))


@dataclass
class TOVA(EvictionPolicy):
    """The last query's attention averaged over all heads of the layer: keep the top C after
    prefill, then drop the lowest-scoring token whenever the cache holds more than C (never
    the newest). Every head of a layer keeps the same tokens."""

    window: int = 1

    def after_prefill(self, layer: EvictionLayer, evidence: Evidence | None) -> None:
        t = layer.length
        if evidence is None or t <= self.capacity:
            return
        b, h, rows, _ = evidence.logits.shape
        w = evidence.queries
        last = evidence.attention().reshape(b, h, rows // w, w, t)[..., -1, :]  # [B, H, G, T]
        scores = last.mean(dim=(1, 2))[:, None, :].expand(b, h, t)
        layer.keep &= keep_top(scores, torch.ones_like(layer.keep), self.capacity)

    def after_step(self, layer: EvictionLayer, attention: torch.Tensor) -> None:
        kept = layer.keep[:, 0]  # [B, T], shared by the heads
        over = kept.sum(dim=-1) > self.capacity  # [B]
        if not bool(over.any()):
            return
        scores = attention.mean(dim=(1, 2)).masked_fill(~kept, float("inf"))
        scores[:, -1] = float("inf")  # the newest token stays
        victim = scores.argmin(dim=-1)  # [B]
        rows = torch.nonzero(over).flatten()
        layer.keep[rows, :, victim[rows]] = False


@dataclass
class Quest(EvictionPolicy):
    """Nothing evicted; each decode step reads the top C / page pages by the min/max-key bound
    of its own query (the current page always), the first ``dense_layers`` layers dense."""

    page: int = 16
    dense_layers: int = 2

    def step_mask(self, layer: EvictionLayer, query: torch.Tensor) -> torch.Tensor | None:
        t = layer.length
        if layer.layer_idx < self.dense_layers or t <= self.capacity:
            return None
        low, high = page_bounds(layer.keys, self.page)
        scores = bound_scores(query, low, high)  # [B, H, P]
        scores[..., -1] = float("inf")
        pages = min(max(1, self.capacity // self.page), scores.shape[-1])
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        chosen.scatter_(-1, torch.topk(scores, pages, dim=-1).indices, True)
        return chosen.repeat_interleave(self.page, dim=-1)[..., :t]

    def side_reads(self, length: int) -> float:
        """Every page's min and max key (two vectors a page: one entry)."""
        return float(math.ceil(length / self.page))


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "streamingllm": StreamingLLM,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "h2o": H2O,
    "tova": TOVA,
    "quest": Quest,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The eviction baseline ``name`` keeping ``capacity`` tokens per KV head."""
    if name not in POLICIES:
        raise SFIError(f"unknown eviction baseline {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](capacity)
