"""The engine's running batches (lanes): one for ``"sfi"`` and ``"full"`` requests, which take
one token per step, and one for ``"exact"`` requests, which take a round of exact mode per
step (``sfi.decoding.exact``: fast steps draft, one dense forward verifies). A round commits the
same number of positions for every row of its batch, so exact requests share a slab of their own.
A joining request's prefill, chunk by chunk, is a :class:`Join` (:func:`open_join`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.decoding.decode_step import Sampling
from sfi.decoding.exact import Emitted, ExactDecoder, RoundCounts
from sfi.decoding.prefill import chunk_end, prefill
from sfi.decoding.stopping import StopChecker
from sfi.hf.methods import build_cache
from sfi.hf.slowfast_cache import SlowFastCache
from sfi.server.requests import GenerationRequest


@dataclass
class Join:
    """A request whose prompt is being prefilled, chunk by chunk; ``window``: the last chunk
    holds at least this many tokens (the queries of SFI's first selection)."""

    request: GenerationRequest
    cache: SlowFastCache
    ids: torch.Tensor  # [1, T]
    window: int
    prefilled: int = 0  # prompt tokens in the cache
    seconds_per_token: float | None = None  # the last chunk's prefill time per token

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def prefill_to(self, model: torch.nn.Module, end: int) -> torch.Tensor:
        """Prefill the prompt up to ``end`` (timed); returns its last position's logits
        ``[1, V]``."""
        start, begin = self.prefilled, time.perf_counter()
        self.cache.prompt_continues = end < self.length
        logits = prefill(model, self.cache, self.ids[:, start:end], start=start)
        if logits.device.type == "cuda":  # (the chunk's own time, not its kernels' launch)
            torch.cuda.synchronize(logits.device)
        self.seconds_per_token = (time.perf_counter() - begin) / (end - start)
        self.prefilled = end
        return logits

    def next_end(self, tokens: int | None) -> int:
        """Where a next chunk of at most ``tokens`` (None: no bound) ends
        (:func:`sfi.decoding.prefill.chunk_end`)."""
        return chunk_end(self.prefilled, self.length, tokens, self.window)


MIN_CHUNK = 16  # the fewest prompt tokens a chunk between two decode steps takes


def chunk_tokens(join: Join | None, most: int | None, left: float | None) -> int | None:
    """How many tokens the joining prompt's next chunk may take (None: all that are left):
    ``most`` at most (None: no bound), and, with ``left`` seconds before the running streams'
    next step (None: nobody waits), as many as the last chunk's speed fits in them; none once
    the time is up."""
    if left is not None and left <= 0:
        return 0
    if left is None or join is None or join.seconds_per_token is None:
        return most
    fits = int(left / join.seconds_per_token)
    return fits if most is None else min(most, fits)


@dataclass
class Lane:
    """A running batch: its requests (row i of ``cache``'s slab is ``requests[i]``) and the
    position of each row's next input; the exact lane's rounds go through ``decoder``."""

    exact: bool
    requests: list[GenerationRequest] = field(default_factory=list)
    cache: SlowFastCache | None = None
    positions: list[int] = field(default_factory=list)
    decoder: ExactDecoder | None = None

    def start(self, model: torch.nn.Module, cache: SlowFastCache, rows: int) -> None:
        """``cache`` (a prefilled sequence) becomes this lane's batch, its slab ``rows`` rows."""
        self.cache = cache
        cache.reserve(rows)
        self.decoder = ExactDecoder(model, cache) if self.exact else None

    def clear(self) -> None:
        self.requests, self.cache, self.positions, self.decoder = [], None, [], None

    def kv_bytes(self) -> int:
        return self.cache.kv_bytes() if self.cache is not None else 0

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B]`` each row's last token and ``[B]`` the position it is fed at."""
        tokens = torch.tensor([r.tokens[-1] for r in self.requests], device=device)
        return tokens, torch.tensor(self.positions, device=device)

    def exact_round(self, device: torch.device) -> tuple[Emitted, RoundCounts]:
        """One round of exact mode over the lane: the tokens that follow each row's last (at
        least one, each row its own number), and what the round did."""
        tokens, positions = self.inputs(device)
        room = max(r.max_tokens - len(r.tokens) for r in self.requests)
        samplings = [r.sampling for r in self.requests]
        emitted = self.decoder.advance(tokens, positions - 1, None, [True] * len(tokens), room,
                                       samplings)
        self.positions = [p + n for p, n in zip(self.positions, emitted.counts.tolist())]
        return emitted, self.decoder.last


def request_sampling(request: GenerationRequest, device: torch.device) -> Sampling:
    """The request's sampling, with its own seeded generator when it sent a seed."""
    generator = None
    if request.seed is not None:
        generator = torch.Generator(device=device).manual_seed(request.seed)
    return Sampling(request.temperature, request.top_p, generator)


def open_join(model: torch.nn.Module, tokenizer: Any, request: GenerationRequest,
              config: SFIConfig, device: torch.device, eos: Collection[int],
              seconds_per_token: float | None) -> Join:
    """``request``'s prefill to come: its own cache (``config``; dense-only for a ``"full"``
    request; an ``"exact"`` request's verify writes full attention's KV, so its cache repairs
    nothing, ``repair_tokens``), its sampling and its stop checker."""
    if request.mode == "exact" and config.repair_tokens:
        config = config.replace(repair_tokens=0)
    cache = build_cache(model, tokenizer, "sfi", config=config,
                        dense_only=request.mode == "full",
                        capacity=len(request.prompt_ids) + request.max_tokens + 1)
    request._sampling = request_sampling(request, device)
    request._checker = StopChecker(tokenizer, eos, request.stop, request.max_tokens)
    ids = torch.tensor([request.prompt_ids], device=device)
    return Join(request, cache, ids, config.evidence_window,
                seconds_per_token=seconds_per_token)
