"""One step's attention metadata under SFI, and the builder that makes it.

:class:`SFIBuilder` is mixed into a stock metadata builder (first in the bases). It records the
batch's shapes in an :class:`SFIMetadata` together with the request book of the configuration
in force; when the step's first attention layer runs (the model has by then attached its input
ids, which the triggers observe), :meth:`SFIMetadata.plan` has the book decide every row and
vLLM's own builder makes the stock metadata of each part: the rows that read vLLM's cache
(prefill, dense and slow rows: their real block tables) and the fast rows, whose block table
lists their slot's blocks in the plugin's buffer and whose ``seq_len`` is the slot's length.
The impl (:mod:`sfi.vllm.impl`) reads only this metadata: nothing on the step path is kept in
module state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import torch
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

from sfi.cost_model import slow_fast_layers, weight_positions
from sfi.overlap import StackingRebuilder
from sfi.scorers.registry import make_scorer
from sfi.triggers import token_classes
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
from sfi.vllm.settings import active_config, active_slots, plugin_state

log = logging.getLogger(__name__)

def book() -> RequestBook | None:
    """The request book of the configuration in force in this process (None until an SFI
    step ran under it, or with SFI off): what tests and benchmarks read."""
    return plugin_state().book


# The architectures whose model class sfi subclasses to record each step's input ids (the
# sentence trigger observes them; vLLM's attention metadata carries none).
TOKEN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM")


def _on_host(values: torch.Tensor) -> list[int]:
    """The values of one of the tensors vLLM keeps on the host (reading them waits for no
    device)."""
    if values.device.type != "cpu":
        raise RuntimeError(f"sfi.vllm expected a host tensor here, found one on {values.device}")
    return values.tolist()


def _host_inputs(md: SFIMetadata) -> tuple[list[int] | None, list[int], list[int], list[bool]]:
    """What the step's decisions need from the device, in one transfer (the step's only wait
    for the device outside refreshes; under vLLM's async scheduling every further one would
    stall the host): each row's last input token (None if the model recorded none), request
    key and context length (unless vLLM gave them on the host), and the probes' misses since
    the last step per slot (OR-ed over the tensor-parallel ranks)."""
    requests, n = md.book, len(md.query_start) - 1
    device = md.key_column.device
    parts = []
    if md.input_ids is not None:
        last = torch.tensor(md.query_start[1:], device=md.input_ids.device) - 1
        parts.append(md.input_ids.index_select(0, last))
    parts.append(md.key_column)
    if md.seq_lens is None:
        parts.append(md.common.seq_lens[:n])
    flags = requests.missed
    if flags is not None:
        flags = flags.to(torch.float32)
        if get_tensor_model_parallel_world_size() > 1:
            flags = tensor_model_parallel_all_reduce(flags)
        parts.append(flags)
    values = torch.cat([part.to(device=device, dtype=torch.int64) for part in parts]).tolist()
    if requests.missed is not None:
        requests.missed.zero_()
    tokens = values[:n] if md.input_ids is not None else None
    values = values[n:] if md.input_ids is not None else values
    keys, values = values[:n], values[n:]
    seq_lens = md.seq_lens
    if seq_lens is None:
        seq_lens, values = values[:n], values[n:]
    return tokens, keys, seq_lens, [bool(v) for v in values]


def refuse_unsupported(vllm_config: Any) -> None:
    """Raise, naming it, what an engine with SFI on cannot run: prefix caching, a quantized KV
    cache, decode context parallelism, pipeline parallelism (later stages get no input ids,
    and each stage would decide alone) and speculative decoding (its verify rows are several
    queries per request, and the drafter's metadata would make a second plan per step)."""
    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    if cache.enable_prefix_caching:
        raise RuntimeError("SFI in vLLM needs prefix caching off "
                           "(--no-enable-prefix-caching, or enable_prefix_caching=False)")
    if cache.cache_dtype not in ("auto", None):
        raise RuntimeError("SFI in vLLM needs an unquantized KV cache (kv_cache_dtype=auto), "
                           f"not {cache.cache_dtype!r}")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise RuntimeError("SFI in vLLM does not support decode context parallelism "
                           "(--decode-context-parallel-size 1)")
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise RuntimeError("SFI in vLLM does not support pipeline parallelism "
                           "(--pipeline-parallel-size 1; tensor parallelism is supported)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise RuntimeError("SFI in vLLM does not support speculative decoding "
                           "(no --speculative-config), or unset SFI_VLLM")


def _book_for(vllm_config: Any) -> RequestBook | None:
    """The request book of the configuration in force (made at its first step, and kept by
    the plugin's state), or None with SFI off."""
    state = plugin_state()
    config = state.config
    if config is None:
        return None
    if state.book is None:
        refuse_unsupported(vllm_config)
        capacity = slot_capacity(config, vllm_config.model_config.max_model_len)
        classes = None
        if config.trigger == "sentence":
            from transformers import AutoTokenizer  # the engine's own tokenizer files

            model = vllm_config.model_config
            classes = token_classes(AutoTokenizer.from_pretrained(
                model.tokenizer, revision=model.tokenizer_revision,
                trust_remote_code=model.trust_remote_code))
        text = vllm_config.model_config.hf_text_config
        state.book = RequestBook(
            config, active_slots(vllm_config.scheduler_config.max_num_seqs), capacity,
            make_scorer("sfi", config), classes, slow_fast_layers(text),
            weight_positions(text))
    return state.book


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
                   max_query_len=max(starts[r + 1] - starts[r] for r in rows),
                   max_seq_len=max(seq_lens),
                   block_table_tensor=block_table.to(common.block_table_tensor.device),
                   slot_mapping=common.slot_mapping.index_select(0, tokens))


# A stock builder's buffers that its metadata may share by design: Triton's scratch space,
# used within one kernel call (SFI runs the parts one after another on one stream).
SCRATCH_BUFFERS = frozenset({"softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"})


def _own_copy(metadata: Any, builder: Any) -> Any:
    """``metadata`` (a stock backend's dataclass) with a copy of each tensor that shares memory
    with one of ``builder``'s own tensors (other than :data:`SCRATCH_BUFFERS`)."""
    buffers = [t for name, t in vars(builder).items()
               if isinstance(t, torch.Tensor) and name not in SCRATCH_BUFFERS]
    if not buffers or not is_dataclass(metadata):
        return metadata
    owned = {t.untyped_storage().data_ptr() for t in buffers}
    shared = {f.name: value.clone() for f in fields(metadata)
              if f.init and isinstance(value := getattr(metadata, f.name, None), torch.Tensor)
              and value.untyped_storage().data_ptr() in owned}
    return replace(metadata, **shared) if shared else metadata


def _full_graphs(vllm_config: Any) -> bool:
    """Whether the engine captures whole steps, attention included, in CUDA graphs."""
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return bool(mode is not None and mode.has_full_cudagraphs())


@dataclass
class SFIMetadata:
    """One step's metadata for every layer, planned when the step's first layer runs (by then
    the model has recorded the input tokens the triggers observe).

    Attributes:
        common: vLLM's metadata of the whole batch; builder: the builder that made this;
            book: the request book that decides its rows.
        key_column: ``[rows]`` each row's first KV block (its request's key, read on the host
            when planned); keys: the same on the host (empty until planned).
        query_lens, query_start: each row's query length and first query token.
        seq_lens: each row's context length (None until planned, where vLLM gives no copy on
            the host).
        block_table: ``[rows, max_blocks]`` vLLM's block table (to read a request's entries).
        stock: the stock metadata of the whole batch, when no row is fast or the first
            ``dense_layers`` layers read everything (else None).
        dense: the stock metadata of the rows that read vLLM's cache, when some are fast.
        dense_tokens / fast_tokens: ``[n]`` the query tokens of each part.
        fast: the stock metadata of the fast rows over the plugin's buffer.
        fast_slots: ``[n_fast]`` where each fast row's new entry goes in the buffer
            (block * bs + offset); fast_blocks: ``[n_fast, blocks]`` each one's slot blocks;
            fast_slot_index: ``[n_fast]`` their slots; fast_plans: their plans.
        plans: what each row does (empty until planned); refreshing: the slow and selecting
            rows among them; recording: the prompt chunks whose last queries are kept.
        last_layer: the last model layer this metadata serves (the builder's), after which
            the slow rows' refreshes held by ``rebuilder`` are selected together and packed.
    """

    common: CommonAttentionMetadata
    builder: SFIBuilder
    book: RequestBook
    key_column: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int] | None
    query_start: list[int]
    block_table: torch.Tensor
    keys: list[int] = field(default_factory=list)
    stock: Any = None
    dense: Any = None
    dense_tokens: torch.Tensor | None = None
    fast: Any = None
    fast_tokens: torch.Tensor | None = None
    fast_slots: torch.Tensor | None = None
    fast_blocks: torch.Tensor | None = None
    fast_slot_index: torch.Tensor | None = None
    fast_plans: list[RowPlan] = field(default_factory=list)
    plans: list[RowPlan] = field(default_factory=list)
    refreshing: list[RowPlan] = field(default_factory=list)
    recording: list[RowPlan] = field(default_factory=list)
    planned: bool = False
    input_ids: torch.Tensor | None = None  # the step's input tokens, attached by the model
    last_layer: int = -1
    rebuilder: StackingRebuilder = field(default_factory=StackingRebuilder)

    def plan(self) -> None:
        """Decide every row (once per step, when the first layer runs) and build the stock
        metadata of each part."""
        if self.planned:
            return
        self.planned = True
        requests = self.book
        if self.input_ids is None and requests.config.trigger == "sentence":
            raise RuntimeError(
                "SFI's sentence trigger needs the input tokens, which sfi records for the "
                f"architectures {', '.join(TOKEN_ARCHITECTURES)}; this model is not one of "
                "them: set trigger=fixed (and a period) in SFI_VLLM")
        if requests.probes and requests.missed is None:
            requests.missed = torch.zeros(requests.slots, dtype=torch.bool,
                                          device=self.key_column.device)
        check_packed(requests, self.rebuilder)
        tokens, self.keys, self.seq_lens, flags = _host_inputs(self)
        if flags:
            requests.apply_coverage_flags(flags)
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
        self.fast_slot_index = torch.tensor([p.slot for p in fast_plans], device=device)


class SFIBuilder:
    """Mixed into a stock metadata builder (first in the bases): the step's metadata becomes an
    :class:`SFIMetadata`, and the stock ``build`` runs once per part of the batch."""

    supports_update_block_table = False
    _layers_checked = False  # check_layers ran for this builder's layers

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if active_config() is not None:  # SFI_VLLM set: refuse at engine start
            refuse_unsupported(self.vllm_config)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """What vLLM may capture in CUDA graphs, asked once at engine start: the stock
        backend's own support when SFI is off then (the engine runs as stock, full graphs
        included), none with SFI on (the parts and memories change at every step)."""
        if active_config() is None:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)  # type: ignore[misc]
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        common = common_attn_metadata
        if active_config() is None or common.num_reqs == 0:
            return super().build(common_prefix_len, common, fast_build)
        if not self._full_attention():
            if self._decoder_attention():  # a sliding window: the model's own attention
                self._check_layers(full=False)
            return super().build(common_prefix_len, common, fast_build)
        if _full_graphs(self.vllm_config):
            raise RuntimeError(
                "SFI was switched on (sfi.vllm.configure) in a vLLM engine that started without "
                "it and replays CUDA graphs of whole steps, attention included, which cannot run "
                "SFI's per-step plan: set SFI_VLLM (or call configure) before the engine "
                "starts, or run it with enforce_eager=True")
        self._check_layers(full=True)
        requests = _book_for(self.vllm_config)
        n = common.num_reqs
        starts = _on_host(common.query_start_loc_cpu[: n + 1])
        # vLLM's host copy of the lengths is exact without speculative decoding (refused)
        host_lens = getattr(common, "seq_lens_cpu_upper_bound", None)
        block_table = common.block_table_tensor[:n]
        return SFIMetadata(common=common, builder=self, book=requests,
                           key_column=block_table[:, 0],
                           query_lens=[starts[r + 1] - starts[r] for r in range(n)],
                           seq_lens=None if host_lens is None else _on_host(host_lens[:n]),
                           query_start=starts, block_table=block_table,
                           last_layer=max(layer_index(name) for name in self.layer_names))

    def _decoder_attention(self) -> bool:
        """A causal decoder layer's self-attention (not cross or encoder-only attention)."""
        return not (getattr(self, "is_cross_attention", False)
                    or getattr(self, "is_encoder_only_attention", False))

    def _full_attention(self) -> bool:
        """A causal decoder layer that sees its whole context (no sliding window)."""
        if not self._decoder_attention():
            return False
        if getattr(self, "window_size", -1) not in (-1, None):  # vLLM's CPU builder
            return False
        return getattr(self.kv_cache_spec, "sliding_window", None) in (-1, None)

    def _check_layers(self, full: bool) -> None:
        """Once per builder: refuse layers whose kind vLLM's KV cache spec (``full``, this
        builder's) and the model's config (:func:`sfi.cost_model.slow_fast_layers`, the
        request book's :attr:`RequestBook.layers`, where its probes go and a fast step's reads
        are counted) see differently."""
        if not self._layers_checked:
            check_layers(slow_fast_layers(self.vllm_config.model_config.hf_text_config),
                         self.layer_names, full)
            self._layers_checked = True

    def build_stock(self, common: CommonAttentionMetadata) -> Any:
        """The stock metadata of ``common`` (a whole batch or a part of it), holding no view
        of the builder's own buffers: a step builds up to three parts, and a stock builder
        may write each build into one persistent buffer (vLLM 0.33's FlashAttention keeps its
        FA3 scheduler metadata so when it expects full CUDA graphs), where the next part's
        build would overwrite the last one's."""
        return _own_copy(super().build(0, common), self)  # type: ignore[misc]

    def blocks_per_slot(self, requests: RequestBook) -> int:
        return blocks_per_slot(requests.capacity, self.block_size)


def check_packed(requests: RequestBook, rebuilder: StackingRebuilder) -> None:
    """Refuse to plan a step while the last step's refreshes still wait: its last layer
    (:attr:`SFIMetadata.last_layer`) never ran with SFI's metadata, so their memories were
    never packed and fast rows would read stale slots. ``rebuilder`` (this step's) becomes the
    one the next step checks."""
    last = requests.step_rebuilder
    requests.step_rebuilder = rebuilder
    if last is not None and last.waiting:
        last.discard()
        raise RuntimeError("sfi.vllm: the last step's memory refreshes were never packed (the "
                           "step's last attention layer did not run with SFI's metadata); "
                           "please report this model to sfi")


def check_layers(served: Sequence[int], names: Sequence[str], full: bool) -> None:
    """Raise, naming them, where layers ``names`` that vLLM builds as attending over their
    whole context (``full``) or within a sliding window are not, or are, among ``served`` (the
    layers the model's config gives SFI, :func:`sfi.cost_model.slow_fast_layers`): the
    probes would be placed, and the reads counted, over layers that do not run SFI."""
    wrong = [name for name in names if (layer_index(name) in served) != full]
    if wrong:
        kind = "the whole context" if full else "a sliding window"
        raise RuntimeError(
            f"sfi.vllm: vLLM's KV cache spec gives {', '.join(wrong)} {kind}, where the "
            f"model's config gives SFI the layers {list(served)}; please report this model "
            "to sfi")


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer's name (``model.layers.3.self_attn.attn``)
    names (0 when it names none)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0
