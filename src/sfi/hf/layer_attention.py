"""The attention of one slow-fast layer: how it carries out a step's plan on its storage.

:class:`SlowFastAttention` reads and writes one :class:`sfi.hf.slab.SlabLayer` (full KV, key
norms, the compact buffer, page summaries: tensors only) and never points back to its cache:
:meth:`attend` gets the step (plan, rebuilder) as an argument and follows the plan:

- prefill (several queries): dense attention as the model computes it, then, for the rows the
  plan refreshes, a first selection from the last W queries;
- a dense block (exact mode's verify, a repairing slow step): every row attends densely, the
  rows the plan refreshes select from the block's last queries;
- ``dense`` rows: attention over the whole cache;
- ``slow`` rows: the same dense attention, whose logits are the evidence from which the rows'
  scorer refreshes the compact buffer (:func:`sfi.core.refresh_selection.select_groups`);
- ``fast`` rows: one softmax over the compact buffer and the recent window read in place,
  O(S + K + R) entries per KV head whatever the context length.

Shapes: B sequences, Hq query heads, H KV heads, G = Hq / H, T cache length, D head size,
C compact slots.
"""

from __future__ import annotations

from typing import Any

import torch

from sfi.core.coverage import batch_reader, page_scores, unheld_pages
from sfi.core.kernels import block_attention, dense_attention, fast_attention, window_logits
from sfi.core.overlap import Refresh, StagedCompact
from sfi.core.refresh_selection import HeldSelection, reads_keys, selection_inputs
from sfi.core.rows import Rows
from sfi.hf.attention import AttendingLayer
from sfi.hf.context import StepContext
from sfi.hf.plan import BLOCK_PHASES, Probe, SlowRows, StepPlan
from sfi.hf.slab import SlabLayer
from sfi.step.probes import ProbeEvidence


class SlowFastAttention(AttendingLayer):
    """The dense, slow (dense + refresh) and fast rows of a planned step at one layer, its
    coverage probes and its refreshes, carried out on the layer's storage ``store``.

    What it keeps from one step to the next: the layer's rebuild in flight (``pending``,
    committed into the store by :meth:`settle`) and the coverage probes' unheld pages (valid
    until a memory changes: :meth:`forget`)."""

    def __init__(self, store: SlabLayer) -> None:
        self.store = store
        self.pending: StagedCompact | None = None
        self._unheld: tuple[tuple, torch.Tensor] | None = None  # a probe's, until a refresh

    @property
    def layer_idx(self) -> int:
        """The model's index of the layer (its store's)."""
        return self.store.layer_idx

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, L, D]`` to the store; the filled
        views (what a compiled step's attention operator calls: ``sfi.hf.attention``)."""
        return self.store.append(key_states, value_states)

    def settle(self, wait: bool = False) -> Rows | None:
        """Commit a pending rebuild that is ready (or, with ``wait``, once it is) into the
        store; return the rows whose rebuild is still running, which must read densely for
        now."""
        staged = self.pending
        if staged is None:
            return None
        if not (wait or staged.ready()):
            return staged.rows
        staged.wait()
        self.pending = None
        if not staged.dropped:  # a dropped one's forward failed: the memory stays as it was
            self.store.write_compact(staged.rows, staged.keys, staged.values, staged.positions,
                                     staged.width)
            self._unheld = None
        return None

    def forget(self) -> None:
        """The rows moved (a join or a leave): what was kept of their memories is stale."""
        self._unheld = None

    # --- attention (the AttendingLayer protocol) ---------------------------------------------
    def attend(self, step: StepContext, module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
        """The protocol's, except for a dense block (:meth:`verify`): exact mode's verify or a
        repairing slow step."""
        if step.plan.phase in BLOCK_PHASES:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return self.verify(step, query, scale, kwargs.get("softcap")), None
        return super().attend(step, module, query, key, value, attention_mask, scaling=scaling,
                              dropout=dropout, **kwargs)

    def verify(self, step: StepContext, query: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
        """A dense block, exact mode's verify or a repairing slow step (``sfi.hf.plan``):
        ``query [B, Hq, Q, D]`` over the whole cache in one read
        (:func:`sfi.core.kernels.block_attention`) -> ``[B, Q, Hq, D]``; its logits are the
        evidence of the rows it refreshes: the rows of their window's last queries (a repair's,
        its last query alone), or each row's own where their windows differ."""
        plan: StepPlan = step.plan
        b, hq, nq, d = query.shape
        keys, values = self.store.keys, self.store.values
        h = keys.shape[1]
        q = query.reshape(b, h, hq // h * nq, d)  # rows (query head, query), as window_logits
        out, logits, attention = block_attention(q, keys, values, plan.block_bias, nq, scale,
                                                 softcap)
        slow = plan.slow
        if slow is not None and plan.selects_at(self.layer_idx):
            windows = set(slow.evidence_windows)
            if len(windows) == 1:  # the block's last w queries' rows (a repair's: its last)
                w = windows.pop()
                last = (torch.arange(hq // h, device=q.device)[:, None] * nq
                        + torch.arange(nq - w, nq, device=q.device)).reshape(-1)  # [G * w]

                def evidence(t: torch.Tensor) -> torch.Tensor:
                    return slow.rows.take(t if w == nq else t[:, :, last])

                self._refresh(step, slow, evidence(logits), queries=w, query=evidence(q),
                              attention=evidence(attention))
            else:  # rows' windows differ: each row's own evidence
                self._select_after_prefill(step, slow, query, scale, softcap)
        return out.reshape(b, hq, nq, -1).transpose(1, 2)

    def after_prefill(self, step: StepContext, query: torch.Tensor, scale: float,
                      softcap: float | None) -> None:
        """First selection of the rows the plan refreshes, from the last W queries."""
        plan: StepPlan = step.plan
        slow = plan.slow
        if slow is not None and plan.selects_at(self.layer_idx):
            self._select_after_prefill(step, slow, query, scale, softcap)

    def decode(self, step: StepContext, q: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
        """One decode step for the whole batch: ``q [B, H, G, D]`` -> ``[B, H, G, D]``."""
        plan: StepPlan = step.plan
        keys, values = self.store.keys, self.store.values
        out = q.new_empty(*q.shape[:3], values.shape[-1])
        rebuilding = self.settle()  # rows whose compact rebuild is still running read densely

        def dense(rows: Rows, refresh: SlowRows | None = None) -> None:
            bias = rows.take(plan.pad_bias) if plan.pad_bias is not None else None
            o, logits, attention = dense_attention(rows.take(q), rows.take(keys),
                                                   rows.take(values), bias, scale, softcap)
            rows.put(out, o)
            if refresh is not None:
                self._refresh(step, refresh, logits, query=rows.take(q), attention=attention)

        forced = plan.dense_at(self.layer_idx)  # this layer is one of their dense ones
        if forced and len(forced) + len(plan.dense) == len(plan.kinds):
            dense(Rows(tuple(range(len(plan.kinds))), len(plan.kinds), q.device))
            return out
        if plan.dense:
            dense(plan.dense)
        if plan.slow:  # refreshed where some slow row reads the layer sparsely
            dense(plan.slow.rows, plan.slow if plan.selects_at(self.layer_idx) else None)
        if plan.fast:
            fast, width = plan.fast, plan.compact_width
            rows = fast.rows
            self.store.ensure_compact(width)
            probes = plan.probes_at(self.layer_idx)
            lse: list[torch.Tensor] | None = [] if probes else None
            logits: list[torch.Tensor] | None = (
                [] if any(p.rule.reads_memory_logits for p in probes) else None)
            store = self.store
            o = fast_attention(rows.take(q),
                               rows.take(store.compact_keys[:, :, :width]),
                               rows.take(store.compact_values[:, :, :width]), fast.compact_bias,
                               rows.take(keys[:, :, fast.read_start:]),
                               rows.take(values[:, :, fast.read_start:]), fast.recent_bias,
                               scale, softcap, lse, logits)
            rows.put(out, o)
            if rebuilding is not None:
                lagging = rows.intersect(rebuilding)
                if lagging:
                    dense(lagging)
                    step.record_lag(lagging.indices)
            if forced:  # fast rows among them read this layer densely
                forced_fast = rows.intersect(Rows(forced, len(plan.kinds), q.device))
                if forced_fast:
                    dense(forced_fast)
            for probe in probes:
                self._probe_coverage(step, plan, probe, q, lse[0], scale, softcap,
                                     logits[0] if logits else None)
        return out

    def _probe_coverage(self, step: StepContext, plan: StepPlan, probe: Probe,
                        q: torch.Tensor, fast_lse: torch.Tensor, scale: float,
                        softcap: float | None, fast_logits: torch.Tensor | None) -> None:
        """Score the pages outside the probe's rows' fast memories for ``step.coverage``, which
        checks every probe layer of the step together when it ends and flags the rows whose
        memory misses attention mass (:class:`sfi.step.probes.ProbeCheck`): they refresh at
        their next step. ``fast_lse [n_fast, H, G]``: the fast rows' memory log-sum-exp;
        ``fast_logits [n_fast, H, G, C]``: their logits over the compact buffer (for
        ``coverage_next`` and ``coverage_copy``)."""
        target, rule = probe.target, probe.rule
        rows = target.rows
        boxes = self.store.page_boxes(rule.page, probe.shift, probe.aligned, target.reach)
        memory = rows.take(self.store.compact_positions[:, :, : plan.compact_width])
        query = rows.take(q)
        outside = self._unheld_pages(probe, memory, target.memories.shift, boxes.shape[2])
        step.coverage.add(rule, target.memories, ProbeEvidence(
            query, page_scores(query, rows.take(boxes), outside),
            (batch_reader(self.store.keys, rows.index),),
            fast_lse.index_select(0, target.fast_index),
            fast_logits.index_select(0, target.fast_index) if fast_logits is not None
            else None, memory, scale, softcap))

    def _unheld_pages(self, probe: Probe, memory: torch.Tensor, shift: torch.Tensor | None,
                      pages: int) -> torch.Tensor:
        """``[n, H, pages]`` :func:`sfi.core.coverage.unheld_pages` of the probe's rows, kept from
        one step to the next: it changes only when a memory does (a refresh, a join or a
        leave, which drop it); pages appended since lie past the middle region."""
        target = probe.target
        page = probe.rule.page
        key = (page, target.rows.indices, memory.shape[-1], probe.aligned)
        if self._unheld is None or self._unheld[0] != key:
            outside = unheld_pages(memory, target.held, target.lo, target.hi, pages=pages,
                                   page=page, shift=shift)
            self._unheld = (key, outside)
        outside = self._unheld[1]
        if outside.shape[-1] < pages:
            outside = torch.nn.functional.pad(outside, (0, pages - outside.shape[-1]))
            self._unheld = (self._unheld[0], outside)
        return outside

    # --- the slow step's refresh -----------------------------------------------------------
    def _select_after_prefill(self, step: StepContext, slow: SlowRows, query: torch.Tensor,
                              scale: float, softcap: float | None) -> None:
        """First selection of a sequence: evidence from the last W queries of the prompt."""
        bias = slow.evidence_bias  # [n, W, T]
        w = bias.shape[1]
        q = slow.rows.take(query[:, :, -w:])  # [n, Hq, W, D]
        keys = slow.rows.take(self.store.keys)
        logits = window_logits(q, keys, bias, scale, softcap)  # [n, H, G * W, T]
        grouped = q.reshape(q.shape[0], keys.shape[1], -1, q.shape[-1])  # [n, H, G * W, D]
        self._refresh(step, slow, logits, queries=w, query=grouped)

    def _refresh(self, step: StepContext, slow: SlowRows, logits: torch.Tensor,
                 queries: int = 1, query: torch.Tensor | None = None,
                 attention: torch.Tensor | None = None) -> None:
        """Score the middle region from ``logits [n, H, N, T]`` (of the evidence queries
        ``query [n, H, N, D]``; ``attention``, their softmax where the step has it) and rebuild
        the compact buffer of the ``slow`` rows.

        The rebuild goes through the step's rebuilder: on CPU stacked with the other layers'
        refreshes at the forward's end (committed then), inline, or on a CUDA side stream
        (committed when the layer next runs and finds it ready)."""
        self.settle(wait=True)  # a newer refresh supersedes a pending one
        if not reads_keys([group.scorer for group in slow.groups]):
            query = None  # nor the keys: no scorer of these rows reads them (no copy either)
        key_norms = slow.rows.take(self.store.key_norms)
        cached_keys = slow.rows.take(self.store.keys) if query is not None else None
        at = slow.geometry
        held = None  # the rows' current memories (their k' selected after S sinks; 0: none)
        if self.store.compact_positions is not None:
            held = HeldSelection(slow.rows.take(self.store.compact_positions), at.sink,
                                 slow.previous_k)
        evidence, previous = selection_inputs(
            logits, self.layer_idx, at.lo, at.hi, at.pinned, key_norms=key_norms,
            keys=cached_keys, query=query, queries=queries, candidates=slow.candidates,
            pads=at.pad, probabilities=attention, held=held,
            hysteresis=any(g.rule.hysteresis > 0 for g in slow.groups))
        store = self.store
        refresh = Refresh(slow.rows, evidence, slow.groups, at.k, at.pinned, previous,
                          lambda selected: pack(store, slow, selected), step.plan.compact_width)
        inputs = [logits, key_norms, slow.candidates, at.lo, at.hi, at.k, at.sink,
                  slow.sink_positions, self.store.keys, self.store.values]
        kept = (previous.selected, previous.pinned) if previous is not None else ()
        inputs += [t for t in (query, cached_keys, attention, *kept) if t is not None]
        self.pending = step.rebuilder.submit(refresh, inputs)
        self.settle()


def pack(store: SlabLayer, slow: SlowRows, selected: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the sink + ``selected [n, H, k]`` entries of the ``slow`` rows from ``store``:
    ``(keys, values)`` ``[n, H, W, D]`` and their ``positions [n, H, W]``, each row's S sink
    slots first (W = S_max + k)."""
    n, h = len(slow.rows), store.keys.shape[1]
    sinks = slow.sink_positions[:, None, :].expand(n, h, -1)
    if slow.uniform_sink is not None or selected.shape[-1] == 0:
        positions = torch.cat([sinks, selected], dim=-1)
    else:  # rows with different S: row b's selected slots start at its own S_b
        width = sinks.shape[-1] + selected.shape[-1]
        slot = torch.arange(width, device=selected.device)[None, :]
        sink = slow.geometry.sink
        from_selected = (slot - sink[:, None]).clamp(0, selected.shape[-1] - 1)
        chosen = selected.gather(-1, from_selected[:, None, :].expand(n, h, width))
        padded = torch.cat([sinks, sinks[..., :1].expand(n, h, selected.shape[-1])], dim=-1)
        positions = torch.where(slot[:, None, :] < sink[:, None, None], padded, chosen)
    keys, values = store.gather(slow.rows.index, positions)
    return keys, values, positions
