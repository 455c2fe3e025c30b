"""The interface between the mechanics of slow-fast decoding and whatever ranks positions.

A scorer sees the evidence of one slow step for one layer (attention logits of the evidence
queries, the cached key norms, and the candidate region per sequence) and returns one score per
(sequence, KV head, position); larger is better. Everything else (which region is a candidate,
how many to keep, top-K, packing the compact buffer) lives in the shared mechanics, so a baseline
is just another scorer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Evidence:
    """What a slow step knows about one layer, for the sequences being refreshed (made by
    :func:`make_evidence`, in either engine).

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
        probabilities: ``[B, H, N, T]`` the softmax of ``logits`` where the engine computed it
            for the step's own attention; None: :meth:`attention` computes it.
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
    probabilities: torch.Tensor | None = None

    def subset(self, index: torch.Tensor) -> Evidence:
        """The evidence of the sequences ``index [n]`` only."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        return replace(self, logits=take(self.logits), key_norms=take(self.key_norms),
                       candidates=take(self.candidates), lo=take(self.lo), hi=take(self.hi),
                       query=take(self.query), keys=take(self.keys), history=take(self.history),
                       pads=take(self.pads), probabilities=take(self.probabilities))

    def attention(self) -> torch.Tensor:
        """``[B, H, N, T]`` each row's softmax over the keys it may see (0 for a row that may
        see nothing)."""
        p = self.probabilities
        return (torch.softmax(self.logits.float(), dim=-1) if p is None else p).nan_to_num(0.0)


def key_norms_of(keys: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` the L2 norm of each key of ``keys [..., T, D]`` (in float32; a transposed
    view, dim-major as some paged layouts store keys, is summed along its D rows)."""
    if keys.stride(-1) == 1:
        return torch.linalg.vector_norm(keys.float(), dim=-1)
    return torch.square(keys.transpose(-1, -2).float()).sum(dim=-2).sqrt_()


def make_evidence(logits: torch.Tensor, layer_idx: int, lo: torch.Tensor, hi: torch.Tensor, *,
                  keys: torch.Tensor | None = None, key_norms: torch.Tensor | None = None,
                  candidates: torch.Tensor | None = None, queries: int = 1,
                  query: torch.Tensor | None = None, history: torch.Tensor | None = None,
                  pads: torch.Tensor | None = None, probabilities: torch.Tensor | None = None
                  ) -> Evidence:
    """The one way a slow step's :class:`Evidence` is made, in either engine.

    ``key_norms [B, H, T]`` where the caller keeps them, else computed from ``keys
    [B, H, T, D]``; ``candidates [B, T]`` where the caller has them, else the region
    ``lo <= position < hi`` of each sequence. The keys travel with the evidence when there are
    evidence queries (``query [B, H, N, D]``: scorers that bound q.k by pages need both).
    ``probabilities [B, H, N, T]``: the softmax of ``logits`` where the caller has it.
    """
    if key_norms is None:
        if keys is None:
            raise ValueError("make_evidence needs keys or key_norms")
        key_norms = key_norms_of(keys)
    if candidates is None:
        positions = torch.arange(logits.shape[-1], device=logits.device)
        bounds = lo.to(positions.device)[:, None], hi.to(positions.device)[:, None]
        candidates = (positions >= bounds[0]) & (positions < bounds[1])
    return Evidence(logits=logits, key_norms=key_norms, candidates=candidates, lo=lo, hi=hi,
                    layer_idx=layer_idx, queries=queries, query=query,
                    keys=keys if query is not None else None, history=history, pads=pads,
                    probabilities=probabilities)


def stack_evidence(parts: Sequence[Evidence]) -> Evidence:
    """The evidence of several refreshes (several layers of one step) as one, their rows
    stacked in order, for scorers with ``scores_rows_alone`` (see :class:`Scorer`): the
    queries, keys and history are left out; ``layer_idx`` is the first part's."""
    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(e, name) for e in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    first = parts[0]
    return Evidence(logits=cat("logits"), key_norms=cat("key_norms"),  # type: ignore[arg-type]
                    candidates=cat("candidates"), lo=cat("lo"), hi=cat("hi"),  # type: ignore[arg-type]
                    layer_idx=first.layer_idx, queries=first.queries, pads=cat("pads"),
                    probabilities=cat("probabilities"))


def scores_rows_alone(scorer: object) -> bool:
    """Whether ``scorer``'s own class declares ``scores_rows_alone = True`` (a subclass that
    may read more must not inherit it): see :class:`Scorer`."""
    return bool(vars(type(scorer)).get("scores_rows_alone", False))


@runtime_checkable
class Scorer(Protocol):
    """Ranks candidate positions from a slow step's evidence.

    A scorer whose class sets ``scores_rows_alone = True`` scores each row from that row's
    logits, probabilities, key norms and region alone (never the queries, keys, history or
    ``layer_idx``): the evidence of several layers may then be stacked into one call
    (:func:`stack_evidence`)."""

    def score(self, evidence: Evidence) -> torch.Tensor:
        """Return ``[B, H, T]`` scores (larger keeps); only candidate positions are read."""
        ...
