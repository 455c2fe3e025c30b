"""What each request of a vLLM batch does at a step, decided from the batch's shapes alone.

vLLM's attention metadata names no request, so a request is known by the first KV block of its
block table (unique among live requests while prefix caching is off): a row whose context is
all new (``seq_len == query_len``) starts a request afresh; a known key continues one. Every
tensor-parallel rank sees the same block tables and lengths; the one thing ranks see apart is
what their probes find in their own KV heads, which the glue ORs over the ranks before each
step's decisions, so every rank decides the same.

The decisions mirror :class:`sfi.hf.planner.Planner` for one sequence without padding:
- a prefill chunk (several query tokens) attends densely and records its last W queries, the
  evidence of the first selection;
- a decode row whose context is too short for sparse reads to pay (``SFIConfig.sparse_pays``)
  attends densely;
- the first decode row after a prompt long enough to select from **selects** from the prompt's
  last W queries (the geometry of the prompt's end, as the transformers path selects at the
  prefill) and then reads its new memory: a fast step;
- a decode row whose trigger fires (or that has no memory yet) takes a **slow** step: dense
  attention, then a refresh from its own query at the step's length;
- otherwise a **fast** step: the row's memory (sinks + selected + recent window, packed in a
  slot of the plugin's buffer) plus the new token. With coverage probes on, the probe layers
  check every fast (and selecting) row; a row they flag
  (:meth:`RequestBook.apply_coverage_flags`) refreshes once ``coverage_gap`` steps have passed
  (reason ``coverage``), as in the planner.

Triggers see each decode row's input token as the transformers path's do (the sentence
trigger needs them; the glue records the model's input ids). A slot has room for S + K + R +
the longest reuse (:data:`BOOTSTRAP_REUSE` tokens for the bootstrap-only trigger); a row whose
memory would outgrow it refreshes (reason ``capacity``; only the bootstrap-only trigger reaches
it, where the transformers path would not refresh).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sfi.core.config import SFIConfig
from sfi.core.coverage import probe_layers
from sfi.core.scorers import Scorer
from sfi.core.sequence_policy import (
    DENSE,
    FAST,
    SLOW,
    Memory,
    SequenceState,
    decode_decision,
    fast_read_fraction,
    next_memory,
    prompt_decision,
    record_step,
)
from sfi.core.triggers import TokenClasses, longest_reuse, make_trigger
from sfi.errors import SFIConfigError

SELECT = "select"  # the first decode step after a prompt: select from it, then read fast
CAPACITY = "capacity"
NO_TOKEN = -1  # shown to a token-free trigger when the input token is not known
BOOTSTRAP_REUSE = 1024  # new tokens a bootstrap-only memory serves before it must refresh


def slot_capacity(config: SFIConfig, max_model_len: int) -> int:
    """Entries one slot holds: sinks + the largest K + the recent window + the longest reuse
    (:func:`sfi.core.triggers.longest_reuse`; :data:`BOOTSTRAP_REUSE` where it has no bound)."""
    reuse = longest_reuse(config)
    return (config.sink + config.budget(max_model_len) + config.recent
            + (BOOTSTRAP_REUSE if reuse is None else reuse) + 1)


@dataclass(frozen=True)
class RowPlan:
    """What one row of the batch does at this step.

    Attributes:
        row: the row in the batch.
        kind: ``dense`` (the stock kernel on vLLM's cache), ``slow`` (dense, then refresh),
            ``select`` (first selection from the prompt's queries, then fast) or ``fast``.
        slot: the row's slot in the plugin's buffer (None for rows the plugin does not track).
        total: T, the row's context after this step (vLLM's ``seq_len``).
        memory: for ``slow`` and ``select``, the memory built at this step; for ``fast``,
            the memory it reads (the coverage probes' ``coverage_copy`` needs its geometry).
        length: entries of the slot a fast read covers at this step (``select`` and ``fast``:
            including the new token); for ``slow``, the entries the refresh packs.
        record: prompt queries to record from this row (its last ``record`` query tokens).
        evidence: for ``select``, how many recorded prompt queries are evidence.
        reason: why a slow step refreshes.
        request: which request (a serial number in the book that planned it, never reused
            there; -1 for untracked rows).
        probed: for ``select`` and ``fast``, whether the coverage probes check the row's
            memory at this step: not where a probe flagged it already (it refreshes as soon as
            its ``coverage_gap`` allows, and probing it again cannot change that), as in the
            transformers path.
    """

    row: int
    kind: str
    slot: int | None
    total: int
    memory: Memory | None = None
    length: int = 0
    record: int = 0
    evidence: int = 0
    reason: str | None = None
    request: int = -1
    probed: bool = False

    @property
    def keys_end(self) -> int:
        """Where a refreshing row's keys end: a first selection's at the prompt's end (its
        memory is laid out there; the new token is appended to the slot by the fast read), a
        slow row's with this step's own."""
        return self.total - 1 if self.kind == SELECT else self.total


@dataclass
class RequestState:
    """One live request's slow-fast state on this worker."""

    key: int
    slot: int | None
    seq: SequenceState
    prompt_length: int = 0
    recorded: int = 0  # prompt queries recorded (at most W)
    seen: int = 0  # the last step it took part in
    serial: int = -1  # which request this is, unique in its book


@dataclass
class BookStats:
    """Counters over every request this worker served (what tests and benchmarks read)."""

    steps: int = 0
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys((DENSE, SLOW, SELECT,
                                                                         FAST), 0))
    mixed_steps: int = 0  # steps with both dense-reading and fast rows
    requests: int = 0
    slots_reused: int = 0
    unslotted: int = 0  # requests that found no free slot (full attention throughout)
    reasons: dict[str, int] = field(default_factory=dict)


class RequestBook:
    """The slow-fast state of every live request of one worker, and each step's decisions.

    Args:
        config: the SFI configuration every request uses.
        slots: how many requests may hold a fast memory at once; a request that starts while
            every slot is held by a live request runs at full attention (stock) to its end.
        capacity: entries per slot (:func:`slot_capacity`).
        scorer: what ranks positions at a refresh.
        classes: the vocabulary's sentence enders and blanks (the sentence trigger needs them).
        layers: the model indices of the layers SFI serves
            (:func:`sfi.core.cost_model.slow_fast_layers`): where the coverage probes go
            (:attr:`probes`) and what a fast step's reads are counted over.
        weight_positions: the model's weights in KV positions, the cost model's W
            (``sfi.core.cost_model.weight_positions``, ``SFIConfig.min_gain``).
    """

    def __init__(self, config: SFIConfig, slots: int, capacity: int, scorer: Scorer,
                 classes: TokenClasses | None = None, layers: Sequence[int] = (),
                 weight_positions: int = 0) -> None:
        if config.trigger == "sentence" and classes is None:
            raise SFIConfigError("the sentence trigger needs the vocabulary's token classes")
        self.config = config
        self.classes = classes
        self.capacity = capacity
        self.scorer = scorer
        self.weight_positions = weight_positions
        self.requests: dict[int, RequestState] = {}
        self.slots = slots
        self.free = list(range(slots))[::-1]
        self.used_slots: set[int] = set()
        self.stats = BookStats()
        self.layers = tuple(layers)
        self.probes = probe_layers(config.coverage_layers, self.layers, config.dense_layers)
        # the probes' misses since the last step's decisions, per slot, where the model runs
        # (a [slots] tensor the glue keeps, so that a probe never waits for the device)
        self.missed: Any = None
        # the rebuilder of the last step that planned refreshes: they must have been packed by
        # the time the next step plans (``sfi.vllm.planning.check_packed``)
        self.step_rebuilder: Any = None
        self._serials = itertools.count()  # the requests' serial numbers (:attr:`RowPlan.request`)

    # --- the step --------------------------------------------------------------------------
    def plan(self, keys: Sequence[int], query_lens: Sequence[int], seq_lens: Sequence[int],
             tokens: Sequence[int] | None = None) -> list[RowPlan]:
        """Decide what each row does, and commit it (the step is about to run).

        ``keys`` identify the rows' requests (their first KV block); ``query_lens`` and
        ``seq_lens`` are vLLM's per-row query and context lengths; ``tokens`` each row's last
        input token (what the triggers observe at a decode step)."""
        if tokens is None:
            if self.config.trigger == "sentence":
                raise RuntimeError("the sentence trigger needs each row's input token")
            tokens = [NO_TOKEN] * len(keys)
        self.stats.steps += 1
        step = self.stats.steps
        counts: dict[int, int] = {}
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        live = set(keys)
        plans = []
        for row, (key, q, t, token) in enumerate(zip(keys, query_lens, seq_lens, tokens)):
            if counts[key] > 1:  # not a request's own block (a warm-up batch): stock attention
                plans.append(RowPlan(row, DENSE, None, t))
                continue
            state = self._state(key, fresh=(q == t), step=step, live=live)
            state.seen = step
            plans.append(replace(self._decide(row, state, q, t, token), request=state.serial))
        kinds = [p.kind for p in plans]
        for kind in kinds:
            self.stats.rows[kind] += 1
        if any(k in (SELECT, FAST) for k in kinds) and any(k in (DENSE, SLOW) for k in kinds):
            self.stats.mixed_steps += 1
        return plans

    def _state(self, key: int, fresh: bool, step: int, live: set[int]) -> RequestState:
        state = self.requests.get(key)
        if state is not None and not fresh:
            return state
        if state is not None:  # the key's old request ended; its block starts a new one
            self._release(state)
        slot = self._take_slot(live)
        c = self.config
        seq = SequenceState(pad=0, config=c,  # without a slot: stock attention, by choice
                            trigger=make_trigger(c, self.classes, self.stats.requests),
                            scorer=self.scorer, dense_only=slot is None,
                            weight_positions=self.weight_positions)
        state = RequestState(key=key, slot=slot, seq=seq, serial=next(self._serials))
        self.requests[key] = state
        self.stats.requests += 1
        return state

    def _take_slot(self, live: set[int]) -> int | None:
        for state in [s for s in self.requests.values() if s.slot is None and s.key not in live]:
            del self.requests[state.key]  # unslotted requests that ended
        if not self.free:  # requests that left the batch (finished) give their slots back
            gone = sorted((s for s in self.requests.values()
                           if s.key not in live and s.slot is not None), key=lambda s: s.seen)
            if not gone:
                self.stats.unslotted += 1
                return None
            self._release(gone[0])
        slot = self.free.pop()
        if slot in self.used_slots:
            self.stats.slots_reused += 1
        self.used_slots.add(slot)
        return slot

    def _release(self, state: RequestState) -> None:
        del self.requests[state.key]
        if state.slot is not None:
            self.free.append(state.slot)

    def _decide(self, row: int, state: RequestState, q: int, t: int, token: int) -> RowPlan:
        """Decide one row and record it (:func:`sfi.core.sequence_policy.record_step`, as the
        planner records a step): the plugin has no hook after the step, and nothing the step does
        changes its decision (a probe's flag counts from the next step, as in the planner)."""
        c, seq = self.config, state.seq
        if state.slot is None:  # no room for a memory: stock attention throughout
            if q == 1:
                record_step(seq, DENSE, decode=True)
            return RowPlan(row, DENSE, None, t)
        if q > 1:  # a prompt chunk
            record = min(c.evidence_window, q)
            state.recorded = min(c.evidence_window, state.recorded + q)
            state.prompt_length = t
            return RowPlan(row, DENSE, state.slot, t, record=record)
        select: RowPlan | None = None
        ends_prompt = seq.memory is None and state.prompt_length == t - 1 and state.recorded > 0
        first, why = prompt_decision(seq, t - 1, ends_prompt)
        if first == SLOW:
            # the prompt's selection (made at its end, as at the transformers path's prefill)
            memory = next_memory(seq, t - 1)
            record_step(seq, SLOW, decode=False, memory=memory, reason=why)
            self._count(why)
            select = RowPlan(row, SELECT, state.slot, t, memory=memory,
                             length=memory.read(t), evidence=state.recorded)
        kind, reason = decode_decision(seq, token, t)
        if kind == FAST and select is None and seq.memory.read(t) > self.capacity:
            kind, reason = SLOW, CAPACITY  # the slot holds the memory's reads (sfi.vllm.impl)
        memory = next_memory(seq, t) if kind == SLOW else None
        probed = bool(self.probes) and not seq.coverage_miss
        read = (fast_read_fraction(seq, t, self.layers, probes=len(self.probes) if probed else 0,
                                   probes_reread_memory=True)
                if kind == FAST else None)
        record_step(seq, kind, decode=True, token=token, memory=memory, reason=reason, read=read)
        if kind == DENSE:  # nothing to save yet
            return RowPlan(row, DENSE, state.slot, t)
        if kind == SLOW:  # dense now, then a memory of the step's length
            self._count(reason)
            return RowPlan(row, SLOW, state.slot, t, memory=memory, length=memory.read(t),
                           reason=reason)
        if select is not None:
            return replace(select, probed=probed)
        return RowPlan(row, FAST, state.slot, t, memory=seq.memory, length=seq.memory.read(t),
                       probed=probed)

    def flag_missed(self, slots: Any, flags: Any) -> None:
        """Keep the probes' verdict of a step, ``flags [n]`` for the requests in ``slots [n]``
        (tensors where the model runs), until the next step's plan reads them
        (:attr:`missed`)."""
        self.missed[slots] |= flags

    def apply_coverage_flags(self, flags: Sequence[bool]) -> None:
        """Flag the request in each slot whose ``flags`` entry is set: the probes' misses since
        the last step, which the glue reads in one transfer before each step's decisions (and,
        under tensor parallelism, ORs over the ranks first, so that every rank decides alike).
        A flagged request refreshes once ``coverage_gap`` steps have passed
        (:func:`decode_decision`)."""
        for state in self.requests.values():
            if state.slot is not None and flags[state.slot]:
                state.seq.coverage_miss = True

    def _count(self, reason: str) -> None:
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1


def blocks_per_slot(capacity: int, block_size: int) -> int:
    return math.ceil(capacity / block_size)


def slot_start(slot: int, blocks: int, block_size: int) -> int:
    """The buffer entry (block * block_size + offset) where ``slot`` begins, each slot
    ``blocks`` blocks of the plugin's buffer (:func:`blocks_per_slot`)."""
    return slot * blocks * block_size
