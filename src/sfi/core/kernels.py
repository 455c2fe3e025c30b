"""Attention kernels shared by every cache and both engines: masks and biases, dense, block and
fast (two-block) attention. Pure tensor functions: nothing here imports a model library.

Shapes: B sequences, H KV heads, G query heads per KV head, T cache length, D head size.
"""

from __future__ import annotations

import torch


def additive_bias(allowed: torch.Tensor) -> torch.Tensor:
    """Additive attention bias: 0 where ``allowed``, -inf elsewhere (float32)."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, float("-inf"))


def attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """Scaled, soft-capped logits ``[..., Q, T]`` of ``q [..., Q, D]`` on ``k [..., T, D]``."""
    return capped_logits(torch.matmul(q, k.transpose(-1, -2)), scale, softcap)


def capped_logits(products: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """The logits of raw ``q . k`` ``products`` (any shape): in float32, scaled, soft-capped."""
    z = products.float() * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def causal_mask(total: int, queries: int, device: torch.device, first_query: int | None = None,
                pads: torch.Tensor | None = None) -> torch.Tensor:
    """``[B or 1, Q, T]`` bool: which of ``total`` keys each of ``queries`` consecutive queries
    may see. Query j (at position ``first_query + j``, by default one of the last ``queries``
    positions) sees the keys up to itself and, with ``pads [B]``, none of its row's padding."""
    start = total - queries if first_query is None else first_query
    return _sees(torch.arange(start, start + queries, device=device)[None, :], total, pads)


def _sees(query_pos: torch.Tensor, total: int, starts: torch.Tensor | None) -> torch.Tensor:
    """``[n, Q, T]`` bool: each query (at ``query_pos [n or 1, Q]``) sees the keys from its
    row's ``starts [n]`` (None: 0) up to itself."""
    key_pos = torch.arange(total, device=query_pos.device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]
    if starts is not None:
        allowed = allowed & (key_pos[None, None, :] >= starts[:, None, None])
    return allowed


def evidence_bias(ends: torch.Tensor, w: int, total: int, starts: torch.Tensor | None = None,
                  windows: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, W, T]`` additive bias of a selection's W evidence queries per row, both engines':
    row b's queries are the positions ``ends[b] - W .. ends[b] - 1`` of its ``total`` keys
    (``ends [n]``); query j sees the keys from ``starts[b]`` (its first real token; default 0)
    up to itself, and none at all unless it is among the row's own last ``windows[b]``
    queries (default: all W)."""
    query_pos = ends[:, None] - w + torch.arange(w, device=ends.device)[None, :]  # [n, W]
    allowed = _sees(query_pos, total, starts)
    if windows is not None:
        allowed = allowed & (query_pos >= (ends - windows)[:, None])[:, :, None]
    return additive_bias(allowed)


def window_logits(query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scale: float,
                  softcap: float | None) -> torch.Tensor:
    """Logits of a window of queries over the whole cache, grouped by KV head: the evidence
    of a selection after prefill, and the observation window of the eviction baselines.

    Args:
        query: ``[B, Hq, W, D]`` (the queries of W consecutive positions); keys:
            ``[B, H, T, D]``; bias: ``[B or 1, W, T]`` additive (from :func:`causal_mask`).
    Returns:
        ``[B, H, G * W, T]`` float32, rows ordered (query head, query).
    """
    b, hq, w, d = query.shape
    h, t = keys.shape[1], keys.shape[-2]
    q = query.reshape(b, h, hq // h, w, d)
    logits = attention_logits(q, keys[:, :, None], scale, softcap)  # [B, H, G, W, T]
    return (logits + bias[:, None, None]).reshape(b, h, -1, t)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                    scale: float, softcap: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step over the whole cache, grouped by KV head.

    Args:
        q: ``[B, H, G, D]``; k, v: ``[B, H, T, D]``; bias: ``[B, 1, 1, T]`` or None.
    Returns:
        ``(out [B, H, G, D], logits [B, H, G, T], attention [B, H, G, T])``: the logits biased,
        and their softmax (both float32; a slow step's evidence).
    """
    logits = attention_logits(q, k, scale, softcap)
    if bias is not None:
        logits = logits + bias
    attention = torch.softmax(logits, dim=-1)
    out = torch.matmul(attention.to(v.dtype), v)
    return out, logits, attention


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    queries: int, scale: float, softcap: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q consecutive queries over the whole cache, grouped by KV head (exact mode's verify):
    K and V are read once for all of them, as :func:`dense_attention` reads them for one.

    Args:
        q: ``[B, H, G * Q, D]``, rows ordered (query head, query); k, v: ``[B, H, T, D]``;
        bias: ``[B or 1, Q, T]`` additive (causal within the block, padding).
    Returns:
        :func:`dense_attention`'s ``(out, logits, attention)`` with ``G * Q`` rows (those of
        :func:`window_logits`), which it computes: each query's bias repeated over its G rows.
    """
    rows = q.shape[2]
    t = k.shape[-2]
    per_row = bias[:, None, None].expand(-1, 1, rows // queries, queries, t)
    return dense_attention(q, k, v, per_row.reshape(-1, 1, rows, t), scale, softcap)


def fast_attention(q: torch.Tensor, compact_k: torch.Tensor, compact_v: torch.Tensor,
                   compact_bias: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor,
                   recent_bias: torch.Tensor | None, scale: float,
                   softcap: float | None = None, lse: list[torch.Tensor] | None = None,
                   memory_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One fast step: a single softmax over the compact buffer and the recent window.

    Args:
        q: ``[B, H, G, D]``; compact_k/v: ``[B, H, C, D]`` (sink + selected);
        compact_bias: ``[B, 1, 1, C]`` (-inf on unused slots); recent_k/v: ``[B, H, L, D]``;
        recent_bias: ``[B, 1, 1, L]`` or None.
        lse: when given, receives the log-sum-exp of the logits ``[B, H, G]`` (the memory's
            total attention weight, for the coverage probes).
        memory_logits: when given, receives the compact buffer's logits ``[B, H, G, C]``
            (biased: -inf on unused slots).
    Returns:
        ``[B, H, G, D]``.
    """
    compact = attention_logits(q, compact_k, scale, softcap) + compact_bias
    recent = attention_logits(q, recent_k, scale, softcap)
    if recent_bias is not None:
        recent = recent + recent_bias
    logits = torch.cat([compact, recent], dim=-1)
    if lse is not None:
        lse.append(torch.logsumexp(logits, dim=-1))
    if memory_logits is not None:
        memory_logits.append(compact)
    p = torch.softmax(logits, dim=-1).to(recent_v.dtype)
    width = compact.shape[-1]
    return torch.matmul(p[..., :width], compact_v) + torch.matmul(p[..., width:], recent_v)
