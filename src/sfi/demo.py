"""The main job (``sfi demo``): answer a question about a fact hidden in a long document, with
full attention and with SFI, side by side.

The document is a few thousand tokens of Paul Graham essays with one sentence inserted at a
seeded depth (the ``niah`` task of ``sfi eval``); the question asks for the number that sentence
gives. Each side reports its answer, whether it is right, the fraction of the context its
decode steps read, and its decode speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sfi.config import SFIConfig
from sfi.decode import GenerateResult, generate
from sfi.eval.tasks import Sample, make_sample, score


@dataclass
class DemoResult:
    """The question, the hidden fact, and each side's answer."""

    sample: Sample
    full: GenerateResult
    sfi: GenerateResult

    @property
    def question(self) -> str:
        return self.sample.question

    @property
    def fact(self) -> str:
        """The hidden sentence."""
        return self.sample.needles[0]

    def correct(self, result: GenerateResult) -> bool:
        return score(self.sample.task, result.text, self.sample.answers) == 100.0


def run_demo(model: torch.nn.Module, tokenizer: Any, *, context: int = 3500, seed: int = 0,
             config: SFIConfig | None = None, max_new_tokens: int = 24,
             on_side: Any = None) -> DemoResult:
    """Ask the ``niah`` question of one seeded sample of ``context`` tokens, decoded with full
    attention and with SFI (``config``: the default preset, K = 15% of the context)."""
    config = config or SFIConfig.from_preset("default", k_fraction=0.15)
    sample = make_sample("niah", tokenizer, context, seed)
    results = {}
    for mode in ("full", "sfi"):
        if on_side is not None:
            on_side(mode)
        results[mode] = generate(model, tokenizer, sample.text, mode=mode,
                                 config=config if mode == "sfi" else None,
                                 max_new_tokens=max_new_tokens)
    return DemoResult(sample, results["full"], results["sfi"])
