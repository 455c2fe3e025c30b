"""The transformers adapter: :class:`~sfi.hf.slowfast_cache.SlowFastCache` (a transformers
``Cache``), its per-layer storage and attention, the batch planner, the attention function
registered with transformers, the routing of a model through it, and the comparison caches
(full attention and the eviction baselines)."""
