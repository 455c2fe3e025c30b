"""A prompt's KV computed once and continued by several caches (benchmarks, evaluations)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from sfi.core.cost_model import head_dim, text_config
from sfi.decoding.prefill import PREFILL_CHUNK, prefill
from sfi.hf.decode_cache import KV, DecodeCache, FullCache
from sfi.hf.eviction.masked_cache import prefill_with_history


@torch.inference_mode()
def prefix_kv(model: torch.nn.Module, ids: torch.Tensor, synthetic: bool,
              on_progress: Callable[[int, int], None] | None = None) -> KV:
    """KV of ``ids [B, T]`` for every layer: a real prefill (in chunks reported to
    ``on_progress(done, total)`` when given), or random tensors of the right shape."""
    cfg = text_config(model)
    if synthetic:
        param = next(model.parameters())
        shape = (ids.shape[0], cfg.num_key_value_heads, ids.shape[1], head_dim(cfg))
        gen = torch.Generator(device=param.device).manual_seed(0)
        return [(torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype),
                 torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype))
                for _ in range(cfg.num_hidden_layers)]
    cache = FullCache(config=model.config)
    chunk = PREFILL_CHUNK if on_progress is not None else None
    prefill(model, cache, ids, chunk=chunk, on_progress=on_progress)
    return [(layer.keys, layer.values) for layer in cache.layers]


class SharedPrefill:
    """One real prefill of ``ids [B, T]`` (one prompt, or ``sfi bench``'s batch of B),
    continued by any number of caches.

    With ``history`` it also keeps, per layer, the attention each key received from every
    prompt query ``[1, H, T]`` (what H2O's eviction starts from); that costs a second pass of
    query-key products over the prompt, so ask for it only when a method needs it.

    ``on_progress(done, total)`` hears of each chunk of the prefill (without ``history``).

    With ``store`` (a folder) the prefill is kept on disk, keyed by the model and the token ids,
    and read back instead of recomputed the next time (an 8K prefill of Qwen2.5-0.5B takes
    minutes on a CPU and about a second to read).
    """

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, history: bool = False,
                 store: Path | None = None,
                 on_progress: Callable[[int, int], None] | None = None):
        self.length = ids.shape[1]
        self.history: list[torch.Tensor] | None = None
        path = None if store is None else Path(store) / f"{prefill_key(model, ids)}.pt"
        if path is not None and path.exists():
            saved = torch.load(path, map_location=ids.device, weights_only=True)
            if saved.get("history") is not None or not history:
                self.kv = [tuple(pair) for pair in saved["kv"]]
                self.history = saved.get("history") if history else None
                return
        if history:
            self.kv, self.history = prefill_with_history(model, ids)
        else:
            self.kv = prefix_kv(model, ids, synthetic=False, on_progress=on_progress)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            torch.save({"kv": [list(pair) for pair in self.kv], "history": self.history},
                       partial)
            partial.replace(path)

    def load(self, cache: DecodeCache) -> None:
        """Fill the empty ``cache`` with a copy of this prefill."""
        cache.load_prefix(self.kv, self.history)


def prefill_key(model: torch.nn.Module, ids: torch.Tensor) -> str:
    """A name for the prefill of ``ids`` by ``model``: its source, its tensors' sizes and
    dtypes (buffers too: int8 and packed layers keep their weights there, so two weight
    formats of one model differ) and the ids."""
    tensors = [*model.parameters(), *model.buffers()]
    sizes = sum(t.numel() for t in tensors)
    dtypes = ",".join(sorted({str(t.dtype) for t in tensors}))
    identity = (f"{getattr(model.config, '_name_or_path', '')}|{type(model).__name__}|"
                f"{sizes}|{dtypes}|")
    digest = hashlib.sha256(identity.encode())
    digest.update(ids.detach().cpu().to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:32]
