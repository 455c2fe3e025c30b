"""TOVA (Oren et al. 2024) as a scorer: the attention of the last query, averaged over heads.

TOVA keeps the tokens the newest query attends to most (averaged over the query heads that
share a KV head here, since selection is per KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfi.core.scorers import Evidence


@dataclass(frozen=True)
class TOVAScorer:
    def score(self, evidence: Evidence) -> torch.Tensor:
        attention = evidence.attention()  # [B, H, G * W, T], rows (query head, query)
        b, h, rows, t = attention.shape
        last = attention.reshape(b, h, rows // evidence.queries, evidence.queries, t)[..., -1, :]
        return last.mean(dim=2)
