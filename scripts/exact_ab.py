"""What the exact-mode A/B scripts (``exact_commit_ab.py``, ``draft_length_ab.py``) share: their
arguments and one real prefill continued by every run.

    [context] [batch] [reps] [--always-draft] [--model=NAME]

(defaults 7680 4 2, the default model; ``--always-draft``: ``draft_fallback=False``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from sfi.bench.throughput import benchmark_ids, measure_bandwidth
from sfi.config import SFIConfig
from sfi.models import load
from sfi.prefix import prefix_kv


@dataclass
class Setup:
    """The model, the configuration, the prompts ``ids [B, T]``, their KV, ``measure_cell``'s
    common keywords (48 timed tokens after 2 warm-up ones), the context and the reps."""

    model: torch.nn.Module
    tokenizer: Any
    config: SFIConfig
    ids: torch.Tensor
    prefix: Any
    common: dict[str, Any]
    context: int
    reps: int


def setup(argv: list[str] | None = None) -> Setup:
    argv = sys.argv[1:] if argv is None else argv
    numbers = [int(a) for a in argv if not a.startswith("--")]
    context, batch, reps = (numbers + [7680, 4, 2][len(numbers):])[:3]
    config = SFIConfig()
    if "--always-draft" in argv:
        config = replace(config, draft_fallback=False)
    named = [a.split("=", 1)[1] for a in argv if a.startswith("--model=")]
    model, tokenizer = load(named[-1] if named else "default")
    ids = benchmark_ids(tokenizer, context, batch)
    prefix = prefix_kv(model, ids[:, :-config.evidence_window], False)  # real KV
    common = dict(kv="prefill", new_tokens=48, warmup=2, bandwidth=measure_bandwidth())
    return Setup(model, tokenizer, config, ids, prefix, common, context, reps)
