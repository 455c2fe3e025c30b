"""Continuous batching: one decode loop steps every active sequence together.

A request is prefilled on its own (its own ``SlowFastCache``), then joins the running batch
(``SlowFastCache.merge``); each decode step is one batched forward pass; a finished or cancelled
sequence leaves at once (``SlowFastCache.keep``). Every sequence keeps its own SFI state,
triggers and counters; a ``mode="full"`` request is a dense-only sequence in the same batch.
The loop runs on one thread; callers talk to it through :meth:`Engine.submit` and
:meth:`Engine.cancel`, and hear back through each request's ``on_event`` callback.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.cache import SlowFastCache
from sfi.config import SFIConfig
from sfi.decode import StopChecker, decode_one, prefill, sample_next
from sfi.errors import SFIError
from sfi.hf import eos_token_ids
from sfi.methods import build_cache
from sfi.stats import DecodeStats

EventSink = Callable[[str, Any], None]  # ("delta", text) ... then ("done", request)


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
    recent_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))

    def decode_tokens_per_second(self) -> float:
        """Tokens generated per second over the last (up to 64) batched steps."""
        if not self.recent_steps:
            return 0.0
        seconds = sum(s for s, _ in self.recent_steps)
        return sum(n for _, n in self.recent_steps) / seconds if seconds > 0 else 0.0


class Engine:
    """The decode loop of a server: continuous batching over slow-fast decoding.

    Args:
        model, tokenizer: from :func:`sfi.load`.
        config: the default SFI configuration (a request may override its budget).
        max_batch: sequences decoded together at most.
        max_queue: requests waiting for a slot at most; past it :meth:`submit` raises.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: SFIConfig | None = None,
                 max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise SFIError("max_batch must be >= 1 and max_queue >= 0")
        self.model, self.tokenizer = model, tokenizer
        self.config = config if config is not None else SFIConfig()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = EngineMetrics()
        self.eos = eos_token_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._active: list[GenerationRequest] = []
        self._batch: SlowFastCache | None = None
        self._positions: list[int] = []
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    # --- the caller's side ------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="sfi-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises :class:`QueueFullError` when ``max_queue`` are waiting."""
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self.metrics.requests += 1
            self._waiting.append(request)
            self._wake.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        """Stop a request; it leaves the batch before the next step."""
        with self._wake:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
            self._wake.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._waiting and not self._active:
                    self._wake.wait(timeout=1.0)
                if not self._running:
                    return
            try:
                self._drop_finished()
                self._admit()
                if self._active:
                    self._step()
            except Exception as exc:  # a failure must not leave callers waiting forever
                for request in [*self._active, *self._waiting]:
                    self._finish(request, "error", error=exc)
                self._active, self._batch, self._positions = [], None, []
                self._waiting.clear()

    @torch.inference_mode()
    def _admit(self) -> None:
        while len(self._active) < self.max_batch:
            with self._wake:
                if not self._waiting:
                    return
                request = self._waiting.popleft()
            self._prefill(request)

    def _prefill(self, request: GenerationRequest) -> None:
        cache = build_cache(self.model, self.tokenizer, "sfi", config=request.config or self.config,
                            dense_only=request.mode == "full",
                            capacity=len(request.prompt_ids) + request.max_tokens + 1)
        if request.seed is not None:
            request._generator = torch.Generator(device=self.device).manual_seed(request.seed)
        request._checker = StopChecker(self.tokenizer, self.eos, request.stop, request.max_tokens)
        ids = torch.tensor([request.prompt_ids], device=self.device)
        logits = prefill(self.model, cache, ids, start=0)
        self.metrics.prompt_tokens += len(request.prompt_ids)
        if self._accept(request, logits, cache, 0):
            return
        if self._batch is None:
            self._batch = cache
        else:
            self._batch.merge(cache)
        self._active.append(request)
        self._positions.append(len(request.prompt_ids))

    @torch.inference_mode()
    def _step(self) -> None:
        tokens = torch.tensor([r.tokens[-1] for r in self._active], device=self.device)
        positions = torch.tensor(self._positions, device=self.device)
        start = time.perf_counter()
        logits = decode_one(self.model, self._batch, tokens, positions)
        self._count_step(self._batch)
        for row, request in enumerate(self._active):
            self._positions[row] += 1
            self._accept(request, logits[row: row + 1], self._batch, row)
        self.metrics.recent_steps.append((time.perf_counter() - start, len(self._active)))
        self._drop_finished()

    def _count_step(self, cache: SlowFastCache) -> None:
        kinds = cache.step_kinds()
        self.metrics.decode_steps += 1
        self.metrics.dense_steps += kinds.count("dense")
        self.metrics.slow_steps += kinds.count("slow")
        self.metrics.fast_steps += kinds.count("fast") + kinds.count("lagged")

    def _accept(self, request: GenerationRequest, logits: torch.Tensor, cache: SlowFastCache,
                row: int) -> bool:
        """Sample the next token of ``request``; returns whether it has finished."""
        token = int(sample_next(logits, request.temperature, request.top_p,
                                request._generator)[0])
        if request.cancelled:
            return self._finish(request, "cancelled", cache, row)
        checker = request._checker
        kept = token not in self.eos
        checker.push(token)
        if kept:
            self.metrics.generated_tokens += 1
        if checker.finish_reason == "stop":
            request.text = checker.text
            if kept:
                self._emit_delta(request)
            return self._finish(request, "stop", cache, row)
        request.text = checker.text
        if not request.text.endswith("\ufffd"):  # hold back an incomplete UTF-8 character
            self._emit_delta(request)
        if checker.finish_reason == "length":
            request.text = request.text.rstrip("\ufffd")
            self._emit_delta(request)
            return self._finish(request, "length", cache, row)
        return False

    def _emit_delta(self, request: GenerationRequest) -> None:
        delta = request.text[request._sent:]
        if delta and request.on_event is not None:
            request._sent = len(request.text)
            request.on_event("delta", delta)

    def _finish(self, request: GenerationRequest, reason: str,
                cache: SlowFastCache | None = None, row: int = 0,
                error: Exception | None = None) -> bool:
        if request.done:
            return True
        request.finish_reason = reason
        request.stats = DecodeStats.merge([cache.stats(row)]) if cache is not None \
            else DecodeStats()
        if reason == "cancelled":
            self.metrics.cancelled += 1
        if request.on_event is not None:
            request.on_event("error" if error is not None else "done",
                             error if error is not None else request)
        return True

    def _drop_finished(self) -> None:
        for row, request in enumerate(self._active):
            if request.cancelled and not request.done:
                self._finish(request, "cancelled", self._batch, row)
        keep = [row for row, request in enumerate(self._active) if not request.done]
        if len(keep) == len(self._active):
            return
        self._active = [self._active[row] for row in keep]
        self._positions = [self._positions[row] for row in keep]
        if keep:
            self._batch.keep(keep)
        else:
            self._batch = None
