"""The engine's running batches (lanes): one for ``"sfi"`` and ``"full"`` requests, which take
one token per step, and one for ``"exact"`` requests, which take a round of exact mode per
step (``sfi.exact``: fast steps draft, one dense forward verifies). A round commits the same
number of positions for every row of its batch, so exact requests share a slab of their own.
A joining request's prefill, chunk by chunk, is a :class:`Join`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sfi.cache import SlowFastCache
from sfi.exact import ExactDecoder, RoundCounts, Sampling
from sfi.server.requests import GenerationRequest


@dataclass
class Join:
    """A request whose prompt is being prefilled, chunk by chunk."""

    request: GenerationRequest
    cache: SlowFastCache
    ids: torch.Tensor  # [1, T]
    bounds: list[int]
    done: int = 0  # chunks prefilled

    @property
    def length(self) -> int:
        return self.ids.shape[1]


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

    def exact_round(self, device: torch.device) -> tuple[torch.Tensor, RoundCounts]:
        """One round of exact mode over the lane: ``[B, n]`` the tokens that follow each row's
        last (n >= 1; a row that finishes takes fewer), and what the round did."""
        tokens, positions = self.inputs(device)
        room = max(r.max_tokens - len(r.tokens) for r in self.requests)
        samplings = [r.sampling for r in self.requests]
        emitted = self.decoder.advance(tokens, positions - 1, None, [True] * len(tokens), room,
                                       samplings)
        self.positions = [p + emitted.shape[1] for p in self.positions]
        return emitted, self.decoder.last


def request_sampling(request: GenerationRequest, device: torch.device) -> Sampling:
    """The request's sampling, with its own seeded generator when it sent a seed."""
    generator = None
    if request.seed is not None:
        generator = torch.Generator(device=device).manual_seed(request.seed)
    return Sampling(request.temperature, request.top_p, generator)
