"""A prompt's forward into a cache: :func:`prefill`, in one forward or in chunks.

Shapes: B sequences, L tokens of the forward, V vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.errors import PromptError, SFIError
from sfi.hf.facts import cache_argument


def chunk_end(start: int, length: int, tokens: int | None, window: int) -> int:
    """Where a prompt's chunk that starts at ``start`` ends, at most ``tokens`` long (None: no
    bound): at the prompt's end, or short of it by at least ``window`` tokens (the last chunk
    holds the queries of SFI's first selection)."""
    rest = length - start
    if tokens is None or rest <= max(tokens, window):
        return length
    return start + min(tokens, rest - window)


def prompt_chunks(length: int, chunk: int | None, window: int) -> list[int]:
    """Boundaries ``[0, ..., length]`` of a prompt's prefill chunks: at most ``chunk`` tokens
    each, except that the last has at least ``window`` tokens (the queries of SFI's first
    selection), taken from the chunk before it (:func:`chunk_end`)."""
    bounds = [0]
    while bounds[-1] < length:
        bounds.append(chunk_end(bounds[-1], length, chunk or None, window))
    return bounds if length else [0, 0]


PREFILL_CHUNK = 512  # tokens per forward of a prefill that reports its progress


def prefill(model: torch.nn.Module, cache: Any, ids: torch.Tensor, *,
            attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
            start: int | None = None, chunk: int | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Run ``ids [B, L]`` through ``model`` into ``cache``; return the logits ``[B, V]`` of the
    last position.

    Positions are ``positions``, else ``start, start + 1, ...`` when ``start`` is given, else
    the model's default (counting from the cache's length; with left padding pass them).
    With ``chunk`` the tokens go in forwards of at most that many (the last one at least SFI's
    evidence window, so that the first selection sees as many queries as in one forward; the
    first at least as long as the longest left padding, so that every row has a real token in
    it), and ``on_progress(done, total)`` is called after each. Chunks suit SFI's cache and
    transformers' dense caches; the eviction baselines, which compress after each prefill
    forward, are refused."""
    if positions is None and start is not None:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        positions = positions[None].expand(ids.shape[0], -1)
    length = ids.shape[1]
    if length == 0:
        raise PromptError("prefill got no tokens")
    config = getattr(cache, "config", None)
    window = config.evidence_window if isinstance(config, SFIConfig) else 1
    bounds = prompt_chunks(length, chunk, window)
    past = attention_mask.shape[1] - length if attention_mask is not None else 0
    if len(bounds) > 2:
        if getattr(cache, "compresses_after_prefill", False):
            raise SFIError(f"{type(cache).__name__} compresses its cache after each prefill "
                           "forward: prefill it in one forward (no chunk)")
        if attention_mask is not None:
            # every row needs a real token in the first chunk (a left-padded row's padding)
            padding = int((attention_mask[:, past:] == 0).sum(dim=-1).max())
            if padding >= length:
                raise PromptError("a sequence of the batch is all padding (empty prompt)")
            bounds = [0, *(b for b in bounds[1:] if b > padding)]
    continues = getattr(cache, "prompt_continues", None)  # the caller's own chunking, if any
    try:
        for begin, end in itertools.pairwise(bounds):
            kwargs: dict[str, Any] = {}
            if positions is not None:
                kwargs["position_ids"] = positions[:, begin:end]
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, :past + end]
            if continues is not None:
                cache.prompt_continues = end < length or continues
            out = model(input_ids=ids[:, begin:end], use_cache=True, logits_to_keep=1,
                        **{cache_argument(model): cache}, **kwargs)
            if on_progress is not None:
                on_progress(end, length)
    finally:
        if continues is not None:
            cache.prompt_continues = continues  # as the caller set it, even after a failure
    return out.logits[:, -1]
