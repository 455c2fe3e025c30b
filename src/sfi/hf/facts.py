"""What sfi reads off a transformers model: the keyword its forward takes the cache by, its
context window, its end-of-sequence ids, and whether its attention can be routed through sfi."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from sfi.core.cost_model import text_config
from sfi.errors import UnsupportedModelError


@functools.lru_cache(maxsize=64)
def _cache_keyword(model_type: type) -> str:
    parameters = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by (``cache`` from transformers 5.24 on)."""
    return _cache_keyword(type(model))


def context_length(model: torch.nn.Module) -> int | None:
    """The model's context window in tokens, when its config says."""
    return getattr(text_config(model), "max_position_embeddings", None)


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id the generation config, the model config or the tokenizer
    names."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def check_routable(model: torch.nn.Module) -> None:
    """Raise unless ``model`` routes its attention through transformers' AttentionInterface."""
    can_route = getattr(model, "_can_set_attn_implementation", None)
    routable = can_route() if callable(can_route) else getattr(
        model, "_supports_attention_backend", False)
    if getattr(model, "config", None) is None or not routable:
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route its attention through transformers' "
            "AttentionInterface, so sfi cannot make its decode steps sparse")
