"""Coverage-aware refresh (beyond the paper): does the fast memory miss what the query needs?

A fast memory is chosen at a slow step and reused until the next; when the model's need moves
before a sentence ends (the second digit of a number it copies, the next value of a list), the
paper's triggers do not see it. Here a few probe layers check at every fast step.

For each page of P positions (aligned at 0) the element-wise min and max of its keys bound every
``q . k`` inside it: ``sum_d max(q_d min_d, q_d max_d)`` (Quest). A probe ranks the pages of the
middle region by that bound, summed over the G query heads of each KV head; when one of the
``top`` best pages (wholly inside the middle region) of some KV head holds none of the
memory's positions, the memory is likely
missing attention mass the query wants, and the row refreshes at its next step. A probe reads
the page summaries, O(T / P) per layer, where a dense step reads O(T) on every layer.

Shapes: n rows, H KV heads, G query heads per KV head, P pages, D head size, C compact slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sfi.scorers.quest import page_scores

DEFAULT_PAGE = 16


def probe_layers(count: int, layer_ids: Sequence[int], dense_layers: int) -> tuple[int, ...]:
    """``count`` probe layers spread evenly over the slow-fast layers past the dense ones (at
    the centres of ``count`` equal parts)."""
    sparse = [i for i in layer_ids if i >= dense_layers]
    if count <= 0 or not sparse:
        return ()
    count = min(count, len(sparse))
    return tuple(sparse[int((j + 0.5) * len(sparse) / count)] for j in range(count))


def missing_rows(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                 memory: torch.Tensor, held: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 page: int, top: int) -> torch.Tensor:
    """``[n]`` bool: rows whose fast memory holds nothing of one of the ``top`` pages (per KV
    head) that the query bounds highest in its middle region.

    Args:
        query: ``[n, H, G, D]``; low, high: ``[n, H, P, D]`` per-page min and max keys.
        memory: ``[n, H, C]`` the compact slots' positions; held: ``[n, C]`` bool, the slots
            that hold a selected position.
        lo, hi: ``[n]`` the middle region [lo, hi) of each row.
    """
    n, h, pages = low.shape[0], low.shape[1], low.shape[2]
    scores = page_scores(query, low, high)  # [n, H, P]
    starts = torch.arange(pages, device=low.device) * page
    # pages wholly inside the middle region: one that reaches into the sinks or the recent
    # window is (partly) read anyway
    middle = (starts[None, :] >= lo[:, None]) & (starts[None, :] + page <= hi[:, None])  # [n, P]
    scores = scores.masked_fill(~middle[:, None, :], float("-inf"))
    in_memory = torch.zeros(n, h, pages + 1, dtype=torch.bool, device=low.device)
    slot_pages = torch.where(held[:, None, :], memory // page, pages).clamp(max=pages)
    in_memory.scatter_(-1, slot_pages, True)
    k = min(top, pages)
    best = torch.topk(scores, k, dim=-1)
    wanted = torch.isfinite(best.values)
    missed = wanted & ~in_memory[..., :pages].gather(-1, best.indices)
    return missed.flatten(1).any(dim=-1)
