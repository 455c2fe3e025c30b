"""Teacher-forced fidelity to full attention.

A long real text is the context; its next tokens are fed one by one through each method's
decoding (so sentence triggers fire on the real tokens), and every step's next-token
distribution is compared with full attention's: KL(full || method), top-1 agreement, and the
perplexity of the real continuation under each. The context is prefilled once and shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sfi.core.config import SFIConfig
from sfi.core.scorers import Scorer
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import SharedPrefill
from sfi.errors import SFIError
from sfi.hf.decode_cache import DecodeCache, FullCache
from sfi.hf.methods import build_cache

MethodSpec = SFIConfig | tuple[SFIConfig, Scorer] | Callable[[], Any]


@dataclass
class FidelityResult:
    """One method's agreement with full attention over a teacher-forced continuation."""

    method: str
    context: int
    tokens: int
    kl_mean: float
    kl_max: float
    top1: float
    ppl: float
    ppl_full: float
    retention: float
    fast_retention: float | None = None
    slow_steps: list[int] = field(default_factory=list)
    refresh_reasons: dict[str, int] = field(default_factory=dict)  # refreshes by cause
    kl_per_step: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def teacher_forced_logits(model: torch.nn.Module, cache: DecodeCache, prefix: SharedPrefill,
                          ids: torch.Tensor, context: int, window: int
                          ) -> tuple[torch.Tensor, list[int]]:
    """``[N, V]`` logits predicting ``ids[context : context + N]``, and the slow steps."""
    prefix.load(cache)
    device = ids.device
    steps = ids.shape[1] - context
    logits = [prefill(model, cache, ids[:, context - window: context], start=context - window)]
    slow = []
    for step in range(1, steps):
        token = ids[0, context + step - 1: context + step]
        position = torch.tensor([context + step - 1], device=device)
        logits.append(decode_one(model, cache, token, position))
        if "slow" in cache.step_kinds():
            slow.append(step)
    return torch.cat(logits).float(), slow


def teacher_forced_fidelity(model: torch.nn.Module, ids: torch.Tensor, context: int,
                            methods: dict[str, MethodSpec], tokenizer: Any = None,
                            window: int = 16, prefix: SharedPrefill | None = None
                            ) -> list[FidelityResult]:
    """Compare each method with full attention.

    Args:
        model: a routed causal LM (``sfi.load``).
        ids: ``[1, context + N]`` real token ids: the context, then the continuation.
        context: how many of ``ids`` are context.
        methods: name -> SFIConfig, (SFIConfig, scorer) for an ablation of the Selector, or a
            function returning a fresh cache (a :class:`~sfi.hf.decode_cache.DecodeCache`: any
            method of ``sfi.hf.methods``).
        window: the last context tokens run as one forward after the shared prefill (SFI's first
            selection sees their queries, as after a normal prefill).
        prefix: the shared prefill of ``ids[:, : context - window]``, when the caller has it.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise SFIError("ids must be one sequence, shaped [1, context + continuation]")
    steps = ids.shape[1] - context
    if steps < 1 or context <= window:
        raise SFIError(f"need a context longer than {window} tokens and a continuation; got "
                       f"context {context} of {ids.shape[1]} tokens")
    if prefix is None:
        prefix = SharedPrefill(model, ids[:, : context - window])
    target = ids[0, context:]
    full, _ = teacher_forced_logits(model, FullCache(config=model.config), prefix, ids,
                                     context, window)
    log_full = F.log_softmax(full, dim=-1)
    ppl_full = perplexity(log_full, target)
    results = []
    for name, method in methods.items():
        cache = _build(model, method, tokenizer)
        logits, slow = teacher_forced_logits(model, cache, prefix, ids, context, window)
        log_method = F.log_softmax(logits, dim=-1)
        kl, top1 = agreement(log_full, log_method)
        read, fast_read = cache.read_fraction()
        results.append(FidelityResult(
            method=name, context=context, tokens=steps, kl_mean=float(kl.mean()),
            kl_max=float(kl.max()), top1=top1, ppl=perplexity(log_method, target),
            ppl_full=ppl_full, retention=read, fast_retention=fast_read, slow_steps=slow,
            refresh_reasons=dict(cache.stats().refresh_reasons),
            kl_per_step=[round(float(v), 6) for v in kl]))
    return results


def agreement(reference: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(KL(reference || got) [N], top-1 agreement)`` of two ``[N, V]`` log-probabilities."""
    kl = (reference.exp() * (reference - got)).sum(dim=-1)
    return kl, float((reference.argmax(-1) == got.argmax(-1)).float().mean())


def perplexity(log_probs: torch.Tensor, target: torch.Tensor) -> float:
    """Perplexity of ``target [N]`` under ``log_probs [N, V]``."""
    return float(torch.exp(-log_probs[torch.arange(target.shape[0]), target].mean()))


def _build(model: torch.nn.Module, method: MethodSpec, tokenizer: Any) -> DecodeCache:
    if isinstance(method, SFIConfig):
        return build_cache(model, tokenizer, "sfi", config=method)
    if isinstance(method, tuple):
        config, scorer = method
        return build_cache(model, tokenizer, "sfi", config=config, scorer=scorer)
    return method()


@dataclass
class WeightFidelity:
    """Teacher-forced agreement of a weight format with the native weights (full attention)."""

    weights: str
    tokens: int
    kl_mean: float
    kl_max: float
    top1: float
    ppl: float
    ppl_native: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def next_token_log_probs(model: torch.nn.Module, ids: torch.Tensor, chunk: int | None = None
                         ) -> torch.Tensor:
    """``[N - 1, V]`` float32 log-probabilities of ``ids [1, N]``'s tokens 1..N-1, each from
    the real tokens before it (full attention: teacher forcing). One forward, or with
    ``chunk`` forwards of that many tokens over a cache of the ones before: each linear layer
    then multiplies ``chunk`` rows at a time, as a decode step does (the narrow weight formats
    take another product for a few rows than for many: ``sfi.weights.reduction``)."""
    if chunk is None:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        return F.log_softmax(logits.float(), dim=-1)
    from transformers import DynamicCache

    from sfi.hf.facts import cache_argument

    cache = {cache_argument(model): DynamicCache(config=model.config)}
    parts = [model(input_ids=ids[:, start: start + chunk], use_cache=True, **cache).logits[0]
             for start in range(0, ids.shape[1], chunk)]
    return F.log_softmax(torch.cat(parts)[:-1].float(), dim=-1)


def weight_fidelity(name: str, native: torch.Tensor, model: torch.nn.Module,
                    ids: torch.Tensor) -> WeightFidelity:
    """Compare ``model`` (the network in weight format ``name``) with ``native [N - 1, V]``
    (:func:`next_token_log_probs` of the native weights) on the same ``ids [1, N]``:
    KL(native || format) per position, top-1 agreement, and both perplexities. The format's
    side runs :data:`sfi.weights.reduction.REDUCE_ROWS` tokens a forward, so that its products are
    the ones its decode steps take."""
    from sfi.weights.reduction import REDUCE_ROWS

    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] != native.shape[0] + 1:
        raise SFIError("ids must be the [1, N] sequence the native log-probabilities came from")
    got = next_token_log_probs(model, ids, chunk=REDUCE_ROWS)
    kl, top1 = agreement(native, got)
    target = ids[0, 1:]
    return WeightFidelity(
        weights=name, tokens=int(target.shape[0]), kl_mean=float(kl.mean()),
        kl_max=float(kl.max()), top1=top1, ppl=perplexity(got, target),
        ppl_native=perplexity(native, target))
