"""Free generation against full attention: how far a method's own text departs from full
attention's.

Every method, full attention included, continues the same prompt greedily from one shared
prefill. Full attention then reads each method's text (one forward of the text over the
prompt's KV) and gives: its perplexity of that text, which :attr:`GenerationScores.ppl_ratio`
compares with its perplexity of its own text; how often each of the text's tokens is the one
full attention itself would choose there (``top1``); and, from the tokens alone, the share of
distinct 4-grams (repetition lowers it) and where the text first departs from full
attention's.

Shapes: N generated tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sfi.decoding.prefix import SharedPrefill
from sfi.hf.decode_cache import FullCache
from sfi.hf.facts import cache_argument

NGRAM = 4  # the n of the repetition measure


def distinct_ngrams(tokens: Sequence[int], n: int = NGRAM) -> float | None:
    """The share of the n-grams of ``tokens`` that are distinct (1.0: nothing repeats); None
    for fewer than ``n`` tokens."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first position where ``tokens`` and ``reference`` differ (the shorter one's length
    when one is a prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


@dataclass(frozen=True)
class GenerationScores:
    """Full attention's reading of one generated text.

    Attributes:
        ppl: full attention's perplexity of the text.
        top1: the share of the text's tokens that are full attention's own greedy choice
            given the text before them.
        distinct: :func:`distinct_ngrams` of the text.
    """

    ppl: float
    top1: float
    distinct: float | None

    def ppl_ratio(self, own: GenerationScores) -> float:
        """This text's perplexity over that of full attention's own text (``own``)."""
        return self.ppl / own.ppl


@torch.inference_mode()
def full_attention_scores(model: torch.nn.Module, shared: SharedPrefill, ids: torch.Tensor,
                          tokens: Sequence[int]) -> GenerationScores:
    """Full attention's reading of ``tokens``, generated after the prompt ``ids [1, T]``
    whose first ``shared.length`` positions ``shared`` holds: one forward of the prompt's rest
    and the text over a copy of that prefill."""
    device = ids.device
    generated = torch.tensor([list(tokens)], device=device)
    cache = FullCache(config=model.config)
    shared.load(cache)
    start = shared.length
    inputs = torch.cat([ids[:, start:], generated[:, :-1]], dim=1)
    positions = torch.arange(start, start + inputs.shape[1], device=device)[None]
    out = model(input_ids=inputs, position_ids=positions, use_cache=True,
                logits_to_keep=len(tokens), **{cache_argument(model): cache})
    log_probs = F.log_softmax(out.logits[0].float(), dim=-1)  # [N, V]: predicting tokens
    target = generated[0]
    chosen = log_probs[torch.arange(len(tokens), device=device), target]
    return GenerationScores(ppl=float(torch.exp(-chosen.mean())),
                            top1=float((log_probs.argmax(-1) == target).float().mean()),
                            distinct=distinct_ngrams(tokens))
