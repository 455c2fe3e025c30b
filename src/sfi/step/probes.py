"""A step's coverage probes, collected layer by layer and checked together after the step's
last layer: the one probe check of both engines (``sfi.core.coverage`` holds its maths).

Each engine hands what a probe layer saw of the rows it checks as a :class:`ProbeEvidence`:
their queries, the page scores of the pages their memories leave out (from the engine's page
summaries), a reader of the layer's cached keys, the log-sum-exp of the fast step over each
memory and, where the rule needs them (``coverage_next``, ``coverage_copy``), the fast step's
logits over the memory's sink and selected slots with the positions those slots hold. The
transformers path's fast kernel gives the log-sum-exp and logits as it runs; the vLLM plugin
computes them again from its slots (its kernel returns neither). :meth:`ProbeCheck.check`
then, per group of layers that check the same rows the same way, raises the next pages, flags
copies about to run out and gives the verdict (:func:`sfi.core.coverage.missing_rows`) with a
fixed number of small tensor operations per step instead of per probe layer (on CPU their
fixed costs outweigh their arithmetic). The flags stay where the model runs: each engine reads
them when it needs them (the transformers path after the forward, the plugin at its next
plan).

Shapes: L probe layers, n rows, H KV heads, G query heads per KV head, D head size, P pages,
W slots of a memory's sinks and selected positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.core.coverage import KeyReader, copy_runs_out, missing_rows, with_next_pages
from sfi.core.memory_tensors import MemoryTensors
from sfi.core.pages import probe_page


@dataclass(frozen=True)
class ProbeRule:
    """How a group of rows is probed (``SFIConfig``'s coverage fields): the probes' page size,
    how many of the best unheld pages they read, the attention share above which a row is
    flagged, whether the page after the most attended selected position is read too
    (``coverage_next``), the share above which a copy about to run out is flagged
    (``coverage_copy``, 0: off) and how a KV head's query heads judge (``coverage_heads``)."""

    page: int
    top: int
    threshold: float
    next_page: bool = False
    copy_share: float = 0.0
    heads: str = "mean"

    @classmethod
    def of(cls, config: Any) -> ProbeRule:
        """The rule of an ``SFIConfig`` (or anything with its coverage fields)."""
        return cls(probe_page(config), config.coverage_top, config.coverage_threshold,
                   bool(config.coverage_next), float(config.coverage_copy),
                   config.coverage_heads)

    @property
    def reads_memory_logits(self) -> bool:
        """Whether the check needs the fast step's logits over the memory's slots."""
        return self.next_page or self.copy_share > 0


@dataclass(frozen=True, eq=False)
class ProbedMemories:
    """The rows a group of probe layers checks, the same at every one of them.

    Attributes:
        rows: the engine's names of the n rows (what the verdict is reported by).
        held: ``[n, W]`` bool, the memory slots that hold a selected position (not the sinks).
        hi: ``[n]`` where each row's recent window starts (its middle region's end).
        length: where the rows' keys end: an int for all, or ``[n]``.
        shift: ``[n]`` where each row's pages start (``sfi.core.pages.page_shift``; None: at
            position 0).
    """

    rows: tuple[int, ...]
    held: torch.Tensor
    hi: torch.Tensor
    length: int | torch.Tensor
    shift: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: Sequence[int], geometry: MemoryTensors, width: int, first: torch.Tensor,
           length: int | torch.Tensor, shift: torch.Tensor | None = None) -> ProbedMemories:
        """The ``rows`` whose memories are ``geometry``, each memory's k selected slots from
        ``first [n]`` among ``width`` (:meth:`MemoryTensors.selected_slots`)."""
        return cls(tuple(rows), geometry.selected_slots(width, first), geometry.hi, length,
                   shift)


@dataclass(frozen=True)
class ProbeEvidence:
    """What L probe layers saw of the n rows of a :class:`ProbedMemories`, every tensor the L
    layers' rows one layer after another (layer i's at ``i n`` to ``(i + 1) n``).

    Attributes:
        query: ``[L n, H, G, D]`` the rows' queries.
        scores: ``[L n, H, P]`` the page scores (:func:`sfi.core.coverage.page_scores`), -inf
            for the pages a probe may not read.
        readers: L :data:`sfi.core.coverage.KeyReader`, each layer's cached keys of the rows.
        lse: ``[L n, H, G]`` the log-sum-exp of the fast step's logits over each memory.
        memory_logits: ``[L n, H, G, W]`` the fast step's logits over the memory's sink and
            selected slots (needed where :attr:`ProbeRule.reads_memory_logits`).
        memory: ``[L n, H, W]`` the positions those slots hold (only the selected are read).
        scale, softcap: the layers' attention scale and logit cap.
    """

    query: torch.Tensor
    scores: torch.Tensor
    readers: tuple[KeyReader, ...]
    lse: torch.Tensor
    memory_logits: torch.Tensor | None = None
    memory: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None


@dataclass(frozen=True)
class ProbeVerdict:
    """What a step's probes found of one group of rows: ``missed [n]`` bool, rows whose memory
    misses attention mass some probe layer's pages would take; ``copying [n]`` bool, rows whose
    copy is about to run past what their memory holds (their step was served, the next one
    needs more)."""

    memories: ProbedMemories
    missed: torch.Tensor
    copying: torch.Tensor


@dataclass
class _Group:
    rule: ProbeRule
    memories: ProbedMemories
    scale: float
    softcap: float | None
    evidence: list[ProbeEvidence] = field(default_factory=list)


class ProbeCheck:
    """A step's coverage probes: :meth:`add` as the probe layers run, :meth:`check` after the
    last one."""

    def __init__(self) -> None:
        self._groups: dict[tuple[Any, ...], _Group] = {}

    def add(self, rule: ProbeRule, memories: ProbedMemories, evidence: ProbeEvidence) -> None:
        """Keep ``evidence`` of ``memories`` (the same object at every probe layer of a
        step), checked by ``rule`` with the other layers' of the same rows and settings."""
        if rule.reads_memory_logits and (evidence.memory_logits is None
                                         or evidence.memory is None):
            raise ValueError("coverage_next and coverage_copy need the fast step's logits over "
                             "the memory's slots and the positions they hold")
        key = (rule, id(memories), evidence.scale, evidence.softcap,
               tuple(evidence.query.shape[1:]), evidence.scores.shape[-1],
               None if evidence.memory is None else evidence.memory.shape[-1])
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(rule, memories, evidence.scale,
                                               evidence.softcap)
        group.evidence.append(evidence)

    def check(self) -> list[ProbeVerdict]:
        """Every group's verdict, and forget them (a step is checked once)."""
        verdicts = [_verdict(g) for g in self._groups.values()]
        self._groups.clear()
        return verdicts


def flagged_rows(verdicts: Sequence[ProbeVerdict]) -> tuple[set[int], set[int]]:
    """``(missed, copying)``: the rows (by :attr:`ProbedMemories.rows`) the ``verdicts`` flag,
    read back to the host in one wait per group."""
    missed: set[int] = set()
    copying: set[int] = set()
    for verdict in verdicts:
        found = torch.stack([verdict.missed, verdict.copying]).tolist()
        missed.update(row for row, miss in zip(verdict.memories.rows, found[0]) if miss)
        copying.update(row for row, copy in zip(verdict.memories.rows, found[1]) if copy)
    return missed, copying


def _verdict(group: _Group) -> ProbeVerdict:
    """One group's :class:`ProbeVerdict`, its layers checked together."""
    rule, at, parts = group.rule, group.memories, group.evidence
    readers = tuple(r for part in parts for r in part.readers)
    layers, n = len(readers), len(at.rows)
    query = torch.cat([part.query for part in parts])
    lse = torch.cat([part.lse for part in parts])
    scores = torch.cat([part.scores for part in parts])
    shift = at.shift.repeat(layers) if at.shift is not None else None
    raised = None
    copying = torch.zeros(n, dtype=torch.bool, device=query.device)
    if rule.reads_memory_logits:
        logits = torch.cat([part.memory_logits for part in parts])  # type: ignore[misc]
        memory = torch.cat([part.memory for part in parts])  # type: ignore[misc]
        held = at.held.repeat(layers, 1)
        if rule.next_page:  # the page after the most attended selected position, read first
            scores, raised = with_next_pages(scores, logits, memory, held, page=rule.page,
                                             shift=shift)
        if rule.copy_share:  # flagged whatever the pages say
            copying = copy_runs_out(logits, lse, memory, held, at.hi.repeat(layers),
                                    share=rule.copy_share).view(layers, n).any(dim=0)
    missed = missing_rows(query, scores, readers, lse, page=rule.page, top=rule.top,
                          threshold=rule.threshold, scale=group.scale, softcap=group.softcap,
                          length=at.length, shift=at.shift, raised=raised, heads=rule.heads)
    return ProbeVerdict(at, missed, copying)

