"""Continuous batching: one decode loop steps every active sequence together.

A request is prefilled on its own (its own ``SlowFastCache``), in chunks between the running
batch's decode steps (sized to fit in ``max_stall``), then joins the running batch
(``SlowFastCache.merge``); each decode step is one batched forward pass; a finished or
cancelled sequence leaves at once (``SlowFastCache.keep``). The batch's KV lives in a slab
of ``max_batch`` rows reserved at its start (``SlowFastCache.reserve``): a joining sequence is
copied into a free row, a leaving one gives its row back (the batch is copied only when the
slab needs more positions).
Every sequence keeps its own SFI state, triggers and counters; a ``mode="full"`` request is a
dense-only sequence in the same batch. ``mode="exact"`` requests (``sfi.decoding.exact``: full
attention's tokens, drafted by fast steps) run in a second batch of their own
(``sfi.server.lanes``): a loop iteration steps each batch once, the exact one by a round of
drafts and a verify (a configuration's ``repair_tokens`` repairs the lossy batch's slow steps,
an exact request's verify writes full attention's KV, so its cache repairs nothing). The loop
runs on one thread; callers talk to it through
:meth:`Engine.submit` and :meth:`Engine.cancel`, and hear back through each request's
``on_event`` callback.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.decoding.decode_step import decode_one, sample_next
from sfi.errors import SFIError
from sfi.hf.facts import eos_token_ids
from sfi.hf.slowfast_cache import SlowFastCache
from sfi.runtime import give_back_freed_memory
from sfi.server.lanes import MIN_CHUNK, Join, Lane, chunk_tokens, open_join
from sfi.server.requests import (
    EngineLimits,
    EngineMetrics,
    GenerationRequest,
    KVBudgetError,
    QueueFullError,
    kv_tokens,
)

__all__ = ["Engine", "EngineLimits"]
log = logging.getLogger("sfi.server")


class Engine:
    """The decode loop of a server: continuous batching over slow-fast decoding.

    Args:
        model, tokenizer: from :func:`sfi.load`.
        config: the default SFI configuration (a request may override its budget).
        max_batch, max_queue, request_timeout, prefill_chunk, max_stall, max_kv_tokens: its
            limits (:class:`sfi.server.requests.EngineLimits`).

    A request whose prefill or sampling raises fails alone (its traceback is logged); a failing
    batched forward pass fails the sequences in that batch and the engine carries on. The loop
    thread's health is :attr:`alive`.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: SFIConfig | None = None,
                 max_batch: int = 8, max_queue: int = 64, request_timeout: float | None = None,
                 prefill_chunk: int | None = 128, max_stall: float = 0.4,
                 max_kv_tokens: int | None = None):
        limits = EngineLimits(max_batch, max_queue, request_timeout, prefill_chunk, max_stall,
                              max_kv_tokens)
        self.max_batch, self.max_queue = limits.max_batch, limits.max_queue
        self.request_timeout, self.prefill_chunk = limits.request_timeout, limits.prefill_chunk
        self.max_stall, self.max_kv_tokens = limits.max_stall, limits.max_kv_tokens
        self.min_chunk = min(MIN_CHUNK, self.prefill_chunk or MIN_CHUNK)  # tokens in a gap
        self._step_done = 0.0  # when the last decode step ended (perf_counter)
        self.model, self.tokenizer = model, tokenizer
        self.config = config if config is not None else SFIConfig()
        self.kv_bytes = 0  # what the running batch's slab holds (set by the engine thread)
        self.metrics = EngineMetrics()
        self.eos = eos_token_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._lanes = (Lane(exact=False), Lane(exact=True))
        self._join: Join | None = None  # the request whose prompt is being prefilled
        self._ready: tuple[GenerationRequest, SlowFastCache, int] | None = None  # prefilled
        self._wake = threading.Condition()
        self._running = self._stopped = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the loop thread died, if it did

    # --- the caller's side ------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="sfi-engine", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop the loop: running and waiting requests end with an error event (none hangs).

        ``wait=False`` only asks (safe from a signal handler); the loop ends after its step.
        """
        self._running, self._stopped = False, True
        if not wait:  # no lock: the caller may be a signal handler interrupting a holder
            return    # the loop notices within its 1 s wait, or after the current step
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        """Whether the loop thread is running and has not died."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises :class:`QueueFullError` when ``max_queue`` requests already
        wait for a slot that is not free, or :class:`SFIError` when the engine is stopped."""
        need = kv_tokens(request)
        if self.max_kv_tokens is not None and need > self.max_kv_tokens:
            raise KVBudgetError(f"the request needs {need} KV tokens (prompt + max_tokens); "
                                f"the server holds at most {self.max_kv_tokens}")
        with self._wake:
            if self._stopped:
                raise SFIError("the server is shutting down")
            free = self.max_batch - self.active - (self._join is not None) \
                - (self._ready is not None)
            if len(self._waiting) - max(free, 0) >= self.max_queue:
                self.metrics.rejected += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self.metrics.requests += 1
            if self.request_timeout is not None and request.deadline is None:
                request.deadline = time.monotonic() + self.request_timeout
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
        """Sequences in the running batches."""
        return sum(len(lane.requests) for lane in self._lanes)

    def _lane(self, request: GenerationRequest) -> Lane:
        return self._lanes[request.mode == "exact"]

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while self._running and not self._waiting and not self.active \
                            and self._join is None and self._ready is None:
                        self._wake.wait(timeout=1.0)
                    if not self._running:
                        break
                try:
                    if not self._drop_finished():  # at most one batch rebuild per gap
                        self._admit()
                except Exception as exc:  # a batch could not be rebuilt: its sequences fail
                    for lane in self._lanes:
                        self._fail_lane(lane, exc)
                for lane in self._lanes:
                    if lane.requests:
                        self._step_lane(lane)
        except BaseException as exc:  # the loop itself died: say so, and fail everyone
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("the engine loop died")
            raise
        finally:
            shutdown = SFIError(self.failure or "the server is shutting down")
            with self._wake:
                pending = [*(r for lane in self._lanes for r in lane.requests), *self._waiting]
                if self._join is not None:
                    pending.append(self._join.request)
                if self._ready is not None:
                    pending.append(self._ready[0])
                self._waiting.clear()
                self._join = self._ready = None
            for request in pending:
                self._finish(request, "error", error=shutdown)
            for lane in self._lanes:
                lane.clear()

    @torch.inference_mode()
    def _admit(self) -> None:
        """Prefill chunks of the joining prompt (or of the next waiting request's, given a free
        slot) that fit in ``max_stall`` (``lanes.chunk_tokens``); while nobody decodes, whole
        prompts back to back. A prefilled prompt joins the batch in the next gap, alone."""
        if self._ready is not None:
            self._join_batch(*self._ready)
            self._ready = None
            return
        while True:
            if self._join is None and not self._start_join():
                return
            self._advance_join()
            if self._ready is not None:
                if self.active:
                    return  # it joins in the next gap
                self._join_batch(*self._ready)
                self._ready = None
            elif self.active and self._chunk_tokens() in range(self.min_chunk):  # (None: any)
                return  # a decode step of the running batch before the next chunk

    def _chunk_tokens(self) -> int | None:
        """The joining prompt's next chunk's tokens at most (None: all that are left)."""
        left = self.max_stall - (time.perf_counter() - self._step_done) if self.active else None
        return chunk_tokens(self._join, self.prefill_chunk, left)

    def _start_join(self) -> bool:
        """Take the next waiting request into ``_join``; returns whether there was one."""
        while self.active < self.max_batch:
            with self._wake:
                if not self._waiting or not self._running:
                    return False
                if not self._fits(self._waiting[0]):
                    return False  # it waits (first come, first served) until others finish
                request = self._waiting.popleft()
            if self._expired(request) or request.done:
                continue
            try:
                self._join = open_join(self.model, self.tokenizer, request,
                                       request.config or self.config, self.device, self.eos,
                                       self.metrics.prefill_seconds_per_token)
            except Exception as exc:  # this request fails alone
                log.exception("request %s could not start", request.id)
                self._finish(request, "error", error=exc)
                continue
            return True
        return False

    def _fits(self, request: GenerationRequest) -> bool:
        """Whether ``request``'s KV fits beside the running batch's, under ``max_kv_tokens``."""
        if self.max_kv_tokens is None:
            return True
        return self.kv_tokens_held + kv_tokens(request) <= self.max_kv_tokens

    @property
    def kv_tokens_held(self) -> int:
        """KV tokens reserved by the running batch (prompt + max_tokens per sequence)."""
        return sum(kv_tokens(r) for lane in self._lanes for r in lane.requests)

    def _advance_join(self) -> None:
        """Prefill the next chunk of the joining prompt; after the last one, sample the first
        token and put the sequence in the running batch."""
        join = self._join
        request = join.request
        if request.cancelled or self._expired(request):
            self._join = None
            if not request.done:
                self._finish(request, "cancelled")
            join.cache.close()
            return
        tokens = self._chunk_tokens()
        end = join.next_end(None if tokens is None else max(tokens, self.min_chunk))
        try:
            logits = join.prefill_to(self.model, end)
            self.metrics.prefill_seconds_per_token = join.seconds_per_token
            self.metrics.prefill_chunks += 1
            give_back_freed_memory()  # a chunk's activations
            if end < join.length:
                return
            self._join = None
            self.metrics.prompt_tokens += join.length
            if self._accept(request, logits, join.cache, 0):
                return
        except Exception as exc:  # this request fails alone
            log.exception("request %s failed in its prefill", request.id)
            self._join = None
            self._finish(request, "error", error=exc)
            return
        self._ready = (request, join.cache, join.length)

    def _join_batch(self, request: GenerationRequest, cache: SlowFastCache,
                    length: int) -> None:
        """Put a prefilled sequence into a free row of the running batch's slab."""
        if request.done:  # cancelled or expired after its prefill
            cache.close()
            return
        lane = self._lane(request)
        if lane.cache is None:
            lane.start(self.model, cache, self.max_batch)
        else:
            copies = lane.cache.copies
            lane.cache.merge(cache)
            self.metrics.joins += 1
            self.metrics.batch_copies += lane.cache.copies > copies
            give_back_freed_memory()
        self._held_bytes()
        lane.requests.append(request)
        lane.positions.append(length)

    def _held_bytes(self) -> None:
        self.kv_bytes = sum(lane.kv_bytes() for lane in self._lanes)

    def _expired(self, request: GenerationRequest) -> bool:
        """Fail ``request`` if its deadline has passed; returns whether it did."""
        if request.deadline is None or request.done or time.monotonic() < request.deadline:
            return False
        self._finish(request, "error", error=SFIError(
            f"the request took longer than the server's limit of {self.request_timeout} s"))
        return True

    def _step_lane(self, lane: Lane) -> None:
        """One step of ``lane``; if its batched forward fails, its sequences fail."""
        try:
            if lane.exact:
                self._exact_round(lane)
            else:
                self._step(lane)
        except Exception as exc:
            self._fail_lane(lane, exc)

    def _fail_lane(self, lane: Lane, exc: Exception) -> None:
        if lane.requests:
            log.exception("a batch failed; its %d sequences fail", len(lane.requests))
        for request in lane.requests:
            self._finish(request, "error", error=exc)
        lane.clear()
        self._held_bytes()

    @torch.inference_mode()
    def _step(self, lane: Lane) -> None:
        tokens, positions = lane.inputs(self.device)
        start = time.perf_counter()
        logits = decode_one(self.model, lane.cache, tokens, positions)
        self.metrics.count_step(lane.cache.step_kinds())
        for row, request in enumerate(lane.requests):
            lane.positions[row] += 1
            try:
                self._accept(request, logits[row: row + 1], lane.cache, row)
            except Exception as exc:  # this request fails alone
                log.exception("request %s failed while sampling", request.id)
                self._finish(request, "error", lane.cache, row, error=exc)
        self._step_done = time.perf_counter()
        self.metrics.recent_steps.append((self._step_done - start, len(lane.requests)))

    @torch.inference_mode()
    def _exact_round(self, lane: Lane) -> None:
        """A round of exact mode over ``lane``: each row takes the tokens it committed, up to
        its end (the rest of a finished row's are dropped with it)."""
        start = time.perf_counter()
        emitted, counts = lane.exact_round(self.device)
        self.metrics.count_round(counts)
        taken = 0
        for row, (request, tokens) in enumerate(zip(lane.requests, emitted.rows())):
            try:
                for token in tokens:
                    taken += 1
                    if self._take(request, token, lane.cache, row):
                        break
            except Exception as exc:  # this request fails alone
                log.exception("request %s failed while taking its tokens", request.id)
                self._finish(request, "error", lane.cache, row, error=exc)
        self._step_done = time.perf_counter()
        self.metrics.recent_steps.append((self._step_done - start, taken))

    def _accept(self, request: GenerationRequest, logits: torch.Tensor, cache: SlowFastCache,
                row: int) -> bool:
        """Sample the next token of ``request``; returns whether it has finished."""
        sampling = request.sampling
        token = int(sample_next(logits, sampling.temperature, sampling.top_p,
                                sampling.generator)[0])
        return self._take(request, token, cache, row)

    def _take(self, request: GenerationRequest, token: int, cache: SlowFastCache,
              row: int) -> bool:
        """``request``'s next token is ``token``; returns whether it has finished."""
        if request.cancelled:
            return self._finish(request, "cancelled", cache, row)
        checker = request._checker
        if token not in self.eos:
            self.metrics.generated_tokens += 1
        checker.push(token)
        request.text = checker.text
        if checker.done:
            if checker.finish_reason == "length":
                request.text = request.text.rstrip("\ufffd")
            self._emit_delta(request, request.text)
            return self._finish(request, checker.finish_reason, cache, row)
        settled = checker.settled_text  # held back: a tail that may become a stop string
        if not settled.endswith("\ufffd"):  # or an incomplete UTF-8 character
            self._emit_delta(request, settled)
        return False

    def _emit_delta(self, request: GenerationRequest, text: str) -> None:
        delta = text[request._sent:]
        if delta and request.on_event is not None:
            request._sent = len(text)
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

    def _drop_finished(self) -> bool:
        """Take finished and cancelled sequences out of the batches; returns whether a batch
        was rebuilt."""
        rebuilt = False
        for lane in self._lanes:
            rebuilt |= self._drop_from(lane)
        return rebuilt

    def _drop_from(self, lane: Lane) -> bool:
        for row, request in enumerate(lane.requests):
            if request.cancelled and not request.done:
                self._finish(request, "cancelled", lane.cache, row)
            self._expired(request)
        keep = [row for row, request in enumerate(lane.requests) if not request.done]
        if len(keep) == len(lane.requests):
            return False
        if not keep:
            lane.clear()
            self._held_bytes()
            return False
        lane.requests = [lane.requests[row] for row in keep]
        lane.positions = [lane.positions[row] for row in keep]
        lane.cache.keep(keep)  # moves rows within the slab: never a copy of it
        give_back_freed_memory()
        return True
