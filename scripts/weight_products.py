"""One linear product of each weight path, in GB/s of weight bytes read, against a plain read.

Each path multiplies one fp32 row (``--rows``) by Qwen2.5-0.5B's weight shapes, cycling through
enough copies of the weight (``--megabytes`` in all) that each product reads it from memory,
not from the CPU's caches, as a decode step does. Prints one JSON object: the plain read's
GB/s (a sum over 512 MB, the bench's ``measure_bandwidth``) and, per shape and path, the median
milliseconds, GB/s and the share of the plain read.

    .venv/bin/python scripts/weight_products.py > docs/eval/weight-products-avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from sfi.bench.throughput import measure_bandwidth
from sfi.weights import int8_kernel
from sfi.weights.fp16_linear import fp16_product
from sfi.weights.int8_linear import int8_product, quantize_rows
from sfi.weights.layout import PackedLinear
from sfi.weights.reduction import compiled_for_shape

SHAPES = [(4864, 896), (896, 4864), (151936, 896)]  # MLP up, MLP down, output layer


def median_seconds(call: Callable[[int], object], copies: int, repeats: int) -> float:
    for i in range(3):
        call(i % copies)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i % copies)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shape_products(out: int, inp: int, rows: int, megabytes: int, repeats: int,
                   bandwidth: float) -> list[dict[str, object]]:
    """Each path's product for one weight shape."""
    elements = out * inp
    x = torch.randn(rows, inp)
    copies = max(2, megabytes * 2 ** 20 // elements)
    w8, scale = quantize_rows(torch.randn(out, inp))
    int8s = [w8.clone() for _ in range(copies)]
    fp16s = [torch.randn(out, inp).half() for _ in range(max(2, copies // 2))]
    packed = [PackedLinear(torch.nn.Linear(inp, out, bias=False))
              for _ in range(max(2, copies // 4))]
    reduced8 = compiled_for_shape(int8_product, inp, out)
    reduced16 = compiled_for_shape(fp16_product, inp, out)
    paths: dict[str, tuple[Callable[[int], object], int, int]] = {
        "fp32 oneDNN (native)": (lambda i: packed[i](x), len(packed), 4),
        "fp16 compiled reduction": (lambda i: reduced16(x, fp16s[i]), len(fp16s), 2),
        "int8 compiled reduction": (lambda i: reduced8(x, int8s[i], scale), copies, 1),
    }
    if int8_kernel.available():
        paths["int8 sfi kernel"] = (lambda i: torch.ops.sfi.int8_gemv(x, int8s[i], scale),
                                    copies, 1)
    found = []
    with torch.inference_mode():
        for name, (call, count, width) in paths.items():
            seconds = median_seconds(call, count, repeats)
            gb_s = elements * width / seconds / 1e9
            found.append({"shape": f"{out}x{inp}", "path": name, "ms": round(seconds * 1e3, 3),
                          "gb_s": round(gb_s, 1), "of_bandwidth": round(gb_s / bandwidth, 2)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    bandwidth = measure_bandwidth()
    result = {"cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "rows": args.rows, "bandwidth_gb_s": round(bandwidth, 2),
              "int8_kernel": int8_kernel.available(), "products": []}
    for out, inp in SHAPES:
        result["products"] += shape_products(out, inp, args.rows, args.megabytes, args.repeats,
                                             bandwidth)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
