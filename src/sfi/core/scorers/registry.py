"""Scorers by name: what a slow step ranks positions with (``sfi+<name>`` ablations)."""

from __future__ import annotations

from collections.abc import Callable

from sfi.core.config import SFIConfig
from sfi.core.scorers import Scorer
from sfi.core.scorers.h2o import H2OScorer
from sfi.core.scorers.quest import QuestScorer
from sfi.core.scorers.recency import RecencyScorer
from sfi.core.scorers.snapkv import SnapKVScorer
from sfi.core.scorers.tova import TOVAScorer
from sfi.core.selector import SFISelector
from sfi.errors import SFIError

SCORERS: dict[str, Callable[[SFIConfig], Scorer]] = {
    "sfi": SFISelector,
    "streamingllm": lambda config: RecencyScorer(),
    "snapkv": lambda config: SnapKVScorer(),
    "h2o": lambda config: H2OScorer(),
    "tova": lambda config: TOVAScorer(),
    "quest": lambda config: QuestScorer(),
}

NOT_SCORERS = {
    "pyramidkv": "PyramidKV ranks positions exactly as SnapKV does and differs only in giving "
                 "each layer its own budget, which SFI's one budget per step does not model; "
                 "use sfi+snapkv for its score, or the 'pyramidkv' eviction baseline",
}


def make_scorer(name: str, config: SFIConfig) -> Scorer:
    if name in NOT_SCORERS:
        raise SFIError(NOT_SCORERS[name])
    if name not in SCORERS:
        raise SFIError(f"unknown scorer {name!r}; choose from {', '.join(SCORERS)}")
    return SCORERS[name](config)
