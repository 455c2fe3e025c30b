"""The compiled decode step: a model's one-token forwards compiled with inductor.

:func:`compile_decode` gives a model a forward that runs every one-token step (``input_ids
[B, 1]``) through ``torch.compile`` and everything else (prefill chunks, exact mode's verify
of several positions) eagerly. A step is one graph, gpt-fast's shape: the model's own work
(embeddings, norms, RoPE, the linear layers, the MLP, residuals, the output layer) fused into
inductor's kernels, and each layer's attention one opaque operator
(:func:`sfi.hf.attention.attention_step`) that carries out what sfi planned for the step (dense,
slow and fast rows, refreshes, probes) eagerly, so a fast step and a slow step share one graph
and no step recompiles. The slow-fast cache leaves its write to that operator; transformers'
caches (``full``, ``full-static``) are traced as they are and attended by the same operator
with PyTorch's SDPA kernel: the dense baseline compiled the same way. A compiled model stays
routed through sfi's attention (:func:`sfi.hf.routing.routed`) for that.

inductor keeps what it builds on disk under sfi's cache folder (``<cache>/inductor``, unless
``TORCHINDUCTOR_CACHE_DIR`` is set), so a second process spends its first step on dynamo's
trace alone (about 8 s for SmolLM2) instead of the whole build (30-45 s).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sfi.cache_folder import use_sfi_inductor_cache
from sfi.hf.routing import RoutingLease

#: dynamo settings the compiled step runs under (only there: the user's own compiles keep
#: theirs): room for more variants per function than the default 8, because transformers
#: decorates many forwards with one wrapper (one code object, one count) and each cache type
#: and attention implementation a model meets is a variant
DYNAMO_SETTINGS = {"recompile_limit": 256,
                   "cache_size_limit": 256, "accumulated_recompile_limit": 4096,
                   "accumulated_cache_size_limit": 4096}
#: (``cache_size_limit`` is ``recompile_limit``'s name before PyTorch 2.7; a setting the
#: installed PyTorch lacks is left out)


class CompiledDecode:
    """A model's forward with its one-token steps compiled (see the module).

    ``compile_seconds`` adds up the wall time of the steps that built a graph (dynamo's trace,
    inductor's code generation or its cache read, and the step itself); ``compiled_steps`` and
    ``eager_calls`` count the forwards each way.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        use_sfi_inductor_cache()
        self.routing = RoutingLease(self, model)
        self.eager = model.forward
        self.compiled = torch.compile(self.eager, dynamic=None)
        self.settings = {name: value for name, value in DYNAMO_SETTINGS.items()
                         if hasattr(torch._dynamo.config, name)}
        self.compile_seconds = 0.0
        self.compiled_steps = 0
        self.eager_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        frames = _compiled_frames()
        begin = time.perf_counter()
        with torch._dynamo.config.patch(**self.settings):
            out = self.compiled(*args, **kwargs)
        if _compiled_frames() != frames:
            self.compile_seconds += time.perf_counter() - begin
        self.compiled_steps += 1
        return out


def _compiled_frames() -> int:
    """Frames dynamo has compiled in this process (its own counter)."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def compile_decode(model: torch.nn.Module) -> CompiledDecode:
    """Give ``model`` a forward whose one-token steps are compiled (idempotent); returns it.
    :func:`eager_decode` takes it back."""
    current = compiled_forward(model)
    if current is not None:
        return current
    compiled = CompiledDecode(model)
    model.forward = compiled
    return compiled


def eager_decode(model: torch.nn.Module) -> None:
    """Undo :func:`compile_decode` (nothing when the model has no compiled forward)."""
    current = compiled_forward(model)
    if current is not None:
        del model.forward
        current.routing.release()


def compiled_forward(model: torch.nn.Module) -> CompiledDecode | None:
    """The model's :class:`CompiledDecode`, or None when its steps run eagerly."""
    current = model.__dict__.get("forward")
    return current if isinstance(current, CompiledDecode) else None
