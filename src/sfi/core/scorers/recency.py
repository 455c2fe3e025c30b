"""StreamingLLM (Xiao et al. 2023) as a scorer: no scoring, the newest positions win.

StreamingLLM keeps the first S and the last R tokens. Behind the Selector's interface its rule
ranks middle positions by recency, so the K selected slots extend the recent window backwards:
the ablation that shows what selection adds over a longer window of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfi.core.scorers import Evidence


@dataclass(frozen=True)
class RecencyScorer:
    def score(self, evidence: Evidence) -> torch.Tensor:
        b, h, t = evidence.key_norms.shape
        positions = torch.arange(t, dtype=torch.float32, device=evidence.key_norms.device)
        return positions.expand(b, h, t)
