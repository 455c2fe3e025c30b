"""Exact mode's speed-up against the measured fast/dense ratio, from ``sfi bench --json``
files with the modes full, sfi and sfi-exact:

    python scripts/figure_exact.py docs/eval/exact/bench-*.json --out docs/eval/exact/speedup.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sfi.bench.plots import exact_points, plot_exact_speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = [json.loads(p.read_text()) for p in args.results]
    for point in exact_points(results):
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in point.items()}))
    plot_exact_speedup(results, str(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
