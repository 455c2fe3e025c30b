"""The frozen plan of one forward pass of the transformers path: which rows of the batch attend
densely, which take a slow step (and the geometry of their refresh), which take a fast step
(and what they read), which probes run, with every attention bias the layers need.
:class:`sfi.hf.planner.Planner` makes a :class:`StepPlan` before the pass and commits it after;
the layers (:mod:`sfi.hf.layer_attention`) carry it out and decide nothing.

Shapes: B sequences, n rows of a subset, T cache length after this forward, W evidence queries,
C compact slots (sink + selected) per KV head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sfi.core.memory_tensors import MemoryTensors
from sfi.core.refresh_selection import SelectionGroup
from sfi.core.rows import Rows
from sfi.core.sequence_policy import DENSE, SLOW, Memory
from sfi.core.triggers import COVERAGE
from sfi.step.probes import ProbedMemories, ProbeRule


@dataclass(frozen=True)
class SlowRows:
    """The sequences refreshed in this forward, one entry per row of ``rows``.

    Attributes:
        rows: which sequences.
        memories: each row's new memory; geometry: the same as ``[n]`` tensors (the middle
            region ``[lo, hi)`` each selects from, its ``k``, its S (``sink``: the compact
            slots before the selected ones), its ``pinned`` positions per KV head and its
            left padding (``pad``: where its pages start, ``sfi.core.pages``)).
        candidates: ``[n, T]`` bool, the middle region as a mask.
        sink_positions: ``[n, S_max]`` positions of the sink entries (clamped where a row has
            fewer).
        groups: the rows that share a scorer and a selection rule.
        previous_k: ``[n]`` K of the memory this refresh replaces (0: the first selection).
        evidence_bias: ``[n, W, T]`` causal and padding bias of the last W queries of a
            multi-token forward (after prefill); None at a decode-time slow step.
        evidence_windows: each row's W there (its ``evidence_window``, at most the forward's
            queries).
    """

    rows: Rows
    memories: tuple[Memory, ...]
    geometry: MemoryTensors
    candidates: torch.Tensor
    sink_positions: torch.Tensor
    groups: tuple[SelectionGroup, ...]
    previous_k: torch.Tensor
    evidence_bias: torch.Tensor | None = None
    evidence_windows: tuple[int, ...] = ()

    @property
    def uniform_sink(self) -> int | None:
        """S when every row has the same, else None."""
        sinks = {m.sink for m in self.memories}
        return sinks.pop() if len(sinks) == 1 else None


@dataclass(frozen=True)
class FastRows:
    """The sequences that take a fast step in this forward.

    Attributes:
        rows: which sequences.
        read_start: first cache position of the recent window read in place (min over rows).
        recent_bias: ``[n, 1, 1, T - read_start]`` masks positions before each row's own
            recent start, or None when every row starts at ``read_start``.
        compact_bias: ``[n, 1, 1, C]`` masks the unused slots of the compact buffer.
    """

    rows: Rows
    read_start: int
    recent_bias: torch.Tensor | None
    compact_bias: torch.Tensor


@dataclass(frozen=True)
class ProbedRows:
    """The fast rows a group of coverage probes checks, and what every probe layer needs of them.

    Attributes:
        rows: which sequences.
        fast_index: ``[n]`` their places among the step's fast rows.
        lo: ``[n]`` where their middle regions [lo, hi) start; ``reach``: the largest ``hi``.
        memories: what the step's check (:class:`sfi.step.probes.ProbeCheck`) knows of them
            (their batch rows, the compact slots holding a selected position ``held [n, C]``,
            ``hi [n]``, where their keys end and where their pages start), one object for every
            probe layer of the group.
    """

    rows: Rows
    fast_index: torch.Tensor
    lo: torch.Tensor
    reach: int
    memories: ProbedMemories

    @property
    def held(self) -> torch.Tensor:
        return self.memories.held

    @property
    def hi(self) -> torch.Tensor:
        return self.memories.hi


@dataclass(frozen=True)
class Probe:
    """A coverage probe of one layer: the rows it checks and how (``rule``: the page size of its
    summaries, how many of the best pages outside the memory it reads, the attention share
    above which a row refreshes, ``coverage_next``, ``coverage_copy``, ``coverage_heads``;
    ``sfi.core.coverage``). ``shift [B]``: where every row's pages start
    (``sfi.core.pages.page_shift``; None: at position 0); ``aligned`` the same as Python ints, a
    key for what the layers keep between steps."""

    layer: int
    rule: ProbeRule
    target: ProbedRows
    shift: torch.Tensor | None = None
    aligned: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepPlan:
    """What every layer does in one forward pass, decided before it runs.

    ``dense`` rows attend to the whole cache without refreshing; ``slow`` rows attend densely
    and refresh their selection; ``fast`` rows read the compact buffer plus the recent window.
    ``pad_bias [B, 1, 1, T]`` masks left padding and exact mode's holes wherever a row may read
    densely (None when there are none or no row reads densely). ``compact_width`` is C, the
    compact slots the layers hold after this step. ``reasons`` holds each slow row's refresh
    reason.
    """

    query_length: int
    total_length: int
    decode: bool
    kinds: tuple[str, ...]
    reasons: tuple[str | None, ...]
    tokens: tuple[int | None, ...]
    dense: Rows
    slow: SlowRows | None
    fast: FastRows | None
    pad_bias: torch.Tensor | None
    compact_width: int
    dense_layers: tuple[int, ...] = ()
    probes: tuple[Probe, ...] = ()
    phase: str | None = None
    block_bias: torch.Tensor | None = None  # a block's [B or 1, Q, T]: causal, pads, holes
    redo: Redo | None = None  # a decode step done again (coverage_retry, retry_margin, stop_margin)
    inputs: tuple[tuple[int, ...], ...] | None = None  # a prompt's last inputs (repair_tokens)

    def outcome(self) -> tuple[tuple[str, ...], tuple[str | None, ...], dict[int, Memory]]:
        """What the step did, to commit: each row's kind and refresh reason, and the new
        memory of every slow row (a second pass's, :meth:`Redo.merged` with the first's)."""
        memories = dict(zip(self.slow.rows.indices, self.slow.memories)) if self.slow else {}
        if self.redo is None:
            return self.kinds, self.reasons, memories
        return self.redo.merged(self.kinds, self.reasons, memories)

    def probes_at(self, layer_idx: int) -> list[Probe]:
        """The coverage probes this layer runs (the fast rows they check, and how)."""
        return [probe for probe in self.probes if probe.layer == layer_idx]

    def selects_at(self, layer_idx: int) -> bool:
        """Whether a slow row refreshes its memory at ``layer_idx``: the layer is not one of
        the row's first ``dense_layers`` layers (which read densely at every step), for some
        slow row."""
        if self.slow is None:
            return False
        dense = self.dense_layers or (0,) * len(self.kinds)
        return any(dense[row] <= layer_idx for row in self.slow.rows.indices)

    def dense_at(self, layer_idx: int) -> tuple[int, ...]:
        """The slow and fast rows that read densely at ``layer_idx`` (one of their first
        ``dense_layers`` layers)."""
        return tuple(r for r, (d, kind) in enumerate(zip(self.dense_layers, self.kinds))
                     if d > layer_idx and kind != DENSE)


# Exact mode's phases (sfi.decoding.exact; None: a lossy step): a fast draft that changes no state,
# a dense verify of the drafts (slow where a refresh is due), a dense step where drafts cannot pay
DRAFT, VERIFY, DENSE_STEP = "draft", "verify", "dense-step"
# A repairing slow step (SFIConfig.repair_tokens, sfi.decoding.decode_step): the drifted positions
# before the step and the step's own input, one dense block; the step is a decode step as
# planned, its fast rows read densely too
REPAIR = "repair"
PHASES: tuple[str | None, ...] = (None, DRAFT, VERIFY, DENSE_STEP, REPAIR)
# one dense block (sfi.core.kernels.block_attention)
BLOCK_PHASES: tuple[str, ...] = (VERIFY, REPAIR)


@dataclass(frozen=True)
class Redo:
    """A decode step done again at once: ``first`` is the plan that ran, ``flagged`` the fast
    rows done again (their coverage probes found their memory missing attention mass,
    ``SFIConfig.coverage_retry``, or their next token was uncertain, ``retry_margin``, or would
    end the text, ``stop_margin``: those done again for their next token alone keyed in
    ``reasons`` by their refresh reason, ``margin`` or ``stop``), ``missed`` every row the
    probes flagged (a row whose coverage refresh is not due yet keeps its flag, as without the
    redo). In the second pass the flagged rows take a slow step (reason ``coverage``, or their
    ``reasons`` entry); the first pass's slow rows, whose refresh is in place already, attend
    densely (what their slow step computed); every other row does what it did, with the same
    result."""

    first: StepPlan
    flagged: frozenset[int]
    missed: frozenset[int] = frozenset()
    reasons: Mapping[int, str] = field(default_factory=dict)

    def kinds(self) -> tuple[list[str], list[str | None]]:
        """Each row's kind and refresh reason in the second pass."""
        slow = set(self.first.slow.rows.indices) if self.first.slow else set()
        kinds, reasons = [], []
        for row, kind in enumerate(self.first.kinds):
            if row in self.flagged:
                kinds.append(SLOW)
                reasons.append(self.reasons.get(row, COVERAGE))
            else:
                kinds.append(DENSE if row in slow else kind)
                reasons.append(None)
        return kinds, reasons

    def merged(self, kinds: tuple[str, ...], reasons: tuple[str | None, ...],
               memories: dict[int, Memory]) -> tuple[tuple[str, ...], tuple[str | None, ...],
                                                     dict[int, Memory]]:
        """The step as it counts, from the second pass's ``kinds``, ``reasons`` and slow rows'
        ``memories``: the first pass's slow rows slow again, with their reasons and memories."""
        kinds, reasons, memories = list(kinds), list(reasons), dict(memories)
        first = self.first
        if first.slow is not None:
            for row, memory in zip(first.slow.rows.indices, first.slow.memories):
                kinds[row], reasons[row], memories[row] = SLOW, first.reasons[row], memory
        return tuple(kinds), tuple(reasons), memories
