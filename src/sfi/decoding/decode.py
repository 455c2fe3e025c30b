"""``sfi.generate``: prompts in, continuations out, in one short loop.

The loop is made of the pieces every loop of the project shares (the server's engine, the
evaluations, the benchmark), as in gpt-fast: :func:`sfi.decoding.prefill.prefill` (a prompt's
forward), the step functions of :mod:`sfi.decoding.decode_step`
(:func:`~sfi.decoding.decode_step.token_steps`, one token per row per step) or exact mode's
rounds (:meth:`sfi.decoding.exact.ExactDecoder.rounds`, several tokens per row per round), and
:class:`sfi.decoding.stopping.Outputs` (when each row ends, its text, the streaming).

``mode="sfi"`` decodes through a :class:`~sfi.hf.slowfast_cache.SlowFastCache`; ``mode="full"``
through transformers' ``DynamicCache`` and SDPA, the model as users run it today; ``mode="exact"``
through a ``SlowFastCache`` whose fast steps draft and whose dense forwards verify
(:mod:`sfi.decoding.exact`): full attention's tokens. They share the loop, so their timings compare
like with like.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.core.scorers import Scorer
from sfi.decoding.decode_step import (
    Sampling,
    decode_one,
    repeated_ngram_tokens,
    sample_next,
    token_steps,
)
from sfi.decoding.exact import ExactDecoder
from sfi.decoding.prefill import prefill
from sfi.decoding.prompts import EncodedPrompts, Prompts, encode_prompts
from sfi.decoding.stopping import Outputs, StopChecker
from sfi.errors import PromptError, SFIError
from sfi.hf.facts import context_length, eos_token_ids
from sfi.hf.methods import build_cache

Mode = Literal["sfi", "full", "exact"]
MODES: tuple[str, ...] = ("sfi", "full", "exact")


def continue_greedy(model: torch.nn.Module, cache: Any, ids: torch.Tensor, start: int,
                    max_new_tokens: int, eos: Collection[int],
                    on_token: Callable[[int], None] | None = None,
                    no_repeat_ngram: int = 0) -> list[int]:
    """Greedy decoding of one sequence whose cache already holds ``ids[:, :start]``: run
    ``ids [1, T]``'s remaining tokens as one forward, then one token per step until an
    end-of-sequence token (not kept) or ``max_new_tokens``; returns the new token ids.
    ``on_token(token_id)`` sees each kept token as it comes. ``no_repeat_ngram`` > 0 never
    repeats an n-gram of that length within the answer (:func:`repeated_ngram_tokens`; the
    prompt's n-grams stay allowed, so that an answer can quote it)."""
    total, device = ids.shape[1], ids.device
    checker = StopChecker(None, eos, max_tokens=max_new_tokens)
    logits = prefill(model, cache, ids[:, start:], start=start)
    while True:
        kept = len(checker.tokens)
        banned = repeated_ngram_tokens(checker.tokens, no_repeat_ngram)
        if banned:
            logits[0, banned] = float("-inf")
        ended = checker.push(int(logits[0].argmax()))
        if on_token is not None and len(checker.tokens) > kept:
            on_token(checker.tokens[-1])
        if ended:
            return checker.tokens
        token = torch.tensor([checker.tokens[-1]], device=device)
        position = torch.tensor([total + len(checker.tokens) - 1], device=device)
        logits = decode_one(model, cache, token, position)


# --- sfi.generate ---------------------------------------------------------------------------
@dataclass
class Timing:
    """Wall-clock seconds of a generation: prefill (to the first token) and the decode loop."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "decode_tok_s": round(self.decode_tok_s, 3)}


@dataclass
class GenerateResult:
    """One generated continuation.

    Attributes:
        text: the decoded new tokens (cut before a stop string, if one was hit).
        token_ids: the new token ids.
        prompt_tokens: length of the prompt in tokens (without padding).
        stats: slow/fast step counters of this sequence.
        timing: timings of the whole batch this sequence was decoded in.
        finish_reason: ``"stop"`` (end-of-sequence token or stop string) or ``"length"``.
        mode: ``"sfi"``, ``"full"`` or ``"exact"``.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    stats: DecodeStats
    timing: Timing
    finish_reason: str
    mode: str
    config: SFIConfig | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            "timing": self.timing.to_dict(),
            "config": self.config.to_dict() if self.config is not None else None,
        }


def check_number(name: str, value: Any, low: float, high: float | None = None,
                 integer: bool = False, low_open: bool = False) -> None:
    """Raise :class:`SFIError` naming ``name`` unless ``value`` is a number in range."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise SFIError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
        raise SFIError(f"{name} must be {bounds}, got {value}")


@torch.inference_mode()
def generate(model: torch.nn.Module, tokenizer: Any, prompt: Prompts, *,
             config: SFIConfig | None = None, max_new_tokens: int = 128, mode: Mode = "sfi",
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             stop: Sequence[str] | None = None, chat: bool = False, scorer: Scorer | None = None,
             on_token: Callable[[int, int], None] | None = None,
             prefill_chunk: int | None = None,
             on_prefill: Callable[[int, int], None] | None = None
             ) -> GenerateResult | list[GenerateResult]:
    """Generate continuations of ``prompt``: one prompt, or a list decoded as one batch.

    Args:
        model: a transformers causal LM (see :func:`sfi.load`).
        tokenizer: its tokenizer.
        prompt: text; a chat conversation (``[{"role": "user", "content": ...}, ...]``, put
            through the tokenizer's chat template with the assistant's turn opened); token ids
            (a list of ints or a 1-D tensor, used as given); or a list of these (a 2-D tensor
            of ids too), decoded together with left padding (:mod:`sfi.decoding.prompts`).
        config: SFI knobs (``mode="sfi"`` and ``"exact"``, where it is the drafter's); defaults
            to ``SFIConfig()``.
        max_new_tokens: how many tokens to generate at most.
        mode: ``"sfi"`` (slow-fast decoding), ``"full"`` (dense attention, stock cache) or
            ``"exact"`` (fast steps draft, dense forwards verify: full attention's tokens, and
            with sampling its distribution; ``sfi.decoding.exact``).
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus sampling keeps the most likely tokens up to this probability mass.
        seed: the sampling generator's seed (None: torch's global generator).
        stop: strings that end a sequence (the text is cut before them).
        chat: wrap each text prompt in the tokenizer's chat template as a user message
            (conversations always are; token ids never).
        scorer: what ranks positions at slow steps (default: the SFI Selector).
        on_token: called as ``on_token(row, token_id)`` for every new token, for streaming.
        prefill_chunk: prefill the prompt in forwards of at most this many tokens (None: one
            forward); results agree with one forward to float rounding.
        on_prefill: called as ``on_prefill(done, total)`` after each prefill forward.

    Returns:
        A :class:`GenerateResult` for one prompt, a list of them for a batch. Where SFI took
        dense steps because the context was too short for sparse reads to pay, its
        ``stats.dense_reason`` says why and a notice is logged once per process.
    """
    _check_arguments(mode, config, max_new_tokens, temperature, top_p, prefill_chunk)
    device = next(model.parameters()).device
    encoded = encode_prompts(tokenizer, prompt, chat, device,
                             vocab=model.get_input_embeddings().num_embeddings)
    _check_room(model, encoded, max_new_tokens)
    input_ids, attention_mask = encoded.input_ids, encoded.attention_mask
    cache = build_cache(model, tokenizer, "full" if mode == "full" else "sfi", config=config,
                        scorer=scorer, capacity=input_ids.shape[1] + max_new_tokens)
    sampling = Sampling(temperature, top_p, None if seed is None else
                        torch.Generator(device=device).manual_seed(seed))
    eos = eos_token_ids(model, tokenizer)
    outputs = Outputs([StopChecker(tokenizer, eos, stop or (), max_new_tokens)
                       for _ in range(input_ids.shape[0])], on_token)
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)

    timing = Timing()
    start = time.perf_counter()
    logits = prefill(model, cache, input_ids, attention_mask=attention_mask, positions=positions,
                     chunk=prefill_chunk, on_progress=on_prefill)
    first = sample_next(logits, temperature, top_p, sampling.generator)
    timing.prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    outputs.push([[token] for token in first.tolist()])
    for rows in _steps(mode, model, cache, first, positions[:, -1], attention_mask, sampling,
                       outputs):
        outputs.push(rows)
        timing.decode_steps += max(len(tokens) for tokens in rows)
        if outputs.done:
            break
    timing.decode_s = time.perf_counter() - start

    results = [GenerateResult(text=checker.text, token_ids=checker.tokens,
                              prompt_tokens=int(length), stats=cache.stats(row), timing=timing,
                              finish_reason=checker.finish_reason or "length", mode=mode,
                              config=cache.config if mode != "full" else None)
               for row, (checker, length) in enumerate(
                   zip(outputs.checkers, attention_mask.sum(dim=-1).tolist()))]
    return results[0] if encoded.single else results


def _steps(mode: Mode, model: torch.nn.Module, cache: Any, tokens: torch.Tensor,
           position: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling,
           outputs: Outputs) -> Iterator[list[list[int]]]:
    """The decode steps after the first token ``tokens [B]`` at ``position [B]``: each yields
    every row's new tokens (one per step; exact mode, a round's committed ones per row)."""
    if outputs.done:
        return
    mask = None if bool(attention_mask.all()) else attention_mask  # no padding: no mask
    if mode != "exact":
        yield from token_steps(model, cache, tokens, position, mask, sampling)
        return
    exact = ExactDecoder(model, cache, sampling)
    for emitted in exact.rounds(tokens, position, mask, outputs.wanted):
        yield emitted.rows()


def _check_arguments(mode: str, config: SFIConfig | None, max_new_tokens: Any,
                     temperature: Any, top_p: Any, prefill_chunk: Any) -> None:
    """Refuse, naming it, an argument of :func:`generate` out of its range."""
    if mode not in MODES:
        raise SFIError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_number("max_new_tokens", max_new_tokens, 1, integer=True)
    check_number("temperature", temperature, 0.0)
    check_number("top_p", top_p, 0.0, 1.0, low_open=True)
    if prefill_chunk is not None:
        check_number("prefill_chunk", prefill_chunk, 1, integer=True)
    if mode == "full" and config is not None:
        raise SFIError("config applies to mode='sfi' only; full attention takes no SFI config")


def _check_room(model: torch.nn.Module, encoded: EncodedPrompts, max_new_tokens: int) -> None:
    """Refuse prompts that, with ``max_new_tokens``, would pass the model's context."""
    limit = context_length(model)
    longest = int(encoded.attention_mask.sum(dim=-1).max())
    if limit is not None and longest + max_new_tokens > limit:
        raise PromptError(
            f"the prompt is {longest} tokens and max_new_tokens is {max_new_tokens}: together "
            f"{longest + max_new_tokens}, more than the model's context of {limit} tokens")
