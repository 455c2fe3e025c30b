"""Several sequences' memories (:class:`sfi.sequence_policy.Memory`) as tensors, engine-neutral.

Both engines turn the memories of a step's rows into the same ``[n]`` tensors (where each
middle region lies, how many positions each selects and pins) and into masks over the slots of
their buffers; :class:`MemoryTensors` builds them in one host-to-device copy.

Shapes: n memories, C slots of a memory's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sfi.sequence_policy import Memory


@dataclass(frozen=True)
class MemoryTensors:
    """``[n]`` long tensors of n memories, one per :class:`Memory` field (names below).

    Attributes:
        pad: first real position; sink: S, the slots before the selected ones in a buffer
            that gives every row S sink slots (the transformers path's compact buffer);
            lo: the middle region's start (``sink_end``); hi: its end (``recent_start``);
            k: selected positions per KV head; pinned: of those, how many every refresh
            keeps.
    """

    pad: torch.Tensor
    sink: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    k: torch.Tensor
    pinned: torch.Tensor

    @classmethod
    def of(cls, memories: Sequence[Memory], device: torch.device | str) -> MemoryTensors:
        """The ``[n]`` fields of ``memories`` (n >= 1) on ``device``, in one host-to-device
        copy."""
        rows = [(m.pad, m.sink, m.sink_end, m.recent_start, m.k, m.pinned) for m in memories]
        table = torch.tensor(list(zip(*rows, strict=True)), dtype=torch.long, device=device)
        return cls(*table)  # each field a contiguous row of the [6, n] table

    @property
    def sink_count(self) -> torch.Tensor:
        """``[n]`` the sink positions each memory holds (``sink_end - pad``; at most S)."""
        return self.lo - self.pad

    def selected_slots(self, width: int, first: torch.Tensor) -> torch.Tensor:
        """``[n, width]`` bool: the buffer slots holding a selected position, the k slots from
        ``first [n]`` (:attr:`sink` in a buffer of S sink slots per row; :attr:`sink_count`
        in one that packs a row's sinks, selection and recent window one after another)."""
        slot = torch.arange(width, device=self.k.device)[None, :]
        return (slot >= first[:, None]) & (slot < (first + self.k)[:, None])
