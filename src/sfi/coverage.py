"""Coverage-aware refresh (beyond the paper): does the fast memory miss what the query needs?

A fast memory is chosen at a slow step and reused until the next; when the model's need moves
before a sentence ends (the second digit of a number it copies, the next value of a list), the
paper's triggers do not see it. Here a few probe layers check at every fast step.

For each page of P positions (aligned at the sequence's first token, ``sfi.pages``) the
element-wise min and max of its keys bound every
``q . k`` inside it: ``sum_d max(q_d min_d, q_d max_d)`` (Quest). A probe ranks the pages of the
middle region that the memory does not hold by that bound (summed over the G query heads of each
KV head), reads the keys of the ``top`` best of them, and compares their attention weight with
the memory's (the log-sum-exp of the fast step's own logits): when, for some KV head, those
pages would take more than ``threshold`` of the attention (averaged over its query heads), the
memory misses mass the query wants, and the row refreshes at its next step. A probe reads the
page summaries, O(T / P), and ``top`` pages; a dense step reads O(T) at every layer.

Shapes: n rows, H KV heads, G query heads per KV head, P pages, D head size, C compact slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sfi.kernels import attention_logits
from sfi.scorers.quest import box_scores

DEFAULT_PAGE = 16


def probe_layers(count: int, layer_ids: Sequence[int], dense_layers: int) -> tuple[int, ...]:
    """``count`` probe layers spread evenly over the slow-fast layers past the dense ones (at
    the centres of ``count`` equal parts)."""
    sparse = [i for i in layer_ids if i >= dense_layers]
    if count <= 0 or not sparse:
        return ()
    count = min(count, len(sparse))
    return tuple(sparse[int((j + 0.5) * len(sparse) / count)] for j in range(count))


def missing_rows(query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                 centre: torch.Tensor, radius: torch.Tensor, memory: torch.Tensor,
                 held: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, lse: torch.Tensor, *, page: int, top: int,
                 threshold: float, scale: float, softcap: float | None = None,
                 shift: torch.Tensor | None = None,
                 outside: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]`` bool: rows whose fast memory misses attention mass (see the module docstring).

    Args:
        query: ``[n, H, G, D]``; keys: ``[B, H, T, D]`` the cached keys of the whole batch,
            of which these are the ``rows [n]``; centre, radius: ``[n, H, P, D]`` the per-page
            key boxes (``(max + min) / 2``, ``(max - min) / 2``).
        memory: ``[n, H, C]`` the compact slots' positions; held: ``[n, C]`` bool, the slots
            that hold a selected position.
        lo, hi: ``[n]`` the middle region [lo, hi) of each row.
        lse: ``[n, H, G]`` log-sum-exp of the fast step's logits over its memory.
        shift: ``[n]`` where each row's pages start (:func:`sfi.pages.page_shift`; None: at
            position 0).
        outside: ``[n, H, P]`` :func:`unheld_pages` of these rows when the caller keeps it
            between refreshes (None: computed here).
    """
    t = keys.shape[-2]
    if outside is None:
        outside = unheld_pages(memory, held, lo, hi, pages=centre.shape[2], page=page,
                               shift=shift)
    positions, real = best_pages(query, centre, radius, outside, page=page, top=top, length=t,
                                 shift=shift)
    heads = torch.arange(keys.shape[1], device=keys.device)[None, :, None]
    chosen = keys[rows[:, None, None], heads, positions]  # [n, H, m * P, D]: only those pages
    return misses(query, chosen, real, lse, threshold=threshold, scale=scale, softcap=softcap)


def unheld_pages(memory: torch.Tensor, held: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 *, pages: int, page: int, shift: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, H, pages]`` bool: the pages wholly inside the middle region [lo, hi) (one reaching
    into the sinks or the recent window is partly read anyway) that the memory (``memory
    [n, H, C]`` positions, ``held [n, C]`` the slots holding a selected one) holds nothing of.
    Fixed from one refresh to the next."""
    n, h = memory.shape[0], memory.shape[1]
    starts = torch.arange(pages, device=memory.device)[None, :] * page  # [1 or n, P]
    if shift is not None:
        starts = starts - shift[:, None]
        memory = memory + shift[:, None, None]
    middle = (starts >= lo[:, None]) & (starts + page <= hi[:, None])  # [n, P]
    in_memory = torch.zeros(n, h, pages + 1, dtype=torch.bool, device=memory.device)
    slot_pages = torch.where(held[:, None, :], memory // page, pages).clamp(max=pages)
    in_memory.scatter_(-1, slot_pages, True)
    return middle[:, None, :] & ~in_memory[..., :pages]


def best_pages(query: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor,
               outside: torch.Tensor, *, page: int, top: int, length: int,
               shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the ``top`` pages among ``outside [n, H, P]`` (:func:`unheld_pages`)
    whose keys the query bounds highest, per KV head: ``([n, H, m * P], [n, H, m * P] bool,
    the real ones)`` (m = min(top, pages); where fewer than m pages are left to choose, the
    rest are not real and their positions are any of the ``length``). A page of ``outside``
    lies wholly inside its row's middle region, so a real page's positions lie in the cache.
    Shapes as :func:`missing_rows`."""
    pages = centre.shape[2]
    scores = box_scores(query, centre, radius).masked_fill(~outside, float("-inf"))
    best = torch.topk(scores, min(top, pages), dim=-1)  # [n, H, m]
    positions = best.indices[..., None] * page + torch.arange(page, device=centre.device)
    if shift is not None:
        positions = positions - shift[:, None, None, None]
    real = torch.isfinite(best.values).repeat_interleave(page, dim=-1)  # [n, H, m * P]
    return positions.clamp(0, length - 1).flatten(2), real


def misses(query: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor, lse: torch.Tensor, *,
           threshold: float, scale: float, softcap: float | None = None) -> torch.Tensor:
    """``[n]`` bool: whether the ``chosen [n, H, N, D]`` keys (``real [n, H, N]``) would take
    more than ``threshold`` of the attention of some KV head's query heads (on average) beside
    the memory whose log-sum-exp is ``lse [n, H, G]``."""
    logits = attention_logits(query, chosen, scale, softcap)  # [n, H, G, N]
    logits = logits.masked_fill(~real[:, :, None, :], float("-inf"))
    share = torch.sigmoid(torch.logsumexp(logits, dim=-1) - lse)  # their weight vs the memory's
    return (share.mean(dim=2) > threshold).any(dim=-1)
