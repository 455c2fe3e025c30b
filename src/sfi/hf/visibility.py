"""Which cache slots each row of a batch may attend: its real tokens, not its padding or holes.

A row's slots before its first real token are left padding. Exact mode adds **holes**
(:mod:`sfi.decoding.exact`): a batch shares one cache length, but its rows accept different numbers
of drafts in a verify; a row that accepted fewer than the batch's most leaves the slots it did not
commit empty (their KV zeroed, :meth:`sfi.hf.slowfast_cache.SlowFastCache.commit_rows`), and no read
may see them. Holes are cache slots, kept per sequence (``SequenceState.holes``), and move with
the padding when a batch is re-aligned.

Shapes: B sequences, T cache length, Q queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from sfi.core.kernels import additive_bias, causal_mask


class _Row(Protocol):
    pad: int
    holes: list[int]


def visible_slots(rows: Sequence[_Row], total: int, device: torch.device
                  ) -> torch.Tensor | None:
    """``[B, T]`` bool: the slots each row may attend (from its first real token on, less
    its holes); None when every row may attend every slot."""
    pads = [row.pad for row in rows]
    if not any(pads) and not any(row.holes for row in rows):
        return None
    positions = torch.arange(total, device=device)
    allowed = positions[None, :] >= torch.tensor(pads, device=device)[:, None]
    for index, row in enumerate(rows):
        if row.holes:
            allowed[index, row.holes] = False  # holes lie before the cache's length
    return allowed


def dense_bias(rows: Sequence[_Row], total: int, device: torch.device) -> torch.Tensor | None:
    """``[B, 1, 1, T]``: -inf on each row's padding and holes; None when there are none."""
    allowed = visible_slots(rows, total, device)
    return None if allowed is None else additive_bias(allowed)[:, None, None, :]


def block_bias(rows: Sequence[_Row], total: int, queries: int, device: torch.device
               ) -> torch.Tensor:
    """``[B or 1, Q, T]``: the last ``queries`` positions (a verify's block) each see the keys
    up to themselves, less padding and holes."""
    allowed = causal_mask(total, queries, device)
    visible = visible_slots(rows, total, device)
    if visible is not None:
        allowed = allowed & visible[:, None, :]
    return additive_bias(allowed)
