"""Routing a transformers model through sfi for a scope: its attention and the two forward hooks.

:func:`routed` (a context manager, reference-counted per model) sets the model's attention
implementation to ``"sfi"`` and installs two forward hooks; leaving the last scope restores the
implementation the model had and removes the hooks. Before each forward the pre-hook asks the
cache passed to the model (if it takes part: ``begin_forward``) for a
:class:`~sfi.hf.context.StepContext` and makes it current; after the forward (even one that
raised) the post-hook leaves it and tells the cache the step ran (``end_forward``); where the
cache answers that the step must run again (``SFIConfig.coverage_retry``, ``retry_margin``,
``stop_margin``: it is given the output's logits), the hook runs the same forward once more
and returns its output instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sfi.hf.attention import ATTENTION_NAME, register_attention
from sfi.hf.context import enter_step, leave_step
from sfi.hf.facts import check_routable

_LOCK = threading.Lock()


@dataclass
class _Routing:
    """How one model is routed: by how many scopes, from which implementation, which hooks."""

    previous: str | None
    handles: list[Any]
    users: int = 0
    local: threading.local = field(default_factory=threading.local)

    @property
    def open_steps(self) -> list[tuple[Any, Any, Any] | None]:
        """This thread's forwards in progress (two threads may run the same model)."""
        steps = getattr(self.local, "steps", None)
        if steps is None:
            steps = self.local.steps = []
        return steps


def _begin(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    routing: _Routing = model._sfi_routing
    routing.open_steps.append(None)  # paired with this forward's _end, even if planning raises
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    begin = getattr(cache, "begin_forward", None)
    step = None
    if begin is not None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        shaped = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if shaped is not None:
            step = begin(input_ids, kwargs.get("attention_mask"), shaped.shape[0],
                         shaped.shape[1], shaped.device)
    routing.open_steps[-1] = (enter_step(step), cache, step)


def _end(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    routing: _Routing | None = getattr(model, "_sfi_routing", None)
    if routing is None or not routing.open_steps:
        return
    entry = routing.open_steps.pop()
    if entry is None:
        return
    token, cache, step = entry
    leave_step(token)
    if step is not None and output is not None and cache.end_forward(
            step, getattr(output, "logits", None)):
        # the cache asks for the step again (coverage_retry, retry_margin, stop_margin)
        return model(*args, **kwargs)
    return None


def _enter(model: torch.nn.Module) -> None:
    with _LOCK:
        routing: _Routing | None = getattr(model, "_sfi_routing", None)
        if routing is None:
            check_routable(model)
            register_attention()
            previous = getattr(model.config, "_attn_implementation", None)
            if previous != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)
            handles = [
                model.register_forward_pre_hook(_begin, with_kwargs=True),
                model.register_forward_hook(_end, with_kwargs=True, always_call=True),
            ]
            routing = _Routing(previous=previous, handles=handles)
            model._sfi_routing = routing
        routing.users += 1


def _leave(model: torch.nn.Module) -> None:
    with _LOCK:
        routing: _Routing | None = getattr(model, "_sfi_routing", None)
        if routing is None:
            return
        routing.users -= 1
        if routing.users > 0:
            return
        for handle in routing.handles:
            handle.remove()
        if routing.previous is not None and routing.previous != ATTENTION_NAME:
            model.set_attn_implementation(routing.previous)
        del model._sfi_routing


@contextlib.contextmanager
def routed(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Route ``model``'s attention through sfi inside the ``with`` block.

    Scopes nest (per model); leaving the outermost one restores the model's attention
    implementation and removes sfi's hooks. Inside, a model called with any other cache
    computes exactly what it computes outside (SDPA, or its eager function).
    """
    _enter(model)
    try:
        yield model
    finally:
        _leave(model)


class RoutingLease:
    """A routing scope held by an object (a cache) rather than a ``with`` block: released by
    :meth:`release`, or when the holder is garbage-collected."""

    def __init__(self, holder: Any, model: torch.nn.Module):
        import weakref

        _enter(model)
        self._finalizer = weakref.finalize(holder, _leave, model)

    def release(self) -> None:
        self._finalizer()

    @property
    def active(self) -> bool:
        return self._finalizer.alive
