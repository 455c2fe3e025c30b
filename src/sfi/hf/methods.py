"""Methods by name, and the one function that builds the cache a method decodes through.

``full`` is transformers' ``DynamicCache`` (``full-static``: its ``StaticCache``); ``sfi`` and
``sfi+<scorer>`` are slow-fast decoding with the SFI Selector or another scorer at the slow
steps; ``sfi:exact`` (``sfi:exact:<preset>`` for another drafter) is exact mode
(``sfi.decoding.exact``: fast steps draft, dense forwards verify; full attention's tokens);
``streamingllm``, ``snapkv``, ``pyramidkv``, ``h2o``, ``tova`` and ``quest`` are the eviction
baselines. In a comparison every method gets the same budget C tokens per KV head
(``budget`` as a fraction of the context, or as tokens when above 1); SFI spends it as
S + K + R (sink, selected, recent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from sfi.core.config import PRESETS, SFIConfig, parse_overrides
from sfi.core.scorers import Scorer
from sfi.core.scorers.registry import make_scorer
from sfi.errors import SFIError
from sfi.hf.decode_cache import DecodeCache, FullCache, FullStaticCache
from sfi.hf.eviction import POLICIES, EvictionCache, make_policy
from sfi.hf.slowfast_cache import SlowFastCache


def budget_tokens(budget: float, context: int) -> int:
    """C for a context of ``context`` tokens: ``budget`` x context when ``budget <= 1``,
    else ``budget`` tokens (a whole number)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or \
            not math.isfinite(budget) or budget <= 0:
        raise SFIError(f"a budget must be a positive number, got {budget!r}")
    if budget <= 1:
        return max(1, math.ceil(budget * context))
    if budget != int(budget):
        raise SFIError(f"a budget above 1 counts tokens and must be whole, got {budget}")
    return int(budget)


def sfi_config_for(capacity: int, base: SFIConfig | None = None, min_skip: int = 0,
                   min_gain: float = 1.0) -> SFIConfig:
    """SFI's knobs for a budget of ``capacity`` tokens per KV head: the base's S sinks,
    R = min(base R, C / 2) recent, K = C - S - R selected (K = 0 when C leaves no room), and
    the cost model's ``min_skip`` and ``min_gain`` (0 and 1.0: a comparison holds SFI to its
    budget at every context, as it holds the baselines; the cost model's dense steps below
    the break-even would read the whole context under the budget's name)."""
    base = base or SFIConfig()
    recent = max(1, min(base.recent, capacity // 2))
    k = max(0, capacity - base.sink - recent)
    return replace(base, recent=recent, k_head=k, k_fraction=None, min_skip=min_skip,
                   min_gain=min_gain)


@dataclass(frozen=True)
class Method:
    """One method of a comparison: ``kind`` is "full", "full-static", "sfi" or "eviction";
    ``scorer`` names SFI's slow-step scorer or the eviction rule; ``preset`` names SFI's
    configuration (``sfi:paper``), None for the caller's; ``exact``: decoded in exact mode,
    SFI's memory drafting (``sfi:exact``)."""

    name: str
    kind: str
    scorer: str | None = None
    preset: str | None = None
    fields: tuple[tuple[str, Any], ...] = ()
    exact: bool = False

    def sfi_config(self, base: SFIConfig | None = None,
                   overrides: dict[str, Any] | None = None) -> SFIConfig:
        """SFI's configuration for this method: its preset (else ``base``, else the defaults),
        then ``overrides``, then the fields its name sets (``sfi[page_size=16]``)."""
        values = {**(overrides or {}), **dict(self.fields)}
        if self.preset is not None:
            return SFIConfig.from_preset(self.preset, **values)
        return (base or SFIConfig()).replace(**values)

    @property
    def needs_history(self) -> bool:
        """Whether the method needs the prefill's accumulated attention (H2O)."""
        return self.kind == "eviction" and POLICIES[self.scorer](1).tracks_attention


def parse_method(name: str) -> Method:
    """``full``, ``full-static``, ``sfi``, ``sfi:<preset>`` (e.g. ``sfi:paper``),
    ``sfi:exact`` or ``sfi:exact:<preset>`` (exact mode, that preset drafting),
    ``sfi+<scorer>`` or an eviction baseline's name. An SFI method may set config fields in
    brackets: ``sfi[pool_kernel=9,page_size=16]``, ``sfi:paper[nms_strength=0]``,
    ``sfi:exact:paper[k_head=512]``."""
    if name.endswith("]") and "[" in name:
        head, _, inner = name[:-1].partition("[")
        method = parse_method(head)
        if method.kind != "sfi":
            raise SFIError(f"{name!r}: only SFI methods take config fields in brackets")
        fields = parse_overrides([i for i in inner.split(",") if i.strip()], name)
        method.sfi_config(overrides=fields)  # a clear error for a value the config refuses
        return replace(method, name=name, fields=tuple(fields.items()))
    if name in ("full", "full-static"):
        return Method(name, name)
    if name == "sfi":
        return Method(name, "sfi", "sfi")
    if name == "sfi:exact" or name.startswith("sfi:exact:"):
        preset = name[len("sfi:exact:"):] or None
        if preset is not None and preset not in PRESETS:
            raise SFIError(f"unknown drafter preset in {name!r}; choose from {', '.join(PRESETS)}")
        return Method(name, "sfi", "sfi", preset, exact=True)
    if name.startswith("sfi:"):
        preset = name[4:]
        if preset not in PRESETS:
            raise SFIError(f"unknown preset in {name!r}; choose from {', '.join(PRESETS)}")
        return Method(name, "sfi", "sfi", preset)
    if name.startswith("sfi+"):
        scorer = name[4:]
        make_scorer(scorer, SFIConfig())  # a clear error for an unknown or unfit scorer
        return Method(name, "sfi", scorer)
    if name in POLICIES:
        return Method(name, "eviction", name)
    raise SFIError(f"unknown method {name!r}; choose from full, sfi, sfi:<preset>, "
                   f"sfi:exact, sfi:exact:<preset>, sfi+<scorer>, {', '.join(POLICIES)}")


def build_cache(model: torch.nn.Module, tokenizer: Any, method: str | Method, *,
                config: SFIConfig | None = None, budget: float | None = None,
                context: int | None = None, scorer: Scorer | None = None,
                capacity: int | None = None, dense_only: bool = False,
                overrides: dict[str, Any] | None = None) -> DecodeCache:
    """A fresh cache for ``method``.

    Args:
        method: a name (see :func:`parse_method`) or a parsed :class:`Method`.
        config: SFI's knobs (a ``sfi:<preset>`` method takes its preset's instead); with a
            ``budget`` only those other than K and R are taken, and ``min_skip`` and
            ``min_gain`` only where ``overrides`` or the method's name set them (else 0 and
            1.0, :func:`sfi_config_for`).
        budget: tokens per KV head C, as a fraction of ``context`` (<= 1) or tokens; required
            by the eviction baselines; for SFI it sets K and R (:func:`sfi_config_for`).
        context: the prompt's length, for a fractional budget.
        scorer: SFI's slow-step scorer, overriding the method's.
        capacity: a hint of the tokens the cache will hold (prompt + new tokens); required by
            ``full-static``.
        dense_only: SFI sequences decoded densely (full attention that can share a batch).
        overrides: SFIConfig fields set on top of ``config`` or the preset.
    """
    method = parse_method(method) if isinstance(method, str) else method
    if method.kind == "full":
        return FullCache(config=model.config)
    if method.kind == "full-static":
        if capacity is None:
            raise SFIError("full-static needs the capacity of its cache")
        return FullStaticCache(config=model.config, max_cache_len=capacity)
    limit = None if budget is None else budget_tokens(budget, context or 0)
    if method.kind == "eviction":
        if limit is None:
            raise SFIError(f"{method.name} needs a budget (tokens kept per KV head)")
        return EvictionCache(model, make_policy(method.scorer, limit))
    sfi_config = method.sfi_config(config, overrides)
    if limit is not None:
        named = {**(overrides or {}), **dict(method.fields)}  # a break-even asked for is kept
        sfi_config = sfi_config_for(limit, sfi_config, named.get("min_skip", 0),
                                    named.get("min_gain", 1.0))
    if scorer is None and method.scorer != "sfi":
        scorer = make_scorer(method.scorer, sfi_config)
    return SlowFastCache(model, sfi_config, tokenizer=tokenizer, scorer=scorer,
                         max_cache_len=capacity, dense_only=dense_only)
