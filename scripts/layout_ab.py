"""The fast step with the old CPU weight layout against packed oneDNN weights, in one process.

Run as ``.venv/bin/python scripts/layout_ab.py``: loads the default model four times,
alternating the old layout (MKL, wide weights stored transposed) and ``sfi.weights.layout``'s packed
layers, and times ``sfi-fast-only`` (synthetic KV, 32 steps) at 4K and 16K, batch 1 and 4.
Prints one line per load, then the whole result as JSON (``docs/eval/layout-ab.json``).
"""

import json

import torch

from sfi import SFIConfig
from sfi.bench.throughput import run_bench
from sfi.models import load
from sfi.weights import layout as weight_layout

torch.set_num_threads(2)
result = {}
for name in ("transposed-mkl", "packed-onednn", "transposed-mkl#2", "packed-onednn#2"):
    check = weight_layout.format_runs
    if name.startswith("transposed"):
        weight_layout.format_runs = lambda weights, dtype: False  # the fallback layout
    model, tokenizer = load("default", weights="native")
    weight_layout.format_runs = check
    bench = run_bench(model, tokenizer, contexts=[4096, 16384], batches=[1, 4], new_tokens=32,
                      config=SFIConfig(), modes=["sfi-fast-only"], synthetic_kv=True)
    result[name] = [(row["context"], row["batch"], row["fast_step_ms"], row["decode_tok_s"])
                    for row in bench["rows"]]
    print(name, result[name], flush=True)
    del model
print(json.dumps(result))
