"""The transformers path's coverage probes of one forward pass, collected layer by layer and
checked together when the forward ends (:func:`sfi.core.coverage.missing_rows`, the verdict
both engines share).

Shapes: n rows, H KV heads, G query heads per KV head, P pages, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.core.coverage import KeyReader, missing_rows


@dataclass
class _ProbeGroup:
    """Probe layers of one step that check the same rows the same way (the settings of
    :func:`missing_rows`), and what each of them added."""

    rows: tuple[int, ...]
    length: int
    shift: torch.Tensor | None
    page: int
    top: int
    threshold: float
    scale: float
    softcap: float | None
    heads: str
    queries: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    readers: list[KeyReader] = field(default_factory=list)
    lse: list[torch.Tensor] = field(default_factory=list)
    raised: list[torch.Tensor] = field(default_factory=list)
    copying: list[torch.Tensor] = field(default_factory=list)


class CoverageChecks:
    """The coverage probes of one forward pass in the transformers path, checked together when
    it ends.

    A probe layer scores the pages while its queries are at hand (:meth:`add`); the keys of the
    best pages, their attention share and the verdict are computed for all probe layers at once
    (:meth:`missing`), which gives the same rows as checking layer by layer with a fixed number
    of small tensor operations per step instead of per probe layer (on CPU their fixed costs
    outweigh their arithmetic). The flags only act at the rows' next step.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[Any, ...], _ProbeGroup] = {}

    def add(self, rows: tuple[int, ...], query: torch.Tensor, scores: torch.Tensor,
            read: KeyReader, lse: torch.Tensor, *,
            length: int, page: int, top: int, threshold: float, scale: float,
            softcap: float | None, shift: torch.Tensor | None = None,
            aligned: tuple[int, ...] | None = None, raised: torch.Tensor | None = None,
            copying: torch.Tensor | None = None, heads: str = "mean") -> None:
        """One probe layer's evidence: ``rows`` (the batch's indices) with their
        ``query [n, H, G, D]``, ``scores [n, H, P]`` (:func:`page_scores`), the reader of the
        layer's keys of these rows and their fast ``lse [n, H, G]``; ``length`` the cache's
        (where the keys end); ``shift [n]`` where their pages start, ``aligned`` the same as
        Python ints (None: at position 0); ``raised [n, H]`` where :func:`with_next_pages`
        ranked a page first (read beside the ``top``); ``copying [n]`` the rows
        :func:`copy_runs_out` flags (flagged whatever the pages say); ``heads`` how a KV
        head's query heads judge (:func:`sfi.core.coverage.misses`)."""
        key = (rows, page, top, threshold, scale, softcap, aligned, tuple(query.shape),
               tuple(scores.shape), length, raised is not None, copying is not None, heads)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _ProbeGroup(rows, length, shift, page, top, threshold,
                                                    scale, softcap, heads)
        group.queries.append(query)
        group.scores.append(scores)
        group.readers.append(read)
        group.lse.append(lse)
        if raised is not None:
            group.raised.append(raised)
        if copying is not None:
            group.copying.append(copying)

    def missing(self) -> tuple[set[int], set[int]]:
        """``(missed, copying)``, and forget them: the rows some probe layer found their
        memory missing mass for now, and those whose copy is about to run past what it holds
        (:func:`copy_runs_out`; their step was served, the next one needs more)."""
        missed: set[int] = set()
        copying: set[int] = set()
        for g in self._groups.values():
            found = missing_rows(torch.cat(g.queries), torch.cat(g.scores), g.readers,
                                 torch.cat(g.lse), page=g.page, top=g.top,
                                 threshold=g.threshold, scale=g.scale, length=g.length,
                                 softcap=g.softcap, shift=g.shift,
                                 raised=torch.cat(g.raised) if g.raised else None,
                                 heads=g.heads)
            ahead = torch.stack(g.copying).any(dim=0) if g.copying else torch.zeros_like(found)
            for row, miss, copy in zip(g.rows, *torch.stack([found, ahead]).tolist()):
                if miss:  # both verdicts reach the host together: one wait per group
                    missed.add(row)
                if copy:
                    copying.add(row)
        self._groups.clear()
        return missed, copying
