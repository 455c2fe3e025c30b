"""Support stability: the observation behind SFI, measured on a real model and real text.

A long essay prefix is the context; its next tokens are fed one by one with full attention.
At every step, for every layer and KV head, the *support* is the top-k positions of the middle
region by attention (summed over the query heads of the group). We record

- the Jaccard overlap of the support with the previous step's, split into steps inside a
  sentence and steps that start a new sentence;
- its overlap with the support at the last sentence boundary, against steps since it;
- the attention mass that SFI's fast memory (sink + the Selector's K positions chosen at the
  last refresh, by token or by page as the config says + the recent window) captures, with
  refreshes where SFI's sentence trigger fires them (the coverage probes are not simulated).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from statistics import mean
from typing import Any

import torch

from sfi.core.config import SFIConfig
from sfi.core.memory_tensors import memory_mask
from sfi.core.scorers import make_evidence
from sfi.core.selector import SFISelector, top_k_positions
from sfi.core.sequence_policy import Memory, refresh_memory
from sfi.core.triggers import SentenceTrigger, make_trigger, observe, token_classes
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.errors import SFIError
from sfi.hf.eviction.layer import EvictionLayer
from sfi.hf.eviction.masked_cache import EvictionCache

SINCE_BINS = (1, 2, 4, 8, 16, 32, 64)


def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[H, k]`` position sets -> ``[H]`` |a & b| / |a | b| per row."""
    inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).float()
    return inter / (a.shape[-1] + b.shape[-1] - inter)


@dataclass
class StabilityResult:
    """Per-step series (averaged over layers and KV heads) and their summary.
    ``consecutive[i]`` compares step i + 1 with step i; the other series start at step 0."""

    context: int
    tokens: int
    top_k: int
    k_selected: int
    consecutive: list[float] = field(default_factory=list)
    to_boundary: list[float] = field(default_factory=list)
    since_boundary: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    captured: list[float] = field(default_factory=list)
    refreshes: list[int] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Recorder:
    """Observer of an EvictionCache: computes the per-layer measures at each decode step."""

    def __init__(self, config: SFIConfig, top_k: int, layers: int):
        self.config, self.top_k = config, top_k
        self.selector = SFISelector(config)
        self.new_sentence = self.refresh = False
        self.previous: list[torch.Tensor | None] = [None] * layers
        self.at_boundary: list[torch.Tensor | None] = [None] * layers
        self.memory: list[torch.Tensor | None] = [None] * layers  # [H, T] bool, SFI fast memory
        self.step: dict[str, list[float]] = defaultdict(list)

    def __call__(self, layer: EvictionLayer, attention: torch.Tensor) -> None:
        mass = attention[0].sum(dim=1)  # [H, T], summed over the query heads of each group
        mass = mass / mass.sum(dim=-1, keepdim=True)
        t = mass.shape[-1]
        memory = refresh_memory(t, 0, self.config.sink, self.config.recent,
                                self.config.budget(t))
        lo, hi = memory.sink_end, memory.recent_start
        i = layer.layer_idx
        if hi - lo >= self.top_k:
            middle = mass[:, lo:hi]
            support = torch.topk(middle, self.top_k, dim=-1).indices + lo  # [H, k]
            if self.previous[i] is not None:
                self.step["consecutive"].append(float(jaccard(support, self.previous[i]).mean()))
            if self.new_sentence or self.at_boundary[i] is None:
                self.at_boundary[i] = support
            self.step["to_boundary"].append(float(jaccard(support, self.at_boundary[i]).mean()))
            self.previous[i] = support
        if self.refresh or self.memory[i] is None:
            self.memory[i] = self._select(layer, attention, memory)
        fast_memory = self.memory[i]
        grown = torch.ones(fast_memory.shape[0], t - fast_memory.shape[1], dtype=torch.bool,
                           device=fast_memory.device)  # tokens generated since the refresh
        self.step["captured"].append(float((mass * torch.cat([fast_memory, grown], -1)).sum(-1)
                                           .mean()))

    def _select(self, layer: EvictionLayer, attention: torch.Tensor,
                memory: Memory) -> torch.Tensor:
        """SFI's fast ``memory`` after a slow step with this attention: ``[H, T]`` bool."""
        t, h = attention.shape[-1], attention.shape[1]
        lo, hi = memory.sink_end, memory.recent_start
        chosen = torch.zeros(1, h, 0, dtype=torch.long, device=attention.device)
        if memory.k > 0:
            positions = torch.arange(t, device=attention.device)
            candidates = ((positions >= lo) & (positions < hi))[None]
            evidence = make_evidence(attention.clamp_min(1e-30).log(), layer.layer_idx,
                                     torch.tensor([lo]), torch.tensor([hi]), keys=layer.keys,
                                     candidates=candidates)
            chosen, _ = top_k_positions(self.selector.score(evidence), candidates,
                                        torch.tensor([memory.k]), page=self.config.page_size)
        return memory_mask(memory, chosen[0], t)


@torch.inference_mode()
def support_stability(model: torch.nn.Module, tokenizer: Any, ids: torch.Tensor, context: int,
                      config: SFIConfig | None = None, top_k: int = 64,
                      window: int = 32) -> StabilityResult:
    """Teacher-force ``ids[:, context:]`` after ``ids[:, :context]`` with full attention and
    measure support stability (see the module docstring). ``config`` gives SFI's S, R, K and
    trigger for the captured-mass simulation (default: K = 15% of the context)."""
    config = config or SFIConfig(k_head=None, k_fraction=0.15)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] <= context or context <= window:
        raise SFIError("ids must be [1, context + continuation] with a context longer than "
                       f"{window} tokens")
    if top_k < 1 or context < config.sink + config.recent + top_k:
        raise SFIError(f"a context of {context} tokens leaves no middle region of {top_k} "
                       f"positions after {config.sink} sinks and a {config.recent}-token window")
    classes = token_classes(tokenizer)
    sentences = SentenceTrigger(classes, refresh_interval=10**9, min_refresh_gap=0)
    refresh_trigger = make_trigger(replace(config, trigger="sentence"), classes, 0)
    layers = model.config.get_text_config().num_hidden_layers
    recorder = _Recorder(config, top_k, layers)
    cache = EvictionCache(model, policy=None, observer=recorder)
    device = ids.device
    prefill(model, cache, ids[:, :context])
    result = StabilityResult(context=context, tokens=ids.shape[1] - context, top_k=top_k,
                             k_selected=config.budget(context))
    since, since_refresh = 0, 0
    for step in range(ids.shape[1] - context):
        token = int(ids[0, context + step])  # the step's input, as a trigger sees it
        since, since_refresh = since + 1, since_refresh + 1
        # every input reaches both triggers (the first step's too, as in the engine)
        boundary = observe(sentences, token, since) is not None
        due = observe(refresh_trigger, token, since_refresh) is not None
        recorder.new_sentence = step == 0 or boundary
        recorder.refresh = step == 0 or due
        if recorder.new_sentence:
            since = 0
            result.boundaries.append(step)
        if recorder.refresh:
            since_refresh = 0
            result.refreshes.append(step)
        recorder.step.clear()
        decode_one(model, cache, ids[0, context + step: context + step + 1],
                   torch.tensor([context + step], device=device))
        if step:  # overlap with the previous step, from the second step on
            result.consecutive.append(mean(recorder.step["consecutive"]))
        result.to_boundary.append(mean(recorder.step["to_boundary"]))
        result.captured.append(mean(recorder.step["captured"]))
        result.since_boundary.append(since)
    result.summary = summarize_stability(result)
    return result


def summarize_stability(result: StabilityResult) -> dict[str, Any]:
    """Within-sentence vs across-boundary overlap, overlap by steps since the boundary, and
    the captured mass on fast and on refresh steps."""
    boundary = set(result.boundaries)
    within = [j for s, j in enumerate(result.consecutive, start=1) if s not in boundary]
    across = [j for s, j in enumerate(result.consecutive, start=1) if s in boundary]
    by_since: dict[str, float] = {}
    for low, high in zip(SINCE_BINS, (*SINCE_BINS[1:], 10**9)):
        values = [j for j, s in zip(result.to_boundary, result.since_boundary)
                  if low <= s < high]
        if values:
            by_since[f"{low}-{high - 1}" if high < 10**9 else f"{low}+"] = round(mean(values), 4)
    refresh = set(result.refreshes)
    fast = [c for s, c in enumerate(result.captured) if s not in refresh]
    slow = [c for s, c in enumerate(result.captured) if s in refresh]
    return {
        "jaccard_within_sentence": round(mean(within), 4) if within else None,
        "jaccard_across_boundary": round(mean(across), 4) if across else None,
        "jaccard_to_boundary_by_steps_since": by_since,
        "sentences": len(result.boundaries),
        "refreshes": len(result.refreshes),
        "captured_mass_fast_steps": round(mean(fast), 4) if fast else None,
        "captured_mass_min": round(min(result.captured), 4),
        "captured_mass_refresh_steps": round(mean(slow), 4) if slow else None,
    }


def plot_stability(result: StabilityResult, path: str, title: str = "") -> None:
    """Three panels: consecutive overlap with boundaries marked; overlap with the boundary's
    support against steps since it; captured attention mass with refreshes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(range(1, len(result.consecutive) + 1), result.consecutive, linewidth=0.9,
            color="tab:blue")
    for b in result.boundaries[1:]:
        ax.axvline(b, color="tab:red", alpha=0.25, linewidth=0.8)
    ax.set_title(f"top-{result.top_k} support: Jaccard with the previous step\n"
                 "(red: a new sentence starts)", fontsize=9)
    ax.set_xlabel("decode step")
    ax.set_ylim(0, 1)
    ax = axes[1]
    grouped: dict[int, list[float]] = defaultdict(list)
    for j, s in zip(result.to_boundary, result.since_boundary):
        grouped[s].append(j)
    xs = sorted(s for s in grouped if s and len(grouped[s]) >= 3)
    ax.plot(xs, [mean(grouped[s]) for s in xs], marker=".", color="tab:green")
    ax.set_title("Jaccard with the support at the sentence's first step", fontsize=9)
    ax.set_xlabel("steps since the sentence boundary")
    ax.set_ylim(0, 1)
    ax = axes[2]
    ax.plot(range(len(result.captured)), result.captured, linewidth=0.9, color="tab:purple")
    ax.scatter(result.refreshes, [result.captured[s] for s in result.refreshes], marker="v",
               color="tab:red", s=18, zorder=3, label="refresh (slow step)")
    ax.set_title(f"attention mass in SFI's fast memory (K = {result.k_selected})", fontsize=9)
    ax.set_xlabel("decode step")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower left")
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
