"""Run tasks x contexts x methods x budgets on one model; one row per (sample, method, budget).

Each sample is prefilled once (all but its last ``window`` tokens) and every method continues
that prefill with a copy: it runs the last ``window`` prompt tokens as one forward (its own
first selection sees their queries, as after a normal prefill), then decodes greedily. A run
costs one prefill per sample plus short decodes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.decoding.decode import continue_greedy
from sfi.decoding.exact import ExactDecoder
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import SharedPrefill
from sfi.decoding.stopping import StopChecker
from sfi.errors import SFIError
from sfi.eval.fidelity import teacher_forced_fidelity
from sfi.eval.generation import GenerationScores, first_divergence, full_attention_scores
from sfi.eval.report import AS_CONFIGURED
from sfi.eval.tasks import (
    GENERATION_TASKS,
    LIST_TASKS,
    TASKS,
    Sample,
    found_in_order,
    make_sample,
    score,
)
from sfi.hf.decode_cache import DecodeCache
from sfi.hf.facts import eos_token_ids
from sfi.hf.methods import Method, budget_tokens, build_cache, parse_method
from sfi.hf.slowfast_cache import SlowFastCache

WINDOW = 32  # SnapKV's observation window; SFI's evidence is the last 16 of these queries
FIDELITY_TOKENS = 512


@dataclass
class EvalRow:
    """One method on one sample. ``context`` is the length asked for, ``prompt_tokens`` the
    sample's; ``budget`` is what was asked (fraction or tokens; 0: ``sfi@default``, SFI as
    configured), ``capacity`` the tokens per KV head it became (a fast step's S + K + R);
    ``retention`` is the measured mean fraction of the context read per decode step, what
    the coverage probes read included (``fast_retention``: over SFI's fast steps only; exact
    mode: 1.0, every token is verified by a dense read, and ``acceptance`` is the fraction of
    its drafts that full attention accepted)."""

    task: str
    context: int
    prompt_tokens: int
    method: str
    budget: float
    capacity: int
    retention: float
    score: float
    sample: int  # the sample's seed
    depth: float | None = None
    fast_retention: float | None = None
    slow_steps: int | None = None
    refresh_reasons: dict[str, int] | None = None  # SFI: refreshes by cause (nonzero ones)
    kl: float | None = None
    top1: float | None = None
    ppl: float | None = None
    ppl_full: float | None = None
    kl_per_step: list[float] | None = None
    slow_step_indices: list[int] | None = None
    acceptance: float | None = None
    items: list[bool] | None = None  # a list answer's items, each found in the asked order
    distinct: float | None = None  # generation: distinct 4-grams of the text (of full's: _full)
    distinct_full: float | None = None
    divergence: int | None = None  # generation: where the text first departs from full's
    output: str | None = None
    weights: str = "native"  # the linear layers' weight format (``sfi.load(weights=...)``)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@torch.inference_mode()
def greedy_continue(model: torch.nn.Module, cache: DecodeCache, shared: SharedPrefill | None,
                    ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Continue ``shared`` (a prefill of ``ids[:, :P]``) through ``cache``: run ``ids[:, P:]``
    as one forward, then greedy decoding until an end-of-sequence token or ``max_new_tokens``.
    Without ``shared`` the cache prefills the whole prompt itself."""
    start = 0
    if shared is not None:
        shared.load(cache)
        start = shared.length
    return continue_greedy(model, cache, ids, start, max_new_tokens, eos)


@torch.inference_mode()
def exact_continue(model: torch.nn.Module, cache: SlowFastCache, shared: SharedPrefill,
                   ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    """:func:`greedy_continue` in exact mode (``sfi.decoding.exact``): the same tokens as full
    attention's, fast steps drafting them and dense forwards verifying."""
    shared.load(cache)
    checker = StopChecker(None, eos, max_tokens=max_new_tokens)
    token = prefill(model, cache, ids[:, shared.length:], start=shared.length).argmax(-1)
    decoder = ExactDecoder(model, cache)
    position = torch.tensor([ids.shape[1] - 1], device=ids.device)
    if checker.push(int(token[0])):
        return checker.tokens
    for emitted in decoder.rounds(token, position, None,
                                  lambda: ([True], max_new_tokens - len(checker.tokens))):
        for value in emitted.rows()[0]:
            if checker.push(value):
                return checker.tokens
    raise AssertionError("unreachable: the rounds end only when the checker stops")


def parse_runs(methods: Sequence[str], budgets: Sequence[float]
               ) -> list[tuple[Method, float]]:
    """Every (method, budget) to run: ``name@budget`` pins a method's own budget, a bare name
    runs at each of ``budgets``; full attention runs once, at budget 1. ``sfi@default`` (or
    ``sfi:PRESET@default``) runs SFI as ``sfi.generate`` does, with no budget split: its
    config's K, recent window and cost model, dense steps included (budget
    :data:`AS_CONFIGURED`)."""
    runs: list[tuple[Method, float]] = []
    for item in methods:
        name, sep, pinned = item.partition("@")
        method = parse_method(name.strip())
        as_configured = bool(sep) and pinned.strip() == "default"
        if method.kind == "full":
            chosen = [1.0]
        elif as_configured:
            if method.kind != "sfi":
                raise SFIError(f"{item!r}: only SFI runs as configured; "
                               f"{method.name} needs a budget")
            chosen = [AS_CONFIGURED]
        elif sep:
            try:
                chosen = [float(pinned)]
            except ValueError:
                raise SFIError(f"{item!r}: the budget after '@' must be a number") from None
        else:
            chosen = list(budgets)
        if not as_configured:
            for b in chosen:  # a number given: refused unless positive (whole above 1)
                budget_tokens(b, 1)
        runs.extend((method, b) for b in chosen if (method, b) not in runs)
    if not runs:
        raise SFIError("no methods to evaluate")
    return runs


def _depth(task: str, sample: int, samples: int) -> float | None:
    """NIAH sweeps depth evenly over the samples (a heat-map axis); other tasks draw theirs."""
    if task != "niah":
        return None
    return 0.5 if samples == 1 else sample / (samples - 1)


def evaluate_sample(model: torch.nn.Module, tokenizer: Any, sample: Sample, index: int,
                    runs: list[tuple[Method, float]], window: int = WINDOW,
                    base: SFIConfig | None = None, store: Path | None = None,
                    overrides: dict[str, Any] | None = None) -> list[EvalRow]:
    """Every (method, budget) of ``runs`` on one sample, sharing its prefill; ``base`` holds
    the SFI knobs other than the budget and ``overrides`` fields set on top of it (or of a
    method's preset); ``store`` keeps prefills on disk across runs."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids], device=device)
    depth = sample.depths[0] if sample.task == "niah" else None
    if sample.task == "fidelity":
        return _fidelity_rows(model, tokenizer, sample, index, runs, ids, window, base, store,
                              overrides)
    if sample.task in GENERATION_TASKS:
        return _generation_rows(model, tokenizer, sample, index, runs, ids, window, base, store,
                                overrides)
    if sample.context <= window:
        raise SFIError(f"a prompt of {sample.context} tokens is too short for a {window}-token "
                       "window")
    history = any(m.needs_history for m, _ in runs)
    shared = SharedPrefill(model, ids[:, :-window], history=history, store=store)
    eos = eos_token_ids(model, tokenizer)
    rows = []
    for method, budget in runs:
        tokens, read = _continue(model, tokenizer, method, budget, sample, shared, ids, eos,
                                 base, overrides)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(EvalRow(
            task=sample.task, context=sample.target, prompt_tokens=sample.context,
            method=method.name, budget=budget,
            capacity=_capacity(method, budget, sample.context, base, overrides),
            score=score(sample.task, text, sample.answers), sample=index, depth=depth,
            output=text, **read,
            items=found_in_order(text, sample.answers) if sample.task in LIST_TASKS else None))
    return rows


def _continue(model: torch.nn.Module, tokenizer: Any, method: Method, budget: float,
              sample: Sample, shared: SharedPrefill, ids: torch.Tensor, eos: set[int],
              base: SFIConfig | None, overrides: dict[str, Any] | None
              ) -> tuple[list[int], dict[str, Any]]:
    """One run's continuation of ``shared`` (greedy, or exact mode's) and what it read: the
    row fields ``retention``, ``fast_retention``, ``slow_steps``, ``refresh_reasons`` and
    ``acceptance``."""
    cache = build_cache(model, tokenizer, method, config=base,
                        budget=_cache_budget(budget),
                        context=sample.context, overrides=overrides)
    run = exact_continue if method.exact else greedy_continue
    tokens = run(model, cache, shared, ids, sample.max_new_tokens, eos)
    read, fast_read = (1.0, None) if method.exact else cache.read_fraction()
    stats = cache.stats() if method.kind == "sfi" else None
    return tokens, {
        "retention": round(read, 4),
        "fast_retention": None if fast_read is None else round(fast_read, 4),
        "slow_steps": stats.slow_steps if stats is not None else None,
        "refresh_reasons": _refreshes(stats.refresh_reasons) if stats is not None else None,
        "acceptance": round(stats.acceptance_rate, 4) if method.exact else None}


def _capacity(method: Method, budget: float, context: int, base: SFIConfig | None,
              overrides: dict[str, Any] | None) -> int:
    """The tokens per KV head a fast step of ``method`` keeps at ``context``: the budget's, or
    for :data:`AS_CONFIGURED` its config's S + K + R."""
    if budget != AS_CONFIGURED:
        return budget_tokens(budget, context)
    config = method.sfi_config(base, overrides)  # parse_runs lets only SFI run as configured
    return min(context, config.sink + config.budget(context) + config.recent)


def _cache_budget(budget: float) -> float | None:
    """``build_cache``'s budget for a run's: none where SFI runs as configured."""
    return None if budget == AS_CONFIGURED else budget


def _fidelity_rows(model: torch.nn.Module, tokenizer: Any, sample: Sample, index: int,
                   runs: list[tuple[Method, float]], ids: torch.Tensor,
                   window: int, base: SFIConfig | None, store: Path | None,
                   overrides: dict[str, Any] | None) -> list[EvalRow]:
    context = sample.context
    compared = [(m, b) for m, b in runs if m.kind != "full"]
    names = [f"{m.name}@{b:g}" for m, b in compared]
    factories = {name: (lambda m=m, b=b: build_cache(model, tokenizer, m, config=base,
                                                      budget=_cache_budget(b),
                                                      context=context,
                                                      overrides=overrides))
                 for name, (m, b) in zip(names, compared)}
    history = any(m.needs_history for m, _ in compared)
    shared = SharedPrefill(model, ids[:, : context - window], history=history, store=store)
    results = teacher_forced_fidelity(model, ids, context, factories, tokenizer=tokenizer,
                                      window=window, prefix=shared)
    rows = []
    ppl_full = results[0].ppl_full if results else None
    if any(m.kind == "full" for m, _ in runs):
        rows.append(EvalRow("fidelity", sample.target, context, "full", 1.0, context, 1.0, 100.0,
                            index,
                            kl=0.0, top1=1.0, ppl=ppl_full, ppl_full=ppl_full))
    for (method, budget), result in zip(compared, results):
        rows.append(EvalRow(
            task="fidelity", context=sample.target, prompt_tokens=context, method=method.name,
            budget=budget, capacity=_capacity(method, budget, context, base, overrides),
            retention=round(result.retention, 4),
            score=round(100.0 * result.top1, 3), sample=index,
            fast_retention=(None if result.fast_retention is None
                            else round(result.fast_retention, 4)),
            slow_steps=len(result.slow_steps), kl=round(result.kl_mean, 6),
            top1=round(result.top1, 6), ppl=round(result.ppl, 4), ppl_full=round(ppl_full, 4),
            kl_per_step=result.kl_per_step, slow_step_indices=result.slow_steps,
            refresh_reasons=(_refreshes(result.refresh_reasons) if method.kind == "sfi"
                             else None)))
    return rows


def _refreshes(reasons: dict[str, int]) -> dict[str, int]:
    """The causes that refreshed at least once, with their counts."""
    return {reason: count for reason, count in reasons.items() if count}


def _generation_rows(model: torch.nn.Module, tokenizer: Any, sample: Sample, index: int,
                     runs: list[tuple[Method, float]], ids: torch.Tensor,
                     window: int, base: SFIConfig | None, store: Path | None,
                     overrides: dict[str, Any] | None) -> list[EvalRow]:
    """Every run continues the prompt greedily; full attention reads each text
    (:mod:`sfi.eval.generation`) and its own, which it always writes as the reference."""
    history = any(m.needs_history for m, _ in runs)
    shared = SharedPrefill(model, ids[:, :-window], history=history, store=store)
    eos = eos_token_ids(model, tokenizer)

    def run(method: Method, budget: float) -> tuple[list[int], dict[str, Any]]:
        return _continue(model, tokenizer, method, budget, sample, shared, ids, eos, base,
                         overrides)

    reference, reference_read = run(parse_method("full"), 1.0)
    own = _read(model, shared, ids, reference)
    rows = []
    for method, budget in runs:
        full = method.kind == "full"
        tokens, read = (reference, reference_read) if full else run(method, budget)
        scores = own if full else _read(model, shared, ids, tokens)
        rows.append(EvalRow(
            task=sample.task, context=sample.target, prompt_tokens=sample.context,
            method=method.name, budget=budget,
            capacity=_capacity(method, budget, sample.context, base, overrides),
            score=round(100.0 * scores.top1, 3), sample=index, **read,
            top1=round(scores.top1, 6), ppl=round(scores.ppl, 4), ppl_full=round(own.ppl, 4),
            distinct=None if scores.distinct is None else round(scores.distinct, 4),
            distinct_full=None if own.distinct is None else round(own.distinct, 4),
            divergence=first_divergence(tokens, reference),
            output=tokenizer.decode(tokens, skip_special_tokens=True)))
    return rows


def _read(model: torch.nn.Module, shared: SharedPrefill, ids: torch.Tensor,
          tokens: list[int]) -> GenerationScores:
    """Full attention's reading of ``tokens`` (a text that ended at once reads as nothing:
    infinite perplexity, no agreement)."""
    if not tokens:
        return GenerationScores(ppl=float("inf"), top1=0.0, distinct=None)
    return full_attention_scores(model, shared, ids, tokens)


def run_eval(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str],
             contexts: Sequence[int], methods: Sequence[str], budgets: Sequence[float],
             samples: int, seed: int = 0, window: int = WINDOW,
             fidelity_tokens: int = FIDELITY_TOKENS, base: SFIConfig | None = None,
             tag: str = "", on_sample: Callable[[str, int, int], None] | None = None,
             store: Path | None = None, overrides: dict[str, Any] | None = None,
             on_rows: Callable[[list[EvalRow]], None] | None = None,
             done: Collection[tuple[str, int, int]] = (), weights: str = "native"
             ) -> list[EvalRow]:
    """Evaluate ``methods`` (names, or ``name@budget``) at each of ``budgets`` on ``samples``
    seeded samples of each task and context length.

    ``base`` sets SFI's knobs other than the budget and ``overrides`` fields on top of it or of
    a method's preset (``sfi:paper``). A ``tag`` is appended to every method name of the rows
    (``sfi:tag``), so that runs of variants can be merged into one report; ``weights`` names
    the format ``model`` was loaded with, recorded in every row.
    ``on_sample(task, context, index)`` reports progress and ``on_rows(rows)`` receives each
    sample's rows as soon as they exist; samples ``(task, context, seed)`` in ``done`` are
    skipped (a resumed run). ``store`` keeps every sample's prefill on disk, so that a later run
    of other methods on the same samples skips them."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SFIError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if samples < 1:
        raise SFIError(f"samples must be >= 1, got {samples}")
    runs = parse_runs(methods, budgets)
    if "fidelity" in tasks and any(m.exact for m, _ in runs):
        raise SFIError("the fidelity task compares a method's next-token distribution with full "
                       "attention's; exact mode's is full attention's by construction (drop "
                       "sfi:exact from --methods, or fidelity from --tasks)")
    rows: list[EvalRow] = []
    for context in contexts:
        for task in tasks:
            for index in range(samples):
                if on_sample is not None:
                    on_sample(task, context, index)
                if (task, context, seed + index) in done:
                    continue
                sample = make_sample(task, tokenizer, context, seed + index,
                                     depth=_depth(task, index, samples),
                                     continuation=fidelity_tokens)
                new = evaluate_sample(model, tokenizer, sample, seed + index, runs, window, base,
                                      store, overrides)
                for row in new:
                    row.method = f"{row.method}:{tag}" if tag else row.method
                    row.weights = weights
                rows.extend(new)
                if on_rows is not None:
                    on_rows(new)
                gc.collect()  # free this sample's caches and KV now
    return rows
