"""What one layer's refreshes at a vLLM step select from: each refreshing request's evidence
read from the paged cache (:func:`read_refresh`: its logits where its keys lie, or its keys;
the key norms and page bounds of what was written since its last refresh), and the requests'
evidence stacked into one selection's inputs per evidence width (:func:`window_selections`,
through :func:`sfi.core.refresh_selection.selection_inputs`, as the transformers path).

Shapes: H KV heads, G query heads per KV head, D head size, T context length, W evidence
queries, k selected per head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sfi.core.kernels import attention_logits, evidence_bias, window_logits
from sfi.core.memory_tensors import MemoryTensors
from sfi.core.pages import PageSummaries
from sfi.core.refresh_selection import (
    HeldSelection,
    PreviousSelection,
    SelectionRule,
    reads_keys,
    selection_inputs,
)
from sfi.core.scorers import Evidence, Scorer, key_norms_of
from sfi.core.sequence_policy import Memory
from sfi.vllm.paged import KeyLayout, logits_in_place, read_prefix, read_range


@dataclass(frozen=True)
class RequestRefresh:
    """One request's refresh at a step, as read from the paged cache.

    Attributes:
        memory: the new memory (where its middle region lies, its k and pinned counts).
        queries: ``[W, Hq, D]`` the evidence queries, the last W positions before the keys end
            (W = 1: a decode-time slow step, its own query; W > 1: the prompt's last queries,
            as the transformers path selects at the prefill).
        keys: ``[H, T, D]`` the request's cached keys; T is where the evidence queries end.
            None where ``logits`` are given and the scorer reads no keys
            (``scores_rows_alone``).
        previous: ``[H, k']`` the positions the memory it replaces selected (its first
            ``memory.pinned`` pinned), or None for a first selection.
        key_norms: ``[H, T]`` the keys' L2 norms where the caller keeps them (None: computed
            from ``keys``).
        logits: ``[H, G, T]`` a decode-time slow step's logits where the caller computed them
            (:func:`logits_in_place`); None: computed from ``queries`` and ``keys``.
    """

    memory: Memory
    queries: torch.Tensor
    keys: torch.Tensor | None
    previous: torch.Tensor | None = None
    key_norms: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """T, the positions the refresh selects from."""
        return self.logits.shape[-1] if self.logits is not None else self.keys.shape[1]


def read_refresh(memory: Memory, queries: torch.Tensor, end: int,
                 previous: torch.Tensor | None, norms: torch.Tensor | None,
                 pages: PageSummaries | None, page: int | None, half: torch.Tensor,
                 block_row: torch.Tensor, layout: KeyLayout, read_keys: bool, scale: float,
                 softcap: float | None) -> tuple[RequestRefresh, PageSummaries | None]:
    """One request's :class:`RequestRefresh` read from the cache's keys ``half [NB, H, bs,
    D]`` (its blocks ``block_row``, stored as ``layout`` says; its keys end at ``end``), and
    its page summaries brought up to date where ``page`` is given (a probe layer's: those kept
    from its last refresh, ``pages``, or new ones).

    With one evidence query its logits are computed where the keys lie
    (:func:`logits_in_place`), and the keys are read only where that cannot be done or the
    scorer reads them (``read_keys``); else only the keys written since its last refresh are
    read, for the key norms (``norms [H, T']``, kept from its last refresh, or None: the
    refresh's ``key_norms`` are the new ones) and the page bounds.
    """
    h, d = half.shape[1], half.shape[3]
    logits = keys = None
    if queries.shape[0] == 1 and not read_keys:
        logits = logits_in_place(half, block_row, end, queries[0].view(h, -1, d), scale,
                                 softcap, layout)
    if logits is None:
        keys = read_prefix(half, block_row, end, layout)
    summaries = None if page is None else PageSummaries.kept(pages, page, length=end)
    held = 0 if norms is None or norms.shape[1] > end else norms.shape[1]
    start = min(held, end if summaries is None else summaries.reads_from)
    new = keys[:, start:] if keys is not None else read_range(half, block_row, start, end,
                                                              layout)  # [H, end - start, D]
    added = key_norms_of(new[:, held - start:])
    if summaries is not None:
        summaries.update(new[None], start=start)
    return RequestRefresh(memory, queries, keys, previous,
                          torch.cat([norms[:, :held], added], dim=1) if held else added,
                          logits), summaries


@dataclass(frozen=True)
class WindowSelection:
    """One selection's inputs (:func:`sfi.core.refresh_selection.select`) for the requests of one
    layer's refreshes that have the same number of evidence queries.

    Attributes:
        members: their indices among the layer's refreshes.
        k: ``[n]`` positions per KV head each one selects; pins: ``[n]`` its pinned slots.
        evidence: their stacked evidence (keys padded to the longest); it carries the queries
            and keys only for a scorer that reads them (not ``scores_rows_alone``).
        previous: what their replaced memories held (hysteresis, pins), or None.
    """

    members: tuple[int, ...]
    evidence: Evidence
    k: torch.Tensor
    pins: torch.Tensor
    previous: PreviousSelection | None


def window_selections(scorer: Scorer, rule: SelectionRule, layer_idx: int,
                      refreshes: Sequence[RequestRefresh], scale: float, softcap: float | None
                      ) -> list[WindowSelection]:
    """The refreshes of one layer at a step as one :class:`WindowSelection` per number of
    evidence queries (all the requests with that number at once, their keys padded to the
    longest)."""
    by_window: dict[int, list[int]] = {}
    for i, refresh in enumerate(refreshes):
        by_window.setdefault(refresh.queries.shape[0], []).append(i)
    return [_window_selection(scorer, rule, layer_idx, refreshes, tuple(members), w, scale,
                              softcap) for w, members in by_window.items()]


def _padded(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """``[n, H, length, ...]``: each ``[H, T_i, ...]`` zero-padded to ``length`` along its
    second dimension, laid out as the first (a dim-major view of keys stays one: its logits
    read the same)."""
    first = tensors[0]
    if len(tensors) == 1 and first.shape[1] == length:
        return first[None]
    n, h = len(tensors), first.shape[0]
    if first.dim() == 3 and first.stride(-1) != 1:  # a transposed view of [H, D, T]
        out = first.new_zeros(n, h, first.shape[2], length).transpose(-1, -2)
    else:
        out = first.new_zeros(n, h, length, *first.shape[2:])
    for row, t in enumerate(tensors):
        out[row, :, : t.shape[1]] = t
    return out


def _window_selection(scorer: Scorer, rule: SelectionRule, layer_idx: int,
                      refreshes: Sequence[RequestRefresh], members: tuple[int, ...], w: int,
                      scale: float, softcap: float | None) -> WindowSelection:
    """:func:`window_selections` for the ``members`` of ``refreshes``, which have ``w``
    evidence queries each."""
    group = [refreshes[i] for i in members]
    n = len(group)
    ends = [r.length for r in group]
    t = max(ends)
    given = w == 1 and all(r.logits is not None for r in group)
    keys = None
    if not given or reads_keys([scorer]):
        keys = _padded([r.keys for r in group], t)  # [n, H, T, D]
    h = group[0].logits.shape[0] if given else keys.shape[1]
    d, device = group[0].queries.shape[-1], group[0].queries.device
    q = torch.stack([r.queries.permute(1, 0, 2) for r in group])  # [n, Hq, W, D]
    end = torch.tensor(ends, device=device)
    key_pos = torch.arange(t, device=device)
    if w == 1:  # a decode-time slow step: the logits its dense attention computes
        if given:
            logits = torch.stack([F.pad(r.logits, (0, t - r.length)) for r in group])
        else:
            logits = attention_logits(q.reshape(n, h, -1, d), keys, scale, softcap)
        if min(ends) != t:
            logits = logits.masked_fill((key_pos >= end[:, None])[:, None, None, :],
                                        float("-inf"))
    else:  # the prompt's last W queries, each seeing the keys up to itself
        bias = evidence_bias(end, w, t)  # [n, W, T]
        logits = window_logits(q, keys, bias, scale, softcap)  # [n, H, G * W, T]
    memories = [r.memory for r in group]
    geometry = MemoryTensors.of(memories, device)
    norms = (_padded([r.key_norms for r in group], t)
             if all(r.key_norms is not None for r in group) else key_norms_of(keys))
    held = None
    if rule.hysteresis > 0 or any(m.pinned for m in memories):
        held = _held(group, h, device)
    evidence, previous = selection_inputs(
        logits, layer_idx, geometry.lo, geometry.hi, geometry.pinned, key_norms=norms, keys=keys,
        query=q.reshape(n, h, -1, d) if reads_keys([scorer]) else None, queries=w, held=held,
        hysteresis=rule.hysteresis > 0)
    return WindowSelection(members, evidence, geometry.k, geometry.pinned, previous)


def _held(group: Sequence[RequestRefresh], h: int, device: torch.device
          ) -> HeldSelection | None:
    """What the requests' replaced memories selected (their positions in slot order), or
    None where none had a memory."""
    if all(r.previous is None for r in group):
        return None
    held = [r.previous if r.previous is not None else torch.zeros(h, 0, dtype=torch.long,
                                                                   device=device)
            for r in group]
    counts = torch.tensor([p.shape[1] for p in held], device=device)
    return HeldSelection(_padded(held, max(p.shape[1] for p in held)),  # [n, H, k'_max]
                         torch.zeros_like(counts), counts)
