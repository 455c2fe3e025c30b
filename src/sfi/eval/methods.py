"""The methods an evaluation compares, by name, and the cache each one decodes through.

``full`` is transformers' ``DynamicCache``; ``sfi`` and ``sfi+<scorer>`` are slow-fast
decoding with the SFI Selector or another scorer at the slow steps; ``streamingllm``,
``snapkv``, ``pyramidkv``, ``h2o``, ``tova`` and ``quest`` are the eviction baselines. Every
method gets the same budget C tokens per KV head (``budget`` as a fraction of the context, or
as tokens when above 1); SFI spends it as S + K + R (sink, selected, recent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from sfi.cache import SlowFastCache
from sfi.config import SFIConfig
from sfi.errors import SFIError
from sfi.eviction import POLICIES, EvictionCache, make_policy
from sfi.scorers.registry import make_scorer

SFI_RECENT = 256  # METHOD.md's R, shortened to C / 2 when the budget is smaller


def budget_tokens(budget: float, context: int) -> int:
    """C for a context of ``context`` tokens: ``budget`` x context when ``budget <= 1``,
    else ``budget`` tokens (a whole number)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
        raise SFIError(f"a budget must be a positive number, got {budget!r}")
    if budget <= 1:
        return max(1, math.ceil(budget * context))
    if budget != int(budget):
        raise SFIError(f"a budget above 1 counts tokens and must be whole, got {budget}")
    return int(budget)


def sfi_config_for(capacity: int, base: SFIConfig | None = None) -> SFIConfig:
    """SFI's knobs for a budget of ``capacity`` tokens per KV head: S = 4 sinks, R = min(256,
    C / 2) recent, K = C - S - R selected (K = 0 when C leaves no room)."""
    base = base or SFIConfig()
    recent = max(1, min(SFI_RECENT, capacity // 2))
    k = max(0, capacity - base.sink - recent)
    return replace(base, recent=recent, k_head=k, k_fraction=None)


@dataclass(frozen=True)
class Method:
    """One method of a comparison: ``kind`` is "full", "sfi" or "eviction"; ``scorer`` names
    SFI's slow-step scorer or the eviction rule."""

    name: str
    kind: str
    scorer: str | None = None

    @property
    def needs_history(self) -> bool:
        """Whether the method needs the prefill's accumulated attention (H2O)."""
        return self.kind == "eviction" and POLICIES[self.scorer](1).tracks_attention

    def build(self, model: torch.nn.Module, tokenizer: Any, context: int, budget: float,
              base: SFIConfig | None = None) -> Any:
        """A fresh cache for a prompt of ``context`` tokens."""
        if self.kind == "full":
            return DynamicCache(config=model.config)
        capacity = budget_tokens(budget, context)
        if self.kind == "eviction":
            return EvictionCache(model, make_policy(self.scorer, capacity))
        config = sfi_config_for(capacity, base)
        return SlowFastCache(model, config, tokenizer=tokenizer,
                             scorer=make_scorer(self.scorer, config))


def parse_method(name: str) -> Method:
    """``full``, ``sfi``, ``sfi+<scorer>`` or an eviction baseline's name."""
    if name == "full":
        return Method(name, "full")
    if name == "sfi":
        return Method(name, "sfi", "sfi")
    if name.startswith("sfi+"):
        scorer = name[4:]
        make_scorer(scorer, SFIConfig())  # a clear error for an unknown or unfit scorer
        return Method(name, "sfi", scorer)
    if name in POLICIES:
        return Method(name, "eviction", name)
    raise SFIError(f"unknown method {name!r}; choose from full, sfi, sfi+<scorer>, "
                   f"{', '.join(POLICIES)}")


def retention(cache: Any) -> tuple[float, float | None]:
    """``(mean fraction of the context read per decode step, the same over fast steps only)``
    for the cache a method decoded through (full attention reads everything)."""
    if isinstance(cache, SlowFastCache):
        stats = cache.stats()
        steps = stats.fast_steps + stats.slow_steps + stats.dense_steps
        if steps == 0:
            return 1.0, None
        fast = stats.fast_read_fraction
        overall = (fast * stats.fast_steps + stats.slow_steps + stats.dense_steps) / steps
        return overall, fast
    if isinstance(cache, EvictionCache):
        return cache.retention(), None
    return 1.0, None
