"""What the server's engine is asked and what it counts: requests, metrics, and the errors it
raises before a request runs."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.decoding.decode_step import Sampling
from sfi.decoding.exact import RoundCounts
from sfi.decoding.stopping import StopChecker
from sfi.errors import SFIError

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
    mode: str = "sfi"  # "sfi", "full" (dense) or "exact" (sfi.decoding.exact)
    config: SFIConfig | None = None
    on_event: EventSink | None = None
    id: int = field(default_factory=itertools.count().__next__)
    text: str = ""
    finish_reason: str | None = None
    stats: DecodeStats | None = None
    cancelled: bool = False
    deadline: float | None = None  # time.monotonic() after which the request fails
    _sent: int = 0
    _sampling: Sampling | None = None  # set when it starts (its seeded generator)
    _checker: StopChecker | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampling(self) -> Sampling:
        """How its tokens are chosen (temperature, top_p, its seeded generator)."""
        if self._sampling is None:
            self._sampling = Sampling(self.temperature, self.top_p)
        return self._sampling

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        return self._checker.tokens if self._checker is not None else []


@dataclass(frozen=True)
class EngineLimits:
    """The limits an :class:`sfi.server.engine.Engine` runs under (its arguments of the same
    names), checked when made, so that a command line can check them before it loads a model.

    Attributes:
        max_batch: sequences decoded together at most (exact mode's batch and the other
            one together; each batch's slab reserves ``max_batch`` rows when it starts).
        max_queue: requests waiting for a free slot at most (requests that a free slot will take
            at once do not count); past it ``Engine.submit`` raises.
        request_timeout: seconds a request may take from submission, or None for no limit.
        prefill_chunk: a joining prompt is prefilled in chunks of at most this many tokens
            between decode steps of the running batch (None: no bound of its own).
        max_stall: seconds of prefill between two decode steps of running streams: chunks
            are sized to end within it at the last chunk's speed (at least 16 tokens per
            gap), so that a stream waits about ``max_stall`` plus a step for newcomers.
        max_kv_tokens: the KV tokens (prompt + max_tokens per sequence) the running batch may
            hold together; a request that does not fit waits in the queue until others finish
            (None: bounded by ``max_batch`` alone).
    """

    max_batch: int = 8
    max_queue: int = 64
    request_timeout: float | None = None
    prefill_chunk: int | None = 128
    max_stall: float = 0.4
    max_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise SFIError(f"max_batch must be >= 1 (got {self.max_batch})")
        if self.max_queue < 0:
            raise SFIError(f"max_queue must be >= 0 (got {self.max_queue})")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise SFIError(f"prefill_chunk must be >= 1 token, or None for one forward "
                           f"(got {self.prefill_chunk})")
        if self.max_stall < 0:
            raise SFIError(f"max_stall must be >= 0 seconds (got {self.max_stall})")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise SFIError(f"max_kv_tokens must be >= 1 (got {self.max_kv_tokens})")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise SFIError(f"request_timeout must be > 0 seconds (got {self.request_timeout})")


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
    exact_verify_steps: int = 0  # exact mode: sequence-verifies, drafts, accepted drafts,
    exact_drafted: int = 0       # and sequence-steps taken densely (sfi.decoding.exact.RoundCounts)
    exact_accepted: int = 0
    exact_dense_steps: int = 0
    recent_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    prefill_seconds_per_token: float | None = None  # the last prefill chunk's (sizes the next)

    def count_step(self, kinds: list[str]) -> None:
        """A batched decode step whose sequences took steps of these kinds."""
        self.decode_steps += 1
        self.dense_steps += kinds.count("dense")
        self.slow_steps += kinds.count("slow")
        self.fast_steps += kinds.count("fast") + kinds.count("lagged")

    def count_round(self, counts: RoundCounts) -> None:
        """A round of exact mode (its verifies and dense steps are dense sequence-steps)."""
        self.decode_steps += 1
        self.exact_verify_steps += counts.verify_steps
        self.exact_drafted += counts.drafted
        self.exact_accepted += counts.accepted
        self.exact_dense_steps += counts.dense_steps
        self.dense_steps += counts.verify_steps + counts.dense_steps

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
