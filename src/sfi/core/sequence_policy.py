"""One sequence's slow-fast policy, engine-neutral: where its memory lies, what its next decode
step does, and how a step's outcome is recorded.

Both engines decide through these functions: the transformers path's :class:`sfi.hf.planner.Planner`
(a batch of padded rows) and the vLLM plugin's :class:`sfi.vllm.requests.RequestBook` (one
request per row, no padding). Nothing here knows tensors, layers, caches or an engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from sfi.core.config import SFIConfig
from sfi.core.cost_model import dense_reason, probe_reads
from sfi.core.decode_stats import DecodeStats
from sfi.core.scorers import Scorer
from sfi.core.triggers import BOOTSTRAP, COVERAGE, RefreshTrigger
from sfi.notices import notice_once

ACCEPTANCE = "acceptance"  # exact mode: full attention rejected a round's first draft

DENSE, SLOW, FAST, LAGGED = "dense", "slow", "fast", "lagged"
STEP_KINDS: tuple[str, ...] = (DENSE, SLOW, FAST, LAGGED)


@dataclass(frozen=True)
class Memory:
    """Where one sequence's fast memory lies after a refresh (cache positions).

    Sinks are ``[pad, sink_end)``, the middle region ``[sink_end, recent_start)`` (from which
    ``k`` positions per KV head are selected), the recent window ``[recent_start, T)`` (it
    grows by one position per step until the next refresh). ``sink`` is the sequence's S (the
    compact slots before the selected ones); ``pinned`` of the ``k`` selected positions are
    kept by every later refresh.
    """

    pad: int
    sink: int
    sink_end: int
    recent_start: int
    k: int
    pinned: int = 0

    @property
    def sink_count(self) -> int:
        return self.sink_end - self.pad

    def read(self, total: int) -> int:
        """Entries a fast step at cache length ``total`` reads per KV head."""
        return self.sink_count + self.k + total - self.recent_start


def refresh_memory(total: int, pad: int, sink: int, recent: int, budget: int) -> Memory:
    """The memory of a refresh at cache length ``total`` for a sequence whose real tokens start
    at ``pad``: S sinks, the last R tokens, and ``min(budget, middle length)`` selected."""
    recent_start = max(total - recent, pad)
    sink_end = min(pad + sink, recent_start)
    return Memory(pad=pad, sink=sink, sink_end=sink_end, recent_start=recent_start,
                  k=min(budget, recent_start - sink_end))


@dataclass
class DraftAcceptance:
    """Exact mode: one sequence's per-token acceptance of its drafts, from decayed counts of
    the drafts full attention accepted (``hits``) over those it tested (``trials``: a round
    tests its accepted drafts and the first rejected one). A prior of 0.8 over four trials
    stands in before the first round; each round's counts weigh ``1 / decay`` more than the
    last round's."""

    hits: float = 0.0
    trials: float = 0.0
    decay: float = 0.9

    @property
    def rate(self) -> float:
        """The estimated probability that the sequence's next draft is accepted."""
        return (self.hits + 3.2) / (self.trials + 4.0)

    def record(self, accepted: int, drafted: int) -> None:
        """A round drafted ``drafted`` tokens for this sequence, of which full attention
        accepted the first ``accepted``."""
        self.hits = self.hits * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (accepted < drafted)


@dataclass
class SequenceState:
    """What one sequence carries between steps: its config, trigger, scorer, selection and
    counters. ``memory`` is None until its first selection."""

    pad: int
    config: SFIConfig
    trigger: RefreshTrigger
    scorer: Scorer
    dense_only: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)
    steps_since_refresh: int = 0
    memory: Memory | None = None
    coverage_miss: bool = False
    refresh_due: str | None = None  # exact mode: the next verify refreshes, for this reason
    # exact mode: slots left empty (sfi.hf.visibility)
    holes: list[int] = field(default_factory=list)
    acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)  # exact mode's drafts
    weight_positions: int = 0  # the model's weights in KV positions (sfi.core.cost_model)
    inputs: list[int] = field(default_factory=list)  # the last repair_tokens inputs
    drifted: int = 0  # positions a repair would re-run: since the first a sparse step wrote


def next_memory(seq: SequenceState, total: int) -> Memory:
    """The memory of ``seq`` refreshed at cache length ``total``: the geometry of
    :func:`refresh_memory`, and the positions it keeps pinned (``pin_fraction`` of its first
    selection's K, kept by every later refresh)."""
    c = seq.config
    memory = refresh_memory(total, seq.pad, c.sink, c.recent, c.budget(total - seq.pad))
    if seq.memory is None:
        pinned = math.floor(c.pin_fraction * memory.k)
    else:
        pinned = min(seq.memory.pinned, memory.k)
    return replace(memory, pinned=pinned)


def sparse_pays(seq: SequenceState, total: int) -> bool:
    """Whether a step of ``seq`` at cache length ``total`` may read sparsely at all."""
    return not seq.dense_only and seq.config.sparse_pays(total - seq.pad, seq.weight_positions)


def prompt_decision(seq: SequenceState, total: int, selects: bool) -> tuple[str, str | None]:
    """What the forward that ends ``seq``'s prompt at cache length ``total`` does:
    ``(SLOW, bootstrap)``, a selection from the prompt, where it ``selects`` (the engine has
    the prompt's evidence queries at hand) and sparse decoding pays; else ``(DENSE, None)``
    (the first decode step then bootstraps, :func:`decode_decision`)."""
    if selects and sparse_pays(seq, total):
        return SLOW, BOOTSTRAP
    return DENSE, None


def decode_decision(seq: SequenceState, token: int | None, total: int) -> tuple[str, str | None]:
    """What a decode step of ``seq`` at cache length ``total`` does, before it runs:
    ``(kind, refresh reason)``. Dense while sparse decoding does not pay (or for a full-attention
    sequence); slow without a memory (``bootstrap``), when the trigger fires on ``token`` (None:
    not observed), or after a coverage miss once ``coverage_gap`` steps have passed; else fast."""
    if not sparse_pays(seq, total):
        return DENSE, None
    steps = seq.steps_since_refresh + 1
    fired = seq.trigger.decide(token, steps) if token is not None else None
    if seq.memory is None:
        return SLOW, BOOTSTRAP
    if fired is not None:
        return SLOW, fired
    if seq.coverage_miss and steps >= seq.config.coverage_gap:
        return SLOW, COVERAGE
    return FAST, None


def repair_span(seq: SequenceState) -> int:
    """How many of the last positions of ``seq`` a repairing slow step would re-run
    (``repair_tokens``): the drifted ones (written by a sparse step, or after one, since the
    sequence's last repair or prompt), at most ``repair_tokens`` and the inputs kept."""
    return min(seq.drifted, seq.config.repair_tokens, len(seq.inputs))


def fast_read_fraction(seq: SequenceState, total: int, layers: Iterable[int],
                       dense_reads: int = 0, probes: int = 0,
                       probes_reread_memory: bool = False) -> float:
    """The fraction of the context a fast step of ``seq`` at cache length ``total`` read,
    averaged over the slow-fast ``layers`` (model indices): the memory at most of them, the
    whole context at the first ``dense_layers`` ones and at ``dense_reads`` more (layers whose
    rebuild was not ready), and at ``probes`` of them what a coverage probe reads beside the
    memory (:func:`sfi.core.cost_model.probe_reads`; with ``probes_reread_memory`` also the
    memory's keys once more, half an entry a position: the vLLM plugin's probes, whose
    attention kernel gives them no log-sum-exp). With probes, or where the memory holds the
    whole context, a fast step can read more than the context."""
    layers = tuple(layers)
    context, memory = total - seq.pad, seq.memory.read(total)
    read = memory / context
    dense = sum(i < seq.config.dense_layers for i in layers) + dense_reads
    if layers and (dense or probes):
        again = memory / 2 if probes_reread_memory else 0.0
        extra = probes * (probe_reads(seq.config, context) + again) / context
        read = (dense + (len(layers) - dense) * read + extra) / len(layers)
    return read


def record_step(seq: SequenceState, kind: str, *, decode: bool, token: int | None = None,
                memory: Memory | None = None, reason: str | None = None,
                read: float | None = None, lagged: bool = False, repaired: int = 0) -> None:
    """Apply one step's outcome to ``seq``.

    A decode step advances the trigger on its input ``token`` (None: not observed) and counts
    as ``kind``; a slow step (or a first selection, ``decode=False``) installs ``memory``,
    restarts the reuse count, clears a coverage miss and counts its ``reason`` (an engine's
    own too: exact mode's ``acceptance``, the vLLM plugin's ``capacity``).
    ``read`` is a fast step's read fraction (:func:`fast_read_fraction`); ``lagged`` says some
    of its layers read densely because their rebuild was not ready; ``repaired``: the
    positions before the step that it re-ran densely (:func:`repair_span`).
    """
    if decode:
        steps = seq.steps_since_refresh + 1
        if token is not None:
            seq.trigger.advance(token, steps)
        seq.steps_since_refresh = steps
        _record_drift(seq, kind, token, repaired)
    if kind == SLOW:
        if memory is None:
            raise ValueError("a slow step installs a new memory")
        seq.memory = memory
        seq.steps_since_refresh = 0
        seq.coverage_miss = False
        if reason is not None:
            reasons = seq.stats.refresh_reasons
            reasons[reason] = reasons.get(reason, 0) + 1
    if not decode:
        return
    if kind == DENSE:
        seq.stats.dense_steps += 1
        if seq.stats.dense_reason is None and not seq.dense_only:
            seq.stats.dense_reason = dense_reason(seq.config, seq.weight_positions)
            notice_once(f"SFI decodes densely: {seq.stats.dense_reason}")
    elif kind == SLOW:
        seq.stats.slow_steps += 1
    elif lagged:
        seq.stats.record_lagged_step(read)
    else:
        seq.stats.record_fast_step(read)


def _record_drift(seq: SequenceState, kind: str, token: int | None, repaired: int) -> None:
    """Keep the inputs and the drift count :func:`repair_span` reads, after a decode step whose
    input was ``token`` (None: not observed; the inputs kept would no longer end at the cache's
    end, so none is kept and nothing before it is re-run)."""
    limit = seq.config.repair_tokens
    if not limit:
        return
    if token is None:
        keep_inputs(seq, None)
        return
    seq.stats.repaired_tokens += repaired
    if repaired:  # re-run from its first drifted position, the KV is full attention's again;
        seq.drifted = 0  # after a shorter block no later repair reaches the positions before it
    elif seq.drifted or kind == FAST:
        seq.drifted += 1
    seq.inputs.append(token)
    del seq.inputs[:-limit]


def keep_inputs(seq: SequenceState, tokens: Sequence[int] | None) -> None:
    """After a prompt's forward (``repair_tokens``) whose real input tokens were ``tokens``
    (its last ones; None: not known): keep them, so that a repair may re-run prompt positions
    too and a row that joins a batch does not shorten the batch's repairs. Without them
    nothing before the forward can be re-run."""
    limit = seq.config.repair_tokens
    if not limit:
        return
    if tokens is None:
        seq.inputs, seq.drifted = [], 0
        return
    if seq.drifted:  # a prompt continuing drifted KV was computed over it
        seq.drifted += len(tokens)
    seq.inputs = [*seq.inputs, *tokens][-limit:]


def record_verified(seq: SequenceState, inputs: Iterable[int], refreshed: bool,
                    accepted: int | None = None, drafted: int = 0) -> None:
    """Exact mode (``sfi.decoding.exact``): walk the trigger over the ``inputs`` of the decode
    steps a verify (or a dense step) committed, as if each had been a decode step of its own, and
    count a verify's ``accepted`` of ``drafted`` drafts in the sequence's acceptance.

    ``refreshed``: the verify selected a new memory at its first position (installed by
    the plan's commit, which restarted the reuse count), so its first input is that slow
    step's. A trigger that fires on a later input makes the next verify refresh
    (``refresh_due``), as does a round whose first draft was rejected (``accepted == 0``,
    reason ``acceptance``) once ``min_refresh_gap`` steps have passed since the refresh.
    """
    for j, token in enumerate(inputs):
        steps = seq.steps_since_refresh + 1
        if refreshed and j == 0:
            seq.trigger.advance(token, steps)
            seq.refresh_due = None
            continue  # the refresh step itself: the count restarted at it
        if seq.refresh_due is None and seq.memory is not None:
            seq.refresh_due = seq.trigger.decide(token, steps)
        seq.trigger.advance(token, steps)
        seq.steps_since_refresh = steps
    if accepted is not None and drafted:
        seq.acceptance.record(accepted, drafted)
    if accepted == 0 and seq.refresh_due is None and seq.memory is not None and \
            seq.steps_since_refresh >= seq.config.min_refresh_gap:
        seq.refresh_due = ACCEPTANCE
