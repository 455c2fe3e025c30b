"""The KV store of slow-fast decoding, and the per-sequence state that plans each step.

``SlowFastCache`` is a transformers ``Cache``: pass it as ``past_key_values`` to ``generate`` or
to a forward call. It keeps the full KV cache (nothing is ever evicted) in preallocated storage
that grows geometrically, the L2 norm of every cached key (computed once per token, for the
Selector's prior), and per layer a compact buffer that packs the sink and selected entries of
every (sequence, KV head) contiguously.

Before each forward pass a hook on the model calls :meth:`SlowFastCache.begin_forward` with the
input tokens; it asks each sequence's trigger whether this step is slow and writes a
:class:`StepPlan` that every layer's attention then follows (see ``sfi.attention``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from sfi.config import SFIConfig
from sfi.errors import SFIError, UnsupportedModelError
from sfi.kernels import additive_bias
from sfi.overlap import Rebuilder, StagedCompact, make_rebuilder
from sfi.rows import Rows
from sfi.scorers import Scorer
from sfi.selector import SFISelector
from sfi.stats import DecodeStats
from sfi.triggers import BOOTSTRAP, RefreshTrigger, TokenClasses, make_trigger, token_classes

_active = threading.local()


def set_active_layer(layer: Any) -> None:
    """Record the cache layer whose ``update`` just ran (for the attention call that follows)."""
    _active.layer = layer


def take_active_layer(layer_idx: int) -> Any:
    """The SFI layer whose ``update`` ran just before this attention call, if any.

    A decoder calls ``cache.update`` and then the attention function for the same layer, in the
    same thread; this is how the attention function finds the state of its layer.
    """
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if layer is not None and layer.layer_idx == layer_idx:
        return layer
    return None


@dataclass
class SequenceState:
    """What one sequence of the batch carries between steps (host side, a few ints)."""

    pad: int
    trigger: RefreshTrigger
    config: SFIConfig
    dense_only: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)
    steps_since_refresh: int = 0
    has_selection: bool = False
    recent_start: int = 0
    sink_count: int = 0
    selected_count: int = 0


@dataclass
class SlowRows:
    """Geometry of the sequences refreshed in this forward (one entry per row of ``rows``).

    Attributes:
        rows: which sequences.
        lo, hi: ``[n]`` the middle region [lo, hi) each selects from.
        k: ``[n]`` how many positions each keeps per KV head.
        candidates: ``[n, T]`` bool, the middle region as a mask.
        sink_positions: ``[n, S]`` positions of the sink entries (clamped where there are fewer).
        evidence_bias: ``[n, 1, W, T]`` causal and padding bias of the last W prompt queries
            (prefill only).
    """

    rows: Rows
    lo: torch.Tensor
    hi: torch.Tensor
    k: torch.Tensor
    candidates: torch.Tensor
    sink_positions: torch.Tensor
    evidence_bias: torch.Tensor | None = None


@dataclass
class FastRows:
    """Geometry of the sequences that take a fast step in this forward.

    Attributes:
        rows: which sequences.
        read_start: first cache position of the recent window read in place (min over rows).
        recent_bias: ``[n, 1, 1, T - read_start]`` masks positions before each row's own
            recent start, or None when every row starts at ``read_start``.
        compact_bias: ``[n, 1, 1, C]`` masks the unused slots of the compact buffer.
    """

    rows: Rows
    read_start: int
    recent_bias: torch.Tensor | None
    compact_bias: torch.Tensor


@dataclass
class StepPlan:
    """What every layer does in one forward pass.

    ``dense`` rows attend to the whole cache without refreshing (short contexts, prefill);
    ``slow`` rows attend densely and refresh their selection; ``fast`` rows read the compact
    buffer plus the recent window. ``pad_bias`` ``[B, 1, 1, T]`` masks left padding; it is built
    only when a row reads densely (fast rows do not need it) and is None when no row is padded.
    """

    query_length: int
    total_length: int
    dense: Rows
    slow: SlowRows | None
    fast: FastRows | None
    pad_bias: torch.Tensor | None
    padded: bool = False


class SlowFastLayer(CacheLayerMixin):
    """Full KV of one attention layer, preallocated, with key norms and the compact buffer.

    Storage ``[B, H, capacity, D]`` grows by doubling, so appending a token is amortised O(1).
    ``keys``/``values`` are views of the filled part ``[B, H, T, D]``; ``key_norms`` is
    ``[B, H, T]``. The compact buffer ``[B, H, C, D]`` holds S sink slots then the selected
    slots; ``selected_positions`` ``[B, H, C - S]`` says where each selected slot came from.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: SlowFastCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None
        self.compact_keys: torch.Tensor | None = None
        self.compact_values: torch.Tensor | None = None
        self.selected_positions: torch.Tensor | None = None
        self.pending: StagedCompact | None = None

    # --- the CacheLayerMixin interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        capacity = max(self.owner.initial_capacity, 16)
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = key_states.new_zeros(b, h, capacity, d)
        self._values = value_states.new_zeros(b, h, capacity, value_states.shape[-1])
        self._norms = torch.zeros(b, h, capacity, dtype=torch.float32, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, L, D]``; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            self._grow(end)
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self._norms[:, :, start:end] = torch.linalg.vector_norm(key_states.float(), dim=-1)
        self.length = end
        set_active_layer(self)
        return self.keys, self.values

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
        self.compact_keys = self.compact_values = self.selected_positions = None
        self.pending = None

    def crop(self, tokens_to_remove: int) -> None:
        raise SFIError("SlowFastCache cannot be cropped (assisted or speculative decoding is not "
                       "supported with slow-fast decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise SFIError("SlowFastCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise SFIError("SlowFastCache cannot be expanded after prefill; build one per batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise SFIError("SlowFastCache cannot drop sequences after prefill")

    # --- views ---------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise SFIError("SlowFastLayer storage is written through update() only")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise SFIError("SlowFastLayer storage is written through update() only")

    @property
    def key_norms(self) -> torch.Tensor:
        """``[B, H, T]`` L2 norm of every cached key."""
        return self._norms[:, :, : self.length]

    @property
    def storage_keys(self) -> torch.Tensor:
        """The whole preallocated key storage ``[B, H, capacity, D]``."""
        return self._keys

    @property
    def storage_values(self) -> torch.Tensor:
        return self._values

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._keys.shape[-2])
        for name in ("_keys", "_values", "_norms"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    # --- the compact buffer --------------------------------------------------------------------
    def pack(self, slow: SlowRows, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather sink + ``selected`` ``[n, H, k]`` entries of the ``slow`` rows:
        ``(keys, values)``, each ``[n, H, S + k, D]``."""
        n, h = len(slow.rows), self._keys.shape[1]
        sinks = slow.sink_positions[:, None, :].expand(n, h, -1)
        positions = torch.cat([sinks, selected], dim=-1)  # [n, H, S + k]
        row_index = slow.rows.index[:, None, None]
        head_index = torch.arange(h, device=self.device)[None, :, None]
        return (self._keys[row_index, head_index, positions],
                self._values[row_index, head_index, positions])

    def settle(self, wait: bool = False) -> Rows | None:
        """Commit a pending rebuild that is ready (or, with ``wait``, once it is); return the
        rows whose rebuild is still running, which must read densely for now."""
        staged = self.pending
        if staged is None:
            return None
        if not (wait or staged.ready()):
            return staged.rows
        staged.wait()
        self.ensure_compact()
        width = staged.keys.shape[-2]
        staged.rows.put(self.compact_keys[:, :, :width], staged.keys)
        staged.rows.put(self.compact_values[:, :, :width], staged.values)
        staged.rows.put(self.selected_positions[:, :, : staged.selected.shape[-1]],
                        staged.selected)
        self.pending = None
        return None

    def absorb(self, other: SlowFastLayer, length: int, shifts: tuple[int, int],
               compact_capacity: int) -> None:
        """Stack ``other``'s sequences under this layer's, both right-aligned at ``length``."""
        self.settle(wait=True)
        other.settle(wait=True)
        capacity = max(self.capacity, other.capacity, length + 16)
        parts = ((self, shifts[0]), (other, shifts[1]))
        for name in ("_keys", "_values", "_norms"):
            stacked = []
            for layer, shift in parts:
                old = getattr(layer, name)
                new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
                new[:, :, shift:length] = old[:, :, : layer.length]
                stacked.append(new)
            setattr(self, name, torch.cat(stacked))
        for layer, _ in parts:
            layer.ensure_compact()
        sink = self.owner.config.sink
        buffers = []
        for name in ("compact_keys", "compact_values", "selected_positions"):
            stacked = []
            for layer, shift in parts:
                old = getattr(layer, name)
                width = compact_capacity - (sink if name == "selected_positions" else 0)
                new = old.new_zeros(old.shape[0], old.shape[1], width, *old.shape[3:])
                new[:, :, : old.shape[2]] = old + shift if name == "selected_positions" else old
                stacked.append(new)
            buffers.append(torch.cat(stacked))
        self.compact_keys, self.compact_values, self.selected_positions = buffers
        self.length = length

    def keep(self, index: torch.Tensor, trim: int) -> None:
        """Keep the sequences ``index`` and drop the first ``trim`` positions (padding)."""
        self.settle(wait=True)
        for name in ("_keys", "_values", "_norms", "compact_keys", "compact_values",
                     "selected_positions"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, index))
        if trim:
            for name in ("_keys", "_values", "_norms"):
                tensor = getattr(self, name)
                tensor[:, :, : self.length - trim] = tensor[:, :, trim: self.length].clone()
            if self.selected_positions is not None:
                self.selected_positions -= trim
            self.length -= trim

    def ensure_compact(self) -> None:
        """Allocate or grow the compact buffer to the cache's current capacity."""
        b, h, _, d = self._keys.shape
        capacity = self.owner.compact_capacity
        if self.compact_keys is None or self.compact_keys.shape[-2] < capacity:
            self._grow_compact(b, h, d, capacity)

    def _grow_compact(self, b: int, h: int, d: int, capacity: int) -> None:
        old_k, old_v, old_p = self.compact_keys, self.compact_values, self.selected_positions
        sink = self.owner.config.sink
        self.compact_keys = self._keys.new_zeros(b, h, capacity, d)
        self.compact_values = self._values.new_zeros(b, h, capacity, self._values.shape[-1])
        self.selected_positions = torch.zeros(b, h, capacity - sink, dtype=torch.long,
                                              device=self.device)
        if old_k is not None:
            width = old_k.shape[-2]
            self.compact_keys[:, :, :width] = old_k
            self.compact_values[:, :, :width] = old_v
            self.selected_positions[:, :, : old_p.shape[-1]] = old_p


class SlowFastCache(Cache):
    """A transformers ``Cache`` that decodes with Slow-Fast Inference.

    Use it as ``model.generate(**inputs, past_key_values=SlowFastCache(model, config))`` or
    through :func:`sfi.generate`. One cache serves one batch, from prefill to the last token.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``
            (Llama, Qwen2, Qwen3, Mistral, Gemma, ...). Building the cache routes the model's
            attention through sfi's function, which behaves exactly like SDPA for other caches.
        config: the SFI knobs; defaults to ``SFIConfig()``.
        tokenizer: the model's tokenizer, for sentence triggers; taken from ``sfi.load`` or the
            model's folder when omitted.
        scorer: what ranks positions at slow steps; defaults to the SFI Selector.
        max_cache_len: optional capacity hint (prompt + new tokens) to avoid regrowth.
        dense_only: decode these sequences with full attention (every step dense), so that they
            can share a batch (see :meth:`merge`) with slow-fast sequences.
    """

    def __init__(self, model: torch.nn.Module, config: SFIConfig | None = None,
                 tokenizer: Any = None, scorer: Scorer | None = None,
                 max_cache_len: int | None = None, dense_only: bool = False):
        from sfi.attention import route_model  # the attention module imports this one

        self.config = config if config is not None else SFIConfig()
        if not isinstance(self.config, SFIConfig):
            raise SFIError(f"config must be an SFIConfig, got {type(self.config).__name__}")
        model_config = route_model(model)
        self.scorer: Scorer = scorer if scorer is not None else SFISelector(self.config)
        self.token_classes: TokenClasses | None = None
        if self.config.trigger == "sentence":
            self.token_classes = token_classes(_resolve_tokenizer(model, tokenizer))
        self.initial_capacity = int(max_cache_len) if max_cache_len else 256
        self.dense_only = dense_only
        self.compact_capacity = self.config.sink
        self.sequences: list[SequenceState] = []
        self.plan: StepPlan | None = None
        self.rebuilder: Rebuilder | None = None  # chosen on the first forward (needs the device)
        self._compact_valid: torch.Tensor | None = None  # [B, C] bool
        super().__init__(layers=_build_layers(self, model_config))

    def load_kv(self, keys_values: list[tuple[torch.Tensor, torch.Tensor]],
                attention_mask: torch.Tensor | None = None) -> None:
        """Fill an empty cache with already computed KV (a shared prefill, or synthetic KV).

        ``keys_values[i]`` is layer i's ``(keys, values)``, each ``[B, H, T, D]``. The next forward
        continues the sequences; with several tokens it is dense and, where the context is long
        enough, makes the first selection from their queries.
        """
        if self.get_seq_length() != 0:
            raise SFIError("load_kv needs an empty SlowFastCache")
        if len(keys_values) != len(self.layers):
            raise SFIError(f"load_kv got KV for {len(keys_values)} layers; the model has "
                           f"{len(self.layers)}")
        keys = keys_values[0][0]
        self._start(keys.shape[0], attention_mask, keys.device)
        for layer, (k, v) in zip(self.layers, keys_values):
            layer.update(k, v)
        _active.layer = None

    # --- planning -------------------------------------------------------------------------------
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      batch_size: int, query_length: int, device: torch.device) -> StepPlan:
        """Decide, per sequence, whether this forward is dense, slow or fast; build the plan."""
        past = self.get_seq_length()
        total = past + query_length
        if past == 0:
            self._start(batch_size, attention_mask, device)
        elif batch_size != len(self.sequences):
            raise SFIError(f"this SlowFastCache holds {len(self.sequences)} sequences; a forward "
                           f"with batch size {batch_size} cannot continue it")
        tokens = input_ids[:, -1].tolist() if input_ids is not None else [None] * batch_size
        dense, slow, fast, reasons = [], [], [], []
        for row, seq in enumerate(self.sequences):
            context = total - seq.pad
            pays = not seq.dense_only and seq.config.sparse_pays(context)
            if query_length > 1 or past == 0:
                if pays:
                    slow.append(row)
                    reasons.append(BOOTSTRAP)
                else:
                    dense.append(row)
                continue
            seq.steps_since_refresh += 1
            reason = None
            if tokens[row] is not None:
                reason = seq.trigger.observe(tokens[row], seq.steps_since_refresh)
            if not pays:
                dense.append(row)
                seq.stats.dense_steps += 1
            elif not seq.has_selection or reason is not None:
                slow.append(row)
                reasons.append(reason if seq.has_selection else BOOTSTRAP)
                seq.stats.slow_steps += 1
            else:
                fast.append(row)
        self.plan = StepPlan(
            query_length=query_length,
            total_length=total,
            dense=self._rows(dense, device),
            slow=self._plan_slow(slow, reasons, total, query_length, device),
            fast=self._plan_fast(fast, total, device),
            pad_bias=self.pad_bias(total, device) if dense or slow else None,
            padded=any(seq.pad for seq in self.sequences),
        )
        return self.plan

    def _start(self, batch_size: int, attention_mask: torch.Tensor | None,
               device: torch.device) -> None:
        pads = [0] * batch_size
        if attention_mask is not None:
            mask = attention_mask.bool()
            if mask.dim() != 2:
                raise SFIError("SlowFastCache needs a 2-D attention_mask [batch, length]")
            if not bool((mask.int().diff(dim=-1) >= 0).all()):
                raise SFIError("SlowFastCache supports left padding only (pad tokens first); "
                               "set tokenizer.padding_side = 'left'")
            pads = (~mask).sum(dim=-1).tolist()
            if any(p == mask.shape[-1] for p in pads):
                raise SFIError("a sequence of the batch is all padding (empty prompt)")
        self.sequences = [
            SequenceState(pad=int(p), trigger=make_trigger(self.config, self.token_classes, row),
                          config=self.config, dense_only=self.dense_only)
            for row, p in enumerate(pads)
        ]
        self.compact_capacity = self.config.sink
        self._compact_valid = torch.zeros(batch_size, self.config.sink, dtype=torch.bool,
                                          device=device)
        if self.rebuilder is None:
            self.rebuilder = make_rebuilder(device, self.config.overlap_selection)

    def _rows(self, indices: list[int], device: torch.device) -> Rows:
        return Rows(tuple(indices), len(self.sequences), device)

    def _plan_slow(self, rows: list[int], reasons: list[str], total: int, query_length: int,
                   device: torch.device) -> SlowRows | None:
        """Geometry of the refresh of ``rows``; updates their host-side state and stats."""
        if not rows:
            return None
        cfg = self.config
        los, his, ks, sinks = [], [], [], []
        for row, reason in zip(rows, reasons):
            seq = self.sequences[row]
            recent_start = max(total - seq.config.recent, seq.pad)
            sink_end = min(seq.pad + cfg.sink, recent_start)
            k = min(seq.config.budget(total - seq.pad), recent_start - sink_end)
            seq.has_selection, seq.recent_start = True, recent_start
            seq.sink_count, seq.selected_count = sink_end - seq.pad, k
            seq.steps_since_refresh = 0
            seq.stats.refresh_reasons[reason] += 1
            los.append(sink_end)
            his.append(recent_start)
            ks.append(k)
            sinks.append([min(seq.pad + j, max(sink_end - 1, seq.pad)) for j in range(cfg.sink)])
        self._ensure_compact_capacity(cfg.sink + max(ks), device)
        slot = torch.arange(self.compact_capacity, device=device)
        for row, seq in ((r, self.sequences[r]) for r in rows):
            self._compact_valid[row] = (slot < seq.sink_count) | (
                (slot >= cfg.sink) & (slot < cfg.sink + seq.selected_count))
        lo = torch.tensor(los, device=device)
        hi = torch.tensor(his, device=device)
        positions = torch.arange(total, device=device)
        candidates = (positions[None, :] >= lo[:, None]) & (positions[None, :] < hi[:, None])
        slow = SlowRows(self._rows(rows, device), lo, hi, torch.tensor(ks, device=device),
                        candidates, torch.tensor(sinks, dtype=torch.long, device=device))
        if query_length > 1:
            w = min(cfg.evidence_window, query_length)
            slow.evidence_bias = self._evidence_bias(rows, total, w, device)
        return slow

    def _evidence_bias(self, rows: list[int], total: int, w: int,
                       device: torch.device) -> torch.Tensor:
        """``[n, 1, W, T]``: the query at ``total - W + j`` sees the keys from its row's first
        real token up to itself (a padding query sees nothing and yields no evidence)."""
        query_pos = torch.arange(total - w, total, device=device)
        key_pos = torch.arange(total, device=device)
        pads = torch.tensor([self.sequences[r].pad for r in rows], device=device)
        allowed = (key_pos[None, None, :] <= query_pos[None, :, None]) & (
            key_pos[None, None, :] >= pads[:, None, None])
        return additive_bias(allowed)[:, None]

    def _plan_fast(self, rows: list[int], total: int, device: torch.device) -> FastRows | None:
        if not rows:
            return None
        starts = [self.sequences[r].recent_start for r in rows]
        read_start = min(starts)
        for r in rows:
            seq = self.sequences[r]
            read = seq.sink_count + seq.selected_count + total - seq.recent_start
            seq.stats.record_fast_step(read / (total - seq.pad))
        recent_bias = None
        if max(starts) != read_start:
            positions = torch.arange(read_start, total, device=device)
            first = torch.tensor(starts, device=device)
            recent_bias = additive_bias(positions[None, :] >= first[:, None])[:, None, None, :]
        subset = self._rows(rows, device)
        compact_bias = additive_bias(subset.take(self._compact_valid))[:, None, None, :]
        return FastRows(subset, read_start, recent_bias, compact_bias)

    def pad_bias(self, total: int, device: torch.device) -> torch.Tensor | None:
        """``[B, 1, 1, T]``: -inf on each sequence's left padding; None when none is padded."""
        pads = [seq.pad for seq in self.sequences]
        if not any(pads):
            return None
        positions = torch.arange(total, device=device)
        allowed = positions[None, :] >= torch.tensor(pads, device=device)[:, None]
        return additive_bias(allowed)[:, None, None, :]

    def _ensure_compact_capacity(self, needed: int, device: torch.device) -> None:
        if needed <= self.compact_capacity:
            return
        grown = torch.zeros(len(self.sequences), needed, dtype=torch.bool, device=device)
        grown[:, : self.compact_capacity] = self._compact_valid
        self._compact_valid, self.compact_capacity = grown, needed

    # --- continuous batching --------------------------------------------------------------------
    def merge(self, other: SlowFastCache) -> None:
        """Append the sequences of ``other`` (prefilled, same model) to this batch.

        Both batches are right-aligned at the longer length: the shorter one's sequences get
        more left padding (their keys keep the positions they were computed at). Each sequence
        keeps its own configuration, trigger, selection and counters. Costs one copy of both
        caches, once per join.
        """
        if other is self or not other.sequences or not self.sequences:
            raise SFIError("merge needs two distinct, prefilled SlowFastCaches")
        if other.config.sink != self.config.sink or len(other.layers) != len(self.layers):
            raise SFIError("merge needs caches of the same model with the same sink size")
        length = max(self.get_seq_length(), other.get_seq_length())
        shifts = (length - self.get_seq_length(), length - other.get_seq_length())
        capacity = max(self.compact_capacity, other.compact_capacity)
        for mine, theirs in zip(self.layers, other.layers):
            if not (isinstance(mine, SlowFastLayer) and isinstance(theirs, SlowFastLayer)):
                raise SFIError("merge supports models whose layers are all full attention")
            mine.absorb(theirs, length, shifts, capacity)
        valid = torch.zeros(len(self.sequences) + len(other.sequences), capacity,
                            dtype=torch.bool, device=self._compact_valid.device)
        valid[: len(self.sequences), : self.compact_capacity] = self._compact_valid
        valid[len(self.sequences):, : other.compact_capacity] = other._compact_valid
        for seqs, shift in ((self.sequences, shifts[0]), (other.sequences, shifts[1])):
            for seq in seqs:
                seq.pad += shift
                seq.recent_start += shift
        self.sequences = self.sequences + other.sequences
        self._compact_valid, self.compact_capacity, self.plan = valid, capacity, None

    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences ``rows`` (in that order), e.g. when others finish; the left
        padding that every remaining sequence has is then trimmed."""
        if not rows:
            self.reset()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self._compact_valid.device)
        self.sequences = [self.sequences[r] for r in rows]
        trim = min(seq.pad for seq in self.sequences)
        for layer in self.layers:
            layer.keep(index, trim)
        for seq in self.sequences:
            seq.pad -= trim
            seq.recent_start -= trim
        self._compact_valid = self._compact_valid.index_select(0, index)
        self.plan = None

    # --- reporting ------------------------------------------------------------------------------
    def stats(self, row: int | None = None) -> DecodeStats:
        """Counters of one sequence, or summed over the batch when ``row`` is None."""
        if row is not None:
            return self.sequences[row].stats
        return DecodeStats.merge([seq.stats for seq in self.sequences])

    def selected_positions(self, layer_idx: int, row: int) -> torch.Tensor:
        """``[H, k]`` the positions selected for sequence ``row`` at layer ``layer_idx``."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, SlowFastLayer) or layer.selected_positions is None:
            raise SFIError(f"layer {layer_idx} holds no selection")
        return layer.selected_positions[row, :, : self.sequences[row].selected_count]

    def reset(self) -> None:
        super().reset()
        self.sequences, self.plan = [], None


def _resolve_tokenizer(model: torch.nn.Module, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return tokenizer
    attached = getattr(model, "sfi_tokenizer", None)
    if attached is not None:
        return attached
    from pathlib import Path

    from transformers import AutoTokenizer

    source = getattr(model.config, "_name_or_path", "") or ""
    if source and Path(source).is_dir():
        return AutoTokenizer.from_pretrained(source)
    raise SFIError("sentence triggers need the tokenizer: pass SlowFastCache(model, config, "
                   "tokenizer=tok), load the model with sfi.load, "
                   "or use SFIConfig(trigger='fixed')")


def _build_layers(owner: SlowFastCache, model_config: Any) -> list[CacheLayerMixin]:
    """One SlowFastLayer per full-attention layer; sliding-window layers keep their window."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") \
        else model_config
    n_layers = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    uniform = "sliding_attention" if window else "full_attention"  # Mistral-style: all sliding
    layer_types = getattr(text_config, "layer_types", None) or [uniform] * n_layers
    layers: list[CacheLayerMixin] = []
    for idx, kind in enumerate(layer_types):
        if kind == "sliding_attention" and window:
            layers.append(DynamicSlidingWindowLayer(sliding_window=window))
        elif kind in ("full_attention", "sliding_attention"):
            layers.append(SlowFastLayer(owner, idx))
        else:
            raise UnsupportedModelError(
                f"layer {idx} of this model is of type {kind!r}; sfi handles attention layers "
                "(full or sliding window) only")
    return layers
