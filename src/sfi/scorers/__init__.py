"""The interface between the mechanics of slow-fast decoding and whatever ranks positions.

A scorer sees the evidence of one slow step for one layer (attention logits of the evidence
queries, the cached key norms, and the candidate region per sequence) and returns one score per
(sequence, KV head, position); larger is better. Everything else (which region is a candidate,
how many to keep, top-K, packing the compact buffer) lives in the shared mechanics, so a baseline
is just another scorer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Evidence:
    """What a slow step knows about one layer, for the sequences being refreshed.

    Shapes: B sequences, H KV heads, N evidence rows per KV head (G query heads x W queries),
    T cache positions.

    Attributes:
        logits: ``[B, H, N, T]`` scaled attention logits q.k / sqrt(d), ``-inf`` where a row may
            not look (padding, the future).
        key_norms: ``[B, H, T]`` L2 norm of each cached (post-RoPE) key.
        candidates: ``[B, T]`` bool, the middle region M = [lo, hi) of each sequence.
        lo: ``[B]`` first candidate position (after the sinks) of each sequence.
        hi: ``[B]`` end of the candidate region (start of the recent window).
        layer_idx: the model layer the evidence comes from.
        queries: W, the evidence queries per query head; rows are ordered (query head, query),
            the last query of each head last (W = 1 at a decode-time slow step).
        query: ``[B, H, N, D]`` the evidence queries themselves (post-RoPE), rows as in
            ``logits``; None where the caller has only logits.
        keys: ``[B, H, T, D]`` the cached keys (for scorers that bound q.k by pages, Quest).
        history: ``[B, H, T]`` attention accumulated by earlier queries (H2O), where the
            caller tracks it; None otherwise.
        pads: ``[B]`` each sequence's left padding (its first token's position), for scorers
            that cut the cache into pages; None: no padding.
    """

    logits: torch.Tensor
    key_norms: torch.Tensor
    candidates: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    layer_idx: int
    queries: int = 1
    query: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    history: torch.Tensor | None = None
    pads: torch.Tensor | None = None

    def subset(self, index: torch.Tensor) -> Evidence:
        """The evidence of the sequences ``index [n]`` only."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        return replace(self, logits=take(self.logits), key_norms=take(self.key_norms),
                       candidates=take(self.candidates), lo=take(self.lo), hi=take(self.hi),
                       query=take(self.query), keys=take(self.keys), history=take(self.history),
                       pads=take(self.pads))

    def attention(self) -> torch.Tensor:
        """``[B, H, N, T]`` each row's softmax over the keys it may see (0 for a row that may
        see nothing)."""
        return torch.softmax(self.logits.float(), dim=-1).nan_to_num(0.0)


@runtime_checkable
class Scorer(Protocol):
    """Ranks candidate positions from a slow step's evidence."""

    def score(self, evidence: Evidence) -> torch.Tensor:
        """Return ``[B, H, T]`` scores (larger keeps); only candidate positions are read."""
        ...
