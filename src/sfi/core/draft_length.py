"""How long exact mode's rounds are: gamma, the drafts before each dense verify.

:class:`DraftLength` chooses gamma for a batch from what the rounds measured (a draft step's
time, a :class:`ForwardCost` line of a forward's time against the positions it verifies, and
each row's own acceptance, ``sfi.core.sequence_policy.DraftAcceptance``), and decodes densely where
no gamma pays. ``expected_tokens`` is the speculative-decoding count it maximises over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sfi.core.config import SFIConfig


def expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens a round of ``gamma`` drafts commits when each is accepted with probability
    ``acceptance`` (independently): ``1 + a + ... + a^gamma``."""
    return sum(acceptance ** j for j in range(gamma + 1))


@dataclass
class ForwardCost:
    """Seconds of one forward over ``n`` positions per row: a running average of the forwards
    measured at each ``n`` (each new one weighing ``smoothing``; an ``n`` not measured again
    keeps its average, so a long run of dense steps does not wash out the verifies), and
    ``base + slope * n`` fitted by least squares through those averages, one point per ``n``,
    keeping ``base >= 0`` and ``slope >= 0``; while a single ``n`` has been measured it is that
    n's average (no slope). A dense step is a forward over one position, a verify of g drafts
    one over ``g + 1`` (its fixed costs, the rewind and the commit, counted in its time): on
    memory-bound hardware the slope is near 0, on a CPU whose products turn compute-bound at a
    few rows it is not."""

    smoothing: float = 0.3
    seconds: dict[int, float] = field(default_factory=dict)  # n -> running average

    def record(self, n: int, seconds: float) -> None:
        """A forward over ``n`` positions per row took ``seconds``."""
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else old + self.smoothing * (seconds - old)

    def __call__(self, n: int) -> float | None:
        """The estimated seconds of a forward over ``n`` positions (None before any)."""
        if not self.seconds:
            return None
        mean_n = sum(self.seconds) / len(self.seconds)
        mean_s = sum(self.seconds.values()) / len(self.seconds)
        spread = sum((m - mean_n) ** 2 for m in self.seconds)
        if spread == 0.0:
            return mean_s
        slope = sum((m - mean_n) * (s - mean_s) for m, s in self.seconds.items()) / spread
        slope = min(max(slope, 0.0), mean_s / mean_n)  # base >= 0, slope >= 0
        return mean_s + slope * (n - mean_n)


@dataclass
class DraftLength:
    """Gamma for the next round of a batch, from what the rounds measured.

    Each sequence keeps its own per-token acceptance (``SequenceState.acceptance``); the
    batch keeps running estimates of a draft step's seconds (an exponential average), of a
    forward's seconds against the positions it verifies (:class:`ForwardCost`: dense steps
    and verifies), and of a dense step's. Rows share every forward, so one gamma serves the
    batch: the one in ``[draft_min, draft_max]`` that maximises the rows' mean expected
    tokens per round over the round's time, ``mean_r expected_tokens(gamma, a_r) /
    (gamma * t_draft + t_forward(gamma + 1))``. When that rate (after ``judged_after``
    rounds) is below a dense step's ``1 / t_dense`` the batch decodes densely, for
    ``dense_run`` steps, doubled at each round that does not pay (a dense step is measured
    first; ``draft_fallback=False`` always drafts).
    """

    config: SFIConfig
    gamma: int = 0
    draft_s: float | None = None
    forward: ForwardCost = field(default_factory=ForwardCost)
    dense_s: float | None = None
    dense_left: int = 0
    dense_run: int = 16
    judged_after: int = 3  # rounds measured before the first fallback (the first is warm-up)
    smoothing: float = 0.3
    rounds: int = 0

    def __post_init__(self) -> None:
        self.gamma = self.gamma or self.config.draft_tokens

    def rate(self, gamma: int, acceptances: Sequence[float]) -> float:
        """Tokens per second per row of rounds of ``gamma`` drafts, by the estimates, for
        rows whose per-token acceptances are ``acceptances``."""
        tokens = sum(expected_tokens(gamma, a) for a in acceptances) / len(acceptances)
        return tokens / (gamma * self.draft_s + self.forward(gamma + 1))

    def choose(self, room: int, acceptances: Sequence[float]) -> int:
        """The next round's gamma (at most ``room - 1``, the tokens still wanted less the
        verify's own) for rows still wanted whose acceptances are ``acceptances``, or 0 for
        a dense step."""
        limit = min(self.config.draft_max, room - 1)
        fallback = self.config.draft_fallback
        if limit < 1 or (fallback and (self.dense_s is None or self.dense_left > 0)):
            return 0
        if self.rounds == 0:  # nothing measured to choose by yet
            return min(self.gamma, limit)
        low = min(self.config.draft_min, limit)
        best = max(range(low, limit + 1), key=lambda g: self.rate(g, acceptances))
        if fallback and self.rounds >= self.judged_after and \
                self.rate(best, acceptances) * self.dense_s < 1.0:
            self.dense_left = self.dense_run
            self.dense_run *= 2
            return 0
        self.gamma = best
        return best

    def record_round(self, gamma: int, draft_s: float, verify_s: float) -> None:
        """A round of ``gamma`` drafts took ``draft_s`` seconds to draft in all and
        ``verify_s`` to verify (the rows' acceptance is each sequence's own)."""
        self.draft_s = self._mix(self.draft_s, draft_s / gamma)
        self.forward.record(gamma + 1, verify_s)
        self.rounds += 1

    def record_dense(self, seconds: float, acceptances: Sequence[float]) -> None:
        """A dense step took ``seconds``; ``acceptances``: the rows' still wanted."""
        self.dense_s = self._mix(self.dense_s, seconds)
        self.forward.record(1, seconds)
        self.dense_left = max(0, self.dense_left - 1)
        if self.rounds and self.rate(self.gamma, acceptances) * self.dense_s >= 1.0:
            self.dense_run = 16  # rounds pay again at this length: back to short dense runs

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
