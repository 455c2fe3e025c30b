"""Scorers by name: what a slow step ranks positions with (``sfi+<name>`` ablations)."""

from __future__ import annotations

from collections.abc import Callable

from sfi.config import SFIConfig
from sfi.errors import SFIError
from sfi.scorers import Scorer
from sfi.scorers.snapkv import SnapKVScorer
from sfi.scorers.tova import TOVAScorer
from sfi.selector import SFISelector

SCORERS: dict[str, Callable[[SFIConfig], Scorer]] = {
    "sfi": SFISelector,
    "snapkv": lambda config: SnapKVScorer(),
    "tova": lambda config: TOVAScorer(),
}


def make_scorer(name: str, config: SFIConfig) -> Scorer:
    if name not in SCORERS:
        raise SFIError(f"unknown scorer {name!r}; choose from {', '.join(SCORERS)}")
    return SCORERS[name](config)
