"""One decode step's model call and the choice of its token, shared by every loop
(:mod:`sfi.decoding.decode`, :mod:`sfi.decoding.exact`, the server's engine), and
:func:`token_steps`, the one-token steps one after another.

Shapes: B sequences, V vocabulary, T cache length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from sfi.hf.facts import cache_argument
from sfi.hf.plan import REPAIR


@runtime_checkable
class Repairing(Protocol):
    """A cache whose slow steps may re-run the positions before them
    (:class:`sfi.SlowFastCache` with ``SFIConfig.repair_tokens``)."""

    phase: str | None

    def repair_inputs(self, tokens: torch.Tensor) -> torch.Tensor | None: ...

    def rewind(self, length: int) -> None: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


def decode_one(model: torch.nn.Module, cache: Any, tokens: torch.Tensor,
               positions: torch.Tensor, attention_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
    """One decode step: ``tokens [B]`` at ``positions [B]`` -> next-token logits ``[B, V]``.

    ``attention_mask [B, T + 1]`` covers the cache and the step (None without padding). Where
    the cache asks for it (:class:`Repairing`), the step is a repairing slow step: the cache
    forgets its last n positions and one forward feeds their inputs and ``tokens`` as a dense
    block (``sfi.hf.plan.REPAIR``), which writes their KV again and is the step."""
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    inputs = cache.repair_inputs(tokens) if isinstance(cache, Repairing) else None
    if inputs is None:
        out = model(input_ids=tokens[:, None], position_ids=positions[:, None], use_cache=True,
                    **{cache_argument(model): cache}, **kwargs)
        return out.logits[:, -1]
    n = inputs.shape[1]
    cache.rewind(cache.get_seq_length() - n)
    cache.phase = REPAIR
    try:
        return block_logits(model, cache, torch.cat([inputs, tokens[:, None]], dim=1),
                            positions - n, attention_mask)[:, -1]
    finally:
        cache.phase = None


def block_logits(model: torch.nn.Module, cache: Any, ids: torch.Tensor, first: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
    """``ids [B, Q]`` in one forward at positions ``first [B]`` onwards (``attention_mask
    [B, T + Q]`` covering the cache and the block; None without padding) -> the logits of the
    last ``keep`` positions ``[B, keep, V]``: a repair's block, exact mode's verify."""
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    steps = torch.arange(ids.shape[1], device=first.device)
    out = model(input_ids=ids, position_ids=first[:, None] + steps[None, :], use_cache=True,
                logits_to_keep=keep, **{cache_argument(model): cache}, **kwargs)
    return out.logits[:, -keep:]


def extended_mask(attention_mask: torch.Tensor | None, more: int) -> torch.Tensor | None:
    """``attention_mask [B, T]`` with ``more`` real positions after it (None stays None)."""
    if attention_mask is None:
        return None
    return torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], more)], -1)


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """``[B, V]`` logits -> ``[B]`` token ids: greedy at temperature 0, else nucleus sampling.

    Temperatures below ``GREEDY_BELOW`` are greedy (dividing by them overflows float32), and the
    nucleus always keeps the most likely token, however small ``top_p`` is.
    """
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = token_distribution(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``[..., V]`` logits -> the distribution :func:`sample_next` draws from (temperature,
    then the nucleus of ``top_p``; unnormalised after the nucleus cut), float32. Exact mode
    takes both its draft and its target distributions from here (``sfi.decoding.exact``)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        keep[..., 0] = True
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def repeated_ngram_tokens(tokens: Sequence[int], n: int) -> list[int]:
    """The tokens that would make the last ``n - 1`` of ``tokens`` into an ``n``-gram that
    ``tokens`` already holds (transformers' ``no_repeat_ngram_size``, over the answer only)."""
    if n < 1 or len(tokens) < n:
        return []
    tail = list(tokens[len(tokens) - n + 1:]) if n > 1 else []
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1)
            if list(tokens[i:i + n - 1]) == tail]


@dataclass(frozen=True)
class Sampling:
    """How one row chooses its tokens: :func:`sample_next`'s temperature (below
    ``GREEDY_BELOW``: greedy), nucleus ``top_p`` and random ``generator``. Rows given the same
    ``Sampling`` object draw together, in one call."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> the normalised distribution this row draws from."""
        probs = token_distribution(logits, self.temperature, self.top_p)
        return probs / probs.sum(dim=-1, keepdim=True)


def token_steps(model: torch.nn.Module, cache: Any, tokens: torch.Tensor,
                position: torch.Tensor, attention_mask: torch.Tensor | None,
                sampling: Sampling) -> Iterator[list[list[int]]]:
    """One-token decode steps from ``tokens [B]`` at ``position + 1`` (``position [B]``; the
    padded ``attention_mask [B, T]``, extended by one each step; None without padding, so
    that a step does no O(context) work): yields each step's token per row, ``[[t_0], ...,
    [t_B-1]]``, for as long as the caller takes them."""
    while True:
        attention_mask = extended_mask(attention_mask, 1)
        position = position + 1
        logits = decode_one(model, cache, tokens, position, attention_mask)
        tokens = sample_next(logits, sampling.temperature, sampling.top_p, sampling.generator)
        yield [[token] for token in tokens.tolist()]
