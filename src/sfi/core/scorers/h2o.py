"""H2O (Zhang et al. 2023) as a scorer: heavy hitters by accumulated attention.

s_j = attention to j summed over every query seen so far: the evidence rows of this call (the
G query heads of the KV group x its queries) plus ``evidence.history``, the attention of earlier
queries, where the caller tracks it (the eviction baseline does, every step). SFI's slow steps
keep no history (a fast step computes no dense attention), so as an SFI ablation the sum runs
over the slow step's own evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfi.core.scorers import Evidence


@dataclass(frozen=True)
class H2OScorer:
    def score(self, evidence: Evidence) -> torch.Tensor:
        scores = evidence.attention().sum(dim=-2)  # [B, H, T]
        if evidence.history is not None:
            scores = scores + evidence.history
        return scores
