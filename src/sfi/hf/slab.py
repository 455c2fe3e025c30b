"""The tensors of one slow-fast attention layer (transformers' ``CacheLayer`` style).

:class:`SlabLayer` stores the full KV of one layer in a slab of reserved rows, preallocated and
grown by a quarter (at least 256 positions) when full, so that append is amortised O(1); the L2
norm of every cached key (the Selector's prior); the compact buffer that packs the sink and
selected entries of every (sequence, KV head) contiguously; and per-page key summaries kept
incrementally for the coverage probes. Sequences join into free rows and leave without the
batch being copied (``absorb``, ``keep``). It stores and reads what it is told to; what a step
does with these tensors (which rows attend how, when the compact buffer is rebuilt, and with
what) is :class:`sfi.hf.layer_attention.SlowFastAttention`'s, and it imports nothing of the plan.

Shapes: B sequences, H KV heads, T cache length, D head size, C compact slots, P pages.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from sfi.core.pages import PageSummaries
from sfi.core.rows import Rows
from sfi.core.scorers import key_norms_of
from sfi.errors import SFIError

_POSITIONAL = ("_keys", "_values", "_norms")  # [rows, H, positions, ...]
_COMPACT = ("compact_keys", "compact_values", "compact_positions")  # [rows, H, C, ...]


class SlabLayer(CacheLayerMixin):
    """Full KV of one attention layer, with key norms and the compact buffer.

    Storage ``[B, H, capacity, D]``; ``keys``/``values`` are views of the filled part
    ``[B, H, T, D]``; ``key_norms`` is ``[B, H, T]``. The compact buffer ``[B, H, C, D]`` holds,
    per row, its S sink slots then its selected slots; ``compact_positions [B, H, C]`` says
    which cache position each slot holds. Writes go through :meth:`append` (new positions),
    :meth:`write_compact` (a rebuilt compact buffer) and :meth:`blank` (exact mode's holes).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, initial_capacity: int = 256):
        super().__init__()
        self.layer_idx = layer_idx
        self.initial_capacity = max(initial_capacity, 16)
        self.length = 0
        # The tensors below are views of the slab (``_slab``): rows ``[:rows]`` of its
        # ``reserved`` ones, positions from ``origin`` on (to the left of it: room for more
        # left padding, so that a longer sequence joins without moving the others).
        self._slab: dict[str, torch.Tensor] = {}
        self.rows = 0
        self.origin = 0
        self.relayouts = 0  # times the slab was copied (grown, re-rowed, or shifted)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None
        self.compact_keys: torch.Tensor | None = None
        self.compact_values: torch.Tensor | None = None
        self.compact_positions: torch.Tensor | None = None
        self._pages: PageSummaries | None = None

    # --- the CacheLayerMixin interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        capacity = self.initial_capacity
        self.dtype, self.device = key_states.dtype, key_states.device
        self._slab = {
            "_keys": key_states.new_zeros(b, h, capacity, d),
            "_values": value_states.new_zeros(b, h, capacity, value_states.shape[-1]),
            "_norms": torch.zeros(b, h, capacity, dtype=torch.float32, device=self.device)}
        self.rows, self.origin = b, 0
        self._bind()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' write: :meth:`append`."""
        return self.append(key_states, value_states)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[B, H, L, D]`` keys/values after the filled part (and the keys' norms)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            self._grow(end)
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self._norms[:, :, start:end] = key_norms_of(key_states)
        self.length = end
        return self.keys, self.values

    def blank(self, empty: torch.Tensor, start: int) -> None:
        """Zero the KV (and key norms) where ``empty [B, n]`` is true, in the n slots from
        ``start`` (exact mode's holes, which no read attends: ``sfi.hf.visibility``); the page
        summaries from ``start`` on are made again when asked."""
        end = start + empty.shape[1]
        self._keys[:, :, start:end].masked_fill_(empty[:, None, :, None], 0)
        self._values[:, :, start:end].masked_fill_(empty[:, None, :, None], 0)
        self._norms[:, :, start:end].masked_fill_(empty[:, None, :], 0)
        if self._pages is not None:
            self._pages.forget_after(start)

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (their page summaries are made again when
        asked); the compact buffer's positions lie before ``length``."""
        self.length = length
        if self._pages is not None:
            self._pages.forget_after(length)

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.20 passes cache_position
            query_length = query_length.shape[0]
        return self.length + int(query_length), 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.compact_keys = self.compact_values = self.compact_positions = None
        for name in _COMPACT:
            self._slab.pop(name, None)
        if self._slab:
            self.origin = 0
            self._bind()
        self._pages = None

    def crop(self, tokens_to_remove: int) -> None:
        raise SFIError("SlowFastCache cannot be cropped (assisted or speculative decoding is not "
                       "supported with slow-fast decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise SFIError("SlowFastCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise SFIError("SlowFastCache cannot be expanded after prefill; build one per batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise SFIError("SlowFastCache cannot drop sequences this way; use SlowFastCache.keep")

    # --- views ---------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise SFIError("SlabLayer storage is written through update() only")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise SFIError("SlabLayer storage is written through update() only")

    @property
    def key_norms(self) -> torch.Tensor:
        """``[B, H, T]`` L2 norm of every cached key."""
        return self._norms[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def page_summaries(self, page: int, shift: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(low, high)`` ``[B, H, P, D]``: the element-wise min and max key of every page of
        ``page`` positions (starting where ``shift [B]`` says, ``sfi.core.pages``; the first and the
        last may be partial)."""
        pages = self._summarise(page, shift)
        n = pages.count
        return pages.low[:, :, :n], pages.high[:, :, :n]

    def page_boxes(self, page: int, shift: torch.Tensor | None = None,
                   aligned: tuple[int, ...] | None = None, upto: int | None = None
                   ) -> torch.Tensor:
        """``[B, H, P, 2 D]`` the same pages' boxes (``sfi.core.pages.page_boxes``: centre, then
        radius): what bounding ``q . k`` reads (``sfi.core.scorers.quest.box_scores``).
        ``aligned``: ``shift`` as Python ints; ``upto``: only pages ending by this position are
        wanted (where a probe's middle regions end: no new page to summarise at a fast step)."""
        pages = self._summarise(page, shift, aligned, upto)
        n = pages.count
        return pages.boxes[:, :, :n]

    def _summarise(self, page: int, shift: torch.Tensor | None,
                   aligned: tuple[int, ...] | None = None,
                   upto: int | None = None) -> PageSummaries:
        """The page summaries (:class:`sfi.core.pages.PageSummaries`), brought up to date to the
        filled length (or ``upto``, when given)."""
        t = self.length if upto is None else min(self.length, upto)
        if aligned is None and shift is not None:
            aligned = tuple(shift.tolist())
        self._pages = PageSummaries.kept(self._pages, page, aligned)
        return self._pages.update(self.keys[:, :, :t], shift, capacity=self.capacity)

    def _grow(self, needed: int) -> None:
        """Room for ``needed`` positions: a quarter more than now (at least 256 more), so that a
        long-running batch wastes at most a fifth of its KV memory on room."""
        current = self.capacity
        self._relayout(capacity=max(needed, current + max(256, current // 4)), room=self.origin)

    # --- the slab: reserved rows, and room on both sides of the filled positions ------------------
    @property
    def reserved(self) -> int:
        """Rows the slab holds (``rows`` of them in use)."""
        return self._slab["_keys"].shape[0] if self._slab else 0

    def _bind(self) -> None:
        """Point the layer's tensors at the rows in use (and positions from ``origin``)."""
        for name in _POSITIONAL:
            setattr(self, name, self._slab[name][: self.rows, :, self.origin:])
        for name in _COMPACT:
            if name in self._slab:
                setattr(self, name, self._slab[name][: self.rows])

    def _relayout(self, capacity: int | None = None, reserved: int | None = None,
                  shift: int = 0, room: int = 0) -> None:
        """Copy the rows in use into a new slab of ``reserved`` rows and ``room + capacity``
        positions (default: as now), ``shift`` more of left padding, origin ``room``; free rows
        and positions past the length are not zeroed (each is written before it is read)."""
        capacity, reserved = capacity or self.capacity, reserved or self.reserved
        n, start = self.rows, room + shift
        for name in _POSITIONAL:
            old = getattr(self, name)
            new = old.new_empty(reserved, *old.shape[1:2], room + capacity, *old.shape[3:])
            new[:n, :, :start] = 0
            new[:n, :, start: start + self.length] = old[:, :, : self.length]
            self._slab[name] = new
        for name in _COMPACT:
            old = getattr(self, name)
            if old is not None and reserved != old.shape[0]:
                new = old.new_zeros(reserved, *old.shape[1:])
                new[:n] = old
                self._slab[name] = new
        self.origin = room
        self.relayouts += 1
        self._bind()

    def reserve(self, rows: int) -> None:
        """Hold ``rows`` rows from now on (at least those in use), so that sequences join and
        leave without the batch being copied (``absorb``, ``keep``)."""
        rows = max(rows, self.rows)
        if self._slab and rows != self.reserved:
            with self._storage_mode():
                self._relayout(reserved=rows)

    @property
    def slab_bytes(self) -> int:
        """Bytes the slab holds (rows in use or not)."""
        return sum(t.numel() * t.element_size() for t in self._slab.values())

    def _storage_mode(self) -> torch.inference_mode:
        """Inference mode when the storage was made in it (written in place only there)."""
        return torch.inference_mode(self._keys is not None and self._keys.is_inference())

    # --- the compact buffer --------------------------------------------------------------------
    def gather(self, rows: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[n, H, W, D]``: the entries at ``positions [n, H, W]`` of the
        rows ``rows [n]``, each one ``index_select`` of D-wide rows of the contiguous slab, which
        on CPU copies about twice as fast as advanced indexing of the strided view."""
        return self._entries("_keys", rows, positions), self._entries("_values", rows, positions)

    def _entries(self, name: str, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        view, slab = getattr(self, name), self._slab[name]  # the slab is contiguous
        d = view.shape[-1]
        heads = torch.arange(view.shape[1], device=self.device)
        first = (rows[:, None, None] * view.stride(0) + heads[None, :, None] * view.stride(1)
                 + view.storage_offset())
        index = first // d + positions  # [n, H, W] rows of the slab seen as [*, D]
        return slab.view(-1, d).index_select(0, index.flatten()).view(*index.shape, d)

    def write_compact(self, rows: Rows, keys: torch.Tensor, values: torch.Tensor,
                      positions: torch.Tensor, width: int) -> None:
        """Store the ``rows``' rebuilt compact entries: ``keys``/``values`` ``[n, H, W, D]``
        and their cache ``positions [n, H, W]`` in slots ``[0, W)`` of a buffer of at least
        ``width`` slots (in the storage's own inference mode, whatever the caller's)."""
        with self._storage_mode():
            self.ensure_compact(width)
            w = keys.shape[-2]
            rows.put(self.compact_keys[:, :, :w], keys)
            rows.put(self.compact_values[:, :, :w], values)
            rows.put(self.compact_positions[:, :, :w], positions)

    def ensure_compact(self, width: int) -> None:
        """Allocate the compact buffer, or grow it to ``width`` slots (contents kept)."""
        h, d = self._keys.shape[1], self._keys.shape[3]
        if self.compact_keys is not None and self.compact_keys.shape[-2] >= width:
            return
        old = (self.compact_keys, self.compact_values, self.compact_positions)
        r = self.reserved
        self._slab["compact_keys"] = self._keys.new_zeros(r, h, width, d)
        self._slab["compact_values"] = self._values.new_zeros(r, h, width,
                                                              self._values.shape[-1])
        self._slab["compact_positions"] = torch.zeros(r, h, width, dtype=torch.long,
                                                      device=self.device)
        self._bind()
        if old[0] is not None:
            filled = old[0].shape[-2]
            for new, previous in zip((self.compact_keys, self.compact_values,
                                      self.compact_positions), old):
                new[:, :, :filled] = previous

    # --- continuous batching ---------------------------------------------------------------------
    def absorb(self, other: SlabLayer, length: int, shifts: tuple[int, int],
               compact_width: int) -> None:
        """Add ``other``'s sequences below this layer's, both right-aligned at ``length``.

        They are written into free rows of the slab. This layer's sequences stay where they
        are: more left padding for them (``shifts[0]``) takes room left of the origin when
        there is enough; the slab is copied only when it lacks rows, room for that padding or
        room for ``length`` positions. Neither layer may have a compact rebuild pending."""
        with self._storage_mode():
            self._absorb(other, length, shifts, compact_width)

    def _absorb(self, other: SlabLayer, length: int, shifts: tuple[int, int],
                compact_width: int) -> None:
        n, m = self.rows, other.rows
        needed = length + 16
        if n + m <= self.reserved and shifts[0] <= self.origin and \
                self.capacity + shifts[0] >= needed:
            if shifts[0]:
                self.origin -= shifts[0]
                self._bind()
                for name in _POSITIONAL:
                    getattr(self, name)[:, :, : shifts[0]] = 0
        else:
            self._relayout(capacity=max(self.capacity, other.capacity + shifts[1], needed),
                           reserved=max(n + m, self.reserved), shift=shifts[0],
                           room=self.origin if shifts[0] <= self.origin else 0)
        self.ensure_compact(compact_width)
        other.ensure_compact(compact_width)
        for name in _POSITIONAL:
            joining = self._slab[name][n: n + m, :, self.origin:]
            joining[:, :, : shifts[1]] = 0
            joining[:, :, shifts[1]: length] = getattr(other, name)[:, :, : other.length]
        width = self.compact_keys.shape[2]
        for name in _COMPACT:
            theirs = getattr(other, name)[:, :, :width]
            joining = self._slab[name][n: n + m]
            joining[:, :, theirs.shape[2]:] = 0
            if name == "compact_positions":
                getattr(self, name).add_(shifts[0])
                theirs = theirs + shifts[1]
            joining[:, :, : theirs.shape[2]] = theirs
        self.rows = n + m
        self.length = length
        self._bind()
        self._pages = None  # positions moved: summarise again when asked

    def keep(self, index: torch.Tensor, trim: int) -> None:
        """Keep the sequences ``index`` and drop the first ``trim`` positions (padding).

        The rows kept move up into the freed ones (only rows below a freed one are copied);
        the trimmed padding becomes room left of the origin. No compact rebuild may be
        pending."""
        with self._storage_mode():
            self._keep(index, trim)

    def _keep(self, index: torch.Tensor, trim: int) -> None:
        self._pages = None
        order = index.tolist()
        names = [name for name in (*_POSITIONAL, *_COMPACT) if name in self._slab]
        if all(a < b for a, b in itertools.pairwise(order)):
            filled = slice(self.origin, self.origin + self.length)
            for dst, src in enumerate(order):
                if dst != src:
                    for name in names:
                        slab = self._slab[name]
                        if name in _POSITIONAL:
                            slab[dst, :, filled] = slab[src, :, filled]
                        else:
                            slab[dst] = slab[src]
        else:
            for name in names:
                slab = self._slab[name]
                slab[: len(order)] = slab.index_select(0, index)
        self.rows = len(order)
        self.origin += trim
        self.length -= trim
        self._bind()
        if trim and self.compact_positions is not None:
            self.compact_positions -= trim
