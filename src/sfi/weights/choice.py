"""``weights="auto"``: the fastest weight format for this CPU whose next-token distributions stay
with the native weights', checked once per model and cached.

The candidates (:func:`candidates`) depend on the CPU and the batch: at batch 1 a decode step
streams every weight once, so fewer bytes are faster where the CPU's product reads them near
bandwidth: ``int8`` (a quarter of fp32's bytes) where int8 products are fast (AVX-512, or AVX2
with sfi's kernel, :mod:`sfi.weights.int8_kernel`); ``fp16`` (half) with AVX2 or AVX-512; ``native``
last, always. From two rows on the compiled reduction's products were measured slower than
native's (``docs/eval/weight-formats.md``; sfi's AVX2 kernel was not measured there), so
``native`` is the one candidate above batch 1. A format that does not
run here (:func:`sfi.weights.layout.format_runs`), or saves less than :data:`MIN_SAVING` of the
weight bytes (:func:`sfi.weights.layout.format_byte_saving`), is passed over.

Each candidate is checked by teacher forcing (:func:`sfi.eval.fidelity.weight_fidelity`: one
full-attention forward over :data:`CHECK_TOKENS` essay tokens, the format's next-token
distributions against the native weights') and kept only with mean KL(native || format) <=
:data:`MAX_KL` and top-1 agreement >= :data:`MIN_TOP1`. The measurement is stored in sfi's cache
folder (``weights/``), keyed by the model (its path, config and a fingerprint of its weights),
the format, the token count and the torch version, so a later load of the same model decides at
once. A candidate that fails leaves the model as it was: its layers are put back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import sfi.weights.int8_kernel as int8_kernel
from sfi.cache_folder import cache_root
from sfi.errors import SFIError
from sfi.texts import ESSAYS_HINT
from sfi.weights.int8_linear import int8_runs_fast
from sfi.weights.layout import (
    WEIGHT_FORMATS,
    format_byte_saving,
    format_runs,
    prefer_decode_layout,
)

#: the value of ``weights`` that asks for this module's choice
AUTO = "auto"
#: what ``sfi.load(weights=...)`` and ``--weights`` take
WEIGHT_CHOICES = (AUTO, *WEIGHT_FORMATS)
#: the largest mean KL(native || format) a format may have and be chosen
MAX_KL = 0.01
#: the smallest top-1 agreement with the native weights a format may have and be chosen
MIN_TOP1 = 0.97
#: the least share of the linear weights' bytes a format must save to be tried: a format that
#: stores only a few layers narrow (fp16 on a small model,
#: :func:`sfi.weights.fp16_linear.worth_storing`) saves too little to pay for its compiled step
#: (docs/eval/weight-formats.md)
MIN_SAVING = 0.25
#: essay tokens of the teacher-forced check
CHECK_TOKENS = 1024


def candidates(capability: str, batch: int, dtype: torch.dtype = torch.float32,
               int8_fast: bool = True) -> tuple[str, ...]:
    """Formats ``auto`` tries, fastest first, ``native`` last.

    Args:
        capability: ``torch.backends.cpu.get_cpu_capability()`` (``"AVX512"``, ``"AVX2"``, ...).
        batch: the most sequences decoded together; the reduced formats are for one.
        dtype: the model's dtype; ``fp16`` saves bytes only over a 32-bit model.
        int8_fast: whether int8 products are fast here
            (:func:`sfi.weights.int8_linear.int8_runs_fast`: AVX-512, or sfi's AVX2 kernel).
    """
    if batch > 1 or not capability.startswith(("AVX512", "AVX2")):
        return ("native",)
    int8 = ("int8",) if int8_fast else ()
    fp16 = ("fp16",) if dtype == torch.float32 else ()
    return (*int8, *fp16, "native")


@dataclass(frozen=True)
class Verdict:
    """A candidate format's teacher-forced agreement with the native weights."""

    format: str
    tokens: int
    kl_mean: float
    top1: float

    @property
    def passed(self) -> bool:
        return self.kl_mean <= MAX_KL and self.top1 >= MIN_TOP1

    def text(self) -> str:
        return f"{self.format}: KL {self.kl_mean:.1e}, top-1 {self.top1:.1%}"


@dataclass
class WeightChoice:
    """What ``auto`` chose (``format``) on a CPU of ``capability``, with the verdicts it read
    (measured now or cached) and the candidates passed over without one (format -> why)."""

    format: str
    capability: str
    batch: int
    verdicts: list[Verdict] = field(default_factory=list)
    passed_over: dict[str, str] = field(default_factory=dict)
    measured: bool = False

    def summary(self) -> str:
        """One line for the user: the format, the CPU and why."""
        reasons = [v.text() + (" (kept)" if v.passed else
                               f" (over KL {MAX_KL:g})" if v.kl_mean > MAX_KL else
                               f" (under top-1 {MIN_TOP1:.0%})") for v in self.verdicts]
        reasons += [f"{name}: {why}" for name, why in self.passed_over.items()]
        checked = (f" against native weights over {self.verdicts[0].tokens} tokens"
                   + ("" if self.measured else ", cached")) if self.verdicts else ""
        said = f"; {'; '.join(reasons)}" if reasons else ""
        return (f"weights auto -> {self.format} on this {self.capability} CPU at batch "
                f"{self.batch}{checked}{said}")


def choose_weights(model: torch.nn.Module, ids: torch.Tensor | None, *, key: str,
                   batch: int = 1,
                   capability: str | None = None, store: Path | None = None) -> WeightChoice:
    """Give ``model`` (a CPU model with plain ``nn.Linear`` layers, as loaded) the fastest
    format among :func:`candidates` that holds the fidelity bounds, in its decode layout
    (:func:`sfi.weights.layout.prefer_decode_layout`), and say which.

    Args:
        model: a causal LM on the CPU, not yet in a decode layout.
        ids: ``[1, N]`` token ids of real text, the teacher-forced check's input (None: no
            text to check with, so ``native``).
        key: what names the model in the verdicts' cache (its path or hub id).
        batch: the most sequences decoded together.
        capability: the CPU's (default: ``torch.backends.cpu.get_cpu_capability()``).
        store: the verdicts' folder (default: ``<sfi cache>/weights``).
    """
    from sfi.eval.fidelity import next_token_log_probs, weight_fidelity

    capability = capability or torch.backends.cpu.get_cpu_capability()
    store = store if store is not None else cache_root() / "weights"
    dtype = next(model.parameters()).dtype
    choice = WeightChoice(format="native", capability=capability, batch=batch)
    reference: torch.Tensor | None = None
    # int8 is fast with AVX-512's compiled loop, or on AVX2 in sfi's kernel (fp32 models)
    int8_may_run_fast = capability.startswith("AVX512") or (
        dtype == torch.float32 and int8_kernel.cpu_takes_kernel())
    for name in candidates(capability, batch, dtype, int8_may_run_fast):
        if name == "native":
            break
        saving = format_byte_saving(model, name)
        if saving < MIN_SAVING:
            choice.passed_over[name] = (f"saves {saving:.0%} of the weight bytes "
                                        f"(< {MIN_SAVING:.0%})")
            continue
        if ids is None:
            choice.passed_over[name] = f"not checked (no essays to check with; {ESSAYS_HINT})"
            continue
        path = store / f"{_fingerprint(model, key, name, ids)}.json"
        verdict = _read(path)
        if verdict is not None and not verdict.passed:  # decided without building anything
            choice.verdicts.append(verdict)
            continue
        # (on AVX2, int8_runs_fast builds sfi's int8 kernel, once per machine)
        if not format_runs(name, dtype):
            choice.passed_over[name] = "does not run here"
            continue
        if name == "int8" and not int8_runs_fast():
            choice.passed_over[name] = ("slow here: sfi's int8 kernel does not run "
                                        f"({int8_kernel.why_not()})")
            continue
        if verdict is not None:
            prefer_decode_layout(model, name)
            choice.verdicts.append(verdict)
            choice.format = name
            return choice
        linears = _linear_layers(model)
        try:
            if reference is None:
                reference = next_token_log_probs(model, ids)
            prefer_decode_layout(model, name)
            measured = weight_fidelity(name, reference, model, ids)
        except Exception as exc:  # a check that cannot run (memory, a model's own limits)
            _put_back(model, linears)
            choice.passed_over[name] = f"not checked ({type(exc).__name__}: {exc})"
            continue
        verdict = Verdict(name, measured.tokens, measured.kl_mean, measured.top1)
        _write(path, verdict)
        choice.verdicts.append(verdict)
        choice.measured = True
        if verdict.passed:
            choice.format = name
            return choice
        _put_back(model, linears)
    prefer_decode_layout(model, "native")
    return choice


def check_ids(tokenizer: Any, tokens: int = CHECK_TOKENS) -> torch.Tensor | None:
    """``[1, tokens]`` ids of the essays' first tokens (``sfi.texts``), the check's input;
    None where the essays are not installed."""
    from sfi.texts import essays

    try:
        text = essays()[: tokens * 8]  # a token is seldom more than 8 characters of English
    except SFIError:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return torch.tensor([ids])


def _linear_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """``(parent, name, layer)`` of every ``nn.Linear``, to put back after a failed check."""
    return [(parent, name, module) for parent in model.modules()
            for name, module in parent.named_children() if isinstance(module, torch.nn.Linear)]


def _put_back(model: torch.nn.Module,
              linears: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    for parent, name, module in linears:
        setattr(parent, name, module)


#: what a verdict's cache key says of how formats are made and checked; raised when either
#: changes, so that older verdicts are measured again
SCHEME = 1


def _fingerprint(model: torch.nn.Module, key: str, name: str, ids: torch.Tensor) -> str:
    """A hash of what a verdict depends on: the model (its name, config, parameter count and a
    sample of its first and last linear weights), the format, the check's token ids, torch and
    :data:`SCHEME`."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    sums = [float(m.weight.detach().reshape(-1)[::997].double().sum())
            for m in (linears[:1] + linears[-1:])]
    config = getattr(model, "config", None)
    described = {
        "key": key, "format": name, "scheme": SCHEME, "torch": torch.__version__.split("+")[0],
        "ids": hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest(),
        "config": config.to_json_string(use_diff=False) if config is not None else "",
        "parameters": sum(p.numel() for p in model.parameters()), "sums": sums,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def _read(path: Path) -> Verdict | None:
    try:
        return Verdict(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent, or not a verdict: measure again
        return None


def _write(path: Path, verdict: Verdict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(verdict)))
    except OSError:  # a read-only cache folder: the verdict is measured again next time
        pass
