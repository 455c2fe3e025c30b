"""Reading a request's entries out of a paged KV cache, and packing a fast memory into a slot.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sfi.core.kernels import attention_logits, capped_logits, evidence_bias, window_logits
from sfi.core.memory_tensors import MemoryTensors
from sfi.core.pages import PageSummaries
from sfi.core.refresh_selection import (
    HeldSelection,
    PreviousSelection,
    SelectionRule,
    reads_keys,
    selection_inputs,
)
from sfi.core.scorers import Evidence, Scorer, key_norms_of
from sfi.core.sequence_policy import Memory

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


@dataclass(frozen=True)
class RequestRefresh:
    """One request's refresh at a step, as read from the paged cache.

    Attributes:
        memory: the new memory (where its middle region lies, its k and pinned counts).
        queries: ``[W, Hq, D]`` the evidence queries, the last W positions before the keys end
            (W = 1: a decode-time slow step, its own query; W > 1: the prompt's last queries,
            as the transformers path selects at the prefill).
        keys: ``[H, T, D]`` the request's cached keys; T is where the evidence queries end.
            None where ``logits`` are given and the scorer reads no keys
            (``scores_rows_alone``).
        previous: ``[H, k']`` the positions the memory it replaces selected (its first
            ``memory.pinned`` pinned), or None for a first selection.
        key_norms: ``[H, T]`` the keys' L2 norms where the caller keeps them (None: computed
            from ``keys``).
        logits: ``[H, G, T]`` a decode-time slow step's logits where the caller computed them
            (:func:`logits_in_place`); None: computed from ``queries`` and ``keys``.
    """

    memory: Memory
    queries: torch.Tensor
    keys: torch.Tensor | None
    previous: torch.Tensor | None = None
    key_norms: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """T, the positions the refresh selects from."""
        return self.logits.shape[-1] if self.logits is not None else self.keys.shape[1]


def read_refresh(memory: Memory, queries: torch.Tensor, end: int,
                 previous: torch.Tensor | None, norms: torch.Tensor | None,
                 pages: PageSummaries | None, page: int | None, half: torch.Tensor,
                 block_row: torch.Tensor, layout: KeyLayout, read_keys: bool, scale: float,
                 softcap: float | None) -> tuple[RequestRefresh, PageSummaries | None]:
    """One request's :class:`RequestRefresh` read from the cache's keys ``half [NB, H, bs,
    D]`` (its blocks ``block_row``, stored as ``layout`` says; its keys end at ``end``), and
    its page summaries brought up to date where ``page`` is given (a probe layer's: those kept
    from its last refresh, ``pages``, or new ones).

    With one evidence query its logits are computed where the keys lie
    (:func:`logits_in_place`), and the keys are read only where that cannot be done or the
    scorer reads them (``read_keys``); else only the keys written since its last refresh are
    read, for the key norms (``norms [H, T']``, kept from its last refresh, or None: the
    refresh's ``key_norms`` are the new ones) and the page bounds.
    """
    h, d = half.shape[1], half.shape[3]
    logits = keys = None
    if queries.shape[0] == 1 and not read_keys:
        logits = logits_in_place(half, block_row, end, queries[0].view(h, -1, d), scale,
                                 softcap, layout)
    if logits is None:
        keys = read_prefix(half, block_row, end, layout)
    summaries = None if page is None else PageSummaries.kept(pages, page, length=end)
    held = 0 if norms is None or norms.shape[1] > end else norms.shape[1]
    start = min(held, end if summaries is None else summaries.reads_from)
    new = keys[:, start:] if keys is not None else read_range(half, block_row, start, end,
                                                              layout)  # [H, end - start, D]
    added = key_norms_of(new[:, held - start:])
    if summaries is not None:
        summaries.update(new[None], start=start)
    return RequestRefresh(memory, queries, keys, previous,
                          torch.cat([norms[:, :held], added], dim=1) if held else added,
                          logits), summaries


@dataclass(frozen=True)
class WindowSelection:
    """One selection's inputs (:func:`sfi.core.refresh_selection.select`) for the requests of one
    layer's refreshes that have the same number of evidence queries.

    Attributes:
        members: their indices among the layer's refreshes.
        k: ``[n]`` positions per KV head each one selects; pins: ``[n]`` its pinned slots.
        evidence: their stacked evidence (keys padded to the longest); it carries the queries
            and keys only for a scorer that reads them (not ``scores_rows_alone``).
        previous: what their replaced memories held (hysteresis, pins), or None.
    """

    members: tuple[int, ...]
    evidence: Evidence
    k: torch.Tensor
    pins: torch.Tensor
    previous: PreviousSelection | None


def window_selections(scorer: Scorer, rule: SelectionRule, layer_idx: int,
                      refreshes: Sequence[RequestRefresh], scale: float, softcap: float | None
                      ) -> list[WindowSelection]:
    """The refreshes of one layer at a step as one :class:`WindowSelection` per number of
    evidence queries (all the requests with that number at once, their keys padded to the
    longest)."""
    by_window: dict[int, list[int]] = {}
    for i, refresh in enumerate(refreshes):
        by_window.setdefault(refresh.queries.shape[0], []).append(i)
    return [_window_selection(scorer, rule, layer_idx, refreshes, tuple(members), w, scale,
                              softcap) for w, members in by_window.items()]


def _padded(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """``[n, H, length, ...]``: each ``[H, T_i, ...]`` zero-padded to ``length`` along its
    second dimension, laid out as the first (a dim-major view of keys stays one: its logits
    read the same)."""
    first = tensors[0]
    if len(tensors) == 1 and first.shape[1] == length:
        return first[None]
    n, h = len(tensors), first.shape[0]
    if first.dim() == 3 and first.stride(-1) != 1:  # a transposed view of [H, D, T]
        out = first.new_zeros(n, h, first.shape[2], length).transpose(-1, -2)
    else:
        out = first.new_zeros(n, h, length, *first.shape[2:])
    for row, t in enumerate(tensors):
        out[row, :, : t.shape[1]] = t
    return out


def _window_selection(scorer: Scorer, rule: SelectionRule, layer_idx: int,
                      refreshes: Sequence[RequestRefresh], members: tuple[int, ...], w: int,
                      scale: float, softcap: float | None) -> WindowSelection:
    """:func:`window_selections` for the ``members`` of ``refreshes``, which have ``w``
    evidence queries each."""
    group = [refreshes[i] for i in members]
    n = len(group)
    ends = [r.length for r in group]
    t = max(ends)
    given = w == 1 and all(r.logits is not None for r in group)
    keys = None
    if not given or reads_keys([scorer]):
        keys = _padded([r.keys for r in group], t)  # [n, H, T, D]
    h = group[0].logits.shape[0] if given else keys.shape[1]
    d, device = group[0].queries.shape[-1], group[0].queries.device
    q = torch.stack([r.queries.permute(1, 0, 2) for r in group])  # [n, Hq, W, D]
    end = torch.tensor(ends, device=device)
    key_pos = torch.arange(t, device=device)
    if w == 1:  # a decode-time slow step: the logits its dense attention computes
        if given:
            logits = torch.stack([F.pad(r.logits, (0, t - r.length)) for r in group])
        else:
            logits = attention_logits(q.reshape(n, h, -1, d), keys, scale, softcap)
        if min(ends) != t:
            logits = logits.masked_fill((key_pos >= end[:, None])[:, None, None, :],
                                        float("-inf"))
    else:  # the prompt's last W queries, each seeing the keys up to itself
        bias = evidence_bias(end, w, t)  # [n, W, T]
        logits = window_logits(q, keys, bias, scale, softcap)  # [n, H, G * W, T]
    memories = [r.memory for r in group]
    geometry = MemoryTensors.of(memories, device)
    norms = (_padded([r.key_norms for r in group], t)
             if all(r.key_norms is not None for r in group) else key_norms_of(keys))
    held = None
    if rule.hysteresis > 0 or any(m.pinned for m in memories):
        held = _held(group, h, device)
    evidence, previous = selection_inputs(
        logits, layer_idx, geometry.lo, geometry.hi, geometry.pinned, key_norms=norms, keys=keys,
        query=q.reshape(n, h, -1, d) if reads_keys([scorer]) else None, queries=w, held=held,
        hysteresis=rule.hysteresis > 0)
    return WindowSelection(members, evidence, geometry.k, geometry.pinned, previous)


def _held(group: Sequence[RequestRefresh], h: int, device: torch.device
          ) -> HeldSelection | None:
    """What the requests' replaced memories selected (their positions in slot order), or
    None where none had a memory."""
    if all(r.previous is None for r in group):
        return None
    held = [r.previous if r.previous is not None else torch.zeros(h, 0, dtype=torch.long,
                                                                   device=device)
            for r in group]
    counts = torch.tensor([p.shape[1] for p in held], device=device)
    return HeldSelection(_padded(held, max(p.shape[1] for p in held)),  # [n, H, k'_max]
                         torch.zeros_like(counts), counts)
