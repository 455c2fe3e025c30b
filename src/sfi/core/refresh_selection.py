"""One refresh's selection, engine-neutral: from a slow step's evidence to the positions each
refreshing row keeps (docs/method.md section 3, stages 1-6).

Both engines select through :func:`select`: the transformers layers (every slow row of a batch,
grouped by scorer and rule with :func:`select_groups`) and the vLLM plugin (every request that
refreshes at a step, in one call). A selection keeps a row's pinned positions (chosen by its
first selection, ``pin_fraction``) and, with hysteresis, the previously selected positions that
still rank near the top; pages start at each row's first real token (``sfi.core.pages``).

Shapes: n rows, H KV heads, T positions, L slots of a memory, k positions kept per KV head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sfi.core.config import SFIConfig
from sfi.core.pages import page_shift
from sfi.core.rows import Rows
from sfi.core.scorers import Evidence, Scorer, make_evidence, scores_rows_alone
from sfi.core.selector import best_pages_slots, compact_slots, hysteresis_keep, selection_order


@dataclass(frozen=True)
class SelectionRule:
    """How positions are taken from the scores: in whole pages of ``page`` positions (1: one
    by one), and keeping previously selected ones that rank within (1 + ``hysteresis``) K."""

    page: int = 1
    hysteresis: float = 0.0

    @classmethod
    def of(cls, config: SFIConfig) -> SelectionRule:
        return cls(config.page_size, config.hysteresis)


@dataclass(frozen=True)
class PreviousSelection:
    """What the rows' current memories hold, as ``[n, H, T]`` bool masks (None: not needed):
    ``selected``, every selected position (for hysteresis); ``pinned``, those kept by every
    refresh."""

    selected: torch.Tensor | None = None
    pinned: torch.Tensor | None = None

    def take(self, rows: Rows | None) -> PreviousSelection:
        """The same for a subset of the rows (None: all)."""
        if rows is None:
            return self
        return PreviousSelection(*(None if t is None else rows.take(t)
                                   for t in (self.selected, self.pinned)))


def held_mask(positions: torch.Tensor, start: torch.Tensor, count: torch.Tensor, length: int
              ) -> torch.Tensor:
    """``[n, H, T]`` bool: the positions held in slots ``[start, start + count)`` of each row's
    memory ``positions [n, H, L]`` (cache positions per slot; ``start``, ``count`` ``[n]``)."""
    n, h, slots = positions.shape
    slot = torch.arange(slots, device=positions.device)[None, None, :]
    first = start.to(positions.device)[:, None, None]
    held = (slot >= first) & (slot < first + count.to(positions.device)[:, None, None])
    mask = torch.zeros(n, h, length + 1, dtype=torch.bool, device=positions.device)
    mask.scatter_(-1, torch.where(held, positions.clamp(max=length - 1), length), True)
    return mask[..., :length]


def previous_selection(positions: torch.Tensor, start: torch.Tensor, selected: torch.Tensor,
                       pinned: torch.Tensor, length: int, hysteresis: bool
                       ) -> PreviousSelection | None:
    """The :class:`PreviousSelection` of memories ``positions [n, H, L]`` whose selected
    positions fill ``selected [n]`` slots from ``start [n]``, the first ``pinned [n]`` of them
    pinned; None when neither hysteresis nor a pin needs it."""
    pins = bool(pinned.any())
    if not (hysteresis or pins):
        return None
    return PreviousSelection(
        held_mask(positions, start, selected, length) if hysteresis else None,
        held_mask(positions, start, pinned, length) if pins else None)


@dataclass(frozen=True)
class HeldSelection:
    """What the refreshing rows' current memories selected, as each engine stores it:
    ``positions [n, H, L]`` (cache positions per slot), the selected ones in slots ``[start,
    start + count)`` (``start``, ``count`` ``[n]``; ``count`` 0 for a row without a memory,
    or whose memory selected none)."""

    positions: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor


def selection_inputs(logits: torch.Tensor, layer_idx: int, lo: torch.Tensor, hi: torch.Tensor,
                     pinned: torch.Tensor, *, key_norms: torch.Tensor,
                     keys: torch.Tensor | None = None, query: torch.Tensor | None = None,
                     queries: int = 1,
                     candidates: torch.Tensor | None = None, pads: torch.Tensor | None = None,
                     probabilities: torch.Tensor | None = None,
                     held: HeldSelection | None = None, hysteresis: bool = False
                     ) -> tuple[Evidence, PreviousSelection | None]:
    """The :class:`Evidence` and :class:`PreviousSelection` of one layer's refresh of n rows,
    in either engine (what :func:`select` reads): each row's new memory selects from its
    middle region ``[lo, hi)`` (``[n]``) and keeps ``pinned [n]`` of its old selection.

    ``logits [n, H, N, T]`` of the evidence queries (``query [n, H, N, D]`` and the ``keys
    [n, H, T, D]``: only for scorers that read them, :func:`reads_keys`), ``key_norms [n, H,
    T]``; ``candidates``, ``pads``, ``probabilities``: :func:`sfi.core.scorers.make_evidence`'s.
    ``held``: what the replaced memories selected (None: no row had one); of those, each
    row's new memory keeps its first ``pinned`` (none where it had no memory), and with
    ``hysteresis`` the rest may stay (``sfi.core.sequence_policy.next_memory``)."""
    evidence = make_evidence(logits, layer_idx, lo, hi, keys=keys, key_norms=key_norms,
                             candidates=candidates, queries=queries, query=query, pads=pads,
                             probabilities=probabilities)
    if held is None:
        return evidence, None
    pinned = pinned * (held.count > 0)
    return evidence, previous_selection(held.positions, held.start, held.count, pinned,
                                        logits.shape[-1], hysteresis)


def reads_keys(scorers: Sequence[Scorer]) -> bool:
    """Whether a refresh scored by ``scorers`` needs its evidence queries and the keys (a
    scorer that does not score each row from its logits alone: ``scores_rows_alone``)."""
    return not all(scores_rows_alone(s) for s in scorers)


def select(scorer: Scorer, evidence: Evidence, k: torch.Tensor, rule: SelectionRule,
           pins: torch.Tensor | None = None, previous: PreviousSelection | None = None
           ) -> torch.Tensor:
    """``[n, H, k_max]`` the slots of the rows' new memories: the middle region scored by
    ``scorer`` (stages 1-5), then stage 6 by ``rule``: ``k [n]`` positions per KV head, the
    previously pinned ones first, the ``pins [n]`` first slots pinned (a first selection's best
    positions, in increasing order; later ones, the kept pins), the rest in increasing order.
    Slots past a row's k hold its first candidate."""
    candidates = evidence.candidates
    shift = None
    if rule.page > 1 and evidence.pads is not None:
        shift = page_shift(evidence.pads, rule.page)
    scores = scorer.score(evidence)
    previous = previous or PreviousSelection()
    keep = None
    if rule.hysteresis > 0 and previous.selected is not None:
        keep = hysteresis_keep(scores, candidates, k, previous.selected, rule.hysteresis,
                               rule.page, shift)
    pins = torch.zeros_like(k) if pins is None else pins
    if rule.page > 1 and keep is None and previous.pinned is None and not bool(pins.any()):
        return best_pages_slots(scores, candidates, k, rule.page, shift)  # no position sort
    order, valid = selection_order(scores, candidates, k, rule.page, keep, previous.pinned,
                                   shift)
    return compact_slots(order, valid, candidates, pins)


@dataclass(frozen=True)
class SelectionGroup:
    """Rows of one refresh that share a scorer and a rule; ``rows`` index into the refreshing
    rows (None: all of them)."""

    scorer: Scorer
    rule: SelectionRule
    rows: Rows | None


def select_groups(groups: Sequence[SelectionGroup], evidence: Evidence, k: torch.Tensor,
                  pins: torch.Tensor, previous: PreviousSelection | None) -> torch.Tensor:
    """:func:`select` for rows with different scorers or rules: ``[n, H, k_max]``, each group
    selected in one call."""
    slots = None
    for group in groups:
        part = evidence if group.rows is None else evidence.subset(group.rows.index)

        def local(t: torch.Tensor, group: SelectionGroup = group) -> torch.Tensor:
            return t if group.rows is None else group.rows.take(t)

        chosen = select(group.scorer, part, local(k), group.rule, local(pins),
                        None if previous is None else previous.take(group.rows))
        if group.rows is None:
            return chosen
        if slots is None:
            slots = chosen.new_zeros(len(k), chosen.shape[1], int(k.max()))
        group.rows.put(slots[..., : chosen.shape[-1]], chosen)
    if slots is None:
        raise ValueError("select_groups needs at least one group")
    return slots
