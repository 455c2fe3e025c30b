"""``sfi bench --weights``: the throughput benchmark once per weight format, in one process.

Each format (``sfi.weights.layout.WEIGHT_FORMATS``) loads the model again and runs
:func:`sfi.bench.throughput.run_bench`; every format but ``native`` is also read against the
native weights, teacher-forced (:func:`sfi.eval.fidelity.weight_fidelity`), and every row gets
its tokens/s ratio to the native row of the same cell and mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sfi.bench.throughput import benchmark_ids, run_bench


def run_weight_formats(load_model: Callable[[str], tuple[torch.nn.Module, Any]],
                       formats: Sequence[str], *, fidelity_tokens: int = 1024,
                       progress: Callable[[str], None] | None = None,
                       **bench: Any) -> dict[str, Any]:
    """:func:`run_bench` once per weight format (``sfi.weights.layout.WEIGHT_FORMATS``), in one
    process.

    ``load_model(format) -> (model, tokenizer)``. Rows carry their ``weights`` and, beside the
    native rows of the same cell and mode, ``speedup_vs_native``. Every format but ``native``
    also gets its teacher-forced fidelity to the native weights (``fidelity``: KL, top-1,
    perplexities over ``fidelity_tokens`` essay tokens, full attention).
    """
    from sfi.decoding.compiled import compiled_forward
    from sfi.eval.fidelity import next_token_log_probs, weight_fidelity

    formats = list(dict.fromkeys(formats))
    reference = ids = None
    if any(f != "native" for f in formats):
        model, tokenizer = load_model("native")
        ids = benchmark_ids(tokenizer, fidelity_tokens, 1)
        reference = next_token_log_probs(model, ids)
        del model
    result: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    fidelity: list[dict[str, Any]] = []
    for i, name in enumerate(formats):
        if progress:
            progress(f"weights {name}")
        model, tokenizer = load_model(name)
        if reference is not None and ids is not None and name != "native":
            fidelity.append(weight_fidelity(name, reference, model, ids).to_dict())
        one = run_bench(model, tokenizer, progress=progress, weights=name,
                        **{**bench, "ggufs": bench.get("ggufs", ()) if i == 0 else ()})
        compiled = compiled_forward(model)
        del model
        rows.extend(one["rows"])
        if not result:
            result = one
        result.setdefault("weight_bytes_by_format", {})[name] = one["weight_bytes"]
        result.setdefault("compile_s_by_format", {})[name] = (
            None if compiled is None else round(compiled.compile_seconds, 2))
    native = {(r["context"], r["batch"], r["mode"]): r["decode_tok_s"] for r in rows
              if r["weights"] == "native"}
    for row in rows:
        base = native.get((row["context"], row["batch"], row["mode"]))
        if base:
            row["speedup_vs_native"] = round(row["decode_tok_s"] / base, 3)
    result.update(rows=rows, fidelity=fidelity, weights=formats)
    return result
