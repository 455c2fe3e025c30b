"""llama.cpp as a benchmark peer (``llama-cpp-python``): which GGUF files to run, what weight
type each stores, and one greedy decode timed step by step.

llama.cpp runs with as many threads as PyTorch uses (the cores), prompt batches of 512, its KV
in F16 (its default), and flash attention on or off as asked: which of the two is faster on a
CPU depends on the context (``sfi bench --gguf-flash-attn on,off`` times both).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path

from sfi.errors import SFIError

#: the word ``--gguf`` takes for the model's own packaged GGUF
PACKAGED = "packaged"
#: what a row of llama.cpp with flash attention off adds to its mode's name
NO_FLASH_ATTN = "no-fa"


def gguf_weights(gguf: str | Path) -> str:
    """The weight type most of a GGUF's matrices are stored in (``Q4_1``, ``Q5_0``, ``Q8_0``,
    ``F16``, ``F32``, ...): what a llama.cpp row reads, named in its ``mode``."""
    from collections import Counter

    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors
                    if len(t.shape) > 1 and min(int(n) for n in t.shape) > 1)
    return types.most_common(1)[0][0] if types else "F32"


def installed() -> bool:
    """Whether ``llama-cpp-python`` can be imported here."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_files(model: str, items: Sequence[str]) -> list[Path]:
    """The GGUF files ``--gguf`` names (``packaged``: the model's own), checked: each exists,
    is a GGUF, and stores another weight type than the others (rows are named by it)."""
    from sfi.models import packaged_gguf

    paths: list[Path] = []
    for item in items:
        if item == PACKAGED:
            own = packaged_gguf(model) or (Path(model) if model.endswith(".gguf") else None)
            if own is None:
                raise SFIError(f"--gguf {PACKAGED}: {model!r} is neither a packaged model nor "
                               "a .gguf file")
            paths.append(own)
            continue
        path = Path(item).expanduser()
        if not path.is_file():
            raise SFIError(f"--gguf: no file {item!r}")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise SFIError(f"--gguf: {item!r} is not a GGUF file")
        paths.append(path)
    if paths and not installed():
        raise SFIError("--gguf runs llama.cpp, which needs llama-cpp-python (pip install "
                       "llama-cpp-python)")
    named: dict[str, Path] = {}
    for path in paths:
        weights = gguf_weights(path)
        if (other := named.setdefault(weights, path)) != path:
            raise SFIError(f"llama.cpp would run {str(other)!r} and {str(path)!r}, which both "
                           f"store {weights} weights: their rows would share a name")
    return paths


def flash_attn_settings(value: str) -> tuple[bool, ...]:
    """``--gguf-flash-attn``'s value (``on``, ``off``, or both, comma-separated) as the flash
    attention settings llama.cpp runs with, in order."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names or any(name not in ("on", "off") for name in names) or \
            len(set(names)) != len(names):
        raise SFIError(f"--gguf-flash-attn takes on, off or on,off; got {value!r}")
    return tuple(name == "on" for name in names)


def decode_times(gguf: str | Path, prompt: list[int], new_tokens: int, warmup: int,
                 threads: int, flash_attn: bool = True) -> list[float]:
    """llama.cpp decoding greedily after ``prompt`` (token ids): the seconds of each one-token
    ``eval`` after ``warmup`` untimed ones."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(prompt) + warmup + new_tokens + 8,
                          n_threads=threads, n_threads_batch=threads, n_batch=512,
                          flash_attn=flash_attn, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(prompt)
    times = []
    for _ in range(warmup + new_tokens):
        last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        token = int(np.argmax(np.ctypeslib.as_array(last, shape=(vocab,))))
        begin = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - begin)
    llm.close()
    return times[warmup:]
