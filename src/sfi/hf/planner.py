"""The transformers path's batch plan: what each forward pass does, for every row of a batch.

The sequence policy (memories, decisions, what a step records) is :mod:`sfi.core.sequence_policy`,
shared with the vLLM plugin; this module turns it into the tensors a padded batch needs.

Before a forward pass, :meth:`Planner.plan` turns the sequences' state and the new input tokens
into a frozen :class:`StepPlan`: which rows attend densely (short contexts, prefill without a
budget, full-attention sequences), which take a **slow** step and refresh their selection, and
which take a **fast** step; the geometry of every refresh; and every attention bias the layers
need. Planning reads the state and changes nothing. After the pass, :meth:`Planner.commit`
applies the plan (new geometry, counters, triggers) and records the statistics of what the step
actually did (a fast row whose rebuild was not ready read some layers densely).

Shapes: B sequences, n rows of a subset, T cache length after this forward, W evidence queries,
C compact slots (sink + selected) per KV head.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch

from sfi.core.config import SFIConfig
from sfi.core.coverage import probe_layers
from sfi.core.kernels import additive_bias, evidence_bias
from sfi.core.memory_tensors import MemoryTensors
from sfi.core.pages import page_shifts
from sfi.core.refresh_selection import SelectionGroup, SelectionRule
from sfi.core.rows import Rows
from sfi.core.scorers import Scorer
from sfi.core.sequence_policy import (
    DENSE,
    FAST,
    LAGGED,
    SLOW,
    SequenceState,
    decode_decision,
    fast_read_fraction,
    keep_inputs,
    next_memory,
    prompt_decision,
    record_step,
    repair_span,
    sparse_pays,
)
from sfi.core.triggers import BOOTSTRAP, MARGIN, STOP, RefreshTrigger
from sfi.errors import SFIError
from sfi.hf.plan import (
    BLOCK_PHASES,
    DENSE_STEP,
    DRAFT,
    PHASES,
    REPAIR,
    VERIFY,
    FastRows,
    Probe,
    ProbedRows,
    Redo,
    SlowRows,
    StepPlan,
)
from sfi.hf.visibility import block_bias, dense_bias, visible_slots
from sfi.notices import notice_once
from sfi.step.probes import ProbedMemories, ProbeRule

TriggerFactory = Callable[[SFIConfig, int], RefreshTrigger]
ScorerFactory = Callable[[SFIConfig], Scorer]


class Planner:
    """The sequences of one batch and the decisions of each step.

    ``compact_width`` (C) only grows: it is the widest sink + K any refresh has needed.
    """

    def __init__(self, layer_ids: Sequence[int] = (), stops: Collection[int] = ()) -> None:
        self.sequences: list[SequenceState] = []
        self.compact_width = 0
        self.layer_ids = tuple(layer_ids)
        self.stops = frozenset(stops)  # the model's end-of-sequence ids (stop_margin)

    def start(self, pads: Sequence[int], config: SFIConfig, trigger: TriggerFactory,
              scorer: Scorer, dense_only: bool, weight_positions: int = 0) -> None:
        """Begin a batch whose rows have ``pads`` padding tokens each (W: sfi.core.cost_model)."""
        self.sequences = [SequenceState(int(p), config, trigger(config, row), scorer, dense_only,
                                        weight_positions=weight_positions)
                          for row, p in enumerate(pads)]
        self.compact_width = config.sink

    # --- planning ---------------------------------------------------------------------------
    def plan(self, tokens: Sequence[int | None], query_length: int, past: int,
             device: torch.device, may_lag: bool = False, select: bool = True,
             phase: str | None = None, redo: Redo | None = None,
             inputs: Sequence[Sequence[int]] | None = None) -> StepPlan:
        """Decide, per sequence, whether this forward is dense, slow or fast.

        ``tokens`` are the last input token of each row (what the triggers observe);
        ``may_lag`` says that a fast row may find its rebuild not ready and read densely (an
        asynchronous rebuilder), so the padding bias is needed even without dense rows;
        ``select=False`` makes a multi-token forward dense without a selection (a prompt chunk
        that more chunks follow). ``phase``: exact mode's (:data:`PHASES`; a verify's memory
        is laid out at its first position), or ``REPAIR``: a decode step whose input is the
        block's last token, decided as a one-token step, its refreshes' evidence that token's
        query alone (:meth:`repair_length`). ``redo``: this decode step runs again, its rows'
        kinds set by :meth:`Redo.kinds` (no probe runs: the rows still fast were checked).
        ``inputs``: each row's last input tokens of a prompt's forward, what a repair may
        re-run later (``repair_tokens``; None: not kept).
        """
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        total = past + query_length
        decode = (query_length == 1 or phase == REPAIR) and past > 0
        memory_total = past + 1 if phase == VERIFY else total
        if redo is not None:
            kinds, reasons = redo.kinds()
        else:
            decided = [self._decide(seq, token, total, memory_total, decode, select, phase)
                       for seq, token in zip(self.sequences, tokens)]
            kinds, reasons = [k for k, _ in decided], [r for _, r in decided]
        slow_rows = [r for r, k in enumerate(kinds) if k == SLOW]
        if phase is None and decode and slow_rows and self.repairs and \
                self._repair_bounds([k == SLOW for k in kinds], total)[1]:
            notice_once("repair_tokens: a slow step ran without re-running the positions "
                        "before it; only sfi's decode loops (sfi.generate, the server, "
                        "sfi.decoding.decode_step.decode_one) run them, not model.generate")
        fast_rows = [r for r, k in enumerate(kinds) if k == FAST]
        dense_rows = [r for r, k in enumerate(kinds) if k == DENSE]
        slow = self._plan_slow(slow_rows, total, query_length, device, memory_total,
                               evidence_queries=1 if phase == REPAIR else query_length)
        width = self.compact_width
        if slow is not None:
            width = max(width, max(m.sink + m.k for m in slow.memories))
        fast = self._plan_fast(fast_rows, total, width, device)
        reads_densely = bool(dense_rows or slow_rows) or (
            bool(fast_rows) and (may_lag or any(s.config.dense_layers for s in self.sequences)))
        return StepPlan(query_length=query_length, total_length=total, decode=decode,
                        kinds=tuple(kinds), reasons=tuple(reasons), tokens=tuple(tokens),
                        dense=self._rows(dense_rows, device), slow=slow, fast=fast,
                        pad_bias=dense_bias(self.sequences, total, device)
                        if reads_densely else None,
                        compact_width=width,
                        dense_layers=tuple(s.config.dense_layers for s in self.sequences),
                        probes=self._probes(fast_rows, width, total, device)
                        if phase is None and redo is None else (),
                        phase=phase,
                        block_bias=block_bias(self.sequences, total, query_length, device)
                        if phase in BLOCK_PHASES else None, redo=redo,
                        inputs=tuple(tuple(row) for row in inputs) if inputs is not None
                        else None)

    @staticmethod
    def _decide(seq: SequenceState, token: int | None, total: int, memory_total: int,
                decode: bool, select: bool, phase: str | None) -> tuple[str, str | None]:
        """One row's kind and refresh reason for this forward."""
        if phase == DRAFT:
            return (FAST if seq.memory is not None and sparse_pays(seq, total) else DENSE), None
        if phase == DENSE_STEP:
            return DENSE, None
        if phase == VERIFY:
            if not sparse_pays(seq, memory_total):
                return DENSE, None
            due = BOOTSTRAP if seq.memory is None else seq.refresh_due
            return (SLOW, due) if due is not None else (DENSE, None)
        if decode:
            return decode_decision(seq, token, total)
        return prompt_decision(seq, total, select)

    def _probes(self, fast_rows: list[int], width: int, total: int, device: torch.device
                ) -> tuple[Probe, ...]:
        """Which fast rows each probe layer checks, and how."""
        groups: dict[tuple[ProbeRule, int, int], list[int]] = {}
        for row in fast_rows:
            c = self.sequences[row].config
            # a row already flagged refreshes as soon as its gap allows: probing it again
            # cannot change that
            if c.coverage_layers and not self.sequences[row].coverage_miss:
                groups.setdefault((ProbeRule.of(c), c.coverage_layers, c.dense_layers),
                                  []).append(row)
        probes = []
        pads = [seq.pad for seq in self.sequences]
        for (rule, layers, dense), rows in groups.items():
            aligned = page_shifts(pads, rule.page)
            shift = torch.tensor(aligned, device=device) if aligned else None
            memories = [self.sequences[r].memory for r in rows]
            geometry = MemoryTensors.of(memories, device)
            target = ProbedRows(
                self._rows(rows, device),
                torch.tensor([fast_rows.index(r) for r in rows], device=device),
                geometry.lo, max(m.recent_start for m in memories),
                ProbedMemories.of(rows, geometry, width, geometry.sink, total,
                                  shift[rows] if shift is not None else None))
            for layer in probe_layers(layers, self.layer_ids, dense):  # none the rows read densely
                probes.append(Probe(layer, rule, target, shift, aligned))
        return tuple(probes)

    def _rows(self, indices: list[int], device: torch.device) -> Rows:
        return Rows(tuple(indices), len(self.sequences), device)

    def _plan_slow(self, rows: list[int], total: int, query_length: int,
                   device: torch.device, memory_total: int | None = None,
                   evidence_queries: int | None = None) -> SlowRows | None:
        """The refreshes of ``rows``: memories laid out at cache length ``memory_total``
        (default ``total``; a verify's first position), evidence over ``total`` keys from at
        most the forward's last ``evidence_queries`` queries (default all of them)."""
        if not rows:
            return None
        seqs = [self.sequences[r] for r in rows]
        memories = tuple(next_memory(s, memory_total or total) for s in seqs)
        s_max = max(m.sink for m in memories)
        sinks = [[min(m.pad + j, max(m.sink_end - 1, m.pad)) for j in range(s_max)]
                 for m in memories]
        geometry = MemoryTensors.of(memories, device)
        positions = torch.arange(total, device=device)[None, :]
        candidates = (positions >= geometry.lo[:, None]) & (positions < geometry.hi[:, None])
        if any(s.holes for s in seqs):  # holes are never candidates (padding lies before lo)
            candidates = candidates & visible_slots(seqs, total, device)
        bias, windows = None, []
        if query_length > 1:  # the last W queries of every row (all end at ``total``), each
            # seeing the keys from the row's first real token up to itself if it is among the
            # row's own last W_b queries (a padding query, or one outside the window: none)
            queries = evidence_queries or query_length
            windows = [min(s.config.evidence_window, queries) for s in seqs]
            bias = evidence_bias(torch.full((len(rows),), total, device=device), max(windows),
                                 total, starts=geometry.pad,
                                 windows=torch.tensor(windows, device=device))
        return SlowRows(
            rows=self._rows(rows, device), memories=memories, geometry=geometry,
            candidates=candidates,
            sink_positions=torch.tensor(sinks, dtype=torch.long, device=device),
            groups=_selection_groups(seqs, device),
            previous_k=torch.tensor([s.memory.k if s.memory is not None else 0 for s in seqs],
                                    device=device),
            evidence_bias=bias, evidence_windows=tuple(windows))

    def _plan_fast(self, rows: list[int], total: int, width: int,
                   device: torch.device) -> FastRows | None:
        if not rows:
            return None
        memories = [self.sequences[r].memory for r in rows]
        starts = [m.recent_start for m in memories]
        read_start = min(starts)
        recent_bias = None
        seqs = [self.sequences[r] for r in rows]
        visible = visible_slots(seqs, total, device) if any(s.holes for s in seqs) else None
        if max(starts) != read_start or visible is not None:
            positions = torch.arange(read_start, total, device=device)
            allowed = positions[None, :] >= torch.tensor(starts, device=device)[:, None]
            if visible is not None:
                allowed = allowed & visible[:, read_start:]
            recent_bias = additive_bias(allowed)[:, None, None, :]
        geometry = MemoryTensors.of(memories, device)
        slot = torch.arange(width, device=device)[None, :]
        valid = (slot < geometry.sink_count[:, None]) | geometry.selected_slots(width,
                                                                                geometry.sink)
        compact_bias = additive_bias(valid)[:, None, None, :]
        return FastRows(self._rows(rows, device), read_start, recent_bias, compact_bias)

    @property
    def repairs(self) -> bool:
        """Whether a row of the batch repairs its slow steps (``repair_tokens``)."""
        return any(seq.config.repair_tokens for seq in self.sequences)

    def repair_length(self, tokens: Sequence[int | None], total: int) -> int:
        """How many positions before a one-token decode step with inputs ``tokens`` at cache
        length ``total`` (this step's included) the step re-runs first, densely, for the whole
        batch (``SFIConfig.repair_tokens``): where a row's step is slow, the longest
        :func:`repair_span` of all rows (every row re-runs the block, so every row's drift is
        repaired with it), at most the inputs every row has kept; 0: a plain step."""
        if not self.repairs:
            return 0
        span, length = self._repair_bounds([decode_decision(seq, token, total)[0] == SLOW
                                            for seq, token in zip(self.sequences, tokens)],
                                           total)
        if length < span:
            notice_once("repair_tokens: a repair re-ran fewer positions than drifted, as far "
                        "as every row of the batch allows (the inputs it kept, the recent "
                        "window of a row not refreshing)")
        return length

    def _repair_bounds(self, slow: Sequence[bool], total: int) -> tuple[int, int]:
        """``(span, length)`` for each row's ``slow`` decision: the longest drift a repair
        would re-run (0 where no row is slow) and how much of it every row allows."""
        seqs = self.sequences
        span = max(repair_span(seq) for seq in seqs) if any(slow) else 0
        if not span:
            return 0, 0
        # every row re-runs the block: it needs each row's inputs, and must stay inside the
        # recent window of a row that does not refresh (its compact copies of older
        # positions stay as they are)
        kept = min(len(seq.inputs) for seq in seqs)
        recent = [total - 1 - seq.memory.recent_start for seq, refreshes in zip(seqs, slow)
                  if seq.memory is not None and not refreshes]
        return span, min(span, kept, *recent)

    # --- after the step ---------------------------------------------------------------------
    def commit(self, plan: StepPlan, lagged: dict[int, int], layers: Sequence[int],
               missed: Collection[int] = ()) -> None:
        """Apply ``plan`` once its forward has run. ``layers`` are the model indices of the
        slow-fast layers; ``lagged[row]`` counts those at which a fast row read densely because
        its rebuild was not ready; ``missed`` rows' memories lack a page a probe wanted. A
        step's second pass (``plan.redo``) is committed as the whole step
        (:meth:`Redo.merged`), with the first pass's flags."""
        if plan.phase in (DRAFT, DENSE_STEP):  # exact mode records these (sfi.decoding.exact)
            return
        redo = plan.redo
        if redo is not None:
            missed = set(missed) | redo.missed
        kinds, reasons, slow_memories = plan.outcome()
        probed = Counter(row for probe in (redo.first if redo is not None else plan).probes
                         for row in probe.target.rows.indices)  # probe layers per row
        repaired = plan.query_length - 1 if plan.phase == REPAIR else 0
        if not plan.decode:
            for row, seq in enumerate(self.sequences):  # the real tokens of each row
                real = min(plan.query_length, plan.total_length - seq.pad)
                kept = plan.inputs[row] if plan.inputs is not None and real > 0 else None
                keep_inputs(seq, kept[max(0, len(kept) - real):] if kept else None)
        for row, (seq, kind) in enumerate(zip(self.sequences, kinds)):
            read = None
            if plan.decode and kind == FAST:  # a repair's fast rows read the block densely
                read = 1.0 if repaired else fast_read_fraction(seq, plan.total_length, layers,
                                                               lagged.get(row, 0), probed[row])
            record_step(seq, kind, decode=plan.decode, token=plan.tokens[row],
                        memory=slow_memories.get(row), reason=reasons[row], read=read,
                        lagged=row in lagged or bool(repaired), repaired=repaired)
            if kind != SLOW and row in missed:
                seq.coverage_miss = True
        widths = (plan.compact_width, redo.first.compact_width if redo is not None else 0)
        self.compact_width = max(widths)

    def redo_rows(self, plan: StepPlan, missed: Collection[int],
                  logits: torch.Tensor | None = None) -> tuple[frozenset[int], dict[int, str]]:
        """The rows of a decode step ``plan`` to do again at once (:class:`Redo`), and the
        refresh reason of those done again for their next token alone: fast rows whose probes
        flagged their memory, whose configuration asks for it (``coverage_retry``) and whose
        coverage refresh is due (``coverage_gap``); fast rows whose next token was uncertain
        (``retry_margin``: reason ``margin``) or would end the text with too small a lead
        (``stop_margin``: reason ``stop``), from the step's output ``logits [B, Q, V]``, the
        last position's; a row whose input is an end-of-sequence id already (a batch keeps
        decoding its ended rows) is not checked again."""
        if plan.phase is not None or not plan.decode:
            return frozenset(), {}
        seqs = self.sequences
        flagged = frozenset(row for row in missed if plan.kinds[row] == FAST
                            and seqs[row].config.coverage_retry
                            and seqs[row].steps_since_refresh + 1
                            >= seqs[row].config.coverage_gap)
        asks = [row for row, kind in enumerate(plan.kinds)
                if kind == FAST and row not in flagged
                and (seqs[row].config.retry_margin > 0
                     or (seqs[row].config.stop_margin > 0 and self.stops))]
        if not asks:
            return flagged, {}
        if logits is None or logits.dim() != 3:
            asking = [f for f in ("retry_margin", "stop_margin")
                      if any(getattr(seqs[row].config, f) for row in asks)]
            raise SFIError(f"{' and '.join(asking)} needs the model's output logits [batch, "
                           "positions, vocabulary] after each step (a causal LM returning "
                           ".logits)")
        last = logits[asks, -1]
        margins, tops = (t.tolist() for t in top_margin(last))
        reasons: dict[int, str] = {}
        for row, margin, top in zip(asks, margins, tops):
            config = seqs[row].config
            if margin < config.retry_margin:
                reasons[row] = MARGIN
            elif (top in self.stops and plan.tokens[row] not in self.stops  # not ended already
                  and (margin < config.stop_margin or config.stop_margin >= 1)):
                reasons[row] = STOP
        return flagged | frozenset(reasons), reasons

    def executed_kinds(self, plan: StepPlan, lagged: dict[int, int]) -> tuple[str, ...]:
        """Per row, what the step did: ``plan.kinds`` (a redone step's merged kinds) with
        lagging fast rows, and a repair's fast rows, as ``lagged``."""
        return tuple(LAGGED if kind == FAST and (row in lagged or plan.phase == REPAIR)
                     else kind for row, kind in enumerate(plan.outcome()[0]))

    # --- continuous batching ----------------------------------------------------------------
    def shift(self, amount: int) -> None:
        """Every sequence gains ``amount`` more positions of left padding."""
        for seq in self.sequences:
            seq.pad += amount
            seq.holes = [h + amount for h in seq.holes]
            if seq.memory is not None:
                m = seq.memory
                seq.memory = replace(m, pad=m.pad + amount, sink_end=m.sink_end + amount,
                                     recent_start=m.recent_start + amount)

    def absorb(self, other: Planner) -> None:
        """Append ``other``'s sequences (already shifted to this batch's alignment)."""
        self.sequences = self.sequences + other.sequences
        self.compact_width = max(self.compact_width, other.compact_width)

    def keep(self, rows: Sequence[int]) -> int:
        """Keep the sequences ``rows`` (in that order); return the padding they all share,
        which the caller trims from the cache (and which is taken off their positions)."""
        self.sequences = [self.sequences[r] for r in rows]
        trim = min(seq.pad for seq in self.sequences)
        self.shift(-trim)
        return trim


def top_margin(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(margin [n], top [n])``: how much more probability the softmax of ``logits [n, V]``
    gives its most likely token than the second (1 for a vocabulary of one), and that token,
    from one pass over the vocabulary."""
    if logits.shape[-1] < 2:
        return (logits.new_ones(logits.shape[0], dtype=torch.float32),
                torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
    best = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1)
    return best.values[:, 0] - best.values[:, 1], best.indices[:, 0]


def _selection_groups(seqs: Sequence[SequenceState], device: torch.device
                      ) -> tuple[SelectionGroup, ...]:
    """Group the slow rows by scorer object and selection rule: one group in the usual case."""
    groups: dict[tuple[int, SelectionRule], tuple[Scorer, list[int]]] = {}
    for local, seq in enumerate(seqs):
        rule = SelectionRule.of(seq.config)
        groups.setdefault((id(seq.scorer), rule), (seq.scorer, []))[1].append(local)
    n = len(seqs)
    return tuple(SelectionGroup(scorer, rule,
                                None if len(rows) == n else Rows(tuple(rows), n, device))
                 for (_, rule), (scorer, rows) in groups.items())
