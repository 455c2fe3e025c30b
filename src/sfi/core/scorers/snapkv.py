"""SnapKV (Li et al. 2024) as a scorer: observation-window attention, pooled along positions.

s_j = mean over the evidence rows (the G query heads of the KV group x the W observation
queries) of A_rj, then a 1-D average pooling of kernel ``kernel`` (stride 1, same length),
as kvpress does (the paper's LongBench configs use max pooling, kernel 7: ``pooling="max"``).
Defaults: W = 32 in the paper's code (here: the cache's ``evidence_window``), kernel 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sfi.core.scorers import Evidence


@dataclass(frozen=True)
class SnapKVScorer:
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, got {self.kernel}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")

    def score(self, evidence: Evidence) -> torch.Tensor:
        scores = evidence.attention().mean(dim=-2)  # [B, H, T]
        b, h, t = scores.shape
        flat = scores.reshape(b * h, 1, t)
        pad = self.kernel // 2
        if self.pooling == "avg":
            pooled = F.avg_pool1d(flat, self.kernel, stride=1, padding=pad,
                                  count_include_pad=False)
        else:
            pooled = F.max_pool1d(flat, self.kernel, stride=1, padding=pad)
        return pooled.reshape(b, h, t)
