"""Several sequences' memories (:class:`~sfi.core.sequence_policy.Memory`) as tensors.

Both engines turn the memories of a step's rows into the same ``[n]`` tensors (where each
middle region lies, how many positions each selects and pins) and into masks over the slots of
their buffers; :class:`MemoryTensors` builds them in one host-to-device copy. One memory's
positions, in the order a buffer lays them out (:func:`memory_positions`) or as a mask over
the cache (:func:`memory_mask`), are what the vLLM plugin packs and what the evaluations
measure a memory's hold by.

Shapes: n memories, C slots of a memory's buffer, H KV heads, k selected positions per head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sfi.core.sequence_policy import Memory


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


def memory_positions(memory: Memory, selected: torch.Tensor, end: int) -> torch.Tensor:
    """``[H, L]`` the positions a fast memory holds at cache length ``end``, in slot order:
    the sinks ``[pad, sink_end)``, the ``selected [H, k]`` positions, the recent window
    ``[recent_start, end)``."""
    h, device = selected.shape[0], selected.device
    sinks = torch.arange(memory.pad, memory.sink_end, device=device)
    recent = torch.arange(memory.recent_start, end, device=device)
    return torch.cat([sinks.expand(h, -1), selected, recent.expand(h, -1)], dim=-1)


def memory_mask(memory: Memory, selected: torch.Tensor, length: int) -> torch.Tensor:
    """``[H, length]`` bool: which positions of a cache of ``length`` the memory holds (its
    :func:`memory_positions`, on ``selected``'s device)."""
    held = memory_positions(memory, selected, length)
    mask = torch.zeros(selected.shape[0], length, dtype=torch.bool, device=selected.device)
    return mask.scatter_(-1, held, True)
