"""One step's attention metadata under SFI: the batch as vLLM built it, the step's plan once it
is made, and the step's scratch.

An :class:`SFIMetadata` (made by :class:`sfi.vllm.builder.SFIBuilder`) holds the batch's shapes
and the request book of the configuration in force; before the step's first layer runs,
:func:`sfi.vllm.planning.plan` gives it its :class:`PlannedStep` (what every row does and the
stock metadata of each part), after which the metadata is frozen. What the step's layers leave
for its last one (the refreshes to select together, the probe layers to check together) goes
to its :class:`StepWork`, an object of its own. The impl (:mod:`sfi.vllm.impl`) reads the
metadata and fills the work: nothing on the step path is kept in module state. Here too: the
architectures whose model classes sfi subclasses to record the input ids
(:data:`TOKEN_ARCHITECTURES`, :data:`STOCK_ENTRY`) and the request book in force (:func:`book`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from sfi.core.overlap import StackingRebuilder
from sfi.vllm.probes import ProbeLayer
from sfi.vllm.requests import RequestBook, RowPlan
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


@dataclass(frozen=True)
class PlannedStep:
    """What a step's rows do, decided once before its first layer runs
    (:func:`sfi.vllm.planning.plan_step`).

    Attributes:
        keys: each row's request key (its first KV block); seq_lens: each row's context length.
        plans: what each row does; refreshing: the slow and selecting rows among them;
            recording: the prompt chunks whose last queries are kept.
        stock: the stock metadata of the whole batch, when no row is fast or the first
            ``dense_layers`` layers read everything (else None).
        dense: the stock metadata of the rows that read vLLM's cache, when some are fast.
        dense_tokens / fast_tokens: ``[n]`` the query tokens of each part.
        fast: the stock metadata of the fast rows over the plugin's buffer.
        fast_slots: ``[n_fast]`` where each fast row's new entry goes in the buffer
            (block * bs + offset); fast_blocks: ``[n_fast, blocks]`` each one's slot blocks;
            fast_plans: their plans.
        probe_plans: the fast rows the coverage probes check (:attr:`RowPlan.probed`);
            probe_tokens / probe_blocks / probe_slot_index: their query tokens ``[n_probed]``,
            slot blocks ``[n_probed, blocks]`` and slots ``[n_probed]``.
    """

    keys: list[int]
    seq_lens: list[int]
    plans: list[RowPlan]
    refreshing: list[RowPlan]
    recording: list[RowPlan]
    stock: Any = None
    dense: Any = None
    dense_tokens: torch.Tensor | None = None
    fast: Any = None
    fast_tokens: torch.Tensor | None = None
    fast_slots: torch.Tensor | None = None
    fast_blocks: torch.Tensor | None = None
    fast_plans: list[RowPlan] = field(default_factory=list)
    probe_plans: list[RowPlan] = field(default_factory=list)
    probe_tokens: torch.Tensor | None = None
    probe_blocks: torch.Tensor | None = None
    probe_slot_index: torch.Tensor | None = None


@dataclass
class StepWork:
    """What a step's layers leave for its last one: the slow rows' refreshes, selected together
    and packed after the last layer (``rebuilder``), and what each probe layer keeps for the
    check of all of them (``probes``)."""

    rebuilder: StackingRebuilder = field(default_factory=StackingRebuilder)
    probes: list[ProbeLayer] = field(default_factory=list)


@dataclass
class SFIMetadata:
    """One step's metadata for every layer: the batch as vLLM built it, and, once planned
    (before the first layer runs: where the model's forward records the input tokens the
    triggers observe, and by the builder where the model's class records none,
    :func:`~sfi.vllm.builder.records_input_ids`), its :class:`PlannedStep`. Frozen once
    planned; the impl reads it and fills :attr:`work`.

    Attributes:
        common: vLLM's metadata of the whole batch; builder: the builder that made this;
            book: the request book that decides its rows.
        key_column: ``[rows]`` each row's first KV block (its request's key, read on the host
            when planned).
        query_lens, query_start: each row's query length and first query token.
        seq_lens: each row's context length where vLLM gives it on the host (else None: the
            plan reads it in its one transfer).
        block_table: ``[rows, max_blocks]`` vLLM's block table (to read a request's entries).
        last_layer: the last model layer this metadata serves (the builder's), after which
            the step's work is done: the refreshes selected and packed, the probes checked.
        input_ids: the step's input tokens, attached by the model before the plan.
        step: the plan (None until planned); work: the step's scratch.
    """

    common: CommonAttentionMetadata
    builder: Any  # the sfi.vllm.builder.SFIBuilder that made this (its stock build)
    book: RequestBook
    key_column: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int] | None
    query_start: list[int]
    block_table: torch.Tensor
    last_layer: int = -1
    input_ids: torch.Tensor | None = None
    step: PlannedStep | None = None
    work: StepWork = field(default_factory=StepWork)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "step", None) is not None:
            raise AttributeError(f"sfi.vllm: a step's metadata is frozen once planned "
                                 f"({name} was set after the plan)")
        super().__setattr__(name, value)

    @property
    def planned(self) -> bool:
        return self.step is not None


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer's name (``model.layers.3.self_attn.attn``)
    names (0 when it names none)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0
