"""The one interface every cache of a comparison implements, and transformers' own caches
behind it.

A :class:`DecodeCache` can be loaded with a shared prefill, says what each step did, and counts:
``SlowFastCache`` (slow-fast decoding), ``EvictionCache`` (the eviction baselines) and the two
dense adapters here, :class:`FullCache` over transformers' ``DynamicCache`` (the model as users
run it) and :class:`FullStaticCache` over its ``StaticCache`` (preallocated). Code that compares
methods talks to this protocol and never asks which cache it holds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from transformers import DynamicCache, StaticCache

from sfi.core.decode_stats import DecodeStats

KV = list[tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class DecodeCache(Protocol):
    """What the decode loops, the benchmark and the evaluations ask of a cache."""

    def load_prefix(self, prefix: KV, history: list[torch.Tensor] | None = None) -> None:
        """Fill the empty cache with a copy of ``prefix`` (per layer ``(keys, values)``,
        ``[B, H, T, D]``); ``history`` is the prefill's accumulated attention (H2O)."""
        ...

    def step_kinds(self) -> tuple[str, ...]:
        """Per sequence, what the last forward did: ``dense``, ``slow``, ``fast``, ``lagged``
        or ``masked`` (an eviction baseline's step)."""
        ...

    def stats(self, row: int | None = None) -> DecodeStats:
        """Counters of one sequence, or of the batch."""
        ...

    def read_fraction(self) -> tuple[float, float | None]:
        """``(mean fraction of the context read per decode step, the same over fast steps
        only, or None where there are none)``."""
        ...


class _CountedDenseCache:
    """Mixin for transformers' caches: every one-token forward is a dense decode step, and is
    counted in a tensor, so that a compiled step traces the count with the rest of the step
    (:mod:`sfi.decoding.compiled`; an int attribute would be a constant of the graph)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch = 0
        self._steps = torch.zeros((), dtype=torch.long)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._batch = key_states.shape[0]
            if key_states.shape[-2] == 1:
                self._steps.add_(1)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def _decode_steps(self) -> int:
        return int(self._steps)

    def load_prefix(self, prefix: KV, history: list[torch.Tensor] | None = None) -> None:
        for idx, (k, v) in enumerate(prefix):
            self.update(k.clone(), v.clone(), idx)

    def step_kinds(self) -> tuple[str, ...]:
        return ("dense",) * self._batch

    def stats(self, row: int | None = None) -> DecodeStats:
        steps = self._decode_steps * (self._batch if row is None else 1)
        return DecodeStats(dense_steps=steps)

    def read_fraction(self) -> tuple[float, float | None]:
        return 1.0, None


class FullCache(_CountedDenseCache, DynamicCache):
    """transformers' ``DynamicCache`` (full attention, grown by concatenation), counted."""


class FullStaticCache(_CountedDenseCache, StaticCache):
    """transformers' ``StaticCache`` (full attention over preallocated storage), counted."""
