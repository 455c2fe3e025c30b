"""Prefill, the per-token loop, sampling and stop conditions: ``sfi.generate``.

``mode="sfi"`` decodes through a :class:`~sfi.cache.SlowFastCache`; ``mode="full"`` decodes the
same way through transformers' stock ``DynamicCache`` and SDPA, the model as users run it today.
Both share this loop, so their timings compare like with like.
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from sfi.cache import SlowFastCache
from sfi.config import SFIConfig
from sfi.errors import PromptError, SFIError
from sfi.scorers import Scorer
from sfi.stats import DecodeStats

Mode = Literal["sfi", "full"]
MODES: tuple[str, ...] = ("sfi", "full")


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
        mode: ``"sfi"`` or ``"full"``.
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


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by (``cache`` from transformers 5.24 on)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def context_length(model: torch.nn.Module) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    return getattr(config, "max_position_embeddings", None)


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _check_number(name: str, value: Any, low: float, high: float | None = None,
                  integer: bool = False, low_open: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise SFIError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
        raise SFIError(f"{name} must be {bounds}, got {value}")


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat: bool,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize with left padding: ``(input_ids [B, T], attention_mask [B, T])``."""
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        pad_missing = tokenizer.pad_token_id is None
        if pad_missing:
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True,
                        add_special_tokens=not chat)
    finally:
        tokenizer.padding_side = side
        if pad_missing:
            tokenizer.pad_token = None
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """``[B, V]`` logits -> ``[B]`` token ids: greedy at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_cache(model: torch.nn.Module, tokenizer: Any, mode: str, config: SFIConfig | None,
               scorer: Scorer | None, max_cache_len: int) -> Any:
    if mode == "full":
        return DynamicCache(config=model.config)
    return SlowFastCache(model, config, tokenizer=tokenizer, scorer=scorer,
                         max_cache_len=max_cache_len)


@torch.inference_mode()
def generate(model: torch.nn.Module, tokenizer: Any, prompt: str | Sequence[str], *,
             config: SFIConfig | None = None, max_new_tokens: int = 128, mode: Mode = "sfi",
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             stop: Sequence[str] | None = None, chat: bool = False, scorer: Scorer | None = None,
             on_token: Callable[[int, int], None] | None = None
             ) -> GenerateResult | list[GenerateResult]:
    """Generate continuations of ``prompt`` (one string, or a list decoded as one batch).

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer (see :func:`sfi.load`).
        prompt: the text, or a list of texts decoded together with left padding.
        config: SFI knobs (``mode="sfi"`` only); defaults to ``SFIConfig()``.
        max_new_tokens: how many tokens to generate at most.
        mode: ``"sfi"`` (slow-fast decoding) or ``"full"`` (dense attention, stock cache).
        temperature, top_p, seed: sampling; temperature 0 is greedy.
        stop: strings that end a sequence (the text is cut before them).
        chat: wrap each prompt in the tokenizer's chat template as a user message.
        scorer: what ranks positions at slow steps (default: the SFI Selector).
        on_token: called as ``on_token(row, token_id)`` for every new token, for streaming.

    Returns:
        A :class:`GenerateResult` for a string prompt, a list of them for a list of prompts.
    """
    if mode not in MODES:
        raise SFIError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise PromptError("the prompt is empty: give some text to continue")
    _check_number("max_new_tokens", max_new_tokens, 1, integer=True)
    _check_number("temperature", temperature, 0.0)
    _check_number("top_p", top_p, 0.0, 1.0, low_open=True)
    if mode == "full" and config is not None:
        raise SFIError("config applies to mode='sfi' only; full attention takes no SFI config")
    device = next(model.parameters()).device
    input_ids, attention_mask = encode_prompts(tokenizer, prompts, chat, device)
    prompt_lengths = attention_mask.sum(dim=-1).tolist()
    limit = context_length(model)
    longest = max(prompt_lengths)
    if limit is not None and longest + max_new_tokens > limit:
        raise PromptError(
            f"the prompt is {longest} tokens and max_new_tokens is {max_new_tokens}: together "
            f"{longest + max_new_tokens}, more than the model's context of {limit} tokens")

    batch = input_ids.shape[0]
    cache = make_cache(model, tokenizer, mode, config, scorer, input_ids.shape[1] + max_new_tokens)
    cache_kw = cache_argument(model)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos = eos_token_ids(model, tokenizer)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)

    padded = not bool(attention_mask.all())
    timing = Timing()
    start = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    next_ids = sample_next(out.logits[:, -1], temperature, top_p, generator)
    timing.prefill_s = time.perf_counter() - start

    generated: list[list[int]] = [[] for _ in range(batch)]
    finish = [""] * batch
    texts = [""] * batch
    last_pos = position_ids[:, -1:]
    decode_start = time.perf_counter()
    for step in range(max_new_tokens):
        tokens = next_ids.tolist()
        for row, token in enumerate(tokens):
            if finish[row]:
                continue
            if token in eos:
                finish[row] = "stop"
                continue
            generated[row].append(token)
            if on_token is not None:
                on_token(row, token)
            if stop:
                texts[row] = tokenizer.decode(generated[row], skip_special_tokens=True)
                if any(s in texts[row] for s in stop):
                    finish[row] = "stop"
        if all(finish) or step == max_new_tokens - 1:
            break
        if padded:  # without padding no mask is needed: no O(context) work per step
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], -1)
        last_pos = last_pos + 1
        out = model(input_ids=next_ids[:, None], attention_mask=attention_mask if padded else None,
                    position_ids=last_pos, use_cache=True, **{cache_kw: cache})
        next_ids = sample_next(out.logits[:, -1], temperature, top_p, generator)
        timing.decode_steps += 1
    timing.decode_s = time.perf_counter() - decode_start

    results = []
    for row in range(batch):
        text = tokenizer.decode(generated[row], skip_special_tokens=True)
        for s in stop or ():
            if s in text:
                text = text[: text.index(s)]
        if isinstance(cache, SlowFastCache):
            stats = cache.stats(row)
        else:
            stats = DecodeStats(dense_steps=timing.decode_steps)
        results.append(GenerateResult(text=text, token_ids=generated[row],
                                      prompt_tokens=int(prompt_lengths[row]), stats=stats,
                                      timing=timing, finish_reason=finish[row] or "length",
                                      mode=mode, config=cache.config if mode == "sfi" else None))
    return results[0] if isinstance(prompt, str) else results
