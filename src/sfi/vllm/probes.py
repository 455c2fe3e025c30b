"""The vLLM plugin's coverage probes (``sfi.core.coverage``), checked once per step.

A probe layer only keeps what its check needs while the step runs (:class:`ProbeLayer`: its fast
rows' queries, where its buffer and cache keep their keys, each row's page boxes and selection);
after the step's last layer :func:`check_probes` hands what they saw to the check both engines
share (:class:`sfi.step.probes.ProbeCheck`: the next pages, the copy flags and the verdict),
with what only this engine knows: the memories' logits and log-sum-exp, computed again from
the slots (the stock kernel gives neither), the pages' bounds from each request's boxes, and a
reader of each layer's paged cache. Done for all probe layers together, most of the small
tensor operations run once per step instead of once per probe layer; each layer's slot-key
gather, product and best pages' read stay its own. The flags stay where the model runs: the
next step's plan reads them in its one transfer.

Shapes: L probe layers, n probed fast rows (those no probe has flagged yet), H KV heads, G
query heads per KV head, D head size, P pages, S slot entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sfi.core.coverage import KeyReader, page_scores
from sfi.core.kernels import attention_logits
from sfi.core.memory_tensors import MemoryTensors
from sfi.step.probes import ProbeCheck, ProbedMemories, ProbeEvidence, ProbeRule
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
    """``[n]`` bool: the probed fast rows of ``md``'s step (an
    :class:`~sfi.vllm.metadata.SFIMetadata`, its ``probe_plans``) whose memory misses pages
    the query bounds highly at some of the probe ``layers``, or (``coverage_copy``) whose copy
    is about to run past what it holds (:class:`sfi.step.probes.ProbeCheck`, the transformers
    path's check); the layers checked together where their scale, cap and shapes agree, in
    groups otherwise."""
    plans = md.step.probe_plans
    device = layers[0].query.device
    width = max(p.memory.sink_count + p.memory.k for p in plans)
    geometry = MemoryTensors.of([p.memory for p in plans], device)
    memories = ProbedMemories.of(range(len(plans)), geometry, width, geometry.sink_count,
                                 torch.tensor([p.total for p in plans], device=device))
    rows = torch.tensor([p.row for p in plans], device=md.block_table.device)
    blocks = md.block_table.index_select(0, rows)
    groups: dict[tuple[Any, ...], list[ProbeLayer]] = {}
    for layer in layers:
        key = (layer.scale, layer.softcap, tuple(layer.query.shape),
               tuple(layer.memory_keys.shape[1:]))
        groups.setdefault(key, []).append(layer)
    rule = ProbeRule.of(md.book.config)
    checks = ProbeCheck()
    for group in groups.values():
        checks.add(rule, memories, _evidence(group, md, blocks, width, rule))
    flagged = torch.zeros(len(plans), dtype=torch.bool, device=device)
    for verdict in checks.check():
        flagged |= verdict.missed | verdict.copying
    return flagged


def _evidence(layers: Sequence[ProbeLayer], md: Any, blocks: torch.Tensor, width: int,
              rule: ProbeRule) -> ProbeEvidence:
    """What the probe ``layers`` (of one scale, cap and shape) saw of the step's fast rows
    (their ``blocks`` of vLLM's cache): the memories' logits read again from the slots (the
    stock kernel gives none), their log-sum-exp over each slot's written entries, the page
    scores, and where ``rule`` reads them, the logits over the first ``width`` slots (sinks,
    then the selected) and their positions."""
    plans = md.step.probe_plans
    nl, n = len(layers), len(plans)
    q = torch.cat([layer.query for layer in layers])  # [L n, H, G, D]
    logits = torch.cat([  # [L n, H, G, S] (a layer's slot keys, [n, H, S, D], read once)
        attention_logits(layer.query, read_blocks(layer.memory_keys, md.step.probe_blocks,
                                                  layer.layout), layer.scale, layer.softcap)
        for layer in layers])
    device = q.device
    lengths = torch.tensor([p.length for p in plans], device=device).repeat(nl)
    unwritten = torch.arange(logits.shape[-1], device=device) >= lengths[:, None]
    lse = torch.logsumexp(logits.masked_fill(unwritten[:, None, None], float("-inf")), -1)
    reads = rule.reads_memory_logits
    return ProbeEvidence(q, _scores(layers, q.view(nl, n, *q.shape[1:])),
                         tuple(_reader(layer, blocks) for layer in layers), lse,
                         logits[..., :width] if reads else None,
                         _selected_positions(layers, plans, width) if reads else None,
                         layers[0].scale, layers[0].softcap)


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


def _selected_positions(layers: Sequence[ProbeLayer], plans: Sequence[Any], width: int
                        ) -> torch.Tensor:
    """``[L n, H, width]`` the positions of the fast rows' first ``width`` slots at each of
    ``layers``, as the copy and next-page rules of :mod:`sfi.core.coverage` read them (sinks,
    then the selected positions; only the selected are written, -1 elsewhere, as only they are
    read)."""
    nl, n = len(layers), len(plans)
    h = layers[0].query.shape[1]
    positions = torch.full((nl, n, h, width), -1, dtype=torch.long,
                           device=layers[0].query.device)
    for j, layer in enumerate(layers):
        for row, plan in enumerate(plans):
            memory = plan.memory
            positions[j, row, :, memory.sink_count: memory.sink_count + memory.k] = \
                layer.selected[row]
    return positions.view(nl * n, h, width)
