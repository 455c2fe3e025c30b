"""What the coverage probes cost a fast step, measured in one process.

Run as ``.venv/bin/python scripts/probe_ab.py [context] [batch] [reps] [model] [weights]``
(default 16384 1 12 default native; ``weights`` as ``sfi.load``'s, int8 compiling the step):
fills a cache of the default model with synthetic KV, then alternates ``reps`` times 20 fast
steps with the default preset's 8 probe layers, 20 with them and the copy probe
(``coverage_copy``, at a share of 1, so that it computes its verdict and never flags) and 20
without probes (the same cache, the sequences' configuration switched between them; no refresh
happens), and prints the median step of each block and the medians of the paired differences.
"""

import statistics
import sys
import time
from dataclasses import replace

import torch

from sfi.bench.throughput import benchmark_ids, make_bench_cache
from sfi.core.config import SFIConfig
from sfi.decoding.decode_step import decode_one
from sfi.decoding.prefill import prefill
from sfi.decoding.prefix import prefix_kv
from sfi.models import load

torch.set_num_threads(2)
args = sys.argv[1:] + ["16384", "1", "12", "default", "native"][len(sys.argv) - 1:]
context, batch, reps = (int(a) for a in args[:3])
model, tokenizer = load(args[3], weights=args[4])
# never refresh: the pages' probe never flags at a threshold of 1, the copy probe never at a
# share of 1 (it computes its verdict all the same)
probing = replace(SFIConfig(), trigger="bootstrap", coverage_threshold=1.0, coverage_copy=0.0)
configs = {"probes": probing, "probes+copy": replace(probing, coverage_copy=1.0),
           "no probes": replace(probing, coverage_layers=0)}
ids = benchmark_ids(tokenizer, context, batch)
window = probing.evidence_window
medians: dict[str, list[float]] = {name: [] for name in configs}
with torch.inference_mode():
    prefix = prefix_kv(model, ids[:, :-window], True)
    cache = make_bench_cache("sfi", model, tokenizer, probing, prefix, context + 20 * 2 * reps + 20)
    token = prefill(model, cache, ids[:, -window:], start=context - window).argmax(-1)
    position = torch.full((batch,), context, dtype=torch.long)
    for _ in range(5):
        token = decode_one(model, cache, token, position).argmax(-1)
        position = position + 1
    for _ in range(reps):
        for name, config in configs.items():
            for sequence in cache.planner.sequences:
                sequence.config = config
            times = []
            for _ in range(20):
                start = time.perf_counter()
                token = decode_one(model, cache, token, position).argmax(-1)
                times.append(time.perf_counter() - start)
                position = position + 1
            if set(cache.step_kinds()) != {"fast"}:
                raise SystemExit(f"a step was not fast: {cache.step_kinds()}")
            medians[name].append(statistics.median(times) * 1e3)
for name, values in medians.items():
    print(f"{name:12s}", " ".join(f"{v:.2f}" for v in values), "ms")


def paired(a: str, b: str) -> float:
    return statistics.median(x - y for x, y in zip(medians[a], medians[b]))


print(f"the probes' cost per step (median of paired differences): "
      f"{paired('probes', 'no probes'):.2f} ms")
print(f"the copy probe's cost on top of them: {paired('probes+copy', 'probes'):.2f} ms")
