"""Why SFI keeps or loses an answer: the selection's coverage of it, stage by stage, and the
attention mass its fast memory holds at each answer step.

For one task sample and several SFI methods at one budget (every method continues one shared
prefill, as in ``sfi eval``):

- **coverage**: the answer's tokens in the prompt (e.g. the digits of a passkey) and, for the
  first selection after the prompt, which of them the top-K of each Selector stage holds, per
  (layer, KV head); ``selected`` is what the memory really holds (pages, pins included);
- **captured mass**: feeding full attention's own answer token by token, the attention mass of
  full attention at each answer step that the SFI memory of that step (sinks, selected,
  recent window) holds, per layer, averaged over KV heads and query heads;
- **answers held**: at the step that writes each answer in full attention's output (its first
  token), the share of (layer, KV head) memories that hold all of the answer's prompt tokens
  (1 on a slow step, which reads everything): for a list answer, which item the memory had
  lost by the time it was asked for;
- the method's own greedy answer and its score.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sfi.core.memory_tensors import memory_mask
from sfi.core.scorers import Evidence, Scorer
from sfi.core.selector import top_k_positions
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import SharedPrefill
from sfi.eval.runner import WINDOW, greedy_continue
from sfi.eval.tasks import Sample, score
from sfi.hf.eviction.masked_cache import EvictionCache
from sfi.hf.facts import eos_token_ids
from sfi.hf.methods import budget_tokens, build_cache, parse_method
from sfi.hf.slowfast_cache import SlowFastCache


def answer_positions(tokenizer: Any, sample: Sample) -> dict[str, list[int]]:
    """Prompt token positions of each answer, where it stands in its needle sentence."""
    encoded = tokenizer(sample.text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != list(sample.prompt_ids):
        return {}
    offsets = encoded["offset_mapping"]
    spans: dict[str, list[int]] = {}
    for answer in sample.answers:
        needle = next((n for n in sample.needles if answer in n), None)
        if needle is None or needle not in sample.text:
            continue
        start = sample.text.index(needle) + needle.index(answer)
        end = start + len(answer)
        spans[answer] = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return spans


class RecordingScorer:
    """Wraps a scorer; keeps the per-stage scores of each layer's first call (the selection
    after the prompt)."""

    def __init__(self, inner: Scorer):
        self.inner = inner
        self.first: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}

    def score(self, evidence: Evidence) -> torch.Tensor:
        stages = getattr(self.inner, "stages", None)
        scores = stages(evidence) if stages is not None else {"score": self.inner.score(evidence)}
        if evidence.layer_idx not in self.first:
            self.first[evidence.layer_idx] = (scores, evidence.candidates)
        return list(scores.values())[-1]


@dataclass
class MethodDiagnosis:
    """One method on the sample. ``coverage[stage][answer]`` is the share of (layer, KV head)
    selections that hold the whole answer, ``token_coverage[stage]`` the share of answer tokens
    held over all (layer, KV head); ``captured[step]`` the mass held, mean over layers, and
    ``captured_min[step]`` the lowest layer's; ``held_at_answer[answer]`` the share of (layer, KV
    head) memories holding the answer at the step that writes it in full attention's output
    (None when the prompt's last forward writes it, or full attention never does), and
    ``step_kinds[step]`` what each of those steps was (``slow``, ``fast``, ``lagged`` or
    ``dense``: :meth:`sfi.hf.slowfast_cache.SlowFastCache.step_kinds`)."""

    method: str
    output: str
    score: float
    k: int
    coverage: dict[str, dict[str, float]] = field(default_factory=dict)
    token_coverage: dict[str, float] = field(default_factory=dict)
    captured: list[float] = field(default_factory=list)
    captured_min: list[float] = field(default_factory=list)
    held_at_answer: dict[str, float | None] = field(default_factory=dict)
    step_kinds: list[str] = field(default_factory=list)
    layer_coverage: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    retention: float = 1.0


@dataclass
class Diagnosis:
    task: str
    context: int
    sample: int
    budget: float
    answers: list[str]
    positions: dict[str, list[int]]
    full_output: str
    methods: list[MethodDiagnosis] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _coverage(selections: list[torch.Tensor], spans: dict[str, list[int]]
              ) -> tuple[dict[str, float], float, list[float]]:
    """``selections[layer]`` ``[H, k]`` -> (per answer: share of (layer, head) holding all its
    tokens, share of answer tokens held, per layer share of answer tokens held)."""
    whole: dict[str, float] = {}
    tokens = [p for span in spans.values() for p in span]
    per_layer = []
    for answer, span in spans.items():
        wanted = torch.tensor(span)
        held = [bool(torch.isin(wanted, head).all()) for sel in selections for head in sel]
        whole[answer] = sum(held) / max(1, len(held))
    wanted = torch.tensor(tokens)
    for sel in selections:
        per_layer.append(float(torch.isin(wanted[None], sel[:, None, :]).float().mean())
                         if tokens else 0.0)
    share = sum(per_layer) / max(1, len(per_layer))
    return whole, share, per_layer


def _memory_mask(cache: SlowFastCache, layer: int, length: int) -> torch.Tensor:
    """``[H, T]`` bool: what sequence 0's fast memory reads at ``layer`` for a cache of
    ``length`` positions."""
    memory = cache.memory(0)
    if memory is None or cache.reads_densely(layer, 0):
        return torch.ones(cache.layers[layer].keys.shape[1], length, dtype=torch.bool)
    return memory_mask(memory, cache.selected_positions(layer, 0).cpu(), length)


@torch.inference_mode()
def diagnose(model: torch.nn.Module, tokenizer: Any, sample: Sample, index: int,
             methods: list[str], budget: float, window: int = WINDOW,
             store: Any = None) -> Diagnosis:
    """Diagnose ``methods`` (SFI methods, e.g. ``sfi``, ``sfi:paper``,
    ``sfi[page_size=16]``) on one sample at ``budget`` (see the module docstring)."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids], device=device)
    shared = SharedPrefill(model, ids[:, :-window], store=store)
    eos = eos_token_ids(model, tokenizer)
    full_cache = build_cache(model, tokenizer, "full")
    full_tokens = greedy_continue(model, full_cache, shared, ids, sample.max_new_tokens, eos)
    spans = answer_positions(tokenizer, sample)
    result = Diagnosis(sample.task, sample.target, index, budget, list(sample.answers), spans,
                       tokenizer.decode(full_tokens, skip_special_tokens=True))
    for name in methods:
        method = parse_method(name)
        if method.kind != "sfi":
            raise ValueError(f"diagnose takes SFI methods; {name!r} is not one")
        cache = build_cache(model, tokenizer, method, budget=budget, context=sample.context)
        tokens = greedy_continue(model, cache, shared, ids, sample.max_new_tokens, eos)
        output = tokenizer.decode(tokens, skip_special_tokens=True)
        diagnosis = MethodDiagnosis(name, output, score(sample.task, output, sample.answers),
                                    k=budget_tokens(budget, sample.context),
                                    stats=cache.stats().to_dict(),
                                    retention=round(cache.read_fraction()[0], 4))
        diagnosis.coverage, diagnosis.token_coverage, diagnosis.layer_coverage = \
            _stage_coverage(model, tokenizer, method, budget, sample, shared, ids, spans)
        mass = _captured_mass(model, tokenizer, method, budget, sample, shared, ids,
                              full_tokens, spans)
        diagnosis.captured, diagnosis.captured_min, diagnosis.step_kinds = mass[:3]
        diagnosis.held_at_answer = _held_at_answer(tokenizer, full_tokens, spans, mass[3])
        result.methods.append(diagnosis)
    return result


def _stage_coverage(model, tokenizer, method, budget, sample, shared, ids, spans):
    """Coverage of the answer by each stage's top-K and by the real selection, at the first
    selection after the prompt."""
    cache = build_cache(model, tokenizer, method, budget=budget, context=sample.context)
    recorder = RecordingScorer(cache.scorer)
    cache.scorer = recorder  # the sequences take it when the prefix is loaded
    shared.load(cache)
    prefill(model, cache, ids[:, shared.length:], start=shared.length)
    memory = cache.memory(0)
    if memory is None:  # the context is too short for a selection: every step is dense
        return {"selected": dict.fromkeys(spans, 1.0)}, {"selected": 1.0}, []
    k = torch.tensor([memory.k])
    layers = sorted(recorder.first)
    coverage, token_coverage = {}, {}
    per_layer: list[float] = []
    stage_names = list(recorder.first[layers[0]][0]) if layers else []
    for stage in [*stage_names, "selected"]:
        if stage == "selected":
            selections = [cache.selected_positions(layer, 0).cpu() for layer in layers]
        else:
            selections = []
            for layer in layers:
                stages, candidates = recorder.first[layer]
                chosen, _ = top_k_positions(stages[stage], candidates, k)
                selections.append(chosen[0].cpu())
        coverage[stage], token_coverage[stage], per_layer = _coverage(selections, spans)
    return coverage, token_coverage, per_layer


def _captured_mass(model, tokenizer, method, budget, sample, shared, ids, full_tokens, spans):
    """Per answer step (full attention's own answer fed to both), the mass of full attention
    that the SFI memory holds (all of it on a slow step): mean over layers, and the lowest
    layer; the step's kind; and per answer the share of (layer, KV head) memories holding all
    of its ``spans`` tokens."""
    sfi_cache = build_cache(model, tokenizer, method, budget=budget, context=sample.context)
    held: list[float] = []
    answers: dict[str, list[float]] = {answer: [] for answer in spans}

    def observe(layer, attention: torch.Tensor) -> None:
        mass = attention[0].float()  # [H, G, T]
        if "slow" in sfi_cache.step_kinds():
            held.append(1.0)
            for shares in answers.values():
                shares.append(1.0)
            return
        mask = _memory_mask(sfi_cache, layer.layer_idx, mass.shape[-1]).to(mass.device)
        held.append(float(((mass * mask[:, None, :]).sum(-1) / mass.sum(-1)).mean()))
        for answer, span in spans.items():
            answers[answer].append(float(mask[:, span].all(-1).float().mean()))

    full = EvictionCache(model, policy=None, observer=observe)
    for cache in (sfi_cache, full):
        shared.load(cache)
        prefill(model, cache, ids[:, shared.length:], start=shared.length)
    total = ids.shape[1]
    captured, lowest, kinds = [], [], []
    by_step: list[dict[str, float]] = []
    for step, token in enumerate(full_tokens[:-1]):
        position = torch.tensor([total + step], device=ids.device)
        token_t = torch.tensor([token], device=ids.device)
        decode_one(model, sfi_cache, token_t, position)  # the SFI memory of this step
        kinds.append(sfi_cache.step_kinds()[0])
        held.clear()
        for shares in answers.values():
            shares.clear()
        decode_one(model, full, token_t, position)  # full attention, observed against it
        captured.append(round(sum(held) / len(held), 4))
        lowest.append(round(min(held), 4))
        by_step.append({a: round(sum(v) / len(v), 4) for a, v in answers.items() if v})
    return captured, lowest, kinds, by_step


def _held_at_answer(tokenizer: Any, full_tokens: list[int], spans: dict[str, list[int]],
                    by_step: list[dict[str, float]]) -> dict[str, float | None]:
    """Per answer, its share in ``by_step`` at the step that writes its first token in full
    attention's output: token ``j`` is written by step ``j - 1`` (token 0 by the prompt's
    last forward, which reads densely: None, as for an answer full attention never writes)."""
    text = tokenizer.decode(full_tokens, skip_special_tokens=True)
    ends = [len(tokenizer.decode(full_tokens[: j + 1], skip_special_tokens=True))
            for j in range(len(full_tokens))]  # the text's length once token j is written
    held: dict[str, float | None] = {}
    for answer in spans:
        start = text.find(answer)
        first = bisect.bisect_right(ends, start) if start >= 0 else None
        step = None if not first else first - 1
        held[answer] = None if step is None or step >= len(by_step) else \
            by_step[step].get(answer)
    return held
