"""The README's performance table and plot from ``sfi bench-vllm --json`` outputs.

    .venv/bin/python scripts/engines_table.py RUN.json [RUN.json ...] [--plot engines.png]

One markdown row per (context, batch) of every run: each engine and mode's decode tokens/s,
with vLLM + SFI against stock vLLM and sfi's default preset against stock vLLM and against
each llama.cpp row of its cell (a cell measured by two of the runs is refused: ratios only
within a run, as measured); ``--plot`` draws every run's rows with
:func:`sfi.bench.plots.plot_engines` (one panel per batch size).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sfi.bench.doc_tables import vllm_engines
from sfi.bench.plots import plot_engines


def table(results: list[dict[str, Any]]) -> str:
    """Every run's rows as one table (:func:`sfi.bench.doc_tables.vllm_engines`)."""
    try:
        return vllm_engines({"rows": [row for result in results for row in result["rows"]]})
    except ValueError as error:
        sys.exit(str(error))


def main() -> None:
    args = sys.argv[1:]
    plot = None
    if "--plot" in args:
        at = args.index("--plot")
        if at + 1 == len(args):
            sys.exit("--plot needs a file name")
        plot, args = args[at + 1], args[:at] + args[at + 2:]
    results = [json.loads(Path(path).read_text()) for path in args]
    print(table(results))
    if plot:
        merged = dict(results[0], rows=[row for r in results for row in r["rows"]])
        plot_engines(merged, plot)


if __name__ == "__main__":
    main()
