"""Eviction baselines: a cache whose decode steps attend under a per-head keep mask that a
policy (StreamingLLM, SnapKV, PyramidKV, H2O, TOVA, Quest) sets once after prefill or at every
step. Tokens a policy drops are never attended again, exactly as if they had been evicted; the
KV stays in memory, since these runs measure quality, not speed."""

from sfi.hf.eviction.layer import EvictionLayer
from sfi.hf.eviction.masked_cache import EvictionCache
from sfi.hf.eviction.policies import POLICIES, EvictionPolicy, make_policy

__all__ = ["POLICIES", "EvictionCache", "EvictionLayer", "EvictionPolicy", "make_policy"]
