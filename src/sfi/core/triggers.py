"""When a decode step is slow: sentence boundaries from the tokenizer's vocabulary, and policies.

A sentence ender is a token whose text, with whitespace removed, ends in one of
``. ? ! 。 ？ ！`` (merged forms such as ``.\\n`` count; commas, colons, semicolons and bare
newlines do not). The slow step runs on the first token of the next sentence: the first input
token after an ender that is neither an ender nor whitespace-only (the paper's); or, with
``sentence_step="end"``, on the ender itself, the first of a run of enders (so that the dense
step writes the next sentence's first token). A sentence trigger within
``min_refresh_gap`` steps of the last refresh is ignored; ``refresh_interval`` steps after the
last refresh a refresh is forced. Fixed-period, seeded random-period and bootstrap-only policies
exist for ablations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

from sfi.core.config import SFIConfig

SENTENCE_END_CHARS: tuple[str, ...] = (".", "?", "!", "。", "？", "！")

# Reasons a refresh (slow step) happens; they key DecodeStats.refresh_reasons.
BOOTSTRAP = "bootstrap"
SENTENCE = "sentence"
INTERVAL = "interval"
PERIOD = "period"
COVERAGE = "coverage"  # the fast memory missed a page the query bounds highly (sfi.core.coverage)
MARGIN = "margin"  # a fast step's next token was uncertain: done again (SFIConfig.retry_margin)
STOP = "stop"  # a fast step would end the text: done again (SFIConfig.stop_margin)
REFRESH_REASONS: tuple[str, ...] = (BOOTSTRAP, SENTENCE, INTERVAL, PERIOD, COVERAGE, MARGIN,
                                    STOP)


@dataclass(frozen=True)
class TokenClasses:
    """Token ids of a vocabulary that end a sentence, and those that are whitespace only."""

    enders: frozenset[int]
    whitespace: frozenset[int]


def classify_text(text: str) -> tuple[bool, bool]:
    """(is a sentence ender, is whitespace only) for the decoded text of one token."""
    stripped = "".join(text.split())
    is_whitespace = text != "" and stripped == ""
    return stripped.endswith(SENTENCE_END_CHARS), is_whitespace


@lru_cache(maxsize=16)
def token_classes(tokenizer) -> TokenClasses:
    """Derive the ender and whitespace sets from every id of ``tokenizer``'s vocabulary."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    enders, whitespace = set(), set()
    for i, text in zip(ids, texts):
        is_ender, is_ws = classify_text(text)
        if is_ender:
            enders.add(i)
        elif is_ws:
            whitespace.add(i)
    return TokenClasses(frozenset(enders), frozenset(whitespace))


class RefreshTrigger(Protocol):
    """Per-sequence policy: shown each input token, says whether this step refreshes, and why.

    ``decide`` only looks (the planner calls it before the step); ``advance`` records the token
    once the step has run. ``steps_since_refresh`` counts this step (1 on the step after a
    refresh).
    """

    def decide(self, token_id: int, steps_since_refresh: int) -> str | None:
        """The refresh reason for a step whose input is ``token_id``, or None."""
        ...

    def advance(self, token_id: int, steps_since_refresh: int) -> None:
        """Take ``token_id`` into the trigger's state, after its step."""
        ...


def observe(trigger: RefreshTrigger, token_id: int, steps_since_refresh: int) -> str | None:
    """``decide`` then ``advance``: the reason for this step, with the token taken in."""
    reason = trigger.decide(token_id, steps_since_refresh)
    trigger.advance(token_id, steps_since_refresh)
    return reason


@dataclass
class SentenceTrigger:
    """The paper's policy: sentence boundaries, a minimum gap, and a reuse budget."""

    classes: TokenClasses
    refresh_interval: int = 96
    min_refresh_gap: int = 16
    at_end: bool = False  # ``sentence_step="end"``: the ender's step is slow
    pending_boundary: bool = False

    def _starts_sentence(self, token_id: int) -> bool:
        """The first token of a new sentence: after an ender, neither an ender nor blank."""
        return (self.pending_boundary and token_id not in self.classes.enders
                and token_id not in self.classes.whitespace)

    def _boundary(self, token_id: int) -> bool:
        """Whether the step whose input is ``token_id`` is the boundary's slow step."""
        if self.at_end:  # the first ender of a run
            return token_id in self.classes.enders and not self.pending_boundary
        return self._starts_sentence(token_id)

    def decide(self, token_id: int, steps_since_refresh: int) -> str | None:
        if self._boundary(token_id) and steps_since_refresh >= self.min_refresh_gap:
            return SENTENCE
        if steps_since_refresh >= self.refresh_interval:
            return INTERVAL
        return None

    def advance(self, token_id: int, steps_since_refresh: int) -> None:
        if token_id in self.classes.enders:
            self.pending_boundary = True
        elif self._starts_sentence(token_id):
            self.pending_boundary = False


@dataclass
class FixedPeriodTrigger:
    """Ablation: refresh every ``period`` steps, whatever the text."""

    period: int

    def decide(self, token_id: int, steps_since_refresh: int) -> str | None:
        return PERIOD if steps_since_refresh >= self.period else None

    def advance(self, token_id: int, steps_since_refresh: int) -> None:
        return None


@dataclass
class RandomPeriodTrigger:
    """Ablation: refresh after a period drawn uniformly from [low, high], seeded per sequence."""

    low: int
    high: int
    seed: int
    _rng: random.Random = field(init=False, repr=False)
    _next: int = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next = self._rng.randint(self.low, self.high)

    def decide(self, token_id: int, steps_since_refresh: int) -> str | None:
        return PERIOD if steps_since_refresh >= self._next else None

    def advance(self, token_id: int, steps_since_refresh: int) -> None:
        if steps_since_refresh >= self._next:  # the period ran out: draw the next one
            self._next = self._rng.randint(self.low, self.high)


class BootstrapOnlyTrigger:
    """Ablation: select once after prefill and never refresh."""

    def decide(self, token_id: int, steps_since_refresh: int) -> str | None:
        return None

    def advance(self, token_id: int, steps_since_refresh: int) -> None:
        return None


def longest_reuse(config: SFIConfig) -> int | None:
    """The most decode steps a memory of :func:`make_trigger`'s trigger serves before it
    refreshes (None: no bound, the bootstrap-only trigger)."""
    if config.trigger == "sentence":
        return config.refresh_interval
    if config.trigger == "fixed":
        return config.period
    if config.trigger == "random":
        return config.random_period_max
    return None


def make_trigger(config: SFIConfig, classes: TokenClasses | None, row: int) -> RefreshTrigger:
    """The trigger of one sequence (``row`` seeds the random policy)."""
    if config.trigger == "sentence":
        if classes is None:
            raise ValueError("the sentence trigger needs the tokenizer's vocabulary")
        return SentenceTrigger(classes, config.refresh_interval, config.min_refresh_gap,
                               at_end=config.sentence_step == "end")
    if config.trigger == "fixed":
        return FixedPeriodTrigger(config.period)
    if config.trigger == "random":
        return RandomPeriodTrigger(config.random_period_min, config.random_period_max,
                                   config.seed * 1_000_003 + row)
    return BootstrapOnlyTrigger()
