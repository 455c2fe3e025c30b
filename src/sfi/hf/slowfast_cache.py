"""``SlowFastCache``: the transformers ``Cache`` that decodes with Slow-Fast Inference.

Pass it as the cache of ``model.generate`` or of a forward call, or let :func:`sfi.generate`
build one. It holds one :class:`~sfi.hf.slab.SlabLayer` per full-attention layer (tensors only),
one :class:`~sfi.hf.layer_attention.SlowFastAttention` beside each (how a step reads and rebuilds
that layer), a :class:`~sfi.hf.planner.Planner` (the sequences' state and each step's decisions)
and the rebuilder that runs slow steps' selections. Building it routes the model's attention
through sfi for the cache's lifetime (:func:`sfi.hf.routing.routed`): before each forward the
routing hook calls :meth:`SlowFastCache.begin_forward`, which plans the step; the layers carry the
plan out; after the forward :meth:`SlowFastCache.end_forward` commits it and records what the
step did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from sfi.core.config import SFIConfig
from sfi.core.decode_stats import DecodeStats
from sfi.core.overlap import Rebuilder, make_rebuilder
from sfi.core.scorers import Scorer
from sfi.core.selector import SFISelector
from sfi.core.sequence_policy import SLOW, Memory, record_verified
from sfi.core.triggers import make_trigger, token_classes
from sfi.errors import SFIError
from sfi.hf.attention import WritesInAttention
from sfi.hf.cache_layers import attention_of, build_layers, resolve_tokenizer
from sfi.hf.context import StepContext, current_step
from sfi.hf.facts import eos_token_ids
from sfi.hf.layer_attention import SlowFastAttention
from sfi.hf.plan import Redo, StepPlan
from sfi.hf.planner import Planner, TriggerFactory
from sfi.hf.routing import RoutingLease
from sfi.hf.slab import SlabLayer
from sfi.step.probes import flagged_rows
from sfi.weights.layout import stored_weight_positions

KV = list[tuple[torch.Tensor, torch.Tensor]]


class SlowFastCache(WritesInAttention, Cache):
    """A transformers ``Cache`` that decodes with Slow-Fast Inference.

    Use it as ``model.generate(**inputs, cache=SlowFastCache(model, config))``
    (``past_key_values=`` before transformers 5.24) or through :func:`sfi.generate`. One cache
    serves one batch, from prefill to the last token (sequences can join with :meth:`merge`
    and leave with :meth:`keep`). The model is routed
    through sfi while the cache lives, or until :meth:`close` (also ``with SlowFastCache(...)
    as cache:``).

    A prompt may be prefilled in several forwards (chunks): set :attr:`prompt_continues` to
    True before every chunk but the last, which then makes the first selection from its last
    W queries (so the last chunk should have at least W tokens).

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``
            (Llama, Qwen2, Qwen3, Mistral, Gemma, ...).
        config: the SFI knobs; defaults to ``SFIConfig()``.
        tokenizer: the model's tokenizer, for sentence triggers; taken from ``sfi.load`` or the
            model's folder when omitted.
        scorer: what ranks positions at slow steps; defaults to the SFI Selector.
        max_cache_len: optional capacity hint (prompt + new tokens) to avoid regrowth.
        dense_only: decode these sequences with full attention (every step dense), so that they
            can share a batch (see :meth:`merge`) with slow-fast sequences.
        trigger_factory: ``(config, row) -> RefreshTrigger``, a custom refresh policy per
            sequence (default: the policy ``config.trigger`` names).
    """

    def __init__(self, model: torch.nn.Module, config: SFIConfig | None = None,
                 tokenizer: Any = None, scorer: Scorer | None = None,
                 max_cache_len: int | None = None, dense_only: bool = False,
                 trigger_factory: TriggerFactory | None = None):
        self.config = config if config is not None else SFIConfig()
        if not isinstance(self.config, SFIConfig):
            raise SFIError(f"config must be an SFIConfig, got {type(self.config).__name__}")
        self._routing = RoutingLease(self, model)
        self.scorer: Scorer = scorer if scorer is not None else SFISelector(self.config)
        if trigger_factory is None:
            classes = None
            if self.config.trigger == "sentence":
                classes = token_classes(resolve_tokenizer(model, tokenizer))

            def trigger_factory(cfg: SFIConfig, row: int) -> Any:
                return make_trigger(cfg, classes, row)

        self._trigger_factory = trigger_factory
        self.dense_only = dense_only
        # the cost model's W (SFIConfig.min_gain), at the bytes the weights are stored in
        self.weight_positions = stored_weight_positions(model)
        self._layer_ids: tuple[int, ...] = ()
        self.rebuilder: Rebuilder | None = None  # chosen on the first forward (needs the device)
        self._kinds: tuple[str, ...] = ()
        self._redo: Redo | None = None  # a step to run again (coverage_retry, retry_margin,
        # stop_margin), until it runs
        self.prompt_continues = False  # set between the chunks of a chunked prefill
        self.phase: str | None = None  # the next forward's: exact mode's, or a repair's
        capacity = int(max_cache_len) if max_cache_len else 256
        super().__init__(layers=build_layers(model, capacity))
        self._layer_ids = tuple(layer.layer_idx for layer in self._sfi_layers())
        self.attention = attention_of(self.layers)
        stops: frozenset[int] = frozenset()  # stop_margin's: the model's end-of-sequence ids
        if self.config.stop_margin:
            with contextlib.suppress(SFIError):  # no tokenizer: the configs may name the id
                tokenizer = resolve_tokenizer(model, tokenizer)
            stops = frozenset(eos_token_ids(model, tokenizer))
            if not stops:
                raise SFIError("stop_margin needs the model's end-of-sequence id; its generation "
                               "config, config and tokenizer name none")
        self.planner = Planner(self._layer_ids, stops)
        for name, forgets in (("repair_tokens", "the positions it re-runs"),
                              ("retry_margin", "the step it does again"),
                              ("stop_margin", "the step it does again")):
            if getattr(self.config, name) and not self._rewindable():
                raise SFIError(f"{name} needs every layer of the model to attend fully (a "
                               f"sliding-window layer cannot forget {forgets})")

    def writes_in_attention(self, layer_idx: int) -> bool:
        """Whether a compiled step's attention operator writes layer ``layer_idx`` (a slab
        layer, which :class:`SlowFastAttention` attends)."""
        return isinstance(self.layers[layer_idx], SlabLayer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' write of layer ``layer_idx``: only inside a forward this cache
        planned (the routing hook plans each step of the model it was built with)."""
        if not torch.compiler.is_compiling() and isinstance(self.layers[layer_idx], SlabLayer):
            step = current_step()
            if step is None or step.layer(layer_idx) is not self.attention[layer_idx]:
                raise SFIError(
                    "this SlowFastCache was not planned for this forward pass: call the model it "
                    "was built with (its forward hook plans each step), not a submodule")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # --- the routing hook's interface ----------------------------------------------------------
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      batch_size: int, query_length: int, device: torch.device) -> StepContext:
        """Plan the coming forward: per sequence dense, slow or fast (see ``sfi.hf.planner``)."""
        past = self.get_seq_length()
        if past == 0:
            self._start(batch_size, attention_mask, device)
        elif batch_size != len(self.planner.sequences):
            raise SFIError(f"this SlowFastCache holds {len(self.planner.sequences)} sequences; a "
                           f"forward with batch size {batch_size} cannot continue it")
        self.rebuilder.discard()  # refreshes of a forward that raised before its end
        redo, self._redo = self._redo, None  # (the next forward's alone, even if it raises)
        tokens = input_ids[:, -1].tolist() if input_ids is not None else [None] * batch_size
        inputs = None  # a prompt's last inputs, which a repair may re-run
        if query_length > 1 and self.phase is None and input_ids is not None:
            limit = max(seq.config.repair_tokens for seq in self.planner.sequences)
            inputs = input_ids[:, -limit:].tolist() if limit else None
        plan = self.planner.plan(tokens, query_length, past, device,
                                 may_lag=self.rebuilder.asynchronous,
                                 select=not self.prompt_continues, phase=self.phase, redo=redo,
                                 inputs=inputs)
        return StepContext(layers=self.attention, plan=plan, rebuilder=self.rebuilder)

    def end_forward(self, step: StepContext, logits: torch.Tensor | None = None) -> bool:
        """The planned forward ran (its output ``logits [B, Q, V]``, where the model gave
        them): commit its plan and record what it did; or, where its probes flagged rows that
        redo such a step (``coverage_retry``) or a row's next token was uncertain
        (``retry_margin``) or would end the text (``stop_margin``), forget the position it wrote
        and return True: the caller runs the
        same forward again (``sfi.hf.routing``), whose plan is the :class:`~sfi.hf.plan.Redo`
        of this one."""
        plan: StepPlan = step.plan
        self.rebuilder.flush()  # the forward's refreshes, stacked over its layers
        for attention in self._attending():
            attention.settle()  # commit what is ready (inside the forward's inference mode)
        missed, copying = flagged_rows(step.coverage.check())
        step.missed.update(missed)
        flagged, reasons = (self.planner.redo_rows(plan, step.missed, logits)
                            if plan.redo is None else (frozenset(), {}))
        step.missed.update(copying)  # the next step needs more; this one was served
        if flagged and self._rewindable():
            for layer in self._sfi_layers():
                layer.truncate(plan.total_length - plan.query_length)
            self._redo = Redo(plan, flagged, frozenset(step.missed), reasons)
            return True
        self.planner.commit(plan, step.lagged, self.planner.layer_ids, step.missed)
        self._kinds = self.planner.executed_kinds(plan, step.lagged)
        return False

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
        self.planner.start(pads, self.config, self._trigger_factory, self.scorer,
                           self.dense_only, self.weight_positions)
        if self.rebuilder is None:
            self.rebuilder = make_rebuilder(device, self.config.overlap_selection)

    # --- the protocol every cache of a comparison implements (sfi.hf.decode_cache.DecodeCache) --
    def load_prefix(self, prefix: KV, history: list[torch.Tensor] | None = None,
                    attention_mask: torch.Tensor | None = None) -> None:
        """Fill an empty cache with already computed KV (a shared prefill, or synthetic KV).

        ``prefix[i]`` is layer i's ``(keys, values)``, each ``[B, H, T, D]`` (copied in). The
        next forward continues the sequences; with several tokens it is dense and, where the
        context is long enough, makes the first selection from their queries. ``history``
        (accumulated attention, for H2O) is not used.
        """
        if self.get_seq_length() != 0:
            raise SFIError("load_prefix needs an empty SlowFastCache")
        if len(prefix) != len(self.layers):
            raise SFIError(f"load_prefix got KV for {len(prefix)} layers; the model has "
                           f"{len(self.layers)}")
        keys = prefix[0][0]
        self._start(keys.shape[0], attention_mask, keys.device)
        for layer, (k, v) in zip(self.layers, prefix):
            if isinstance(layer, SlabLayer):
                layer.append(k, v)
            else:
                layer.update(k, v)

    def step_kinds(self) -> tuple[str, ...]:
        """What the last forward did for each sequence: ``dense``, ``slow``, ``fast``, or
        ``lagged`` (planned fast, read densely at some layer while its rebuild ran, or at every
        layer in a repairing slow step of another row)."""
        return self._kinds

    def stats(self, row: int | None = None) -> DecodeStats:
        """Counters of one sequence, or summed over the batch when ``row`` is None."""
        if row is not None:
            return self.planner.sequences[row].stats
        return DecodeStats.merge([seq.stats for seq in self.planner.sequences])

    def read_fraction(self) -> tuple[float, float | None]:
        """``(mean fraction of the context read per decode step, the same over fast steps)``,
        over the whole batch; ``(1.0, None)`` before any decode step."""
        stats = self.stats()
        if stats.decode_steps == 0:
            return 1.0, None
        return stats.read_fraction, stats.fast_read_fraction

    # --- repairing slow steps (SFIConfig.repair_tokens, sfi.decoding.decode_step) ---------
    def repair_inputs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """``[B, n]`` the inputs of the cache's last n positions, which the coming one-token
        decode step of ``tokens [B]`` re-runs first, densely, in one forward with its own
        (:meth:`sfi.hf.planner.Planner.repair_length`); None: a plain step."""
        length = self.get_seq_length()
        if not self.planner.repairs or self.phase is not None or length == 0 or \
                tokens.shape[0] != self.batch_size:  # (the forward says what is wrong)
            return None
        n = self.planner.repair_length(tokens.tolist(), length + 1)
        if n == 0:
            return None
        return torch.tensor([seq.inputs[-n:] for seq in self.planner.sequences],
                            dtype=tokens.dtype, device=tokens.device)

    # --- exact mode (sfi.decoding.exact), and repairs' rewind ---------------------------------
    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on, in every layer: the drafts' KV before a
        verify, a verify's rejected positions after it (exact mode), the drifted positions a
        repairing slow step re-runs. The memories lie before ``length`` (drafts never refresh,
        a verify lays its memory out at its first position, and a repair stays inside the
        recent window of every row that does not refresh)."""
        if not 0 < length <= self.get_seq_length():
            raise SFIError(f"rewind needs 0 < length <= {self.get_seq_length()}, got {length}")
        if not self._rewindable():
            raise SFIError("exact mode needs every layer to be full attention (a sliding-window "
                           "layer cannot be rewound)")
        for layer in self._sfi_layers():
            layer.truncate(length)

    def commit_rows(self, start: int, counts: Sequence[int]) -> None:
        """After a verify of the slots from ``start`` on, rewound to its longest commit: row
        r keeps ``counts[r]`` of them and the rest of its slots become holes (zeroed in every
        layer, never attended: ``sfi.hf.visibility``), so that each row keeps its own length."""
        end = self.get_seq_length()
        if all(start + count >= end for count in counts):
            return
        for seq, count in zip(self.planner.sequences, counts):
            seq.holes.extend(range(start + count, end))
        layers = self._sfi_layers()
        slots = torch.arange(start, end, device=layers[0].keys.device)
        empty = slots[None, :] >= start + torch.tensor(counts, device=slots.device)[:, None]
        for layer in layers:
            layer.blank(empty, start)

    def holes(self, row: int) -> list[int]:
        """Exact mode: the slots of sequence ``row`` that hold nothing (``sfi.hf.visibility``)."""
        return list(self.planner.sequences[row].holes)

    def record_exact(self, inputs: list[list[int]], accepted: list[int] | None,
                     drafted: int) -> None:
        """Record what a verify (``accepted`` per row, of ``drafted`` drafts) or a dense step
        (``accepted`` None) committed: each row's ``inputs``, the input tokens of the decode
        steps it stands for, walk the row's trigger
        (``sfi.core.sequence_policy.record_verified``)."""
        if len(inputs) != self.batch_size:
            raise SFIError(f"record_exact got {len(inputs)} rows; the batch has "
                           f"{self.batch_size}")
        for row, (seq, tokens) in enumerate(zip(self.planner.sequences, inputs)):
            refreshed = accepted is not None and self._kinds[row] == SLOW
            record_verified(seq, tokens, refreshed, None if accepted is None else accepted[row],
                            drafted)
            if accepted is None:
                seq.stats.exact_dense_steps += 1
                continue
            seq.stats.verify_steps += 1
            seq.stats.drafted += drafted
            seq.stats.accepted += accepted[row]
            seq.stats.verified_tokens += len(tokens)

    # --- what a sequence holds -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.planner.sequences)

    def padding(self, row: int) -> int:
        """Left padding positions of sequence ``row``."""
        return self.planner.sequences[row].pad

    def memory(self, row: int) -> Memory | None:
        """Where sequence ``row``'s fast memory lies (sinks, middle, recent start, K); None
        before its first selection."""
        return self.planner.sequences[row].memory

    def reads_densely(self, layer_idx: int, row: int) -> bool:
        """Whether sequence ``row`` always attends densely at ``layer_idx`` (one of its first
        ``dense_layers`` layers, or a layer that keeps its own sliding window)."""
        return (not isinstance(self.layers[layer_idx], SlabLayer)
                or layer_idx < self.planner.sequences[row].config.dense_layers)

    def selected_positions(self, layer_idx: int, row: int) -> torch.Tensor:
        """``[H, k]`` the positions selected for sequence ``row`` at layer ``layer_idx`` (a
        layer it reads sparsely: at its dense layers nothing is selected)."""
        layer = self.layers[layer_idx]
        memory = self.memory(row)
        if self.reads_densely(layer_idx, row):
            raise SFIError(f"sequence {row} reads layer {layer_idx} densely: nothing is selected "
                           "there")
        if isinstance(layer, SlabLayer):
            self.attention[layer_idx].settle(wait=True)
        if not isinstance(layer, SlabLayer) or layer.compact_positions is None or memory is None:
            raise SFIError(f"layer {layer_idx} holds no selection for sequence {row}")
        return layer.compact_positions[row, :, memory.sink: memory.sink + memory.k]

    # --- continuous batching --------------------------------------------------------------------
    def merge(self, other: SlowFastCache) -> None:
        """Append the sequences of ``other`` (prefilled, same model) to this batch.

        Both batches are right-aligned at the longer length: the shorter one's sequences get
        more left padding (their keys keep the positions they were computed at). Each sequence
        keeps its own configuration, trigger, scorer, selection and counters. ``other`` is
        copied into free rows of this batch's slab (see :meth:`reserve`); this batch is copied
        only when its slab lacks rows or room.
        """
        if other is self or not other.planner.sequences or not self.planner.sequences:
            raise SFIError("merge needs two distinct, prefilled SlowFastCaches")
        if len(other.layers) != len(self.layers):
            raise SFIError("merge needs caches of the same model")
        length = max(self.get_seq_length(), other.get_seq_length())
        shifts = (length - self.get_seq_length(), length - other.get_seq_length())
        width = max(self.planner.compact_width, other.planner.compact_width)
        if not all(isinstance(layer, SlabLayer) for layer in (*self.layers, *other.layers)):
            raise SFIError("merge supports models whose layers are all full attention")
        for cache in (self, other):
            cache._settle_all()
        for mine, theirs in zip(self.layers, other.layers):
            mine.absorb(theirs, length, shifts, width)
        self.planner.shift(shifts[0])
        other.planner.shift(shifts[1])
        self.planner.absorb(other.planner)
        self._kinds = ()

    def reserve(self, rows: int) -> None:
        """Preallocate ``rows`` rows in every layer (a slab): sequences that :meth:`merge` into
        this batch take free rows, and those that :meth:`keep` drops give theirs back, without
        the batch being copied. One copy of the batch now, when the rows change."""
        if rows < max(1, self.batch_size):
            raise SFIError(f"reserve needs rows >= {max(1, self.batch_size)}, the sequences "
                           f"this batch holds (got {rows})")
        for layer in self._sfi_layers():
            layer.reserve(rows)

    @property
    def copies(self) -> int:
        """Times the layers' slabs were copied (grown, re-rowed, or shifted for a newcomer)."""
        layers = self._sfi_layers()
        return layers[0].relayouts if layers else 0

    def kv_bytes(self) -> int:
        """Bytes the layers' slabs hold (KV, key norms, compact buffers)."""
        return sum(layer.slab_bytes for layer in self._sfi_layers())

    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences ``rows`` (in that order), e.g. when others finish; the left
        padding that every remaining sequence has is then trimmed."""
        if not rows:
            self.reset()
            return
        layers = self._sfi_layers()
        if len(layers) != len(self.layers):
            raise SFIError("keep supports models whose layers are all full attention")
        device = layers[0].device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        self._settle_all()
        trim = self.planner.keep(rows)
        for layer in layers:
            layer.keep(index, trim)
        self._kinds = ()

    # --- lifetime --------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.attention = attention_of(self.layers)
        self.planner = Planner(self._layer_ids, self.planner.stops)
        self._kinds = ()
        self._redo = None

    def close(self) -> None:
        """Stop routing the model through sfi (the cache cannot decode any more)."""
        self._routing.release()

    def __enter__(self) -> SlowFastCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _settle_all(self) -> None:
        """Commit every layer's pending rebuild (waiting for it) and forget what the layers
        kept of the rows' memories: before the rows move (a join or a leave)."""
        for attention in self._attending():
            attention.settle(wait=True)
            attention.forget()

    def _sfi_layers(self) -> list[SlabLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlabLayer)]

    def _rewindable(self) -> bool:
        """Every layer can forget positions (none keeps its own sliding window)."""
        return len(self._sfi_layers()) == len(self.layers)

    def _attending(self) -> list[SlowFastAttention]:
        return [attention for attention in self.attention if attention is not None]

