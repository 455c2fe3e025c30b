"""The decode loop's pieces and ``sfi.generate``.

Every loop of the project (``generate``, the server's engine, the evaluations, the benchmark,
the support-stability analysis) is built from the same three pieces, as in gpt-fast:

- :func:`prefill`: one forward over several tokens per row (a prompt, or the tail of a prompt
  whose head was loaded from a shared prefill) -> the last position's logits;
- :func:`decode_one` (in :mod:`sfi.steps`, with the token choice `sample_next`): one forward
  of one token per row -> its logits;
- :class:`StopChecker`: when a sequence ends (an end-of-sequence token, a stop string, the
  token budget) and its text so far.

``mode="sfi"`` decodes through a :class:`~sfi.cache.SlowFastCache`; ``mode="full"`` through
transformers' ``DynamicCache`` and SDPA, the model as users run it today; ``mode="exact"``
through a ``SlowFastCache`` whose fast steps draft and whose dense forwards verify
(:mod:`sfi.exact`): full attention's tokens. They share the loop, so their timings compare like
with like.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from sfi.config import SFIConfig
from sfi.errors import PromptError, SFIError
from sfi.exact import ExactDecoder, Sampling
from sfi.hf import cache_argument, context_length, eos_token_ids
from sfi.methods import build_cache
from sfi.prompts import Prompts, encode_prompts
from sfi.scorers import Scorer
from sfi.stats import DecodeStats
from sfi.steps import decode_one, extended_mask, repeated_ngram_tokens, sample_next

Mode = Literal["sfi", "full", "exact"]
MODES: tuple[str, ...] = ("sfi", "full", "exact")


# --- the pieces of every loop -------------------------------------------------------------------
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


class StopChecker:
    """When one sequence ends, and its text: an end-of-sequence token (not kept), the earliest
    stop string (the text is cut before it), or ``max_tokens`` tokens.

    Args:
        tokenizer: decodes the tokens (only needed when there are stop strings, or for
            :attr:`text`).
        eos: end-of-sequence token ids.
        stop: strings that end the sequence.
        max_tokens: tokens kept at most.
    """

    def __init__(self, tokenizer: Any, eos: Collection[int], stop: Sequence[str] = (),
                 max_tokens: int | None = None):
        if any(not isinstance(s, str) or not s for s in stop):
            raise SFIError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.eos = eos
        self.stop = tuple(stop)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._text: str | None = None
        self._longest = max((len(s) for s in self.stop), default=0)
        self._scanned = 0  # characters of the text already scanned without a stop string
        self._cut_at: int | None = None
        self._last_scanned: str | None = None  # the decoded text the last scan looked at

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Take the next token; returns whether the sequence has ended."""
        if self.done:
            return True
        if token in self.eos:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        self._text = None
        if self.stop and self._cut() is not None:
            self.finish_reason = "stop"
        elif self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return self.done

    def decoded(self) -> str:
        """The tokens kept so far, decoded (special tokens skipped)."""
        if self._text is None:
            self._text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._text

    def _cut(self) -> int | None:
        """Where the earliest stop string starts; scans only the text not scanned before
        (with a margin for a multi-byte character that the last token completed)."""
        if self._cut_at is not None:
            return self._cut_at
        text = self.decoded()
        if text is self._last_scanned:  # no token since the last scan
            return None
        self._last_scanned = text
        start = max(0, self._scanned - self._longest - _DECODE_MARGIN)
        hits = [at for at in (text.find(s, start) for s in self.stop) if at >= 0]
        if hits:
            self._cut_at = min(hits)
        else:
            self._scanned = len(text)
        return self._cut_at

    @property
    def text(self) -> str:
        """The text so far, cut before the earliest stop string."""
        cut = self._cut() if self.stop else None
        return self.decoded() if cut is None else self.decoded()[:cut]

    @property
    def settled_text(self) -> str:
        """What can be streamed now: :attr:`text`, less a tail that could still grow into a
        stop string (all of it once the sequence has ended)."""
        text = self.text
        if self.done or not self.stop:
            return text
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return text[:-size]
        return text


_DECODE_MARGIN = 8  # characters at the end of the text that the next token may still change


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
            of ids too), decoded together with left padding (:mod:`sfi.prompts`).
        config: SFI knobs (``mode="sfi"`` and ``"exact"``, where it is the drafter's); defaults
            to ``SFIConfig()``.
        max_new_tokens: how many tokens to generate at most.
        mode: ``"sfi"`` (slow-fast decoding), ``"full"`` (dense attention, stock cache) or
            ``"exact"`` (fast steps draft, dense forwards verify: full attention's tokens, and
            with sampling its distribution; ``sfi.exact``).
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
    if mode not in MODES:
        raise SFIError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_number("max_new_tokens", max_new_tokens, 1, integer=True)
    check_number("temperature", temperature, 0.0)
    check_number("top_p", top_p, 0.0, 1.0, low_open=True)
    if prefill_chunk is not None:
        check_number("prefill_chunk", prefill_chunk, 1, integer=True)
    if mode == "full" and config is not None:
        raise SFIError("config applies to mode='sfi' only; full attention takes no SFI config")
    device = next(model.parameters()).device
    encoded = encode_prompts(tokenizer, prompt, chat, device,
                             vocab=model.get_input_embeddings().num_embeddings)
    input_ids, attention_mask = encoded.input_ids, encoded.attention_mask
    prompt_lengths = attention_mask.sum(dim=-1).tolist()
    limit = context_length(model)
    longest = max(prompt_lengths)
    if limit is not None and longest + max_new_tokens > limit:
        raise PromptError(
            f"the prompt is {longest} tokens and max_new_tokens is {max_new_tokens}: together "
            f"{longest + max_new_tokens}, more than the model's context of {limit} tokens")

    batch = input_ids.shape[0]
    cache = build_cache(model, tokenizer, "full" if mode == "full" else "sfi", config=config,
                        scorer=scorer, capacity=input_ids.shape[1] + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos = eos_token_ids(model, tokenizer)
    checkers = [StopChecker(tokenizer, eos, stop or (), max_new_tokens) for _ in range(batch)]
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    padded = not bool(attention_mask.all())

    timing = Timing()
    start = time.perf_counter()
    logits = prefill(model, cache, input_ids, attention_mask=attention_mask, positions=positions,
                     chunk=prefill_chunk, on_progress=on_prefill)
    next_ids = sample_next(logits, temperature, top_p, generator)
    timing.prefill_s = time.perf_counter() - start

    position = positions[:, -1]
    exact = ExactDecoder(model, cache, Sampling(temperature, top_p, generator)) if mode == "exact" \
        else None

    def take(row: int, token: int) -> None:
        checker = checkers[row]
        if checker.done:
            return
        checker.push(token)
        if on_token is not None and token not in eos:
            on_token(row, token)

    def push(tokens: list[int]) -> None:
        for row, token in enumerate(tokens):
            take(row, token)

    def wanted() -> tuple[list[bool], int]:
        return ([not c.done for c in checkers],
                max(c.max_tokens - len(c.tokens) for c in checkers if not c.done))

    decode_start = time.perf_counter()
    push(next_ids.tolist())
    if exact is not None and not all(c.done for c in checkers):
        for emitted in exact.rounds(next_ids, position, attention_mask if padded else None,
                                    wanted):
            for row, tokens in enumerate(emitted.rows()):  # each row takes its own
                for token in tokens:
                    take(row, token)
            timing.decode_steps += emitted.tokens.shape[1]
            if all(c.done for c in checkers):
                break
    while exact is None and not all(c.done for c in checkers):
        if padded:  # without padding no mask is needed: no O(context) work per step
            attention_mask = extended_mask(attention_mask, 1)
        logits = decode_one(model, cache, next_ids, position + 1,
                            attention_mask if padded else None)
        next_ids = sample_next(logits, temperature, top_p, generator)
        position = position + 1
        timing.decode_steps += 1
        push(next_ids.tolist())
    timing.decode_s = time.perf_counter() - decode_start

    results = [GenerateResult(text=checker.text, token_ids=checker.tokens,
                              prompt_tokens=int(prompt_lengths[row]), stats=cache.stats(row),
                              timing=timing, finish_reason=checker.finish_reason or "length",
                              mode=mode, config=cache.config if mode != "full" else None)
               for row, checker in enumerate(checkers)]
    return results[0] if encoded.single else results
