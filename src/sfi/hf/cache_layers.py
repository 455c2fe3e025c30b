"""What a :class:`sfi.SlowFastCache` is made of for a model: its storage layers (a
:class:`~sfi.hf.slab.SlabLayer` per full-attention layer, transformers' own sliding-window layer
otherwise), the :class:`~sfi.hf.layer_attention.SlowFastAttention` beside each slab, and the
tokenizer its sentence triggers read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from sfi.core.cost_model import layer_kinds, slow_fast_layers, text_config
from sfi.errors import SFIError, UnsupportedModelError
from sfi.hf.layer_attention import SlowFastAttention
from sfi.hf.slab import SlabLayer


def resolve_tokenizer(model: torch.nn.Module, tokenizer: Any) -> Any:
    """The tokenizer whose sentence enders the triggers read: ``tokenizer``, the one
    ``sfi.load`` attached to ``model``, or the one in the model's folder."""
    if tokenizer is not None:
        return tokenizer
    attached = getattr(model, "sfi_tokenizer", None)
    if attached is not None:
        return attached
    from transformers import AutoTokenizer

    source = getattr(model.config, "_name_or_path", "") or ""
    if source and Path(source).is_dir():
        return AutoTokenizer.from_pretrained(source)
    raise SFIError("sentence triggers need the tokenizer: pass SlowFastCache(model, config, "
                   "tokenizer=tok), load the model with sfi.load, "
                   "or use SFIConfig(trigger='fixed')")


def attention_of(layers: Sequence[CacheLayerMixin]) -> list[SlowFastAttention | None]:
    """What attends each layer: a :class:`SlowFastAttention` for each slab layer, None for a
    sliding-window layer (the model's own attention)."""
    return [SlowFastAttention(layer) if isinstance(layer, SlabLayer) else None
            for layer in layers]


def build_layers(model: torch.nn.Module, capacity: int) -> list[CacheLayerMixin]:
    """One SlabLayer per full-attention layer; sliding-window layers keep their window."""
    window = getattr(text_config(model), "sliding_window", None)
    served = set(slow_fast_layers(model))
    layers: list[CacheLayerMixin] = []
    for idx, kind in enumerate(layer_kinds(model)):
        if idx in served:
            layers.append(SlabLayer(idx, capacity))
        elif kind == "sliding_attention":
            layers.append(DynamicSlidingWindowLayer(sliding_window=window))
        else:
            raise UnsupportedModelError(
                f"layer {idx} of this model is of type {kind!r}; sfi handles attention layers "
                "(full or sliding window) only")
    return layers
