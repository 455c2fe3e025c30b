"""A subset of the batch's sequences, and the cheapest way to read or write it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """Sorted row indices of a batch of ``batch_size``; views when contiguous, copies otherwise."""

    indices: tuple[int, ...]
    batch_size: int
    device: torch.device

    def __len__(self) -> int:
        return len(self.indices)

    def __bool__(self) -> bool:
        return bool(self.indices)

    @property
    def is_all(self) -> bool:
        return len(self.indices) == self.batch_size

    @property
    def _slice(self) -> slice | None:
        first, last = self.indices[0], self.indices[-1]
        return slice(first, last + 1) if last - first + 1 == len(self.indices) else None

    @property
    def index(self) -> torch.Tensor:
        """``[n]`` long tensor of the row indices on the batch's device."""
        return torch.tensor(self.indices, dtype=torch.long, device=self.device)

    def intersect(self, other: Rows) -> Rows:
        """The rows in both subsets."""
        common = tuple(sorted(set(self.indices) & set(other.indices)))
        return Rows(common, self.batch_size, self.device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of ``t`` (batch first): ``t`` itself, a view, or a gathered copy."""
        if self.is_all:
            return t
        window = self._slice
        return t[window] if window is not None else t.index_select(0, self.index)

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (one entry per row of this subset) into ``dst`` in place."""
        if self.is_all:
            dst.copy_(src)
            return
        window = self._slice
        if window is not None:
            dst[window] = src
        else:
            dst.index_copy_(0, self.index, src)
