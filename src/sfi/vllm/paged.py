"""Reading a request's entries out of a paged KV cache: where a backend's cache op puts them,
and the reads by position, range, block and run of blocks (a slow row's logits in place).

vLLM gives every backend one layer's cache as the logical tensor ``[NB, H, bs, 2 * D]``
(``NB`` blocks of ``bs`` positions, each KV head stored apart; physical strides may differ).
How keys and values share a block's last two dimensions is the backend's business
(:class:`CacheLayout`, found once by :func:`probe_layout` through the backend's own cache op):
vLLM's CPU kernel stores a head's ``bs * D`` keys (dimension-major in fp32) and then its values;
FlashAttention and Triton store each position's D key channels and then its D value channels.
Pure tensor functions then read one half (keys or values) seen as ``[NB, H, bs, D]``: position
``p`` of a request lies in block ``block_row[p // bs]`` at offset ``p % bs``. The plugin's
buffer has the cache's layout (written by the same cache op), so the stock kernel reads a slot
as it reads any request: a fast row's block table lists its slot's blocks and its ``seq_len``
is the slot's length.

Shapes: H KV heads, D head size, T context length, L entries of a memory, k selected per head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sfi.core.kernels import capped_logits

KeyLayout = None | str | torch.Tensor
"""How a kernel stores a block's ``bs * D`` key entries: None (``[bs, D]``), ``"dim-major"``
(``[D, bs]``, as vLLM's CPU kernel stores fp32 keys), or any other order as a ``[bs * D]``
permutation (entry (o, d) lies at ``order[o * D + d]``)."""

DIM_MAJOR = "dim-major"
BLOCKS = "blocks"  # a head's block holds its bs * D keys, then its bs * D values
CHANNELS = "channels"  # each position holds its D key channels, then its D value channels

CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(cache [NB, H, bs, 2D], keys [n, H, D], values [n, H, D], slots [n])``: a backend's
own cache op (slot = block * bs + offset)."""


@dataclass(frozen=True)
class CacheLayout:
    """How a backend lays out keys and values in its logical cache ``[NB, H, bs, 2 * D]``.

    Attributes:
        split: :data:`BLOCKS` or :data:`CHANNELS`.
        keys: how the key half stores a block's ``bs * D`` entries (a :data:`KeyLayout`).
        values: the value half's order, a ``[bs * D]`` permutation or None (natural).
        With the channels split both are natural.
    """

    split: str
    keys: KeyLayout = None
    values: torch.Tensor | None = None

    def halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``cache [NB, H, bs, 2 * D]``, each seen as ``[NB, H, bs, D]``
        (views: no copy)."""
        nb, h, bs, two_d = cache.shape
        if self.split == BLOCKS:
            keys, values = cache.view(nb, h, bs * 2, two_d // 2).chunk(2, dim=2)
            return keys, values
        return cache[..., : two_d // 2], cache[..., two_d // 2:]


def empty_like_cache(cache: torch.Tensor, blocks: int) -> torch.Tensor:
    """A zeroed ``[blocks, H, bs, 2D]`` with ``cache``'s physical order of dimensions (vLLM may
    keep positions outside heads), so the stock kernel reads it as it reads the cache."""
    outer_first = sorted(range(cache.dim()), key=lambda i: -cache.stride(i))
    shape = [blocks, *cache.shape[1:]]
    stored = cache.new_zeros([shape[i] for i in outer_first])
    return stored.permute([outer_first.index(i) for i in range(cache.dim())])


def probe_layout(write: CacheWrite, bs: int, d: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> CacheLayout:
    """Find how ``write`` lays out a block: store one block of ``bs`` positions whose ``2 * bs *
    D`` key and value entries are all distinct normal floats (nothing a copy could flush or
    fold), then see where each one landed."""
    n = bs * d
    marks = _distinct_floats(2 * n, dtype)  # [2n] bit patterns (int16 or int32)
    values_of = marks.view(dtype).to(device)
    keys, values = values_of[:n].view(bs, 1, d), values_of[n:].view(bs, 1, d)
    probe = torch.zeros(1, 1, bs, 2 * d, dtype=dtype, device=device)
    write(probe, keys, values, torch.arange(bs, device=device))
    for split in (BLOCKS, CHANNELS):
        key_half, value_half = CacheLayout(split).halves(probe)
        key_order = _stored_order(key_half, marks[:n])
        value_order = _stored_order(value_half, marks[n:])
        if key_order is False or value_order is False:
            continue
        if split == CHANNELS and (key_order is not None or value_order is not None):
            continue  # permuted along channels: no backend does this, and reads would copy
        return CacheLayout(split, _named(key_order, bs, d), value_order)
    raise RuntimeError("the backend's cache op does not store a block as sfi knows how to read "
                       "it (keys then values per head, or per position)")


def _distinct_floats(count: int, dtype: torch.dtype) -> torch.Tensor:
    """``[count]`` distinct bit patterns (as int16 or int32) of normal, finite ``dtype``
    numbers, from 1.0 up."""
    bits = {2: torch.int16, 4: torch.int32}.get(dtype.itemsize)
    if bits is None or not dtype.is_floating_point:
        raise RuntimeError(f"sfi reads vLLM's cache in 16- or 32-bit float dtypes, not {dtype}")
    one = int(torch.ones(1, dtype=dtype).view(bits).item())
    if bits == torch.int32:
        return (one + torch.arange(count, dtype=torch.int64)).to(bits)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64).to(bits)
    as_float = every.view(dtype).float()
    normal = torch.isfinite(as_float) & (as_float.abs() >= torch.finfo(dtype).tiny)
    patterns = torch.roll(every[normal], -int((every[normal] < one).sum()))  # from 1.0 up
    if count > len(patterns):
        raise RuntimeError(f"a {dtype} cache block of {count} entries is too large to probe")
    return patterns[:count].contiguous()


def _stored_order(half: torch.Tensor, marks: torch.Tensor) -> torch.Tensor | bool | None:
    """Where entry m of a block (``marks[m]``) landed among ``half``'s entries: None if in
    order, else a permutation; False if the half does not hold exactly those marks."""
    stored = half.reshape(-1).contiguous().view(marks.dtype).cpu().long()
    ordered, entry = marks.long().sort()
    where = torch.searchsorted(ordered, stored).clamp_(max=len(marks) - 1)
    if stored.numel() != marks.numel() or not torch.equal(ordered[where], stored):
        return False
    found = entry[where]  # stored position i holds entry found[i]
    n = len(marks)
    if not torch.equal(found.sort().values, torch.arange(n)):
        return False
    if torch.equal(found, torch.arange(n)):
        return None
    return torch.empty(n, dtype=torch.long).scatter_(0, found, torch.arange(n))


def _named(order: torch.Tensor | None, bs: int, d: int) -> KeyLayout:
    """``order`` named :data:`DIM_MAJOR` when it is (:func:`read_prefix` reads it faster)."""
    if order is not None and torch.equal(order, torch.arange(bs * d).view(d, bs).t().flatten()):
        return DIM_MAJOR
    return order


def read_prefix(half: torch.Tensor, block_row: torch.Tensor, total: int,
                layout: KeyLayout = None) -> torch.Tensor:
    """``[H, T, D]``: positions ``[0, total)`` of the request whose blocks are ``block_row``,
    stored as ``layout`` says. For a dim-major layout the result is a transposed view of a
    contiguous ``[H, D, T]`` (what ``q @ k^T`` wants), made with one copy."""
    return read_range(half, block_row, 0, total, layout)


def read_range(half: torch.Tensor, block_row: torch.Tensor, start: int, end: int,
               layout: KeyLayout = None) -> torch.Tensor:
    """``[H, end - start, D]``: positions ``[start, end)`` of the request whose blocks are
    ``block_row`` (only the blocks that hold them are read), as :func:`read_prefix`."""
    bs = half.shape[2]
    first = start // bs
    if end <= start:
        return half.new_empty(half.shape[1], 0, half.shape[3])
    blocks = block_row[first: -(-end // bs)]
    return read_blocks(half, blocks[None], layout)[0, :, start - first * bs: end - first * bs]


MAX_RUNS = 16
""":func:`logits_in_place` reads the keys where they lie when a request's blocks form at most
this many runs of consecutive blocks (one matrix product per run)."""


def logits_in_place(half: torch.Tensor, block_row: torch.Tensor, total: int, q: torch.Tensor,
                    scale: float, softcap: float | None, layout: KeyLayout = None
                    ) -> torch.Tensor | None:
    """``[H, G, T]``: the logits (:func:`sfi.core.kernels.attention_logits`) of ``q [H, G, D]`` (a
    decode row's G query heads per KV head) on positions ``[0, total)`` of the request whose
    blocks are ``block_row``, computed on the cache's blocks where they lie; None where they
    cannot be (then the caller reads the keys, :func:`read_prefix`).

    A slow step's dense attention reads every key once; these logits (the Selector's evidence)
    read them a second time. On the host, with keys stored ``[bs, D]`` or dim-major, each run
    of consecutive blocks is one batched product over the cache's own blocks (no copy of the
    keys: a copy would read and write them once more). Not on a device (the block ids would have
    to be read back), with a permuted layout, or over more than :data:`MAX_RUNS` runs.
    """
    nb, h, bs, d = half.shape
    count = -(-total // bs)
    if total <= 0 or half.device.type != "cpu" or isinstance(layout, torch.Tensor):
        return None
    runs = block_runs(block_row[:count].tolist())
    if len(runs) > MAX_RUNS:
        return None
    # [NB, H, D, bs]: each block's keys transposed, as q @ k^T reads them (a view)
    transposed = half.view(nb, h, d, bs) if layout == DIM_MAJOR else half.transpose(-1, -2)
    g = q.shape[1]
    parts = []
    for first, length in runs:
        keys = transposed[first: first + length].reshape(length * h, d, bs)
        parts.append(torch.bmm(q.expand(length, h, g, d).reshape(length * h, g, d), keys)
                     .view(length, h, g, bs))
    products = torch.cat(parts) if len(parts) > 1 else parts[0]  # [blocks, H, G, bs]
    products = products.permute(1, 2, 0, 3).reshape(h, g, count * bs)[..., :total]
    return capped_logits(products, scale, softcap)


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``blocks`` (block ids in a request's order) as runs of consecutive ids: ``(first id,
    count)`` each, in order."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def read_blocks(half: torch.Tensor, block_rows: torch.Tensor,
                layout: KeyLayout = None) -> torch.Tensor:
    """``[n, H, m * bs, D]``: the entries of the ``m`` blocks of each of ``block_rows [n, m]``,
    in order, stored as ``layout`` says. For a dim-major layout the result is a transposed view
    of one contiguous ``[H, D, n m bs]`` (what ``q @ k^T`` wants), made with one copy."""
    nb, h, bs, d = half.shape
    n, m = block_rows.shape
    blocks = block_rows.reshape(-1).long()
    if isinstance(layout, torch.Tensor):
        layout = layout.to(half.device)
    if isinstance(layout, str):  # one gather straight into [H, D, n m, bs] (no second copy)
        paged = half.view(nb, h, d, bs).permute(1, 2, 0, 3).index_select(2, blocks)
        return paged.view(h, d, n, m * bs).permute(2, 0, 3, 1)
    if layout is None:
        paged = half.permute(1, 0, 2, 3).index_select(1, blocks)  # [H, n m, bs, D]
        return paged.view(h, n, m * bs, d).transpose(0, 1)
    paged = half.index_select(0, blocks)  # [n m, H, bs, D]
    paged = paged.reshape(-1, h, bs * d).index_select(2, layout).view(n, m, h, bs, d)
    return paged.permute(0, 2, 1, 3, 4).reshape(n, h, m * bs, d)


def read_positions(half: torch.Tensor, block_row: torch.Tensor, positions: torch.Tensor,
                   layout: KeyLayout = None) -> torch.Tensor:
    """``[H, L, D]``: head h's entry at ``positions [H, L]`` (cache positions per head), from
    blocks stored as ``layout`` says (a :data:`KeyLayout`: ``[bs, D]``, dim-major, or a
    permutation). With ``block_row [n, max_blocks]`` (n requests' blocks) and ``positions [n,
    H, L]``: ``[n, H, L, D]``."""
    nb, h, bs, d = half.shape
    if block_row.dim() == 2:
        blocks = block_row.long().gather(1, (positions // bs).flatten(1)).view_as(positions)
    else:
        blocks = block_row.long()[positions // bs]
    heads = torch.arange(h, device=positions.device)[:, None]
    if layout is None:
        return half[blocks, heads, positions % bs]
    if isinstance(layout, str):  # each entry's D channels a stride bs apart: one gather
        return half.view(nb, h, d, bs)[blocks, heads, :, positions % bs]
    where = layout.to(half.device).view(bs, d)[positions % bs]  # [H, L, D]
    return half.reshape(nb, h, bs * d)[blocks[..., None], heads[..., None], where]
