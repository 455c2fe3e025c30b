"""Tables in the docs that are rendered from the JSON under ``docs/eval``, so that a figure in a
page and its data cannot disagree.

A page marks each such table with an HTML comment naming its renderer and data file,
``<!-- table: NAME FILE -->``, followed by the table and ``<!-- /table -->``. ``python -m
sfi.bench.doc_tables PAGE...`` rewrites every marked table from its data; ``tests/test_docs.py``
fails when a page's table differs from what its data renders.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"(<!-- table: (\S+) (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *map(_row, rows)]) + "\n"


def weight_products(data: dict[str, Any]) -> str:
    """``scripts/weight_products.py``'s output: milliseconds and GB/s per shape and path."""
    paths = list(dict.fromkeys(p["path"] for p in data["products"]))
    shapes = list(dict.fromkeys(p["shape"] for p in data["products"]))
    cell = {(p["shape"], p["path"]): p for p in data["products"]}
    rows = [[shape.replace("x", " x ")] + [
        f"{cell[shape, path]['ms']:.2f} ms, {cell[shape, path]['gb_s']:.1f} GB/s "
        f"({cell[shape, path]['of_bandwidth']:.0%})" if (shape, path) in cell else "-"
        for path in paths] for shape in shapes]
    return _table(["weight (out x in), 1 row", *paths], rows)


def weight_format_steps(data: dict[str, Any]) -> str:
    """``sfi bench --weights ... --json``: decode tokens/s and step times per format, context
    and mode, with the byte floor and the ratio to the same format's dense step."""
    dense = {(r["weights"], r["context"], r["batch"]): r["decode_tok_s"] for r in data["rows"]
             if r["mode"] == "full-static"}
    rows = []
    for r in data["rows"]:
        step = r["fast_step_ms"] if r["fast_step_ms"] is not None else r["step_ms"]
        base = dense.get((r["weights"], r["context"], r["batch"]))
        rows.append([r["weights"], f"{r['context']:,}", f"`{r['mode']}`",
                     f"{r['decode_tok_s']:.2f}", f"{step:.1f}", f"{r['floor_ms']:.1f}",
                     f"{r['decode_tok_s'] / base:.2f}x" if base else "-"])
    return _table(["weights", "context", "mode", "tokens/s", "step (fast step) ms",
                   "byte floor ms", "x dense, same weights"], rows)


def versus_llama_cpp(data: dict[str, Any]) -> str:
    """``sfi bench --weights ... --gguf ... --json``: decode tokens/s of each of sfi's rows and
    its ratio to llama.cpp's (the first llama.cpp row of the same context and batch)."""
    peer = {}
    for r in data["rows"]:
        if r["mode"].startswith("llama.cpp"):
            peer.setdefault((r["context"], r["batch"]), r)
    rows = []
    for r in data["rows"]:
        other = peer.get((r["context"], r["batch"]))
        if r["mode"].startswith("llama.cpp") or other is None:
            continue
        rows.append([f"{r['context']:,}", r["weights"], f"`{r['mode']}`",
                     f"{r['decode_tok_s']:.2f}", f"{other['decode_tok_s']:.2f}",
                     f"{r['decode_tok_s'] / other['decode_tok_s']:.2f}x"])
    name = next(iter(peer.values()))["mode"] if peer else "llama.cpp"
    return _table(["context", "sfi weights", "sfi mode", "sfi tokens/s", f"{name} tokens/s",
                   "sfi x llama.cpp"], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "weight-products": weight_products, "weight-format-steps": weight_format_steps,
    "versus-llama-cpp": versus_llama_cpp}


def render(page: Path) -> str:
    """``page``'s text with every marked table rendered again from its data (paths relative
    to the page)."""
    text = page.read_text(encoding="utf-8")

    def again(match: re.Match[str]) -> str:
        name, data_file = match.group(2), match.group(3)
        if name not in RENDERERS:
            raise ValueError(f"{page}: no table renderer named {name!r}")
        data = json.loads((page.parent / data_file).read_text(encoding="utf-8"))
        return match.group(1) + RENDERERS[name](data) + match.group(5)

    return BLOCK.sub(again, text)


def main(pages: list[str]) -> None:
    for name in pages:
        page = Path(name)
        page.write_text(render(page), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
