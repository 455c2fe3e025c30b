"""Every knob of Slow-Fast Inference (docs/method.md), validated, with the paper's defaults.

Field names follow docs/method.md: ``sink`` (S), ``recent`` (R), ``k_head`` (K), ``evidence_window``
(W), ``refresh_interval``, ``min_refresh_gap``, and the Selector constants of section 3.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from sfi.errors import SFIConfigError

TriggerPolicy = Literal["sentence", "fixed", "random", "bootstrap"]
TRIGGER_POLICIES: tuple[str, ...] = ("sentence", "fixed", "random", "bootstrap")
SentenceStep = Literal["start", "end"]
SENTENCE_STEPS: tuple[str, ...] = ("start", "end")
PoolMode = Literal["max", "avg"]
POOL_MODES: tuple[str, ...] = ("max", "avg")

# beta = -ln(0.6) / 0.9: the positional prior falls to 0.6 of its peak at u = 0.9 (with p = 1).
DEFAULT_BETA = -math.log(0.6) / 0.9


class _DefaultBudget(int):
    """The type of ``k_head``'s default: an int that :meth:`SFIConfig.__post_init__` can tell
    from a K the caller gave, so that ``SFIConfig(k_fraction=0.15)`` alone takes the fraction
    and ``SFIConfig(k_head=2048, k_fraction=0.15)`` is still refused as two budgets."""


DEFAULT_K_HEAD = _DefaultBudget(2048)


COVERAGE_HEADS = ("mean", "max")  # SFIConfig.coverage_heads's choices

def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SFIConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise SFIConfigError(f"{name} must be >= {minimum}, got {value}")


def _require_float(name: str, value: Any, low: float | None = None, high: float | None = None,
                   low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SFIConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(float(value)):
        raise SFIConfigError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise SFIConfigError(f"{name} must be {bound}, got {value}")
    if high is not None and value > high:
        raise SFIConfigError(f"{name} must be <= {high}, got {value}")


#: fields that run a decode step again (a fast step redone as a slow one) or positions again (a
#: repair): the transformers path's alone, since vLLM schedules each step once
REDO_FIELDS = ("coverage_retry", "retry_margin", "stop_margin", "repair_tokens")


@dataclass(frozen=True)
class SFIConfig:
    """Configuration of slow-fast decoding: the default preset (what measures best in
    ``docs/eval``); ``SFIConfig.paper()`` is the paper exactly (docs/method.md, section 7).

    A fast step attends, per (layer, KV head), to ``sink`` first tokens, K tokens selected from
    the middle region (``k_head``, or ``k_fraction`` of the context) and the ``recent`` last
    ones. Each field is documented where it is declared below; ``docs/configuration.md`` is
    generated from those docs (:func:`sfi.core.config_doc.reference`). The fields beyond the paper
    (pooled evidence, pages, pins, hysteresis, dense layers, coverage probes) are at their
    neutral value in the paper preset, which also turns soft-NMS back on.
    """

    # --- memory of a fast step (docs/method.md section 2) ---
    sink: int = 4
    """S: the first tokens of a sequence, attended at every step."""
    recent: int = 256
    """R: the last tokens, attended in place (plus every token generated since the last
    refresh)."""
    k_head: int | None = DEFAULT_K_HEAD
    """K: the tokens selected from the middle region per (layer, sequence, KV head); None when
    ``k_fraction`` gives K instead (giving ``k_fraction`` alone does that)."""
    k_fraction: float | None = None
    """K as a fraction of the context (in (0, 1]), instead of ``k_head``."""
    evidence_window: int = 16
    """W: the prompt's last queries whose attention makes the first selection."""
    min_skip: int = 1536
    """Sparse decoding starts once a fast step would skip at least this many entries per KV
    head (the context minus S + K + R); until then every step is dense. Below it a fast step's
    own costs (the compact gather, the coverage probes, the bookkeeping) outweigh the reads it
    saves (measured in docs/benchmarks.md, "Where sparse decoding starts"). A decision per
    sequence, from its context alone (never the batch or timings), so that a batched decode
    equals each row decoded alone and a run repeats. 0: sparse as soon as S + K + R fit
    (the paper's rule, the paper preset)."""
    min_gain: float = 1.1
    """Sparse decoding also waits until a fast step would read ``min_gain`` times fewer bytes
    than a dense step of the same sequence: ``(M + T) / (M + S + K + R) >= min_gain``, with the
    model's weights M counted in KV positions of the same byte width
    (``sfi.core.cost_model.weight_positions``; weights and KV both stream once per step at batch
    1). Where the weights outweigh the KV a fast step cannot save enough to pay for its own
    costs. With 1.1, K = 2,048 and R = 256, Qwen2.5-0.5B (M = 80,397 positions) turns sparse
    from 10,579 tokens and SmolLM2-135M (M = 11,673) from 3,707, below ``min_skip``'s 3,844.
    Per sequence, from its context and the model alone. 1.0: no such rule (the paper
    preset)."""
    force_sparse: bool = False
    """Keep slow/fast steps even where ``min_skip`` or ``min_gain`` say dense (and when the
    context is shorter than S + K + R)."""
    overlap_selection: bool = True
    """On CUDA, run the Selector and the compact rebuild on a side stream; a row whose rebuild
    is not ready reads densely. No effect on CPU, nor in the vLLM plugin (both select every
    layer's refreshes together after the step's last layer)."""

    # --- slow-step triggers ---
    trigger: TriggerPolicy = "sentence"
    """What makes a slow step: ``sentence`` (the first token of a new sentence), ``fixed``
    (every ``period`` steps), ``random`` (seeded periods), ``bootstrap`` (the first selection
    only)."""
    refresh_interval: int = 96
    """Reuse budget: a refresh is forced after this many steps since the last one."""
    min_refresh_gap: int = 16
    """Sentence triggers closer than this many steps to the last refresh are ignored."""
    sentence_step: SentenceStep = "start"
    """Which step of a sentence boundary is slow: ``start`` (the paper's: the step whose input
    is the new sentence's first token, which a fast step has produced already) or ``end``
    (the step whose input is the sentence ender: the new sentence's first token comes from
    the dense step, and the refresh's evidence ends with the sentence)."""
    period: int = 32
    """Steps between refreshes of the ``fixed`` trigger."""
    random_period_min: int = 16
    """Shortest period of the ``random`` trigger."""
    random_period_max: int = 96
    """Longest period of the ``random`` trigger."""
    seed: int = 0
    """Seed of the ``random`` trigger."""
    repair_tokens: int = 0
    """Repairing slow steps: a slow step first forgets the KV of the positions written since
    the sequence's last repair by a sparse step or after one (at most this many, the last
    ones) and computes it again in the same forward, densely, where the sparse steps that
    wrote it left their drift (docs/evaluation.md); the step then takes its token and its
    refresh as any slow step. 0: off. In a batch every row re-runs the block, the longest any
    row needs, within what each row allows (the inputs it kept, the recent window of a row
    not refreshing): rows that do not refresh read densely at that step, so a batch whose
    rows refresh at different steps departs from its rows decoded alone. sfi's own decode
    loops only (``sfi.generate``, the server, ``decode_one``; not ``model.generate``), models
    whose layers all attend fully; not with ``coverage_retry``, in exact mode (its verify
    writes full attention's KV) or in the vLLM plugin."""

    # --- the Selector (docs/method.md section 3) ---
    alpha: float = 1.0
    """Power of the mean that pools the evidence rows (0 would be the geometric mean; the
    paper: 0.5). 1, their plain mean, ranks a position one query head attends strongly above
    one every head attends a little: at 8K it keeps more of a ten-item list at the same reads
    (docs/studies.md)."""
    gamma: float = 0.5
    """Key-norm prior: weight of -log ||k_i||."""
    w_norm: float = 1.0
    """Weight of the key-norm term in the prior."""
    w_pos: float = 0.7
    """Weight of the positional term in the prior."""
    pos_power: float = 1.8
    """p of the positional prior's -beta * u^p."""
    eta: float = 0.4
    """Weight of the positional prior's log(1 - u)."""
    beta: float = DEFAULT_BETA
    """beta of the positional prior (-ln(0.6) / 0.9)."""
    lambda_cap_single: float = 0.35
    """Clip of the fusion weight lambda* with one evidence row (0 = pure evidence)."""
    lambda_cap_multi: float = 0.25
    """Clip of the fusion weight lambda* with several evidence rows."""
    nms_radius: int = 16
    """Soft-NMS: positions on each side compared with a candidate."""
    nms_strength: float = 0.0
    """Soft-NMS: how hard a near-duplicate of a neighbour is pushed down (the paper: 1.0; off
    by default, since it pushes down a needle's neighbours)."""
    exclusivity_temperature: float = 2.0
    """Cross-head exclusivity: temperature of the softmax over KV heads."""
    exclusivity_strength: float = 0.85
    """Cross-head exclusivity: weight of log rho (0 = off)."""
    exclusivity_min_heads: int = 3
    """Cross-head exclusivity applies to layers with at least this many KV heads."""

    # --- retrieval-safe selection (beyond the paper; measured in docs/eval) ---
    pool_kernel: int = 9
    """Evidence pooled along positions over this many (odd; 1 = off), so that a needle's
    span ranks with its peak."""
    pool: PoolMode = "max"
    """How the evidence is pooled: ``max`` or ``avg``."""
    page_size: int = 16
    """Select whole pages of this many tokens (pages start at each sequence's first token),
    ranked by their best token (1 = single tokens)."""
    pin_fraction: float = 0.0
    """Part of K fixed by a sequence's first selection (the question's evidence) and kept by
    every later refresh."""
    hysteresis: float = 0.0
    """A position selected before stays while it ranks within the top (1 + h) K."""
    dense_layers: int = 0
    """The first layers always attend densely (as Quest and TidalDecode keep them)."""
    coverage_layers: int = 8
    """Coverage probes: how many layers check at each fast step whether the memory misses
    attention (0 = off)."""
    coverage_top: int = 2
    """Coverage probes: pages outside the memory that each probe reads, those the query
    bounds highest (per-page min/max keys, as Quest)."""
    coverage_threshold: float = 0.1
    """Coverage probes: the share of the attention those pages may take before the next step
    refreshes (reason ``coverage``)."""
    coverage_heads: str = "mean"
    """Coverage probes: how the query heads of a KV head judge the pages read: ``mean``, the
    pages' average share of their attention over ``coverage_threshold``; ``max``, any one
    query head's (a retrieval head that misses is not averaged away by those that do not)."""
    coverage_gap: int = 2
    """Coverage probes: at most one coverage refresh every this many steps."""
    coverage_next: bool = False
    """Coverage probes: each also reads, per KV head, the page after the one holding the
    selected position its fast step attends to most, where the memory holds nothing of that
    page (beside the ``coverage_top`` pages the bound ranks): a copy that runs past the end of
    what the memory holds (the first digits of a number held, the rest not) is caught as it
    leaves it (both engines)."""
    coverage_copy: float = 0.5
    """Coverage probes: a fast step in which a query head of a probe layer gives more than this
    share of its attention to its most attended selected position, and the memory does not
    hold the position after it (a copy about to run past what the memory holds), refreshes at
    the next step (as ``coverage_gap`` allows), before the copy needs that position; no page is
    read for it, and ``coverage_retry`` does not do the step again for it (0 = off;
    both engines)."""
    coverage_retry: bool = False
    """Coverage probes: a fast step whose probes flag a row is done again at once as that
    row's slow step (its token then comes from dense attention and the refresh), instead of
    refreshing at the next step; the flagged fast forward is spent and not counted in the read
    fraction (transformers path; models whose layers all attend fully, elsewhere the row
    refreshes at its next step)."""
    retry_margin: float = 0.0
    """A fast step whose next-token distribution (the model's output, softmax at temperature
    1) gives its most likely token less than this much more probability than the second is
    done again at once as the row's slow step (reason ``margin``), as ``coverage_retry`` does
    for a probe's flag, whatever ``min_refresh_gap`` and ``coverage_gap`` say (its refresh
    restarts the reuse count, as any slow step's); the spent fast forward is not counted in
    the read fraction (0 = off; transformers path, models whose layers all attend fully; exact
    mode's drafts are not done again)."""

    stop_margin: float = 0.0
    """A checked stop: a fast step whose most likely next token ends the text (an
    end-of-sequence id of the model's generation config, its config or its tokenizer) and
    leads the second by less than this much probability is done again at once as the row's
    slow step (reason ``stop``), as ``retry_margin`` does for any token and whatever
    ``min_refresh_gap`` says, so that an answer ends where dense attention ends it, not where a
    fast step's memory does; 1.0 checks every such step (0 = off; transformers path, models
    whose layers all attend fully; exact mode's drafts are not done again)."""

    # --- exact mode (``mode="exact"``: fast steps draft, one dense forward verifies) ---
    draft_tokens: int = 4
    """Exact mode: gamma, the fast steps drafted before each dense verify, to start with (it
    then adapts to the measured acceptance and step times)."""
    draft_min: int = 1
    """Exact mode: the fewest drafted tokens per verify."""
    draft_max: int = 8
    """Exact mode: the most drafted tokens per verify."""
    draft_fallback: bool = True
    """Exact mode: decode densely where the measured step times and acceptance say that
    drafting cannot pay (False: always draft, e.g. to measure it)."""

    def __post_init__(self) -> None:
        if type(self.k_head) is _DefaultBudget:  # K not given: k_fraction, if given, is K
            object.__setattr__(self, "k_head", None if self.k_fraction is not None
                               else int(self.k_head))
        _require_int("sink", self.sink, 0)
        _require_int("recent", self.recent, 1)
        if self.k_head is not None and self.k_fraction is not None:
            raise SFIConfigError(
                "give the budget either as k_head (tokens per KV head) or as k_fraction "
                f"(fraction of the context), not both (got k_head={self.k_head!r}, "
                f"k_fraction={self.k_fraction!r}); set the other to None"
            )
        if self.k_head is None and self.k_fraction is None:
            raise SFIConfigError("a budget is needed: set k_head (tokens) or k_fraction")
        if self.k_head is not None:
            _require_int("k_head", self.k_head, 0)
        if self.k_fraction is not None:
            _require_float("k_fraction", self.k_fraction, 0.0, 1.0, low_open=True)
        _require_int("evidence_window", self.evidence_window, 1)
        _require_int("min_skip", self.min_skip, 0)
        _require_float("min_gain", self.min_gain, 1.0)
        for name in ("force_sparse", "overlap_selection", "draft_fallback", "coverage_retry",
                     "coverage_next"):
            if not isinstance(getattr(self, name), bool):
                raise SFIConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.coverage_heads not in COVERAGE_HEADS:
            raise SFIConfigError(f"coverage_heads must be one of {', '.join(COVERAGE_HEADS)}; "
                                 f"got {self.coverage_heads!r}")
        if self.trigger not in TRIGGER_POLICIES:
            raise SFIConfigError(
                f"trigger must be one of {', '.join(TRIGGER_POLICIES)}; got {self.trigger!r}"
            )
        _require_int("refresh_interval", self.refresh_interval, 1)
        _require_int("min_refresh_gap", self.min_refresh_gap, 0)
        if self.sentence_step not in SENTENCE_STEPS:
            raise SFIConfigError(f"sentence_step must be one of {', '.join(SENTENCE_STEPS)}; "
                                 f"got {self.sentence_step!r}")
        _require_int("period", self.period, 1)
        _require_int("random_period_min", self.random_period_min, 1)
        _require_int("random_period_max", self.random_period_max, 1)
        if self.random_period_max < self.random_period_min:
            raise SFIConfigError(
                f"random_period_max ({self.random_period_max}) must be >= random_period_min "
                f"({self.random_period_min})"
            )
        _require_int("seed", self.seed, 0)
        _require_int("repair_tokens", self.repair_tokens, 0)
        _require_float("retry_margin", self.retry_margin, 0.0, 1.0)
        _require_float("stop_margin", self.stop_margin, 0.0, 1.0)
        for retry in REDO_FIELDS:
            if retry != "repair_tokens" and self.repair_tokens and getattr(self, retry):
                raise SFIConfigError(f"repair_tokens and {retry} cannot be combined: a step "
                                     f"{retry} does again is not repaired; turn one off")
        _require_float("alpha", self.alpha, 0.0)
        for name in ("gamma", "w_norm", "w_pos", "eta", "beta", "nms_strength",
                     "exclusivity_strength"):
            _require_float(name, getattr(self, name), 0.0)
        _require_float("pos_power", self.pos_power, 0.0, low_open=True)
        _require_float("lambda_cap_single", self.lambda_cap_single, 0.0, 1.0)
        _require_float("lambda_cap_multi", self.lambda_cap_multi, 0.0, 1.0)
        _require_int("nms_radius", self.nms_radius, 0)
        _require_float("exclusivity_temperature", self.exclusivity_temperature, 0.0,
                       low_open=True)
        _require_int("exclusivity_min_heads", self.exclusivity_min_heads, 1)
        _require_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise SFIConfigError(f"pool_kernel must be odd (a window centred on each position), "
                                 f"got {self.pool_kernel}")
        if self.pool not in POOL_MODES:
            raise SFIConfigError(f"pool must be one of {', '.join(POOL_MODES)}; got {self.pool!r}")
        _require_int("page_size", self.page_size, 1)
        _require_float("pin_fraction", self.pin_fraction, 0.0, 1.0)
        _require_float("hysteresis", self.hysteresis, 0.0)
        _require_int("dense_layers", self.dense_layers, 0)
        _require_int("coverage_layers", self.coverage_layers, 0)
        _require_int("coverage_top", self.coverage_top, 1)
        _require_float("coverage_threshold", self.coverage_threshold, 0.0, 1.0)
        _require_float("coverage_copy", self.coverage_copy, 0.0, 1.0)
        _require_int("coverage_gap", self.coverage_gap, 1)
        _require_int("draft_min", self.draft_min, 1)
        _require_int("draft_tokens", self.draft_tokens, 1)
        _require_int("draft_max", self.draft_max, 1)
        if not self.draft_min <= self.draft_tokens <= self.draft_max:
            raise SFIConfigError(
                f"exact mode needs draft_min <= draft_tokens <= draft_max, got {self.draft_min}, "
                f"{self.draft_tokens}, {self.draft_max}")

    def budget(self, context: int) -> int:
        """K, the selected tokens per KV head for a sequence of ``context`` real tokens."""
        if self.k_head is not None:
            return self.k_head
        return math.ceil(self.k_fraction * context)

    def sparse_pays(self, context: int, weight_positions: int = 0) -> bool:
        """Whether fast steps are on for a sequence of ``context`` real tokens: the cost model.

        A fast step must skip at least ``min_skip`` of the T entries per KV head (it reads
        S + K + R), and read at least ``min_gain`` times fewer bytes than a dense step with the
        model's weights, ``weight_positions`` (W, in KV positions; 0: not known, the KV alone)
        counted in both; until then decoding stays dense, unless ``force_sparse`` asks for the
        slow/fast machinery anyway (used by the equivalence tests).
        """
        skipped = context - self.sink - self.budget(context) - self.recent
        kept = self.k_head if self.k_head is not None else self.k_fraction * context  # no
        read = self.sink + kept + self.recent  # rounding: the margin grows with the context
        gain_pays = weight_positions + context >= self.min_gain * (weight_positions + read)
        return self.force_sparse or (skipped >= self.min_skip and gain_pays)

    def sparse_from(self, weight_positions: int = 0, limit: int = 1 << 24) -> int | None:
        """The shortest context (real tokens) at which sparse decoding starts for a model whose
        weights are ``weight_positions`` KV positions (see :meth:`sparse_pays`), None if none
        up to ``limit`` does (a fractional budget too large for ``min_skip`` or ``min_gain``).
        Bisection over :meth:`sparse_pays`: both margins only grow with the context."""
        if self.force_sparse:
            return 0
        if not self.sparse_pays(limit, weight_positions):
            return None
        low, high = self.sink + self.recent + self.min_skip, limit
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if self.sparse_pays(mid, weight_positions) else (mid + 1, high)
        return low

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> SFIConfig:
        """The configuration named ``name`` (see :data:`PRESETS`), with ``overrides``.

        Giving ``k_fraction`` alone switches the budget to a fraction (``k_head`` becomes
        None), and ``k_head`` alone back to tokens."""
        if name not in PRESETS:
            raise SFIConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(**_with_budget(PRESETS[name], overrides))

    def replace(self, **changes: Any) -> SFIConfig:
        """This configuration with ``changes``; a budget given one way alone replaces the
        other (``k_fraction`` alone sets ``k_head`` to None, and ``k_head`` alone the
        fraction), where ``dataclasses.replace`` would refuse two budgets."""
        return type(self)(**_with_budget({f.name: getattr(self, f.name) for f in fields(self)},
                                         changes))

    @classmethod
    def paper(cls, **overrides: Any) -> SFIConfig:
        """The paper exactly (its Selector and defaults), with ``overrides``."""
        return cls.from_preset("paper", **overrides)


def _with_budget(values: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``values`` updated with ``changes``, where a budget given one way alone (``k_head`` or
    ``k_fraction``) clears the other."""
    out = {**values, **changes}
    if "k_fraction" in changes and "k_head" not in changes:
        out["k_head"] = None
    elif "k_head" in changes and "k_fraction" not in changes:
        out["k_fraction"] = None
    return out


# Every field the paper fixes, with the value it gives: the "paper" preset reproduces the paper
# whatever the library's defaults become.
PAPER_PRESET: dict[str, Any] = dict(
    sink=4, recent=256, k_head=2048, k_fraction=None, evidence_window=16, trigger="sentence",
    refresh_interval=96, min_refresh_gap=16, sentence_step="start", alpha=0.5, gamma=0.5,
    w_norm=1.0, w_pos=0.7,
    pos_power=1.8, eta=0.4, beta=DEFAULT_BETA, lambda_cap_single=0.35, lambda_cap_multi=0.25,
    nms_radius=16, nms_strength=1.0, exclusivity_temperature=2.0, exclusivity_strength=0.85,
    exclusivity_min_heads=3, pool_kernel=1, page_size=1, pin_fraction=0.0, hysteresis=0.0,
    dense_layers=0, coverage_layers=0, coverage_copy=0.0, min_skip=0, min_gain=1.0,
    repair_tokens=0,
)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},  # the library's defaults: what measures best (docs/eval)
    "paper": PAPER_PRESET,
}


def parse_overrides(items: list[str], where: str = "--set") -> dict[str, Any]:
    """``["name=value", ...]`` -> SFIConfig fields with typed values (``where`` names the
    option or method spec in error messages)."""
    types = {f.name: str(f.type) for f in fields(SFIConfig)}
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise SFIConfigError(f"{where} expects name=value with a field of SFIConfig, got "
                                 f"{item!r}; fields: {', '.join(types)}")
        values[name] = _parse_value(f"{where} {name}", raw.strip(), types[name])
    return values


def _parse_value(where: str, raw: str, type_name: str) -> Any:
    try:
        if "bool" in type_name:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if "float" in type_name:
            return None if raw.lower() == "none" and "None" in type_name else float(raw)
        if "int" in type_name:
            return None if raw.lower() == "none" else int(raw)
    except ValueError:
        raise SFIConfigError(f"{where}: {raw!r} is not a valid value ({type_name})") from None
    return raw
