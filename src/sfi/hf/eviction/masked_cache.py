"""The masked cache that runs every eviction baseline (``sfi.hf.eviction.layer`` does the work).

Tokens a policy drops are never attended again, exactly as if they had been evicted; the KV
stays in memory, since these runs measure quality, not speed.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from sfi.core.cost_model import text_config
from sfi.core.decode_stats import DecodeStats
from sfi.errors import SFIError, UnsupportedModelError
from sfi.hf.attention import WritesInAttention
from sfi.hf.context import StepContext
from sfi.hf.eviction.layer import EvictionLayer, EvictionStep, Observer, Policy
from sfi.hf.facts import cache_argument
from sfi.hf.routing import RoutingLease

KV = list[tuple[torch.Tensor, torch.Tensor]]
MASKED = "masked"  # the kind of an eviction cache's decode step: it reads its kept entries


class EvictionCache(WritesInAttention, Cache):
    """A transformers ``Cache`` that decodes like an eviction baseline (quality, not speed).

    Args:
        model: a causal LM whose layers are all full attention (Llama, Qwen2, Qwen3, ...).
        policy: the baseline's rule (see :mod:`sfi.hf.eviction.policies`); None attends to the whole
            cache (full attention, e.g. to record attention history or to observe a run).
        track_attention: accumulate every query's attention per key (defaults to what the
            policy needs).
        observer: called with ``(layer, attention [B, H, G, T])`` after every decode step of
            every layer (for analyses).
    """

    compresses_after_prefill = True  # each prefill forward ends in the policy's eviction

    def __init__(self, model: torch.nn.Module, policy: Policy | None = None,
                 track_attention: bool | None = None, observer: Observer | None = None):
        config = text_config(model)
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(config, "sliding_window", None):
            raise UnsupportedModelError("the eviction baselines support models whose layers are "
                                        "all full attention")
        self._routing = RoutingLease(self, model)
        self.policy = policy
        self.track_attention = (track_attention if track_attention is not None
                                else bool(getattr(policy, "tracks_attention", False)))
        self.observer = observer
        self.num_layers = config.num_hidden_layers
        self._reads: list[float] = []
        self._kinds: tuple[str, ...] = ()
        super().__init__(layers=[EvictionLayer(i, self.num_layers, self.track_attention)
                                 for i in range(self.num_layers)])

    # --- the routing hook's interface ----------------------------------------------------------
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      batch_size: int, query_length: int, device: torch.device) -> StepContext:
        decode = query_length == 1 and self.get_seq_length() > 0
        step = EvictionStep(self.policy, decode, self.observer, self._reads)
        return StepContext(layers=self.layers, plan=step)

    def end_forward(self, step: StepContext, logits: torch.Tensor | None = None) -> None:
        batch = self.layers[0].keys.shape[0]
        self._kinds = ((MASKED if step.plan.decode else "dense"),) * batch

    # --- the protocol every cache of a comparison implements (sfi.hf.decode_cache.DecodeCache) --
    def load_prefix(self, prefix: KV, history: list[torch.Tensor] | None = None,
                    attention_mask: torch.Tensor | None = None) -> None:
        """Fill an empty cache with a shared prefill's KV (copied) and, when this cache tracks
        attention, that prefill's accumulated attention per layer ``[B, H, T]``."""
        if self.get_seq_length() != 0:
            raise SFIError("load_prefix needs an empty EvictionCache")
        if self.track_attention and history is None:
            raise SFIError("this policy needs the prefill's attention history; compute it with "
                           "sfi.hf.eviction.masked_cache.prefill_with_history")
        for idx, (layer, (k, v)) in enumerate(zip(self.layers, prefix)):
            layer.update(k.clone(), v.clone())
            if self.track_attention:
                layer.history = history[idx].clone()

    def step_kinds(self) -> tuple[str, ...]:
        """``masked`` after a decode step (it read the entries the policy keeps)."""
        return self._kinds

    def stats(self, row: int | None = None) -> DecodeStats:
        return DecodeStats()

    def read_fraction(self) -> tuple[float, float | None]:
        """Mean fraction of the cache attended per decode step (over layers and heads)."""
        return self.retention(), None

    def retention(self) -> float:
        return sum(self._reads) / len(self._reads) if self._reads else 1.0

    def close(self) -> None:
        self._routing.release()


@torch.inference_mode()
def prefill_with_history(model: torch.nn.Module, ids: torch.Tensor
                         ) -> tuple[KV, list[torch.Tensor]]:
    """Prefill ``ids [B, T]`` with full attention; return each layer's KV and the attention its
    keys received, summed over every prompt query and query head (H2O's prompt scores)."""
    cache = EvictionCache(model, policy=None, track_attention=True)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    history = [layer.history for layer in cache.layers]
    cache.close()
    return kv, history
