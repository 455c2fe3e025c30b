"""The side-by-side demo (``sfi demo``, ``make demo``): one long document, read once, then
asked two things with full attention and with SFI side by side.

The document is about 7,500 tokens of Paul Graham essays (near SmolLM2's 8K context) with one
sentence inserted at a seeded depth (the ``niah`` task of ``sfi eval``). It is prefilled once;
every answer continues a copy of that prefill, so both sides start from the same KV:

1. the hidden-fact question (is the answer right under each?);
2. a longer answer (an explanation of the essays, 128 tokens), where decode speed shows,
   decoded greedily with a repetition guard (no 4-gram of the answer repeated, both sides).

Each answer is timed from the forward over its question (SFI's first selection included) to
its last token: every slow step is inside the timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.decoding.decode import continue_greedy
from sfi.decoding.prefix import SharedPrefill
from sfi.errors import SFIError
from sfi.eval.tasks import Sample, chat_prompt, make_sample, score
from sfi.hf.facts import context_length, eos_token_ids
from sfi.hf.methods import build_cache

SIDES: tuple[str, ...] = ("full", "sfi")
#: the method of the full-attention side: the strongest dense decoding sfi has, a
#: preallocated cache (transformers' ``StaticCache``) with the same weights and compile
DENSE_BASELINE = "full-static"
EXPLAIN = "Write a short essay about the main ideas of the text above."
DEMO_SEED = 1  # the document, and where its fact hides: one that full attention answers right
# The longer answer never repeats a 4-gram of its own (both sides alike), as chat front ends
# guard greedy decoding of a small model against loops (transformers' no_repeat_ngram_size).
NO_REPEAT_NGRAM = 4


@dataclass
class Answer:
    """One side's answer to one question.

    Attributes:
        mode: ``"full"`` or ``"sfi"``.
        text: the answer, decoded.
        token_ids: its tokens.
        seconds: from the forward over the question to the last token.
        stats: the decode steps' counters (slow, fast, dense; fraction of the context read).
    """

    mode: str
    text: str
    token_ids: list[int]
    seconds: float
    stats: DecodeStats

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def read_fraction(self) -> float:
        """Mean fraction of the context the decode steps read (slow and dense steps: all)."""
        return self.stats.read_fraction


@dataclass
class DemoResult:
    """The document, the prefill, and each side's two answers (``answers[question][mode]``)."""

    sample: Sample
    prefill_tokens: int
    prefill_s: float
    fact: dict[str, Answer]
    explanation: dict[str, Answer]

    @property
    def question(self) -> str:
        return self.sample.question

    @property
    def explain_question(self) -> str:
        return EXPLAIN

    @property
    def hidden(self) -> str:
        """The hidden sentence."""
        return self.sample.needles[0]

    def correct(self, answer: Answer) -> bool:
        return score(self.sample.task, answer.text, self.sample.answers) == 100.0

    @property
    def speedup(self) -> float:
        """SFI's tokens/s over full attention's on the longer answer."""
        full, sfi = self.explanation["full"].tokens_per_s, self.explanation["sfi"].tokens_per_s
        return sfi / full if full > 0 else 0.0

    @property
    def agreeing_tokens(self) -> int:
        """How many first tokens of the longer answer the two sides share."""
        return _common_prefix(self.explanation["full"].token_ids,
                              self.explanation["sfi"].token_ids)


@torch.inference_mode()
def run_demo(model: torch.nn.Module, tokenizer: Any, *, context: int = 7500, seed: int = DEMO_SEED,
             config: SFIConfig | None = None, answer_tokens: int = 128,
             on_prefill: Callable[[int, int], None] | None = None,
             on_answer: Callable[[str, str], None] | None = None,
             on_token: Callable[[int], None] | None = None) -> DemoResult:
    """Prefill one seeded ``niah`` document of ``context`` tokens, then answer its question and
    an explanation of ``answer_tokens`` tokens with full attention and with SFI (``config``:
    the default preset, K = 15% of the context).

    ``on_prefill(done, total)`` hears of each prefill chunk, ``on_answer(question, mode)`` of
    each answer as it starts ("fact" or "explanation"), ``on_token(id)`` of each token.
    """
    config = config or SFIConfig.from_preset("default", k_fraction=0.15)
    limit = context_length(model)
    sample = make_sample("niah", tokenizer, context, seed)
    explain_ids = tokenizer(chat_prompt(tokenizer, f"{sample.document}\n\n{EXPLAIN}", ""),
                            add_special_tokens=False)["input_ids"]
    longest = max(len(sample.prompt_ids), len(explain_ids)) + answer_tokens
    if limit is not None and longest > limit:
        raise SFIError(f"a {context}-token document, its question and {answer_tokens} answer "
                       f"tokens need {longest} positions; the model has {limit}: ask for a "
                       "shorter --context")
    device = next(model.parameters()).device
    prompts = {"fact": torch.tensor([sample.prompt_ids], device=device),
               "explanation": torch.tensor([explain_ids], device=device)}
    shared_length = _shared_length(sample.prompt_ids, explain_ids, config.evidence_window)
    start = time.perf_counter()
    shared = SharedPrefill(model, prompts["fact"][:, :shared_length], on_progress=on_prefill)
    prefill_s = time.perf_counter() - start
    eos = eos_token_ids(model, tokenizer)
    budgets = {"fact": sample.max_new_tokens, "explanation": answer_tokens}
    answers: dict[str, dict[str, Answer]] = {}
    for question, ids in prompts.items():
        answers[question] = {}
        for mode in SIDES:
            if on_answer is not None:
                on_answer(question, mode)
            method = "sfi" if mode == "sfi" else DENSE_BASELINE
            cache = build_cache(model, tokenizer, method, config=config if mode == "sfi" else None,
                                capacity=ids.shape[1] + budgets[question])
            shared.load(cache)
            begin = time.perf_counter()
            tokens = continue_greedy(model, cache, ids, shared_length, budgets[question], eos,
                                     on_token=on_token, no_repeat_ngram=NO_REPEAT_NGRAM
                                     if question == "explanation" else 0)
            seconds = time.perf_counter() - begin
            answers[question][mode] = Answer(
                mode, tokenizer.decode(tokens, skip_special_tokens=True), tokens, seconds,
                cache.stats())
            close = getattr(cache, "close", None)
            if close is not None:
                close()
    return DemoResult(sample, shared_length, prefill_s, answers["fact"], answers["explanation"])


def _shared_length(a: list[int], b: list[int], window: int) -> int:
    """The tokens both prompts start with, less enough that each keeps at least ``window``
    of its own (the queries of SFI's first selection)."""
    shared = min(_common_prefix(a, b), len(a) - window, len(b) - window)
    if shared < 1:
        raise SFIError("the demo's two prompts share no document tokens to prefill once")
    return shared


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
