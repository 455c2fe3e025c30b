"""Pages of the cache: runs of ``page`` positions that Quest, the coverage probes and paged
selection treat as units.

Pages start at each sequence's first token, so that a sequence left-padded in a batch is cut into
the same pages as when it runs alone: page p of a row holds positions
``[p * page - shift, (p + 1) * page - shift)``, ``shift = (-pad) % page``.

Shapes: B rows, H KV heads, T positions, D head size, P pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def page_shift(pads: torch.Tensor, page: int) -> torch.Tensor | None:
    """``[B]`` how far page 0 of each row reaches before the cache's position 0, so that its
    pages start at the row's first token (``pads [B]`` positions of left padding): page p
    holds positions ``[p * page - shift, (p + 1) * page - shift)``. None when every shift is
    0 (pages aligned at position 0)."""
    shift = (-pads) % page
    return shift if bool(shift.any()) else None


def page_shifts(pads: Sequence[int], page: int) -> tuple[int, ...] | None:
    """:func:`page_shift` of ``pads`` given as Python ints (what a plan keys its page
    summaries by, read without the device): None when every shift is 0."""
    shift = tuple(-pad % page for pad in pads)
    return shift if any(shift) else None


def page_count(length: int, page: int, shift: torch.Tensor | None = None) -> int:
    """Pages that cover ``length`` positions, every row's shift included."""
    reach = length + (int(shift.max()) if shift is not None else 0)
    return -(-reach // page)


def page_bounds(keys: torch.Tensor, page: int, shift: torch.Tensor | None = None,
                first: int = 0, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys [B, H, T, D]`` -> element-wise (min, max) of pages ``first`` to P - 1, each
    ``[B, H, P - first, D]`` (P = :func:`page_count`; a page's positions outside [0, T) are
    left out; ``shift [B]`` as :func:`page_shift`, None: pages aligned at position 0).
    ``start``: the keys are positions ``start`` to ``start + T`` (pages aligned at 0 only, and
    ``start <= first * page``)."""
    if start and (shift is not None or start > first * page):
        raise ValueError(f"page_bounds: keys from position {start} cannot summarise page "
                         f"{first} (from {first * page}) or shifted pages")
    t = keys.shape[-2]
    if shift is None:
        k = keys[:, :, first * page - start:].float()
        pad = (-k.shape[-2]) % page
        low = F.pad(k, (0, 0, 0, pad), value=float("inf")).unflatten(-2, (-1, page)).amin(-2)
        high = F.pad(k, (0, 0, 0, pad), value=float("-inf")).unflatten(-2, (-1, page)).amax(-2)
        return low, high
    b, h, _, d = keys.shape
    virtual = torch.arange(first * page, page_count(t, page, shift) * page, device=keys.device)
    positions = virtual[None, :] - shift[:, None]  # [B, V]
    outside = ((positions < 0) | (positions >= t))[:, None, :, None]
    index = positions.clamp(0, t - 1)[:, None, :, None].expand(b, h, -1, d)
    k = keys.gather(2, index).float()
    low = k.masked_fill(outside, float("inf")).unflatten(2, (-1, page)).amin(3)
    high = k.masked_fill(outside, float("-inf")).unflatten(2, (-1, page)).amax(3)
    return low, high


def page_boxes(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``[..., P, 2 D]`` each page's box from its bounds ``low``, ``high`` ``[..., P, D]``: its
    centre ``(high + low) / 2`` then its radius ``(high - low) / 2``, side by side, so that a
    bound on ``q . k`` reads one tensor (``sfi.core.scorers.quest.box_scores``)."""
    return torch.cat([(high + low) / 2, (high - low) / 2], dim=-1)


def pages_of(length: int, page: int, shift: torch.Tensor | None, b: int,
             device: torch.device) -> torch.Tensor:
    """``[B, T]`` the page that holds each position of each row."""
    positions = torch.arange(length, device=device)[None, :].expand(b, length)
    return positions // page if shift is None else (positions + shift[:, None]) // page


@dataclass
class PageSummaries:
    """The pages' key bounds of a growing cache, kept up to date incrementally: each
    :meth:`update` summarises only the pages that hold positions written since the last.

    Attributes:
        page: the page size; shift: the rows' shifts (:func:`page_shift`) as Python ints, None
            where pages start at position 0.
        done: positions summarised; count: pages filled (``[:, :, :count]`` of the tensors).
        low, high: ``[B, H, room, D]`` (float32) each page's element-wise min and max key;
        boxes: ``[B, H, room, 2 D]`` their :func:`page_boxes`. None until the first update.
    """

    page: int
    shift: tuple[int, ...] | None = None
    done: int = 0
    count: int = 0
    low: torch.Tensor | None = None
    high: torch.Tensor | None = None
    boxes: torch.Tensor | None = None

    def matches(self, page: int, shift: tuple[int, ...] | None) -> bool:
        """Whether these summaries cut the cache into the same pages."""
        return self.page == page and self.shift == shift

    @classmethod
    def kept(cls, previous: PageSummaries | None, page: int,
             shift: tuple[int, ...] | None = None, length: int | None = None) -> PageSummaries:
        """``previous`` where it cuts the cache into the same pages and has summarised at most
        ``length`` positions (the cache's now; None: any), else new summaries: what both
        engines keep between refreshes and probes (the slab per layer, the vLLM plugin per
        request and layer)."""
        if previous is None or not previous.matches(page, shift) or (
                length is not None and previous.done > length):
            return cls(page, shift)
        return previous

    @property
    def reads_from(self) -> int:
        """The first position :meth:`update` reads: the start of the page partial at
        :attr:`done`."""
        return self.done // self.page * self.page

    def forget_after(self, length: int) -> None:
        """The cache was cut back to ``length`` positions: summarise from there again."""
        self.done = min(self.done, length)

    def update(self, keys: torch.Tensor, shift: torch.Tensor | None = None,
               capacity: int = 0, start: int = 0) -> PageSummaries:
        """Summarise ``keys [B, H, T', D]`` (the cache's positions ``start`` to ``T = start +
        T'``; ``shift [B]``, the tensor of :attr:`shift`): the page that was partial at
        :attr:`done` and those after it (``start`` must not lie past that page's first
        position); nothing when ``T <= done``. When the tensors grow, they make room for the
        pages of ``capacity`` positions (the cache's own room) and one more."""
        t = start + keys.shape[-2]
        if self.low is not None and self.done >= t:
            return self
        count = page_count(t, self.page, shift)
        first = self.done // self.page
        if self.low is None or self.low.shape[2] < count:
            b, h, _, d = keys.shape
            size = max(count, page_count(capacity, self.page, shift) + 1 if capacity else 0)
            low = keys.new_full((b, h, size, d), float("inf"), dtype=torch.float32)
            high = torch.full_like(low, float("-inf"))
            boxes = low.new_zeros(b, h, size, 2 * d)
            if self.low is not None:  # grown: keep what was summarised
                for new, old in ((low, self.low), (high, self.high), (boxes, self.boxes)):
                    new[:, :, :first] = old[:, :, :first]
            self.low, self.high, self.boxes = low, high, boxes
        new_low, new_high = page_bounds(keys, self.page, shift, first, start)
        self.low[:, :, first:count] = new_low
        self.high[:, :, first:count] = new_high
        self.boxes[:, :, first:count] = page_boxes(new_low, new_high)
        self.done, self.count = t, count
        return self


DEFAULT_PAGE = 16


def probe_page(config: Any) -> int:
    """The page size of a configuration's coverage probes (its key boxes): its ``page_size``
    where pages are on, else :data:`DEFAULT_PAGE`."""
    return config.page_size if config.page_size > 1 else DEFAULT_PAGE
