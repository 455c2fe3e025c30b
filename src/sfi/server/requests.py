"""What the server's engine is asked and what it counts: requests, metrics, and the errors it
raises before a request runs."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.config import SFIConfig
from sfi.decode import StopChecker
from sfi.errors import SFIError
from sfi.stats import DecodeStats

# events: ("delta", text) ... then ("done", request) or ("error", exception)
EventSink = Callable[[str, Any], None]

class QueueFullError(SFIError):
    """The engine's waiting queue is full."""


@dataclass
class GenerationRequest:
    """One sequence to generate, and what the engine learns about it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    mode: str = "sfi"
    config: SFIConfig | None = None
    on_event: EventSink | None = None
    id: int = field(default_factory=itertools.count().__next__)
    text: str = ""
    finish_reason: str | None = None
    stats: DecodeStats | None = None
    cancelled: bool = False
    deadline: float | None = None  # time.monotonic() after which the request fails
    _sent: int = 0
    _generator: torch.Generator | None = None
    _checker: StopChecker | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        return self._checker.tokens if self._checker is not None else []


@dataclass
class EngineMetrics:
    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    slow_steps: int = 0
    fast_steps: int = 0
    dense_steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    joins: int = 0  # sequences put into a running batch
    batch_copies: int = 0  # joins that copied the batch's slab
    recent_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))

    def decode_tokens_per_second(self) -> float:
        """Tokens generated per second over the last (up to 64) batched steps."""
        if not self.recent_steps:
            return 0.0
        seconds = sum(s for s, _ in self.recent_steps)
        return sum(n for _, n in self.recent_steps) / seconds if seconds > 0 else 0.0


class KVBudgetError(SFIError):
    """A request needs more KV tokens than the engine may ever hold."""


def kv_tokens(request: GenerationRequest) -> int:
    """The KV tokens a request may come to hold: its prompt and every token it may generate."""
    return len(request.prompt_ids) + request.max_tokens
