"""Tables in the docs that are rendered from the JSON under ``docs/eval``, so that a figure in a
page and its data cannot disagree.

A page marks each such table with an HTML comment naming its renderer and data files,
``<!-- table: NAME FILE[,FILE...] [only=LABEL|LABEL...] -->`` (several ``sfi eval`` results
are merged as ``sfi report`` merges them; ``only`` keeps some of an evaluation's methods),
followed by the table and ``<!-- /table -->``. ``python -m
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

BLOCK = re.compile(r"(<!-- table: (.*?) -->\n)(.*?)(<!-- /table -->)", re.S)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _rate(value: float | None) -> str:
    """A tokens/s cell: one decimal, ``-`` where nothing was measured."""
    return "-" if value is None else f"{value:.1f}"


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


def sfi_against_peers(data: dict[str, Any]) -> str:
    """``sfi bench --modes full-static,sfi,sfi-fast-only --gguf ... --json``, one line per
    context and weight format of sfi's rows: the decode tokens/s of the dense step
    (``full-static``), of the default preset (``sfi``) with its ratio to the dense step and of
    the fast step alone (``sfi-fast-only``), each llama.cpp row's tokens/s at the same context
    and batch, and ``sfi``'s ratio to each."""
    ours: dict[tuple[int, int, str], dict[str, float]] = {}
    peers: dict[tuple[int, int], dict[str, float]] = {}
    for r in data["rows"]:
        if r["mode"].startswith("llama.cpp"):
            peers.setdefault((r["context"], r["batch"]), {})[r["mode"]] = r["decode_tok_s"]
        else:
            ours.setdefault((r["context"], r["batch"], r["weights"]), {})[r["mode"]] = \
                r["decode_tok_s"]
    llamas = sorted({m for cell in peers.values() for m in cell})

    def ratio(value: float | None, base: float | None) -> str:
        return "-" if not value or not base else f"{value / base:.2f}x"

    rows = []
    for (context, batch, weights), cell in ours.items():
        peer = peers.get((context, batch), {})
        sfi, dense = cell.get("sfi"), cell.get("full-static")
        rows.append([f"{context:,}", weights, _rate(dense), _rate(sfi), ratio(sfi, dense),
                     _rate(cell.get("sfi-fast-only")), *(_rate(peer.get(m)) for m in llamas),
                     *(ratio(sfi, peer.get(m)) for m in llamas)])
    return _table(["context", "weights", "dense, preallocated", "`sfi` (default preset)",
                   "x dense", "fast step alone", *llamas,
                   *(f"`sfi` x {m.removeprefix('llama.cpp ')}" for m in llamas)], rows)


def eval_scores(data: dict[str, Any]) -> str:
    """``sfi eval``'s results (``results.json``): its report's task x method table."""
    from sfi.eval.report import table_rows

    header, cells = table_rows(data["summary"])
    return _table(header, cells)


def eval_averages(data: dict[str, Any]) -> str:
    """``sfi eval``'s results: one line per method, its reads, its average score over the
    tasks and its paired difference to full attention with the same weights, both with 95%
    bootstrap intervals."""
    from sfi.eval.report import table_rows

    header, cells = table_rows(data["summary"])
    if "avg" not in header:
        raise ValueError("eval-averages averages retrieval tasks; these results hold none")
    keep = [header.index(c) for c in ("context", "method", "retention", "avg", "95% CI",
                                      "vs full [95% CI]")]
    return _table(["context", "method", "reads per step", "score", "95% CI",
                   "vs full [95% CI]"], [[row[i] for i in keep] for row in cells])


def eval_items(data: dict[str, Any]) -> str:
    """``sfi eval``'s results for the long-answer tasks (``codesN``): per method its reads, the
    items found of those asked, the items lost and gained against full attention on the same
    samples, and its paired score difference to full attention."""
    from sfi.eval.report import table_rows

    header, cells = table_rows(data["summary"])
    delta = header.index("vs full [95% CI]")
    rows = [[*row[:3], f"{e['items']['found']} / {e['items']['asked']}",
             e["items"].get("lost_vs_full", "-"), e["items"].get("gained_vs_full", "-"),
             row[delta]] for e, row in zip(data["summary"], cells) if "items" in e]
    return _table(["context", "method", "retention", "items found", "lost vs full",
                   "gained vs full", "score vs full [95% CI]"], rows)


def eval_fidelity(data: dict[str, Any]) -> str:
    """``sfi eval --tasks fidelity``'s results: per method its reads, KL(full || method) per
    sample and their mean, top-1 agreement with full attention and the slow steps per sample."""
    from sfi.eval.report import label

    rows = []
    for e in data["summary"]:
        if "kl" not in e:  # a method of the merged runs with no fidelity rows
            continue
        mine = sorted((r for r in data["rows"] if r["task"] == "fidelity"
                       and r["context"] == e["context"] and label(r) == e["label"]),
                      key=lambda r: r["sample"])
        slow = [r.get("slow_steps") for r in mine]
        rows.append([e["context"], e["label"], f"{100 * e['retention']:.1f}%",
                     " / ".join(f"{r['kl']:.3f}" for r in mine), f"{e['kl']:.3f}",
                     f"{100 * e['top1']:.1f}",
                     "-" if None in slow else " / ".join(map(str, slow))])
    return _table(["context", "method", "retention", "KL by sample", "mean KL", "top1 %",
                   "slow steps by sample"], rows)


def eval_generation(data: dict[str, Any]) -> str:
    """``sfi eval --tasks generation,generation_code``'s results: per method its reads and the
    free-generation table of its report (full attention's top-1 agreement with the text, its
    perplexity of the text over that of its own, distinct 4-grams over full attention's, 95%
    intervals over the samples; the median first departure; identical texts)."""
    def ci(g: dict[str, Any], key: str) -> str:
        low, high = g.get(f"{key}_ci") or (None, None)
        return f"{g[key]:.3f}" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")

    rows = [[e["context"], e["label"], f"{100 * e['retention']:.1f}%",
             f"{100 * g['top1']:.1f}", ci(g, "ppl_ratio"),
             ci(g, "distinct_ratio") if "distinct_ratio" in g else "-",
             "-" if g["divergence_median"] is None else g["divergence_median"],
             f"{g['identical']} of {g['samples']}"]
            for e in data["summary"] if (g := e.get("generation"))]
    return _table(["context", "method", "retention", "top1 %", "ppl ratio", "distinct-4 ratio",
                   "first departure", "identical"], rows)


def bench_modes(data: dict[str, Any]) -> str:
    """``sfi bench --modes full,full-static,sfi,sfi-fast-only --json`` (one weight format and
    batch): one line per context, each mode's decode tokens/s, ``sfi``'s speed-up over both
    dense modes, the fast step of ``sfi`` and of ``sfi-fast-only`` and the fast step's byte
    floor."""
    cells: dict[int, dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        cells.setdefault(r["context"], {})[r["mode"]] = r

    def num(r: dict[str, Any] | None, key: str, form: str, unit: str = "") -> str:
        return "-" if r is None or r.get(key) is None else format(r[key], form) + unit

    rows = []
    for context, cell in cells.items():
        sfi, fast = cell.get("sfi"), cell.get("sfi-fast-only")
        rows.append([f"{context:,}", *(num(cell.get(m), "decode_tok_s", ".1f")
                                       for m in ("full", "full-static", "sfi")),
                     num(sfi, "speedup_vs_full_static", ".2f", "x"),
                     num(sfi, "speedup_vs_full", ".2f", "x"),
                     f"{num(sfi, 'fast_step_ms', '.1f')} / {num(fast, 'fast_step_ms', '.1f')} ms",
                     num(sfi, "floor_ms", ".1f", " ms")])
    return _table(["context", "full tok/s", "full-static tok/s", "sfi tok/s",
                   "sfi x full-static", "sfi x full", "fast step, sfi / fast-only",
                   "floor (fast step)"], rows)


def vllm_engines(data: dict[str, Any]) -> str:
    """``sfi bench-vllm --json``: one line per context and batch, each engine and mode's decode
    tokens/s, vLLM + SFI against stock vLLM and sfi's default preset against stock vLLM and
    each llama.cpp row of its cell (``scripts/engines_table.py`` prints it). A row measured
    twice (two runs of one cell joined) is refused: ratios compare rows of one run only."""
    cells: dict[tuple[int, int], dict[tuple[str, str], float]] = {}
    for r in data["rows"]:
        cell = cells.setdefault((r["context"], r["batch"]), {})
        if (r["engine"], r["mode"]) in cell:
            raise ValueError(f"context {r['context']}, batch {r['batch']}: {r['engine']} "
                             f"{r['mode']} measured twice; ratios compare rows of one run only")
        cell[r["engine"], r["mode"]] = r["decode_tok_s"]
    llamas = sorted({m for cell in cells.values() for e, m in cell if e == "llama.cpp"})

    rows = []
    for (context, batch), cell in sorted(cells.items()):
        vllm, plugin = cell.get(("vllm", "vllm")), cell.get(("vllm", "vllm+sfi"))
        sfi = cell.get(("sfi", "sfi"))
        ratios = [f"{sfi / vllm:.2f}x vLLM"] if sfi and vllm else []
        ratios += [f"{sfi / r:.2f}x {m}" for m in llamas
                   if sfi and (r := cell.get(("llama.cpp", m)))]
        rows.append([f"{context:,}", batch, _rate(vllm),
                     _rate(plugin) + (f" ({plugin / vllm:.2f}x)" if plugin and vllm else ""),
                     _rate(cell.get(("sfi", "full"))),
                     _rate(sfi) + (f" ({', '.join(ratios)})" if ratios else ""),
                     _rate(cell.get(("sfi", "sfi-fast-only"))),
                     *(_rate(cell.get(("llama.cpp", m))) for m in llamas)])
    return _table(["context", "batch", "vLLM", "vLLM + SFI", "sfi: full", "sfi: SFI",
                   "sfi: fast step only",
                   *(f"llama.cpp {m}" if m != "full" else "llama.cpp" for m in llamas)], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "weight-products": weight_products, "weight-format-steps": weight_format_steps,
    "versus-llama-cpp": versus_llama_cpp, "sfi-against-peers": sfi_against_peers,
    "eval-scores": eval_scores, "eval-averages": eval_averages, "eval-items": eval_items,
    "eval-fidelity": eval_fidelity, "eval-generation": eval_generation,
    "bench-modes": bench_modes, "vllm-engines": vllm_engines}


def load_data(files: list[Path], only: list[str] | None = None) -> dict[str, Any]:
    """The data a table renders: one JSON file, or several as one (``sfi eval`` results
    merged as ``sfi report`` merges them, other files' ``rows`` joined in order); ``only``
    keeps the ``sfi eval`` summary entries of those labels, in the report's order."""
    loaded = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    names = ", ".join(f.name for f in files)
    evals = sum("summary" in d for d in loaded)
    if len(loaded) == 1:
        data = loaded[0]
    elif evals == len(loaded):
        from sfi.eval.report import merge_results

        data = merge_results(loaded)
    elif evals:
        raise ValueError(f"{names}: sfi eval results and other data cannot make one table")
    else:
        data = {**loaded[0], "rows": [r for d in loaded for r in d["rows"]]}
    if only is not None:
        if "summary" not in data:
            raise ValueError(f"only= picks sfi eval methods; {names} hold no eval summary")
        missing = set(only) - {e["label"] for e in data["summary"]}
        if missing:
            raise ValueError(f"only=: no method labelled {', '.join(sorted(missing))} in "
                             f"{names}")
        data = {**data, "summary": [e for e in data["summary"] if e["label"] in only]}
    return data


def parse_marker(spec: str) -> tuple[str, list[str], list[str] | None]:
    """``NAME FILE[,FILE...] [only=LABEL|LABEL...]`` (a marker's text) -> the renderer's name,
    the files, the labels (which may hold spaces: ``full (int8)``)."""
    name, _, rest = spec.strip().partition(" ")
    files, _, extra = rest.strip().partition(" ")
    extra = extra.strip()
    if name not in RENDERERS:
        raise ValueError(f"no table renderer named {name!r}")
    if not files:
        raise ValueError(f"table {name}: no data file")
    if extra and (not extra.startswith("only=") or extra == "only="):
        raise ValueError(f"table {name}: {extra!r} is not only=LABEL|LABEL...")
    only = [label.strip() for label in extra.removeprefix("only=").split("|")] if extra \
        else None
    return name, files.split(","), only


def render(page: Path) -> str:
    """``page``'s text with every marked table rendered again from its data: ``<!-- table:
    NAME FILE[,FILE...] [only=LABEL|LABEL...] -->`` (paths relative to the page)."""
    text = page.read_text(encoding="utf-8")

    def again(match: re.Match[str]) -> str:
        try:
            name, files, only = parse_marker(match.group(2))
            data = load_data([page.parent / f for f in files], only)
        except (ValueError, OSError) as error:
            raise ValueError(f"{page}: <!-- table: {match.group(2)} -->: {error}") from None
        return match.group(1) + RENDERERS[name](data) + match.group(4)

    return BLOCK.sub(again, text)


def main(pages: list[str]) -> None:
    for name in pages:
        page = Path(name)
        page.write_text(render(page), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
