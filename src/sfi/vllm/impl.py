"""The attention impl of SFI inside vLLM: the stock kernel on each part of a step, the
memories' upkeep (selection and packing into the plugin's buffer), and the coverage probes.

:class:`SFIImpl` is mixed into a stock attention impl (first in the bases). It reads the step
from its :class:`~sfi.vllm.metadata.SFIMetadata` argument; what it keeps between steps is its
own (per layer): the buffer of fast memories (the cache's layout, written by the cache op), the
prompt queries of each slot, and a :class:`SlotRecord` of the request that holds each slot (its
last selection, what pins and hysteresis keep; its key norms, of which a refresh computes only
the new positions; in probe layers, its page boxes), kept for the request book that planned
them (a new configuration's book starts new records).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from sfi.coverage import misses, page_scores, probe_page, top_pages, unheld_pages
from sfi.kernels import attention_logits
from sfi.pages import PageSummaries
from sfi.refresh_selection import SelectionRule
from sfi.scorers import key_norms_of
from sfi.vllm.metadata import SFIMetadata
from sfi.vllm.paged import (
    CacheLayout,
    RequestRefresh,
    empty_like_cache,
    memory_positions,
    probe_layout,
    read_blocks,
    read_positions,
    read_prefix,
    select_refreshes,
)
from sfi.vllm.requests import SELECT, RequestBook

log = logging.getLogger(__name__)

def _cache_layout(layer: Any, impl: SFIImpl, cache: torch.Tensor) -> CacheLayout:
    """How the backend's cache op lays out a block, found once per layer (and shape, dtype)."""
    _, _, bs, two_d = cache.shape
    key = (getattr(layer, "isa", None), bs, two_d, cache.dtype, cache.device)
    if impl.layout is None or impl.layout[0] != key:
        impl.layout = (key, probe_layout(
            lambda probe, keys, values, slots: _store(layer, impl, probe, keys, values, slots),
            bs, two_d // 2, cache.dtype, cache.device))
    return impl.layout[1]


def _store(layer: Any, impl: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           slots: torch.Tensor) -> None:
    """Write ``keys``/``values [n, H, D]`` at ``slots [n]`` of ``cache`` with the backend's own
    cache update (so that they land in the layout its kernel reads)."""
    impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slots)


@dataclass
class SlotCoverage:
    """What a probe layer keeps of one slot's memory to check it (``sfi.coverage``).

    Attributes:
        pages: the request's page bounds and boxes (``[1, H, P, ...]``), kept from refresh to
            refresh: only the pages written since are summarised again.
        outside: ``[1, H, P]`` the middle region's pages the memory holds nothing of (the
            pages a probe may ask for, fixed until the next refresh).
    """

    pages: PageSummaries
    outside: torch.Tensor

    @property
    def boxes(self) -> torch.Tensor:
        """``[1, H, P, 2 D]`` the filled pages' boxes."""
        return self.pages.boxes[:, :, : self.pages.count]


@dataclass
class SlotRecord:
    """What one layer keeps of the request that holds a slot (a new request in the slot starts
    a new record).

    Attributes:
        request: whose (:attr:`RowPlan.request`).
        selected: ``[H, k]`` its memory's selected positions, pinned ones first (what pins and
            hysteresis keep at its next refresh).
        norms: ``[H, T]`` its keys' norms up to its last refresh (only later positions are
            computed at the next).
        coverage: in probe layers, what the probes check its memory with.
    """

    request: int
    selected: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    coverage: SlotCoverage | None = None


class SFIImpl:
    """Mixed into a stock attention impl (first in the bases): the stock kernel runs on each
    part of the batch, plus the memories' upkeep and, in probe layers, the coverage probes."""

    layer_idx: int | None = None  # the model layer this impl serves (from its name)
    buffer: torch.Tensor | None = None  # [slots * blocks, H, bs, 2 * D], the cache's layout
    prompt_queries: torch.Tensor | None = None  # [slots, W, Hq, D]
    records: dict[int, SlotRecord] | None = None  # per slot: its request's selection, norms
    records_book: RequestBook | None = None  # the book whose requests ``records`` keeps
    layout: tuple[tuple[Any, ...], CacheLayout] | None = None  # (cache shape, its layout)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        stock = super().forward  # type: ignore[misc]
        if not isinstance(md, SFIMetadata):
            return stock(layer, query, key, value, kv_cache, md, output, output_scale,
                         output_block_scale)
        requests = md.book
        md.plan()
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
            if self.layer_idx == requests.config.dense_layers:  # told once, by the first
                size = self.buffer.numel() * self.buffer.element_size()
                log.info("sfi.vllm: %d fast-memory slots of %d entries: %.1f MiB per attention "
                         "layer, outside vLLM's KV pool", requests.slots, requests.capacity,
                         size / 2**20)
        shape = (requests.slots, requests.config.evidence_window, *query.shape[1:])
        if self.prompt_queries is None or self.prompt_queries.shape != shape:
            self.prompt_queries = query.new_zeros(shape)
        if self.records_book is not requests:  # a new configuration's book: new requests
            self.records, self.records_book = {}, requests

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
        refreshes, records = [], []
        for plan in md.refreshing:
            block_row = md.block_table[plan.row]
            if plan.kind == SELECT:  # evidence: the prompt's last W queries, keys of the prompt
                end = plan.total - 1
                queries = self.prompt_queries[plan.slot, -plan.evidence:]
            else:  # evidence: this step's query, keys up to and with its own
                end = plan.total
                start = md.query_start[plan.row]
                queries = query[start: start + 1]
            record = self.records.get(plan.slot)
            if record is None or record.request != plan.request:
                record = self.records[plan.slot] = SlotRecord(plan.request)
            keys = read_prefix(cache_keys, block_row, end, layout.keys)
            record.norms = _key_norms(record.norms, keys)
            refreshes.append(RequestRefresh(plan.memory, queries, keys, record.selected,
                                            record.norms))
            records.append(record)
        softcap = getattr(self, "logits_soft_cap", None) or None
        chosen = select_refreshes(requests.scorer, SelectionRule.of(requests.config),
                                  self.layer_idx, refreshes, self.scale, softcap)
        per_slot = md.builder.blocks_per_slot(requests)
        probing = self.layer_idx in requests.probes
        packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for plan, refresh, record, selected in zip(md.refreshing, refreshes, records, chosen):
            memory, keys = plan.memory, refresh.keys
            record.selected = selected
            if probing:
                record.coverage = _slot_coverage(record.coverage, keys, selected, memory,
                                                 probe_page(requests.config))
            positions = memory_positions(memory, selected, keys.shape[1])  # [H, L]
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
        """Check every fast row's memory at once: flag the slots whose memory misses pages the
        query bounds highly (their requests refresh at a later step; ``sfi.coverage``). Only
        the page bounds are taken row by row (each request's boxes are its own tensor)."""
        c = requests.config
        layout = _cache_layout(layer, self, kv_cache)
        cache_keys = layout.halves(kv_cache)[0]
        memory_keys = layout.halves(self.buffer)[0]
        h, d = cache_keys.shape[1], cache_keys.shape[3]
        softcap = getattr(self, "logits_soft_cap", None) or None
        plans = md.fast_plans
        q = query.index_select(0, md.fast_tokens).view(len(plans), h, -1, d)  # [n, H, G, D]
        keys = read_blocks(memory_keys, md.fast_blocks, layout.keys)  # [n, H, slot, D]
        logits = attention_logits(q, keys, self.scale, softcap)  # [n, H, G, slot]
        lengths = torch.tensor([p.length for p in plans], device=q.device)
        unwritten = torch.arange(keys.shape[2], device=q.device) >= lengths[:, None]
        lse = torch.logsumexp(logits.masked_fill(unwritten[:, None, None], float("-inf")), -1)
        boxes = [self.records[p.slot].coverage for p in plans]
        scores = torch.full((len(plans), h, max(b.boxes.shape[2] for b in boxes)),
                            float("-inf"), device=q.device)
        for i, held in enumerate(boxes):
            scores[i, :, : held.boxes.shape[2]] = page_scores(q[i: i + 1], held.boxes,
                                                             held.outside)[0]
        totals = torch.tensor([p.total for p in plans], device=q.device)  # each in its blocks
        positions, real = top_pages(scores, page=probe_page(c), top=c.coverage_top,
                                    length=totals)
        rows = torch.tensor([p.row for p in plans], device=md.block_table.device)
        chosen = read_positions(cache_keys, md.block_table.index_select(0, rows), positions,
                                layout.key_order)  # [n, H, top * page, D]
        found = misses(q, chosen, real, lse, threshold=c.coverage_threshold, scale=self.scale,
                       softcap=softcap)
        # kept where the model runs (no wait for the device here); the next step's plan reads
        # every layer's flags in its one transfer
        requests.missed[md.fast_slot_index] |= found


def _key_norms(held: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """``[H, T]`` the norms of a request's keys ``[H, T, D]``, from those ``held`` at its last
    refresh (``[H, T']``, or None) and the positions written since."""
    if held is None or held.shape[1] > keys.shape[1]:
        return key_norms_of(keys)
    return torch.cat([held, key_norms_of(keys[:, held.shape[1]:])], dim=1)


def _slot_coverage(previous: SlotCoverage | None, keys: torch.Tensor, selected: torch.Tensor,
                   memory: Any, page: int) -> SlotCoverage:
    """A probe layer's record of a request's new memory: ``keys [H, T, D]`` its keys read at
    the refresh, ``selected [H, k]``; the page bounds of ``previous`` (its last record) are
    brought up to date."""
    t, device = keys.shape[1], keys.device
    pages = previous.pages if previous is not None else None
    if pages is None or not pages.matches(page, None) or pages.done > t:
        pages = PageSummaries(page)
    pages.update(keys[None])
    outside = unheld_pages(selected[None], torch.ones_like(selected[:1], dtype=torch.bool),
                           torch.tensor([memory.sink_end], device=device),
                           torch.tensor([memory.recent_start], device=device),
                           pages=pages.count, page=page)
    return SlotCoverage(pages=pages, outside=outside)


def _layer_index(layer: Any) -> int:
    found = re.findall(r"\.(\d+)\.", f".{layer.layer_name}.")
    return int(found[0]) if found else 0
