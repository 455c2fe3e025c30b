"""Coverage-aware refresh (beyond the paper): does the fast memory miss what the query needs?

A fast memory is chosen at a slow step and reused until the next; when the model's need moves
before a sentence ends (the second digit of a number it copies, the next value of a list), the
paper's triggers do not see it. Here a few probe layers check at every fast step.

For each page of P positions (aligned at the sequence's first token, ``sfi.core.pages``) the
element-wise min and max of its keys bound every
``q . k`` inside it: ``sum_d max(q_d min_d, q_d max_d)`` (Quest). A probe ranks the pages of the
middle region that the memory does not hold by that bound (summed over the G query heads of each
KV head), reads the keys of the ``top`` best of them, and compares their attention weight with
the memory's (the log-sum-exp of the fast step's own logits): when, for some KV head, those
pages would take more than ``threshold`` of the attention (averaged over its query heads), the
memory misses mass the query wants, and the row refreshes at its next step. A probe reads the
page summaries, O(T / P), and ``top`` pages; a dense step reads O(T) at every layer. With
``coverage_next`` a probe also reads, per KV head, the page after the one holding the fast
step's most attended selected position (:func:`with_next_pages`), where a copied span goes
on when it runs past what the memory holds. With ``coverage_copy`` a probe flags, without
reading anything, a fast step in which a query head gives a large share of its attention to a
selected position whose next position the memory does not hold (:func:`copy_runs_out`): the
copy's next step would need what the memory lacks, so that step refreshes instead (it is
never done again at once, as ``coverage_retry`` does with a page that misses).

Shapes: n rows, H KV heads, G query heads per KV head, P pages, D head size, C compact slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from sfi.core.kernels import attention_logits
from sfi.core.scorers.quest import box_scores


def probe_layers(count: int, layer_ids: Sequence[int], dense_layers: int) -> tuple[int, ...]:
    """``count`` probe layers spread evenly over the slow-fast layers past the dense ones (at
    the centres of ``count`` equal parts)."""
    sparse = [i for i in layer_ids if i >= dense_layers]
    if count <= 0 or not sparse:
        return ()
    count = min(count, len(sparse))
    return tuple(sparse[int((j + 0.5) * len(sparse) / count)] for j in range(count))


KeyReader = Callable[[torch.Tensor], torch.Tensor]
"""Reads one probe layer's cached keys of its rows: positions ``[n, H, N]`` -> keys ``[n, H, N,
D]`` (each engine from its own storage)."""


def batch_reader(keys: torch.Tensor, rows: torch.Tensor) -> KeyReader:
    """The :data:`KeyReader` of the rows ``rows [n]`` of a batch's cached ``keys [B, H, T,
    D]``."""
    heads = torch.arange(keys.shape[1], device=keys.device)[None, :, None]
    index = rows[:, None, None]
    return lambda positions: keys[index, heads, positions]


def missing_rows(queries: torch.Tensor, scores: torch.Tensor, readers: Sequence[KeyReader],
                 lse: torch.Tensor, *, page: int, top: int, threshold: float, scale: float,
                 length: int | torch.Tensor, softcap: float | None = None,
                 shift: torch.Tensor | None = None,
                 raised: torch.Tensor | None = None, heads: str = "mean") -> torch.Tensor:
    """``[n]`` bool: rows whose fast memory misses attention mass at some of L probe layers
    (see the module docstring), the layers checked together (:func:`pages_miss` once). Every
    tensor holds the L layers' rows one layer after another (layer i's at ``i n`` to
    ``(i + 1) n``).

    Args:
        queries: ``[L n, H, G, D]``, each probe layer's queries of these rows.
        scores: ``[L n, H, P]``, their :func:`page_scores`.
        readers: L :data:`KeyReader`, each layer's cached keys of these rows.
        lse: ``[L n, H, G]``, the log-sum-exp of each layer's fast logits over its memory.
        length: where the rows' keys end (an int for all, or ``[n]``), as in
            :func:`top_pages`.
        shift: ``[n]`` where each row's pages start (:func:`sfi.core.pages.page_shift`; None: at
            position 0).
        raised: ``[L n, H]``, where :func:`with_next_pages` ranked a next page first (None:
            the scores are the bound's alone): that page is read beside the ``top`` best by
            the bound.
        heads: how a KV head's query heads judge (:func:`misses`).
    """
    layers = len(readers)
    n = queries.shape[0] // layers

    def read(positions: torch.Tensor) -> torch.Tensor:  # [L * n, H, N] -> [L * n, H, N, D]
        return torch.cat([reader(positions[i * n:(i + 1) * n])
                          for i, reader in enumerate(readers)])

    if isinstance(length, torch.Tensor):
        length = length.repeat(layers)
    missed = pages_miss(queries, scores, lse, read, page=page, top=top, threshold=threshold,
                        scale=scale, softcap=softcap, length=length,
                        shift=shift.repeat(layers) if shift is not None else None,
                        raised=raised, heads=heads)
    return missed.view(layers, n).any(dim=0)


def pages_miss(query: torch.Tensor, scores: torch.Tensor, lse: torch.Tensor,
               read_keys: Callable[[torch.Tensor], torch.Tensor], *, page: int, top: int,
               threshold: float, scale: float, softcap: float | None,
               length: int | torch.Tensor, shift: torch.Tensor | None = None,
               raised: torch.Tensor | None = None, heads: str = "mean") -> torch.Tensor:
    """``[n]`` bool: the coverage verdict of both engines. The ``top`` best pages of ``scores
    [n, H, P]`` (:func:`page_scores`; with ``raised [n, H]``, :func:`with_next_pages`, one more,
    read where it was raised), their keys read by ``read_keys`` (positions ``[n, H, N]`` ->
    keys ``[n, H, N, D]``: each engine reads its own storage), and whether they would take
    more than ``threshold`` of the attention of ``query [n, H, G, D]`` beside the memory whose
    log-sum-exp is ``lse [n, H, G]`` (:func:`misses`, with ``heads``). ``length`` and
    ``shift`` as in :func:`top_pages`."""
    positions, real = top_pages(scores, page=page, top=top + (raised is not None),
                                length=length, shift=shift)  # [n, H, m * P]
    if raised is not None:  # no page raised: the last of the top + 1 is not read
        real = real.clone()
        real[..., -page:] &= raised[..., None]
    return misses(query, read_keys(positions), real, lse, threshold=threshold, scale=scale,
                  softcap=softcap, heads=heads)


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


def page_scores(query: torch.Tensor, boxes: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """``[n, H, P]`` each page's bound on ``query [n, H, G, D]``'s logits against its keys
    (summed over the G query heads of each KV head; ``boxes [n, H, P, 2 D]``,
    :func:`sfi.core.pages.page_boxes`), -inf for the pages not in ``outside [n, H, P]``
    (:func:`unheld_pages`)."""
    return box_scores(query, boxes).masked_fill(~outside, float("-inf"))


def with_next_pages(scores: torch.Tensor, memory_logits: torch.Tensor, memory: torch.Tensor,
                    held: torch.Tensor, *, page: int, shift: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [n, H, P]`` (:func:`page_scores`) with, per KV head, the page after the one
    holding its most attended selected position ranked first, where the memory holds nothing
    of it (its score is finite), and ``[n, H]`` bool where that was so: a model copying a
    span attends, step after step, to the position after the one it copied last, so the page
    after the memory's most attended position is the one a copy runs into when it leaves what
    the memory holds (``coverage_next``).

    Args:
        memory_logits: ``[n, H, G, C]`` the fast step's logits over the compact buffer.
        memory: ``[n, H, C]`` the positions the compact slots hold.
        held: ``[n, C]`` bool, the slots holding a selected position (not the sinks).
        shift: ``[n]`` where each row's pages start (None: at position 0).
    """
    if memory_logits.shape[-1] == 0 or scores.shape[-1] == 0:  # no slot, or no page to raise
        return scores, torch.zeros(scores.shape[:2], dtype=torch.bool, device=scores.device)
    weight = torch.logsumexp(memory_logits, dim=2).masked_fill(~held[:, None, :],
                                                               float("-inf"))  # [n, H, C]
    best = weight.argmax(dim=-1, keepdim=True)  # [n, H, 1]
    position = memory.gather(-1, best)
    if shift is not None:
        position = position + shift[:, None, None]
    following = position // page + 1  # [n, H, 1]
    exists = following < scores.shape[-1]  # past the last page: nothing to raise
    following = following.clamp(max=scores.shape[-1] - 1)
    current = scores.gather(-1, following)
    first = torch.finfo(scores.dtype).max
    raised = exists & torch.isfinite(current) & torch.isfinite(weight.gather(-1, best))
    ranked = torch.where(raised, torch.full_like(current, first), current)
    return scores.scatter(-1, following, ranked), raised[..., 0]


def copy_runs_out(memory_logits: torch.Tensor, lse: torch.Tensor, memory: torch.Tensor,
                  held: torch.Tensor, hi: torch.Tensor, *, share: float) -> torch.Tensor:
    """``[n]`` bool: rows where some query head gives more than ``share`` of its attention to
    its most attended selected position, and the memory does not hold the position after it,
    which lies in the middle region (``coverage_copy``). A model copying a span attends at each
    step to the source of the token it writes; at the next step it attends to the position
    after it, which a fast step of this memory cannot see. Flagged now, that next step is the
    row's slow step (as ``coverage_gap`` allows; never this step again, as ``coverage_retry``
    does for a page that misses now: this step's source is held).

    Args:
        memory_logits: ``[n, H, G, C]`` the fast step's logits over the compact buffer.
        lse: ``[n, H, G]`` their log-sum-exp with the recent window's.
        memory: ``[n, H, C]`` the positions the compact slots hold.
        held: ``[n, C]`` bool, the slots holding a selected position (not the sinks).
        hi: ``[n]`` where each row's recent window starts (its middle region's end).
    """
    if memory_logits.shape[-1] == 0:  # no compact slot: nothing selected to copy from
        return torch.zeros(memory_logits.shape[0], dtype=torch.bool,
                           device=memory_logits.device)
    log_share = (memory_logits - lse[..., None]).masked_fill(~held[:, None, None, :],
                                                             float("-inf"))
    best = log_share.max(dim=-1)  # [n, H, G]
    following = memory.gather(-1, best.indices) + 1  # [n, H, G]
    selected = memory.masked_fill(~held[:, None, :], -1)  # [n, H, C]
    kept = (selected[:, :, None, :] == following[..., None]).any(dim=-1)  # [n, H, G]
    runs_out = (best.values > math.log(share)) & ~kept & (following < hi[:, None, None])
    return runs_out.flatten(1).any(dim=-1)


def top_pages(scores: torch.Tensor, *, page: int, top: int, length: int | torch.Tensor,
              shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the ``top`` best of ``scores [n, H, P]`` (:func:`page_scores`) per KV
    head: ``([n, H, m * P], [n, H, m * P] bool, the real ones)`` (m = min(top, pages); where
    fewer than m pages were left to choose, the rest are not real and their positions are any
    of the row's ``length``, one for all rows or ``[n]``, one each). A page left to choose lies
    wholly inside its row's middle region, so a real page's positions lie in the cache.
    ``shift [n]``: where each row's pages start."""
    best = torch.topk(scores, min(top, scores.shape[-1]), dim=-1)  # [n, H, m]
    positions = best.indices[..., None] * page + torch.arange(page, device=scores.device)
    if shift is not None:
        positions = positions - shift[:, None, None, None]
    real = torch.isfinite(best.values).repeat_interleave(page, dim=-1)  # [n, H, m * P]
    last = length - 1 if isinstance(length, int) else (length - 1)[:, None, None, None]
    return positions.clamp(min=0).clamp(max=last).flatten(2), real


def misses(query: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor, lse: torch.Tensor, *,
           threshold: float, scale: float, softcap: float | None = None,
           heads: str = "mean") -> torch.Tensor:
    """``[n]`` bool: whether the ``chosen [n, H, N, D]`` keys (``real [n, H, N]``) would take
    more than ``threshold`` of the attention of some KV head's query heads beside the memory
    whose log-sum-exp is ``lse [n, H, G]``: of their mean (``heads="mean"``) or of any one of
    them (``"max"``)."""
    logits = attention_logits(query, chosen, scale, softcap)  # [n, H, G, N]
    logits = logits.masked_fill(~real[:, :, None, :], float("-inf"))
    share = torch.sigmoid(torch.logsumexp(logits, dim=-1) - lse)  # their weight vs the memory's
    if heads not in ("mean", "max"):
        raise ValueError(f"heads must be 'mean' or 'max', got {heads!r}")
    judged = share.amax(dim=2) if heads == "max" else share.mean(dim=2)  # [n, H]
    return (judged > threshold).any(dim=-1)
