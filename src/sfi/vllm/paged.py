"""Reading a request's entries out of a paged KV cache, and packing a fast memory into a slot.

Pure tensor functions over one layer's cache half (keys or values) seen as ``[NB, H, bs, D]``
(``NB`` blocks of ``bs`` positions, each KV head stored apart): position ``p`` of a request
lies in block ``block_row[p // bs]`` at offset ``p % bs``; a kernel may pack a block's
``bs * D`` entries in its own order (vLLM's CPU kernel stores keys dimension-major), given as a
permutation. The plugin's buffer has the same layout (written by the platform's own cache
op), so the stock kernel reads a slot as it reads any request: a fast row's block table lists
its slot's blocks and its ``seq_len`` is the slot's length.

Shapes: H KV heads, D head size, T context length, L entries of a memory, k selected per head.
"""

from __future__ import annotations

import torch

from sfi.kernels import additive_bias, attention_logits, causal_mask, window_logits
from sfi.planner import Memory
from sfi.scorers import Evidence, Scorer
from sfi.selector import compact_slots, selection_order

KeyLayout = None | str | torch.Tensor
"""How a kernel stores a block's ``bs * D`` key entries: None (``[bs, D]``), ``"dim-major"``
(``[D, bs]``, as vLLM's CPU kernel stores fp32 keys), or any other order as a ``[bs * D]``
permutation (entry (o, d) lies at ``order[o * D + d]``)."""

DIM_MAJOR = "dim-major"


def read_prefix(half: torch.Tensor, block_row: torch.Tensor, total: int,
                layout: KeyLayout = None) -> torch.Tensor:
    """``[H, T, D]``: positions ``[0, total)`` of the request whose blocks are ``block_row``,
    stored as ``layout`` says. For a dim-major layout the result is a transposed view of a
    contiguous ``[H, D, T]`` (what ``q @ k^T`` wants), made with one copy."""
    nb, h, bs, d = half.shape
    blocks = block_row[: -(-total // bs)].long()
    if isinstance(layout, str):
        paged = half.view(nb, h, d, bs).index_select(0, blocks)  # [n, H, D, bs]
        return paged.permute(1, 2, 0, 3).reshape(h, d, -1)[:, :, :total].transpose(1, 2)
    paged = half.index_select(0, blocks)  # [n, H, bs, D]
    if layout is not None:
        paged = paged.reshape(-1, h, bs * d).index_select(2, layout).view(-1, h, bs, d)
    return paged.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :total]


def read_positions(half: torch.Tensor, block_row: torch.Tensor, positions: torch.Tensor,
                   order: torch.Tensor | None = None) -> torch.Tensor:
    """``[H, L, D]``: head h's entry at ``positions [H, L]`` (cache positions per head), from
    blocks stored ``[bs, D]`` or in the ``order`` of a :data:`KeyLayout` permutation."""
    nb, h, bs, d = half.shape
    blocks = block_row.long()[positions // bs]
    heads = torch.arange(h, device=positions.device)[:, None]
    if order is None:
        return half[blocks, heads, positions % bs]
    where = order.view(bs, d)[positions % bs]  # [H, L, D]
    return half.reshape(nb, h, bs * d)[blocks[..., None], heads[..., None], where]


def memory_positions(memory: Memory, selected: torch.Tensor, end: int) -> torch.Tensor:
    """``[H, L]`` the positions a fast memory holds, in slot order: the sinks
    ``[pad, sink_end)``, the ``selected [H, k]`` positions, the recent window
    ``[recent_start, end)``."""
    h, device = selected.shape[0], selected.device
    sinks = torch.arange(memory.pad, memory.sink_end, device=device)
    recent = torch.arange(memory.recent_start, end, device=device)
    return torch.cat([sinks.expand(h, -1), selected, recent.expand(h, -1)], dim=-1)


def select_positions(scorer: Scorer, memory: Memory, layer_idx: int, page: int,
                     queries: torch.Tensor, keys: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """The ``[H, k]`` positions (increasing per head) a refresh selects from the middle region
    of ``memory``.

    Args:
        queries: ``[W, Hq, D]`` the evidence queries, the last W positions before the keys end
            (the logits are computed as the transformers path computes them: W = 1 as its
            dense decode attention, W > 1 as its first selection after prefill).
        keys: ``[H, T, D]`` the request's cached keys; T is where the evidence queries end.
    """
    w, _, d = queries.shape
    h, t = keys.shape[0], keys.shape[1]
    device = keys.device
    q = queries.permute(1, 0, 2)[None]  # [1, Hq, W, D]
    if w == 1:  # a decode-time slow step: the logits its dense attention computes
        logits = attention_logits(q.reshape(1, h, -1, d), keys[None], scale, softcap)
    else:  # the prompt's last W queries, each seeing the keys up to itself
        bias = additive_bias(causal_mask(t, w, device))
        logits = window_logits(q, keys[None], bias, scale, softcap)  # [1, H, G * W, T]
    positions = torch.arange(t, device=device)
    lo = torch.tensor([memory.sink_end], device=device)
    hi = torch.tensor([memory.recent_start], device=device)
    candidates = (positions >= lo) & (positions < hi)
    if keys.stride(-1) == 1:
        norms = torch.linalg.vector_norm(keys.float(), dim=-1)
    else:  # a transposed view (dim-major blocks): sum the squares along the D rows
        norms = torch.square(keys.transpose(-1, -2).float()).sum(dim=-2).sqrt_()
    evidence = Evidence(
        logits=logits, key_norms=norms[None],
        candidates=candidates[None], lo=lo, hi=hi, layer_idx=layer_idx, queries=w,
        query=q.reshape(1, h, -1, d), keys=keys[None])
    k = torch.tensor([memory.k], device=device)
    order, valid = selection_order(scorer.score(evidence), candidates[None], k, page)
    return compact_slots(order, valid, candidates[None], torch.zeros_like(k))[0]
