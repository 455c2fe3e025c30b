"""The vLLM plugin's coverage probes (``sfi.core.coverage``), checked once per step.

A probe layer only keeps what its check needs while the step runs (:class:`ProbeLayer`: its fast
rows' queries, where its buffer and cache keep their keys, each row's page boxes and selection);
after the step's last layer :func:`check_probes` checks every probe layer at once: the memories'
log-sum-exp from the slots, the pages' bounds (with ``coverage_next``, the page after each KV
head's most attended selected position ranked first), the copy flags (``coverage_copy``) and the
verdict (:func:`sfi.core.coverage.missing_rows`, the transformers path's, with a reader of each
layer's paged cache). The stock kernel gives no log-sum-exp, so the memories' logits are
computed again from the slots. Done for all probe layers together, most of the small tensor
operations run once per step instead of once per probe layer (on CPU their fixed costs outweigh
their arithmetic); each layer's slot-key gather, product and best pages' read stay its own. The
flags stay where the model runs: the next step's plan reads them in its one transfer.

Shapes: L probe layers, n fast rows, H KV heads, G query heads per KV head, D head size,
P pages, S slot entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sfi.core.coverage import (
    KeyReader,
    copy_runs_out,
    missing_rows,
    page_scores,
    with_next_pages,
)
from sfi.core.kernels import attention_logits
from sfi.core.memory_tensors import MemoryTensors
from sfi.core.pages import probe_page
from sfi.vllm.paged import KeyLayout, read_blocks, read_positions


@dataclass(frozen=True)
class ProbeLayer:
    """One probe layer's part of a step's check.

    Attributes:
        query: ``[n, H, G, D]`` the fast rows' queries.
        memory_keys / cache_keys: the key halves of the layer's buffer (the rows' slots) and
            of vLLM's cache; layout: how both store a block's keys.
        boxes / outside: per fast row, its page boxes ``[1, H, P_i, 2 D]`` and the pages its
            memory holds nothing of ``[1, H, P_i]``.
        selected: per fast row, its memory's selected positions ``[H, k_i]``.
        scale / softcap: the layer's attention scale and logit cap.
    """

    query: torch.Tensor
    memory_keys: torch.Tensor
    cache_keys: torch.Tensor
    layout: KeyLayout
    boxes: tuple[torch.Tensor, ...]
    outside: tuple[torch.Tensor, ...]
    selected: tuple[torch.Tensor, ...]
    scale: float
    softcap: float | None


def check_probes(layers: Sequence[ProbeLayer], md: Any) -> torch.Tensor:
    """``[n_fast]`` bool: the fast rows of ``md``'s step (an
    :class:`~sfi.vllm.metadata.SFIMetadata`) whose memory misses pages the query bounds highly
    at some of the probe ``layers``, or (``coverage_copy``) whose copy is about to run past
    what it holds; the layers checked together where their scale, cap and shapes agree, in
    groups otherwise."""
    groups: dict[tuple[Any, ...], list[ProbeLayer]] = {}
    for layer in layers:
        key = (layer.scale, layer.softcap, tuple(layer.query.shape),
               tuple(layer.memory_keys.shape[1:]))
        groups.setdefault(key, []).append(layer)
    flagged = torch.zeros(len(md.step.fast_plans), dtype=torch.bool,
                          device=layers[0].query.device)
    for (scale, softcap, *_), group in groups.items():
        flagged |= _check(group, md, scale, softcap)
    return flagged


def _check(layers: Sequence[ProbeLayer], md: Any, scale: float,
           softcap: float | None) -> torch.Tensor:
    """``[n]`` bool: the fast rows flagged at some of ``layers``."""
    c = md.book.config
    plans = md.step.fast_plans
    nl, n = len(layers), len(plans)
    q = torch.cat([layer.query for layer in layers])  # [L n, H, G, D]
    logits = torch.cat([  # [L n, H, G, S] (a layer's slot keys, [n, H, S, D], read once)
        attention_logits(layer.query, read_blocks(layer.memory_keys, md.step.fast_blocks,
                                                  layer.layout), scale, softcap)
        for layer in layers])
    device = q.device
    lengths = torch.tensor([p.length for p in plans], device=device).repeat(nl)
    unwritten = torch.arange(logits.shape[-1], device=device) >= lengths[:, None]
    lse = torch.logsumexp(logits.masked_fill(unwritten[:, None, None], float("-inf")), -1)
    scores = _scores(layers, q.view(nl, n, *q.shape[1:]))  # [L n, H, P]
    raised = None
    if c.coverage_next or c.coverage_copy:
        selected, held, hi = _selected_slots(layers, plans, device)
        width = selected.shape[-1]
    if c.coverage_next:  # the page after the most attended selected position, read first
        scores, raised = with_next_pages(scores, logits[..., :width], selected, held,
                                         page=probe_page(c))
    rows = torch.tensor([p.row for p in plans], device=md.block_table.device)
    blocks = md.block_table.index_select(0, rows)
    found = missing_rows(q, scores, [_reader(layer, blocks) for layer in layers], lse,
                         page=probe_page(c), top=c.coverage_top,
                         threshold=c.coverage_threshold, scale=scale, softcap=softcap,
                         length=torch.tensor([p.total for p in plans], device=device),
                         raised=raised, heads=c.coverage_heads)
    if c.coverage_copy:  # flagged whatever the pages say
        found = found | copy_runs_out(logits[..., :width], lse, selected, held, hi,
                                      share=c.coverage_copy).view(nl, n).any(dim=0)
    return found


def _reader(layer: ProbeLayer, blocks: torch.Tensor) -> KeyReader:
    """The layer's :data:`sfi.core.coverage.KeyReader` of the fast rows (their ``blocks``)."""
    return lambda positions: read_positions(layer.cache_keys, blocks, positions, layer.layout)


def _scores(layers: Sequence[ProbeLayer], query: torch.Tensor) -> torch.Tensor:
    """``[L n, H, P]`` the page scores (:func:`sfi.core.coverage.page_scores`) of ``query [L, n, H,
    G, D]``, row by row over the layers (each request's boxes are its own tensors; P the most
    pages of any), -inf past a row's pages."""
    nl, n, h = query.shape[:3]
    pages = max(b.shape[2] for layer in layers for b in layer.boxes)
    scores = torch.full((nl, n, h, pages), float("-inf"), device=query.device)
    for i in range(n):
        count = max(layer.boxes[i].shape[2] for layer in layers)
        boxes = torch.cat([_pad_pages(layer.boxes[i], count) for layer in layers])
        outside = torch.cat([_pad_pages(layer.outside[i], count) for layer in layers])
        scores[:, i, :, :count] = page_scores(query[:, i], boxes, outside)  # [L, H, P_i]
    return scores.view(nl * n, h, pages)


def _pad_pages(t: torch.Tensor, count: int) -> torch.Tensor:
    """``t [1, H, P', ...]`` with ``count`` pages (zeros past P': boxes of no page, pages
    outside nothing)."""
    missing = count - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:2], missing, *t.shape[3:])], dim=2)


def _selected_slots(layers: Sequence[ProbeLayer], plans: Sequence[Any], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast rows' selected slots at each of ``layers``, as the copy and next-page rules of
    :mod:`sfi.core.coverage` read them: ``positions [L n, H, W]`` (the slots up to the last
    selected one, W = the most sinks + k of any row: sinks, then the selected positions; only
    the selected are written, -1 elsewhere, as only they are read), ``held [L n, W]`` (the
    slots holding a selected position) and ``hi [L n]`` (where each row's recent window
    starts)."""
    memories = [p.memory for p in plans]
    width = max(m.sink_count + m.k for m in memories)
    nl, n = len(layers), len(plans)
    h = layers[0].query.shape[1]
    positions = torch.full((nl, n, h, width), -1, dtype=torch.long, device=device)
    for j, layer in enumerate(layers):
        for row, memory in enumerate(memories):
            positions[j, row, :, memory.sink_count: memory.sink_count + memory.k] = \
                layer.selected[row]
    geometry = MemoryTensors.of(memories, device)
    held = geometry.selected_slots(width, geometry.sink_count).repeat(nl, 1)
    return positions.view(nl * n, h, width), held, geometry.hi.repeat(nl)
