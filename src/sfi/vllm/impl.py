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
from dataclasses import dataclass
from typing import Any

import torch

from sfi.core.coverage import unheld_pages
from sfi.core.memory_tensors import MemoryTensors, memory_positions
from sfi.core.overlap import Refresh
from sfi.core.pages import PageSummaries, probe_page
from sfi.core.refresh_selection import SelectionGroup, SelectionRule, reads_keys
from sfi.core.rows import Rows
from sfi.vllm.metadata import PlannedStep, SFIMetadata, layer_index
from sfi.vllm.paged import CacheLayout, empty_like_cache, probe_layout, read_positions
from sfi.vllm.probes import ProbeLayer, check_probes
from sfi.vllm.refresh_inputs import read_refresh, window_selections
from sfi.vllm.requests import SELECT, RequestBook, RowPlan, slot_start

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
    """What a probe layer keeps of one slot's memory to check it (``sfi.core.coverage``).

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
        requests, step = md.book, md.step
        if step is None:
            raise RuntimeError(
                "sfi.vllm: a step reached an attention layer unplanned: neither the model's "
                "forward (sfi's recording class) nor the metadata builder planned it")
        if self.layer_idx is None:
            self.layer_idx = layer_index(layer.layer_name)
        if self.layer_idx < requests.config.dense_layers:
            # one of the first dense_layers layers: every row reads vLLM's cache, none selects
            # (as in the transformers path, whose memories at these layers are never read)
            stock(layer, query, key, value, kv_cache, step.stock, output)
            return self._finish(md, output)
        self._ensure_buffers(requests, md, kv_cache, query)
        self._record_prompt_queries(md, step, query)
        if step.fast is None:
            stock(layer, query, key, value, kv_cache, step.stock, output)
        elif step.dense is not None:
            part = output.new_empty(len(step.dense_tokens), *output.shape[1:])
            stock(layer, query.index_select(0, step.dense_tokens), key, value, kv_cache,
                  step.dense, part)
            output.index_copy_(0, step.dense_tokens, part)
        self._refresh(layer, requests, md, step, query, kv_cache)
        if step.fast is not None:
            _store(layer, self, self.buffer, key.index_select(0, step.fast_tokens),
                   value.index_select(0, step.fast_tokens), step.fast_slots)
            part = output.new_empty(len(step.fast_tokens), *output.shape[1:])
            stock(layer, query.index_select(0, step.fast_tokens), key, value, self.buffer,
                  step.fast, part)
            output.index_copy_(0, step.fast_tokens, part)
            if self.layer_idx in requests.probes and step.probe_plans:
                self._probe_coverage(layer, md, step, query, kv_cache)
        return self._finish(md, output)

    def _finish(self, md: SFIMetadata, output: torch.Tensor) -> torch.Tensor:
        """After the step's last layer: the slow rows' refreshes, all layers' selected together
        and packed (their memories are read from the next step on), and the probe layers'
        checks, all at once (:func:`~sfi.vllm.probes.check_probes`), their flags kept where
        the model runs (no wait for the device here): the next step's plan reads them in its
        one transfer."""
        if self.layer_idx == md.last_layer:
            work = md.work
            work.rebuilder.flush()
            if work.probes:
                md.book.flag_missed(md.step.probe_slot_index, check_probes(work.probes, md))
                work.probes.clear()
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

    def _record_prompt_queries(self, md: SFIMetadata, step: PlannedStep,
                               query: torch.Tensor) -> None:
        """Keep each prompt chunk's last W queries (the first selection's evidence)."""
        for plan in step.recording:
            end = md.query_start[plan.row + 1]
            held = self.prompt_queries[plan.slot]
            new = query[end - plan.record: end]
            held.copy_(torch.cat([held[plan.record:], new], dim=0))

    def _refresh(self, layer: Any, requests: RequestBook, md: SFIMetadata, step: PlannedStep,
                 query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Select the memories of every row that refreshes at this step and pack them into
        their slots. A first selection (``select``: read fast at this very step) is made and
        packed at once; a slow step's refresh (read from the next step on) goes to the step's
        rebuilder, which selects the refreshes of all layers together when the step's last
        layer has run (:class:`sfi.core.overlap.StackingRebuilder`, the transformers path's)."""
        if not step.refreshing:
            return
        layout = _cache_layout(layer, self, kv_cache)
        cache_keys = layout.halves(kv_cache)[0]
        page = probe_page(requests.config) if self.layer_idx in requests.probes else None
        softcap = getattr(self, "logits_soft_cap", None) or None
        refreshes, records, pages = [], [], []
        for plan in step.refreshing:
            if plan.kind == SELECT:  # evidence: the prompt's last W queries
                queries = self.prompt_queries[plan.slot, -plan.evidence:]
            else:  # evidence: this step's query
                first = md.query_start[plan.row]
                queries = query[first: first + 1]
            record = self.records.get(plan.slot)
            if record is None or record.request != plan.request:
                record = self.records[plan.slot] = SlotRecord(plan.request)
            kept = record.coverage.pages if record.coverage is not None else None
            refresh, summaries = read_refresh(
                plan.memory, queries, plan.keys_end, record.selected, record.norms,
                kept if page is not None else None, page, cache_keys, md.block_table[plan.row],
                layout.keys, reads_keys([requests.scorer]), self.scale, softcap)
            record.norms = refresh.key_norms
            refreshes.append(refresh)
            records.append(record)
            pages.append(summaries)
        rule = SelectionRule.of(requests.config)
        groups = (SelectionGroup(requests.scorer, rule, None),)
        for now in (True, False):
            chosen = [i for i, plan in enumerate(step.refreshing) if (plan.kind == SELECT) == now]
            if not chosen:
                continue
            for part in window_selections(requests.scorer, rule, self.layer_idx,
                                          [refreshes[i] for i in chosen], self.scale, softcap):
                rows = [chosen[i] for i in part.members]
                target = _PackTarget(layer, self, kv_cache, layout, md,
                                     [step.refreshing[i] for i in rows],
                                     [records[i] for i in rows], [pages[i] for i in rows])
                refresh = Refresh(Rows(tuple(rows), len(refreshes), kv_cache.device),
                                  part.evidence, groups, part.k, part.pins, part.previous,
                                  target.pack, requests.capacity)
                if now:
                    refresh.run()
                else:
                    md.work.rebuilder.submit(refresh, [])

    def _probe_coverage(self, layer: Any, md: SFIMetadata, step: PlannedStep,
                        query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Keep what this probe layer's check of the probed fast rows needs
        (:class:`~sfi.vllm.probes.ProbeLayer`): the step's probe layers are checked together
        after its last layer (:func:`~sfi.vllm.probes.check_probes`, from :meth:`_finish`)."""
        layout = _cache_layout(layer, self, kv_cache)
        cache_keys = layout.halves(kv_cache)[0]
        h, d = cache_keys.shape[1], cache_keys.shape[3]
        plans = step.probe_plans
        records = [self.records[p.slot] for p in plans]
        md.work.probes.append(ProbeLayer(
            query.index_select(0, step.probe_tokens).view(len(plans), h, -1, d),
            layout.halves(self.buffer)[0], cache_keys, layout.keys,
            tuple(r.coverage.boxes for r in records), tuple(r.coverage.outside for r in records),
            tuple(r.selected for r in records), self.scale,
            getattr(self, "logits_soft_cap", None) or None))


@dataclass(frozen=True)
class _PackTarget:
    """Where one layer's refreshed memories go: the rows (``plans``) whose new selections a
    refresh packs into their slots of the layer's buffer, from the layer's cache."""

    layer: Any
    impl: SFIImpl
    kv_cache: torch.Tensor
    layout: CacheLayout
    md: SFIMetadata
    plans: list[RowPlan]
    records: list[SlotRecord]
    pages: list[PageSummaries | None]

    def pack(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Record each row's selection (the first ``memory.k`` of its ``slots [n, H, k_max]``;
        in probe layers, also the pages its memory leaves out) and write the sinks, the
        selection and the recent window of each into its slot (one cache write): the packed
        ``(keys, values)`` ``[L, H, D]`` and their buffer slots ``[L]``."""
        chosen = [slots[row, :, : plan.memory.k] for row, plan in enumerate(self.plans)]
        cache_keys, cache_values = self.layout.halves(self.kv_cache)
        md = self.md
        per_slot = md.builder.blocks_per_slot(md.book)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for plan, record, pages, selected in zip(self.plans, self.records, self.pages, chosen):
            memory = plan.memory
            record.selected = selected
            if pages is not None:
                geometry = MemoryTensors.of([memory], selected.device)
                record.coverage = SlotCoverage(pages, unheld_pages(
                    selected[None], torch.ones_like(selected[:1], dtype=torch.bool),
                    geometry.lo, geometry.hi, pages=pages.count, page=pages.page))
            positions = memory_positions(memory, selected, plan.keys_end)  # [H, L]
            block_row = md.block_table[plan.row]
            keys = read_positions(cache_keys, block_row, positions, self.layout.keys)
            values = read_positions(cache_values, block_row, positions, self.layout.values)
            first = slot_start(plan.slot, per_slot, cache_keys.shape[2])
            parts.append((keys.transpose(0, 1), values.transpose(0, 1),
                          torch.arange(first, first + positions.shape[1],
                                       device=selected.device)))
        new_keys, new_values, slots = (torch.cat(p) for p in zip(*parts))
        _store(self.layer, self.impl, self.impl.buffer, new_keys, new_values, slots)
        return new_keys, new_values, slots
