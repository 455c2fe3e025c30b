"""A compiled fast step's attention traced into the step's graph (gpt-fast's shape).

In a compiled decode step (:mod:`sfi.compiled`) each layer's attention is, by default, one
opaque operator that carries out the step's plan eagerly (:func:`sfi.attention.attention_step`):
any plan, any step, one graph, but a few hundred microseconds of Python per layer. Most steps
are plain fast steps, though: every row fast, nothing rebuilding. For those,
:func:`traced_step` freezes before the forward what such a step reads, as tensors of fixed
shapes (:class:`TracedFast`: per layer the reserved KV and the compact buffer, for the step the
compact slots' bias and the recent window's positions and bias), and the compiled forward gets
it as the keyword argument ``sfi_fast``, which transformers hands to every attention call. The
attention of those layers (:func:`fast_attention_traced`) is then part of the graph: the new
position is stored by one small operator (:func:`append_position`: the layer's own
``update``), the recent window is gathered from the reserved KV at fixed positions (past its
end masked), and one softmax runs over the compact buffer, the window and the new position,
fused by inductor with the rest of the layer; a probe layer then hands its queries and their
log-sum-exp to another small operator (:func:`probe_fast`: the layer's own probes). Layers that
read densely in the step (``dense_layers``) keep the attention operator. A step that is not a
plain fast step (a slow step, a lagging rebuild, a verify) runs without ``sfi_fast``: a second
graph, compiled once.

Shapes: B sequences, H KV heads, G query heads per KV head, D head size, C compact slots,
L the recent window's fixed width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sfi.context import current_step
from sfi.kernels import additive_bias, attention_logits

if TYPE_CHECKING:
    from sfi.plan import StepPlan

#: the keyword argument a compiled forward passes a :class:`TracedFast` by
TRACED_FAST = "sfi_fast"

#: a recent window's fixed width is rounded up to a multiple of this many positions
WINDOW_STEP = 128


def window_width(recent: int, refresh_interval: int) -> int:
    """The fixed width of a traced step's recent window: what the window can grow to before
    the reuse budget refreshes the memory (R + the refresh interval), rounded up to
    :data:`WINDOW_STEP`, so that one graph serves every plain fast step."""
    return -(-(recent + refresh_interval) // WINDOW_STEP) * WINDOW_STEP


@dataclass(frozen=True)
class TracedFast:
    """What a plain fast step's traced attention reads, fixed before the forward.

    Attributes:
        keys, values: per model layer, its reserved KV ``[B, H, capacity, D]`` (positions
            from the cache's length on unwritten), or None where the layer keeps the operator.
        compact_keys, compact_values: per model layer, ``[B, H, C, D]`` (None likewise).
        compact_bias: ``[B, 1, 1, C]``, -inf on the slots a row does not use.
        window: ``[L]`` the cache positions of the recent window read before the new one
            (clamped into the written part).
        window_bias: ``[B, 1, 1, L]``, -inf on positions past the written part or before a
            row's own recent window.
        probed: the traced layers that also run coverage probes (through
            :func:`probe_fast`, after their attention).
    """

    keys: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor | None, ...]
    compact_keys: tuple[torch.Tensor | None, ...]
    compact_values: tuple[torch.Tensor | None, ...]
    compact_bias: torch.Tensor
    window: torch.Tensor
    window_bias: torch.Tensor
    probed: frozenset[int] = frozenset()

    def traces(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s attention is traced in this step."""
        return 0 <= layer_idx < len(self.keys) and self.keys[layer_idx] is not None


def traced_step(plan: StepPlan, attention: Sequence[Any], width: int) -> TracedFast | None:
    """The :class:`TracedFast` of ``plan``, or None unless it is a plain fast step: one query
    per row, every row fast, no redo or exact-mode phase, no rebuild pending in any layer, a
    recent window of at most ``width`` positions before the new one (:func:`window_width`), a
    layer left to trace. ``attention``: the cache's attending layers by model layer
    (``SlowFastAttention`` or None); a layer that reads densely in this step keeps the
    operator. Reserves the new position's room in the traced layers' storage."""
    fast = plan.fast
    if (fast is None or plan.query_length != 1 or plan.phase is not None
            or plan.redo is not None or plan.slow is not None or len(plan.dense)
            or len(fast.rows) != len(plan.kinds)):
        return None
    layers = [a for a in attention if a is not None]
    if not layers or any(a.pending is not None for a in layers):
        return None
    past = plan.total_length - 1  # positions written before this step's
    read = past - fast.read_start
    if read > width:
        return None
    device = fast.compact_bias.device
    positions = fast.read_start + torch.arange(width, device=device)
    allowed = (positions < past)[None, :]
    if fast.recent_bias is not None:  # rows whose own window starts later
        own = fast.recent_bias[:, 0, 0, :read] == 0
        allowed = allowed & torch.nn.functional.pad(own, (0, width - read))
    window_bias = additive_bias(allowed.expand(len(plan.kinds), -1))[:, None, None, :]
    traced = [a if a is not None and not plan.dense_at(a.layer_idx) else None
              for a in attention]
    if all(a is None for a in traced):
        return None
    kv, compact = [], []
    for a in traced:
        if a is None:
            kv.append((None, None))
            compact.append((None, None))
            continue
        store = a.store
        store.reserve_positions(past + 1)  # the new position's room, before the graph reads
        store.ensure_compact(plan.compact_width)
        kv.append(store.reserved_kv())
        compact.append((store.compact_keys[:, :, : plan.compact_width],
                        store.compact_values[:, :, : plan.compact_width]))
    return TracedFast(keys=tuple(k for k, _ in kv), values=tuple(v for _, v in kv),
                      compact_keys=tuple(k for k, _ in compact),
                      compact_values=tuple(v for _, v in compact),
                      compact_bias=fast.compact_bias,
                      window=positions.clamp(max=max(past - 1, 0)), window_bias=window_bias,
                      probed=frozenset(p.layer for p in plan.probes))


@torch.library.custom_op("sfi::append_position", mutates_args=())
def append_position(key: torch.Tensor, value: torch.Tensor, layer_idx: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Store a traced layer's new position ``key``/``value`` ``[B, H, 1, D]`` through the layer's
    own ``update`` (its key norm included) and return copies of them, which the traced
    attention reads: the graph then runs this before the attention and never drops it. Not
    pure: it writes the cache."""
    layer = current_step().layer(layer_idx)
    layer.update(key, value)
    return key.clone(), value.clone()


@append_position.register_fake
def _append_position_shape(key: torch.Tensor, value: torch.Tensor, layer_idx: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(key), torch.empty_like(value)


@torch.library.custom_op("sfi::probe_fast", mutates_args=())
def probe_fast(out: torch.Tensor, query: torch.Tensor, lse: torch.Tensor, layer_idx: int,
               scale: float) -> torch.Tensor:
    """Run a traced layer's coverage probes (``SlowFastAttention.probe``) for its grouped
    queries ``query [B, H, G, D]`` and their memory log-sum-exp ``lse [B, H, G]``, and return a
    copy of the layer's attention output ``out``, which the graph goes on with: it runs this
    after the attention and never drops it. The probes keep their query until the step ends,
    so they get copies (the graph reuses its buffers)."""
    step = current_step()
    step.layer(layer_idx).probe(step, query.clone(), lse.clone(), scale)
    return out.clone()


@probe_fast.register_fake
def _probe_fast_shape(out: torch.Tensor, query: torch.Tensor, lse: torch.Tensor,
                      layer_idx: int, scale: float) -> torch.Tensor:
    return torch.empty_like(out)


def fast_attention_traced(fast: TracedFast, layer_idx: int, query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, scale: float
                          ) -> torch.Tensor:
    """A plain fast step's attention at one layer, traced: ``query [B, Hq, 1, D]`` (RoPE
    applied), ``key``/``value`` ``[B, H, 1, D]`` the new position's -> ``[B, 1, Hq, D]``.

    One softmax over the compact buffer, the recent window before the new position (gathered
    at ``fast.window``) and the new position itself: what
    :func:`sfi.kernels.fast_attention` computes over the compact buffer and the window read in
    place, in another order of its terms."""
    key, value = append_position(key, value, layer_idx)
    b, hq, _, d = query.shape
    h = key.shape[1]
    q = query.reshape(b, h, hq // h, d)
    window_keys = fast.keys[layer_idx].index_select(2, fast.window)
    window_values = fast.values[layer_idx].index_select(2, fast.window)
    compact = attention_logits(q, fast.compact_keys[layer_idx], scale, None) + fast.compact_bias
    window = attention_logits(q, window_keys, scale, None) + fast.window_bias
    own = attention_logits(q, key, scale, None)
    logits = torch.cat([compact, window, own], dim=-1)
    p = torch.softmax(logits, dim=-1).to(value.dtype)
    c, w = compact.shape[-1], window.shape[-1]
    out = (torch.matmul(p[..., :c], fast.compact_values[layer_idx])
           + torch.matmul(p[..., c: c + w], window_values) + p[..., c + w:] * value)
    if layer_idx in fast.probed:
        out = probe_fast(out, q, torch.logsumexp(logits, dim=-1), layer_idx, scale)
    return out.reshape(b, 1, hq, -1)
