"""Planning one vLLM step under SFI: the step's inputs read from the device in one transfer
(OR-ed over tensor-parallel ranks), every row decided by the request book, and vLLM's own
builder run once per part of the batch: the rows that read vLLM's cache (prefill, dense and
slow rows: their real block tables) and the fast rows, whose block table lists their slot's
blocks in the plugin's buffer and whose ``seq_len`` is the slot's length."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.v1.attention.backend import CommonAttentionMetadata

from sfi.core.overlap import StackingRebuilder
from sfi.vllm.metadata import TOKEN_ARCHITECTURES, PlannedStep, SFIMetadata
from sfi.vllm.requests import DENSE, FAST, SELECT, SLOW, RequestBook, slot_start


def plan(md: SFIMetadata) -> None:
    """Plan ``md``'s step, once (:func:`plan_step`); its metadata is frozen from then on."""
    if md.step is None:
        md.step = plan_step(md)


def plan_step(md: SFIMetadata) -> PlannedStep:
    """Decide every row of ``md``'s step and build the stock metadata of each part."""
    requests = md.book
    if md.input_ids is None and requests.config.trigger == "sentence":
        raise RuntimeError(
            "SFI's sentence trigger needs the input tokens, which sfi records for the "
            f"architectures {', '.join(TOKEN_ARCHITECTURES)}; this model is not one of "
            "them: set trigger=fixed (and a period) in SFI_VLLM")
    if requests.probes and requests.missed is None:
        requests.missed = torch.zeros(requests.slots, dtype=torch.bool,
                                      device=md.key_column.device)
    check_packed(requests, md.work.rebuilder)
    tokens, keys, seq_lens, flags = _host_inputs(md)
    if flags:
        requests.apply_coverage_flags(flags)
    plans = requests.plan(keys, md.query_lens, seq_lens, tokens)
    refreshing = [p for p in plans if p.kind in (SLOW, SELECT)]
    recording = [p for p in plans if p.record]
    build = md.builder.build_stock
    fast_rows = [p.row for p in plans if p.kind in (SELECT, FAST)]
    dense_rows = [p.row for p in plans if p.kind in (DENSE, SLOW)]
    stock = None
    if not fast_rows or requests.config.dense_layers:  # (the dense layers read it all)
        stock = build(md.common)
    if not fast_rows:
        return PlannedStep(keys, seq_lens, plans, refreshing, recording, stock)
    common, starts = md.common, md.query_start
    device = common.slot_mapping.device
    dense = dense_tokens = None
    if dense_rows:
        index = torch.tensor(dense_rows, device=md.block_table.device)
        dense_tokens = _query_tokens(starts, dense_rows, device)
        dense = build(_rows_of(common, dense_rows, starts, dense_tokens,
                               md.block_table.index_select(0, index),
                               [seq_lens[r] for r in dense_rows]))
    per_slot = md.builder.blocks_per_slot(requests)
    fast_plans = [plans[r] for r in fast_rows]
    slot_blocks = torch.tensor([[p.slot * per_slot + j for j in range(per_slot)]
                                for p in fast_plans], dtype=md.block_table.dtype)
    fast_tokens = _query_tokens(starts, fast_rows, device)  # one per row: they decode
    fast = build(_rows_of(common, fast_rows, starts, fast_tokens, slot_blocks,
                          [p.length for p in fast_plans]))
    bs = md.builder.block_size
    fast_blocks = slot_blocks.to(md.block_table.device)
    probed = [i for i, p in enumerate(fast_plans) if p.probed]
    probe_plans = [fast_plans[i] for i in probed]
    probe_tokens, probe_blocks = fast_tokens, fast_blocks  # (usually no row waits to refresh)
    if len(probed) < len(fast_plans):
        among = torch.tensor(probed, dtype=torch.long, device=device)
        probe_tokens, probe_blocks = fast_tokens[among], fast_blocks[among.to(fast_blocks.device)]
    return PlannedStep(
        keys, seq_lens, plans, refreshing, recording, stock, dense, dense_tokens, fast,
        fast_tokens,
        fast_slots=torch.tensor([slot_start(p.slot, per_slot, bs) + p.length - 1
                                 for p in fast_plans], device=device),
        fast_blocks=fast_blocks, fast_plans=fast_plans,
        probe_plans=probe_plans, probe_tokens=probe_tokens, probe_blocks=probe_blocks,
        probe_slot_index=torch.tensor([p.slot for p in probe_plans], device=device))


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


