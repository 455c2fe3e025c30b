"""One step's attention metadata under SFI: what the step's rows do and the stock metadata of
each part.

An :class:`SFIMetadata` (made by :class:`sfi.vllm.builder.SFIBuilder`) holds the batch's shapes
and the request book of the configuration in force; before the step's first layer runs (when the
model's forward attaches its input ids, which the triggers observe, or at build where the
model's class records none), :meth:`SFIMetadata.plan` has the book decide every row, and vLLM's
own builder makes the stock metadata of each part: the rows that read vLLM's cache (prefill,
dense and slow rows: their real block tables) and the fast rows, whose block table lists their
slot's blocks in the plugin's buffer and whose ``seq_len`` is the slot's length. The impl
(:mod:`sfi.vllm.impl`) reads only this metadata: nothing on the step path is kept in module
state. Here too: the architectures whose model classes sfi subclasses to record the input ids
(:data:`TOKEN_ARCHITECTURES`, :data:`STOCK_ENTRY`) and the request book in force (:func:`book`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.v1.attention.backend import CommonAttentionMetadata

from sfi.core.overlap import StackingRebuilder
from sfi.vllm.probes import ProbeLayer
from sfi.vllm.requests import DENSE, FAST, SELECT, SLOW, RequestBook, RowPlan, slot_start
from sfi.vllm.settings import plugin_state


def book() -> RequestBook | None:
    """The request book of the configuration in force in this process (None until an SFI
    step ran under it, or with SFI off): what tests and benchmarks read."""
    return plugin_state().book


# The architectures whose model class sfi subclasses to record each step's input ids (the
# sentence trigger observes them; vLLM's attention metadata carries none).
TOKEN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM")


STOCK_ENTRY = "_sfi_stock_entry"  # where a recording class keeps the registry entry it replaced


def on_host(values: torch.Tensor) -> list[int]:
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


@dataclass
class SFIMetadata:
    """One step's metadata for every layer, planned before the first layer runs: where the
    model's forward records the input tokens the triggers observe, and by the builder where
    the model's class records none (:func:`~sfi.vllm.builder.records_input_ids`). The impl
    only reads it.

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
            the slow rows' refreshes held by ``rebuilder`` are selected together and packed,
            and the probe layers kept in ``probes`` are checked together.
        probes: what each probe layer of the step keeps for that check.
    """

    common: CommonAttentionMetadata
    builder: Any  # the sfi.vllm.builder.SFIBuilder that made this (its stock build)
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
    probes: list[ProbeLayer] = field(default_factory=list)

    def plan(self) -> None:
        """Decide every row (once per step, before its first layer runs) and build the stock
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
        self.fast_slots = torch.tensor([slot_start(p.slot, per_slot, bs) + p.length - 1
                                        for p in fast_plans], device=device)
        self.fast_slot_index = torch.tensor([p.slot for p in fast_plans], device=device)


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


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer's name (``model.layers.3.self_attn.attn``)
    names (0 when it names none)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0
