"""The metadata builder SFI mixes into a stock one: it makes the step's
:class:`~sfi.vllm.metadata.SFIMetadata`, refuses the engine settings SFI cannot run, and checks
which layers it serves.

:class:`SFIBuilder` is mixed into a stock metadata builder (first in the bases). It records the
batch's shapes in an :class:`~sfi.vllm.metadata.SFIMetadata` with the request book of the
configuration in force, and plans it at once where the model's class records no input ids
(:func:`records_input_ids`; otherwise the model's forward plans it, ``sfi.vllm.backend``); its
stock ``build`` makes each part's metadata when the plan asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

from sfi.core.cost_model import slow_fast_layers, weight_positions
from sfi.core.scorers.registry import make_scorer
from sfi.core.triggers import token_classes
from sfi.vllm.metadata import STOCK_ENTRY, SFIMetadata, layer_index, on_host
from sfi.vllm.planning import plan
from sfi.vllm.requests import RequestBook, blocks_per_slot, slot_capacity
from sfi.vllm.settings import active_config, active_slots, plugin_state


def records_input_ids(model_config: Any) -> bool:
    """Whether the model class vLLM loaded for ``model_config`` is (or derives from) one of
    sfi's recording classes: then the model's forward hands each step's input ids to its
    metadata and plans it there (``sfi.vllm.backend``); else the builder plans each step.
    Asked of the class the loader resolved (vLLM caches it per model), not of the registry,
    which may have changed since the model was loaded."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    return hasattr(get_model_cls(model_config), STOCK_ENTRY)


def refuse_unsupported(vllm_config: Any) -> None:
    """Raise, naming it, what an engine with SFI on cannot run: prefix caching, a quantized KV
    cache, decode context parallelism, pipeline parallelism (later stages get no input ids,
    and each stage would decide alone) and speculative decoding (its verify rows are several
    queries per request, and the drafter's metadata would make a second plan per step) and
    micro-batching (each micro-batch's metadata would plan the step again)."""
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
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "ubatch_size", 0) > 1:
        raise RuntimeError("SFI in vLLM does not support micro-batching (no --enable-dbo, "
                           "ubatch_size 0 or 1)")
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
    if state.book is None:  # (the engine's settings were checked: SFIBuilder._check_engine)
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


class SFIBuilder:
    """Mixed into a stock metadata builder (first in the bases): the step's metadata becomes an
    :class:`SFIMetadata`, and the stock ``build`` runs once per part of the batch."""

    supports_update_block_table = False
    _engine_checked = False  # _check_engine ran for this builder
    _model_records: bool | None = None  # whether the model's forward plans (_model_plans)

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
                self._check_engine(full=False)
            return super().build(common_prefix_len, common, fast_build)
        if _full_graphs(self.vllm_config):
            raise RuntimeError(
                "SFI was switched on (sfi.vllm.configure) in a vLLM engine that started without "
                "it and replays CUDA graphs of whole steps, attention included, which cannot run "
                "SFI's per-step plan: set SFI_VLLM (or call configure) before the engine "
                "starts, or run it with enforce_eager=True")
        self._check_engine(full=True)
        requests = _book_for(self.vllm_config)
        n = common.num_reqs
        starts = on_host(common.query_start_loc_cpu[: n + 1])
        # vLLM's host copy of the lengths is exact without speculative decoding (refused)
        host_lens = getattr(common, "seq_lens_cpu_upper_bound", None)
        block_table = common.block_table_tensor[:n]
        md = SFIMetadata(common=common, builder=self, book=requests,
                         key_column=block_table[:, 0],
                         query_lens=[starts[r + 1] - starts[r] for r in range(n)],
                         seq_lens=None if host_lens is None else on_host(host_lens[:n]),
                         query_start=starts, block_table=block_table,
                         last_layer=max(layer_index(name) for name in self.layer_names))
        if not self._model_plans():  # no input ids will come: nothing to wait for
            plan(md)
        return md

    def _model_plans(self) -> bool:
        """Whether the model's forward plans each step (:func:`records_input_ids`), asked once
        per builder: the model class does not change under it."""
        if self._model_records is None:
            self._model_records = records_input_ids(self.vllm_config.model_config)
        return self._model_records

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

    def _check_engine(self, full: bool) -> None:
        """Once per builder, at its first step with SFI on: refuse the engine settings SFI
        cannot run under (:func:`refuse_unsupported`; first, since a pipeline stage serves
        only some of the layers), then layers whose kind vLLM's KV cache spec (``full``, this
        builder's) and the model's config (:func:`sfi.core.cost_model.slow_fast_layers`, the
        request book's :attr:`RequestBook.layers`, where its probes go and a fast step's reads
        are counted) see differently."""
        if not self._engine_checked:
            refuse_unsupported(self.vllm_config)
            check_layers(slow_fast_layers(self.vllm_config.model_config.hf_text_config),
                         self.layer_names, full)
            self._engine_checked = True

    def build_stock(self, common: CommonAttentionMetadata) -> Any:
        """The stock metadata of ``common`` (a whole batch or a part of it), holding no view
        of the builder's own buffers: a step builds up to three parts, and a stock builder
        may write each build into one persistent buffer (vLLM 0.33's FlashAttention keeps its
        FA3 scheduler metadata so when it expects full CUDA graphs), where the next part's
        build would overwrite the last one's."""
        return _own_copy(super().build(0, common), self)  # type: ignore[misc]

    def blocks_per_slot(self, requests: RequestBook) -> int:
        return blocks_per_slot(requests.capacity, self.block_size)


def check_layers(served: Sequence[int], names: Sequence[str], full: bool) -> None:
    """Raise, naming them, where layers ``names`` that vLLM builds as attending over their
    whole context (``full``) or within a sliding window are not, or are, among ``served`` (the
    layers the model's config gives SFI, :func:`sfi.core.cost_model.slow_fast_layers`): the
    probes would be placed, and the reads counted, over layers that do not run SFI. A
    whole-context builder must also serve every one of ``served``: where vLLM splits them among
    several builders (KV cache or attention groups), each would plan the step again."""
    wrong = [name for name in names if (layer_index(name) in served) != full]
    if wrong:
        kind = "the whole context" if full else "a sliding window"
        raise RuntimeError(
            f"sfi.vllm: vLLM's KV cache spec gives {', '.join(wrong)} {kind}, where the "
            f"model's config gives SFI the layers {list(served)}; please report this model "
            "to sfi")
    missing = sorted(set(served) - {layer_index(name) for name in names}) if full else []
    if missing:
        raise RuntimeError(
            f"sfi.vllm: one of vLLM's attention metadata builders serves the whole-context "
            f"layers without layers {missing}, which the model's config also gives SFI: vLLM "
            "splits them among several builders (KV cache or attention groups), each of which "
            "would plan the step again, or does not build them as attention; this model cannot "
            "run SFI in vLLM yet: please report it to sfi")
