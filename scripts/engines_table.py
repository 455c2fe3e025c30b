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

from sfi.bench.plots import plot_engines


def _rate(cell: dict[tuple[str, str], dict[str, Any]], key: tuple[str, str]) -> float | None:
    row = cell.get(key)
    return row["decode_tok_s"] if row else None


def table(results: list[dict[str, Any]]) -> str:
    cells: dict[tuple[int, int], dict[tuple[str, str], dict[str, Any]]] = {}
    runs: dict[tuple[int, int], int] = {}
    for run, result in enumerate(results):
        for row in result["rows"]:
            where = (row["context"], row["batch"])
            if runs.setdefault(where, run) != run:
                sys.exit(f"context {where[0]}, batch {where[1]} was measured in two runs: "
                         "ratios compare rows of one run only")
            cells.setdefault(where, {})[(row["engine"], row["mode"])] = row
    llamas = sorted({mode for cell in cells.values() for engine, mode in cell
                     if engine == "llama.cpp"})
    head = (["context", "batch", "vLLM", "vLLM + SFI", "sfi: full", "sfi: SFI",
             "sfi: fast step only"] + [f"llama.cpp {m}" if m != "full" else "llama.cpp"
                                          for m in llamas])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (context, batch), cell in sorted(cells.items()):
        vllm, plugin = _rate(cell, ("vllm", "vllm")), _rate(cell, ("vllm", "vllm+sfi"))
        sfi = _rate(cell, ("sfi", "sfi"))
        ratios = [f"{sfi / vllm:.2f}x vLLM"] if sfi and vllm else []
        ratios += [f"{sfi / r:.2f}x {m}" for m in llamas
                   if sfi and (r := _rate(cell, ("llama.cpp", m)))]
        values = [f"{context:,}", str(batch), _fmt(vllm),
                  _fmt(plugin) + (f" ({plugin / vllm:.2f}x)" if plugin and vllm else ""),
                  _fmt(_rate(cell, ("sfi", "full"))),
                  _fmt(sfi) + (f" ({', '.join(ratios)})" if ratios else ""),
                  _fmt(_rate(cell, ("sfi", "sfi-fast-only")))]
        values += [_fmt(_rate(cell, ("llama.cpp", m))) for m in llamas]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


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
