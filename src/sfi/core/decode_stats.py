"""Counters of a slow-fast decode: which steps were slow or fast, why, and how much was read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sfi.core.triggers import REFRESH_REASONS

_EXACT_COUNTERS = ("verify_steps", "drafted", "accepted", "verified_tokens", "exact_dense_steps")


def _no_refreshes() -> dict[str, int]:
    return dict.fromkeys(REFRESH_REASONS, 0)


@dataclass
class DecodeStats:
    """Per-sequence (or summed) counters of decode steps, recorded after each step ran.

    Attributes:
        slow_steps: decode steps that attended densely and refreshed the selection.
        fast_steps: decode steps that read only sink + selected + recent at every layer.
        dense_steps: decode steps that attended densely because the context was still shorter
            than sink + K + recent (nothing to save yet), or every step of full attention.
        lagged_steps: steps planned fast in which some layers read densely because their
            compact rebuild (on a CUDA side stream) was not ready yet, or all of them because
            another row's repairing slow step re-ran the batch's last positions densely.
        refresh_reasons: refreshes by cause: ``bootstrap`` (after prefill, or the first time the
            context is long enough), ``sentence``, ``interval`` (reuse budget), ``period``
            (ablation policies), ``coverage`` (the coverage probes), ``margin`` (an uncertain
            fast step done again, ``SFIConfig.retry_margin``), ``stop`` (a fast step that would
            end the text done again, ``SFIConfig.stop_margin``).
        fast_read_fraction: mean over fast steps of (entries read) / (context length).
        repaired_tokens: positions re-run densely by repairing slow steps before their own
            (``SFIConfig.repair_tokens``: this row's, or another's in its batch, which every
            row takes part in). They read nothing beyond their slow step's read:
            the block's queries attend in one read of the context
            (:func:`sfi.core.kernels.block_attention`); their cost is compute (``sfi bench``).
        read_fraction: mean over all decode steps of the fraction of the context read (dense
            and slow steps read all of it).
        verify_steps, drafted, accepted, verified_tokens: exact mode (``sfi.decoding.exact``): dense
            forwards that verified drafts, tokens drafted by fast steps, drafts full attention
            agreed with (this sequence's own, before a batch commits the rows' common
            prefix), and tokens the verifies committed (the accepted ones and one of full
            attention's own per verify).
        exact_dense_steps: exact mode's dense decode steps, taken where drafting cannot pay
            (the measured step times and acceptance say so, ``sfi.core.draft_length.DraftLength``).
        dense_reason: why an SFI sequence took dense steps (its context below the length where
            sparse decoding pays, :func:`sfi.core.cost_model.dense_reason`), set at the first such
            step and kept if the sequence turns sparse later; None when it took none for that
            reason (and for full attention and exact mode's own dense steps, dense by choice).
    """

    slow_steps: int = 0
    fast_steps: int = 0
    dense_steps: int = 0
    lagged_steps: int = 0
    refresh_reasons: dict[str, int] = field(default_factory=_no_refreshes)
    fast_read_sum: float = 0.0
    lagged_read_sum: float = 0.0
    repaired_tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0
    exact_dense_steps: int = 0
    dense_reason: str | None = None

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens that full attention agreed with (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft(self) -> float:
        """Drafted tokens per verify, gamma on average (0 before any)."""
        return self.drafted / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens committed per dense verify forward (0 before any)."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def fast_read_fraction(self) -> float:
        return self.fast_read_sum / self.fast_steps if self.fast_steps else 0.0

    @property
    def decode_steps(self) -> int:
        return self.slow_steps + self.fast_steps + self.dense_steps + self.lagged_steps

    @property
    def read_fraction(self) -> float:
        steps = self.decode_steps
        if steps == 0:
            return 1.0
        fast = self.fast_read_fraction * self.fast_steps + self.lagged_read_sum
        return (fast + self.slow_steps + self.dense_steps) / steps

    def record_fast_step(self, read_fraction: float) -> None:
        self.fast_steps += 1
        self.fast_read_sum += read_fraction

    def record_lagged_step(self, read_fraction: float) -> None:
        self.lagged_steps += 1
        self.lagged_read_sum += read_fraction

    @classmethod
    def merge(cls, parts: list[DecodeStats]) -> DecodeStats:
        total = cls()
        for part in parts:
            total.slow_steps += part.slow_steps
            total.fast_steps += part.fast_steps
            total.dense_steps += part.dense_steps
            total.lagged_steps += part.lagged_steps
            total.fast_read_sum += part.fast_read_sum
            total.lagged_read_sum += part.lagged_read_sum
            total.repaired_tokens += part.repaired_tokens
            for name in _EXACT_COUNTERS:
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.dense_reason = total.dense_reason or part.dense_reason
            for reason, count in part.refresh_reasons.items():
                total.refresh_reasons[reason] = total.refresh_reasons.get(reason, 0) + count
        return total

    def to_dict(self) -> dict[str, Any]:
        """The counters as JSON: exact mode's under the key ``exact``, and the key
        ``repaired_tokens``, each present only when it ran."""
        out = self._lossy_dict()
        if self.repaired_tokens:
            out["repaired_tokens"] = self.repaired_tokens
        if self.verify_steps or self.exact_dense_steps:
            out["exact"] = {
                **{name: getattr(self, name) for name in _EXACT_COUNTERS},
                "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_verify": round(self.tokens_per_verify, 4),
                "mean_draft": round(self.mean_draft, 4)}
        return out

    def _lossy_dict(self) -> dict[str, Any]:
        return {
            "slow_steps": self.slow_steps,
            "fast_steps": self.fast_steps,
            "dense_steps": self.dense_steps,
            "lagged_steps": self.lagged_steps,
            "refresh_reasons": dict(self.refresh_reasons),
            "fast_read_fraction": round(self.fast_read_fraction, 6),
            "dense_reason": self.dense_reason,
        }
