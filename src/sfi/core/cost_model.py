"""The model's side of the cost model: how much a decode step reads besides the KV.

``SFIConfig.sparse_pays`` decides per sequence whether fast steps pay; its ``min_gain`` rule
weighs the KV a fast step skips against everything a step reads, and at batch 1 that is mostly
the weights. :func:`weight_positions` counts them in KV positions, from the model's config, so
that sfi's engine and the vLLM plugin count the same number and decide alike; the shapes it
reads (:func:`text_config`, :func:`head_dim`, :func:`kv_elements_per_position`) serve the
benchmarks' byte counts too, and :func:`slow_fast_layers` says which layers a fast step's
reads are counted over.
"""

from __future__ import annotations

import math
from typing import Any

from sfi.core.pages import probe_page


def text_config(model_or_config: Any) -> Any:
    """The text part of a model's config (itself for text-only models)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_kinds(model_or_config: Any) -> list[str]:
    """Each layer's attention kind as the config names it (``full_attention``,
    ``sliding_attention``, ...): its ``layer_types``, or, where it has none, every layer alike,
    sliding where it sets a ``sliding_window`` (Mistral-style)."""
    cfg = text_config(model_or_config)
    uniform = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
    return list(getattr(cfg, "layer_types", None) or [uniform] * int(cfg.num_hidden_layers))


def slow_fast_layers(model_or_config: Any) -> tuple[int, ...]:
    """The model indices of the layers SFI serves: every full-attention layer, and a sliding
    one where the config gives no window; a sliding-window layer keeps the model's own
    attention. Both engines place their coverage probes and count a fast step's reads over
    these."""
    window = getattr(text_config(model_or_config), "sliding_window", None)
    return tuple(i for i, kind in enumerate(layer_kinds(model_or_config))
                 if kind == "full_attention" or (kind == "sliding_attention" and not window))


def head_dim(cfg: Any) -> int:
    """The width of one attention head of a (text) config."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def kv_elements_per_position(model_or_config: Any) -> int:
    """The numbers one cached position holds: keys and values of every layer and KV head."""
    cfg = text_config(model_or_config)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * int(cfg.num_hidden_layers) * int(kv_heads) * head_dim(cfg)


def weight_positions(model_or_config: Any) -> int:
    """W of ``SFIConfig.min_gain``: the weights one decode step reads, in KV positions of the
    same byte width (weight elements over the KV elements of one position: keys and values of
    every layer and KV head).

    Counted from the config of a decoder with gated MLPs (Llama, Qwen2/3, Mistral, Gemma): each
    layer's query, key, value and output projections and its gate, up and down projections (a
    mixture of experts counts the experts one token uses, and its shared expert), and the output
    layer; the input embedding is read one row per token, and norms and biases are left out.
    0 where the config lacks a field this count needs (the ``min_gain`` rule then weighs the KV
    alone).
    """
    cfg = text_config(model_or_config)
    try:
        hidden, layers = int(cfg.hidden_size), int(cfg.num_hidden_layers)
        heads, vocab = int(cfg.num_attention_heads), int(cfg.vocab_size)
        intermediate = int(cfg.intermediate_size)
    except (AttributeError, TypeError):
        return 0
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    width = head_dim(cfg)
    experts = getattr(cfg, "num_experts_per_tok", None)
    if experts:
        expert = getattr(cfg, "moe_intermediate_size", None) or intermediate
        shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
        intermediate = int(experts) * int(expert) + int(shared)
    attention = hidden * width * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    return (layers * (attention + mlp) + vocab * hidden) // kv_elements_per_position(cfg)


def dense_reason(config: Any, weight_positions: int = 0) -> str:
    """Why a sequence decoded with ``config`` (an :class:`~sfi.core.config.SFIConfig`) takes dense
    steps: the context from which sparse reads pay (``SFIConfig.sparse_from``) and the rule
    that sets it, in one sentence for ``DecodeStats.dense_reason`` and the logged notice."""
    start = config.sparse_from(weight_positions)
    rule = ("a fast step must skip min_skip entries and read min_gain times fewer bytes, "
            "weights included" if config.min_skip or config.min_gain > 1.0
            else "S + K + R must leave part of the context unread")
    if start is None:
        return (f"sparse decoding never pays with this budget ({rule}): every step is dense; "
                "lower k_fraction or k_head")
    return (f"the context is shorter than {start:,} tokens, where sparse decoding starts to pay "
            f"for this model and budget ({rule}); force_sparse (--force-sparse) decodes sparsely "
            "anyway")


def probe_reads(config: Any, context: int) -> float:
    """The KV entries (a key and a value of one position) one probe layer reads per KV head of
    a row of ``context`` tokens: the summaries of every page (two vectors a page, one entry;
    the transformers path scores those before the recent window, R / P fewer),
    and the keys of the pages it reads (``coverage_top``, one more with ``coverage_next``;
    keys alone, half an entry a position). ``coverage_copy`` reads nothing more."""
    page = probe_page(config)
    read_pages = config.coverage_top + bool(config.coverage_next)
    return math.ceil(context / page) + read_pages * page / 2
