"""Quest (Tang et al. 2024) as a scorer: query-aware page bounds from min/max keys.

The cache is cut into pages of ``page`` tokens (aligned at each sequence's first token, so that a
left-padded sequence in a batch gets the pages it gets alone); each page keeps the
element-wise min m and max M of its keys. A query q bounds every q.k inside a page by
sum_d max(q_d m_d, q_d M_d). Every position scores its page's bound, so top-K keeps whole pages.
With grouped heads, the bounds of the G query heads sharing a KV head (their last evidence
query each) are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfi.core.pages import page_bounds, page_boxes, page_shift, pages_of
from sfi.core.scorers import Evidence
from sfi.errors import SFIError


def bound_scores(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``query [B, H, G, D]`` and page bounds ``[B, H, P, D]`` -> ``[B, H, P]``, the upper bound
    of q.k in each page summed over the G query heads (see :func:`box_scores`)."""
    return box_scores(query, page_boxes(low, high))


def box_scores(query: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """:func:`bound_scores` from the pages' ``boxes [B, H, P, 2 D]``
    (:func:`sfi.core.pages.page_boxes`: centre, then radius).

    ``max(q m, q M) = q (m + M) / 2 + |q| (M - m) / 2`` per channel, so the sum over the G
    heads is one matrix-vector product per page against ``[sum_g q, sum_g |q|]``, over centres
    and radii side by side (no [G, P, D] intermediate). On CPU one ``torch.mv`` per row and
    head, because ``einsum``'s batched product streams boxes that are out of cache at about
    half the speed there; elsewhere one ``einsum``. A ranking, not differentiated (``query`` is
    detached)."""
    q = query.detach().float()
    both = torch.cat([q.sum(dim=2), q.abs().sum(dim=2)], dim=-1)  # [B, H, 2 D]
    if boxes.device.type != "cpu":
        return torch.einsum("bhpe,bhe->bhp", boxes, both)
    out = boxes.new_empty(boxes.shape[:3])
    for b in range(boxes.shape[0]):
        for h in range(boxes.shape[1]):
            torch.mv(boxes[b, h], both[b, h], out=out[b, h])
    return out


@dataclass(frozen=True)
class QuestScorer:
    page: int = 16

    def __post_init__(self) -> None:
        if self.page < 1:
            raise ValueError(f"page must be >= 1, got {self.page}")

    def score(self, evidence: Evidence) -> torch.Tensor:
        if evidence.query is None or evidence.keys is None:
            raise SFIError("the Quest scorer needs the evidence queries and the cached keys")
        b, h, rows, d = evidence.query.shape
        w = evidence.queries
        last = evidence.query.reshape(b, h, rows // w, w, d)[:, :, :, -1]  # [B, H, G, D]
        shift = page_shift(evidence.pads, self.page) if evidence.pads is not None else None
        low, high = page_bounds(evidence.keys, self.page, shift)
        per_page = bound_scores(last, low, high)  # [B, H, P]
        page_index = pages_of(evidence.keys.shape[-2], self.page, shift, b, per_page.device)
        return per_page.gather(-1, page_index[:, None, :].expand(b, h, -1))
