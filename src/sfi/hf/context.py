"""The step in progress: what the attention function needs while a model runs one forward.

A cache that takes part in sfi's routing (``begin_forward``/``end_forward``, see ``sfi.hf.routing``)
returns a :class:`StepContext` before each forward; it is made current in a context variable
for the duration of that forward, so that the attention function, which transformers calls
without the cache, finds the layer of each call and the step's plan. Each thread (and each
asyncio task) sees its own current step.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from sfi.step.probes import ProbeCheck


@dataclass
class StepContext:
    """One forward pass through a cache.

    Attributes:
        layers: what attends each layer, indexed by the model's ``layer_idx``: an
            :class:`sfi.hf.attention.AttendingLayer` (a slow-fast layer's attention, an eviction
            layer), or None (or a layer without ``attend``) where the model's own attention
            serves.
        plan: what the cache decided for this forward (a ``StepPlan`` for slow-fast caches).
        rebuilder: where slow steps' selections are computed (inline, or a CUDA side stream).
        lagged: per row, how many layers read densely although the row was planned fast (its
            rebuild was not ready); filled in by the layers while the step runs.
        coverage: the probe layers' page scores, checked together when the forward ends.
        missed: rows whose fast memory a probe layer found missing a page the query bounds
            highly, or a copy about to run past it (``sfi.core.coverage``): they refresh at their
            next step.
    """

    layers: Sequence[Any]
    plan: Any = None
    rebuilder: Any = None
    lagged: dict[int, int] = field(default_factory=dict)
    coverage: ProbeCheck = field(default_factory=ProbeCheck)
    missed: set[int] = field(default_factory=set)

    def layer(self, layer_idx: int) -> Any:
        """The layer of the cache that serves ``layer_idx``, or None."""
        return self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None

    def record_lag(self, rows: Sequence[int]) -> None:
        for row in rows:
            self.lagged[row] = self.lagged.get(row, 0) + 1


_CURRENT: ContextVar[StepContext | None] = ContextVar("sfi_current_step", default=None)


def current_step() -> StepContext | None:
    """The step the model is running now, or None outside an sfi cache's forward."""
    return _CURRENT.get()


def enter_step(step: StepContext | None) -> Token:
    return _CURRENT.set(step)


def leave_step(token: Token) -> None:
    _CURRENT.reset(token)
