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


def _ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``1.23x``, ``-`` where either was not measured."""
    return "-" if not value or not base else f"{value / base:.2f}x"


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


def weight_fidelity(data: dict[str, Any]) -> str:
    """``sfi bench --weights native,FORMAT... --json`` (one file or several, each its model's):
    per model and format, the weight bytes a step reads (native's beside them) and the
    format's teacher-forced fidelity to native weights: KL mean and max, top-1 agreement,
    perplexity of the real text (native's beside it)."""
    rows = []
    for part in data.get("parts", [data]):
        sizes = part["weight_bytes_by_format"]
        for f in part["fidelity"]:
            native = sizes.get("native", part.get("weight_bytes"))
            rows.append([part["model"], f["weights"],
                         f"{sizes[f['weights']] / 1e6:,.0f} MB (native {native / 1e6:,.0f} MB)",
                         f"{f['kl_mean']:.1e}", f"{f['kl_max']:.1e}", f"{100 * f['top1']:.1f}%",
                         f"{f['ppl']:.3f} ({f['ppl_native']:.3f})"])
    return _table(["model", "weights", "weight bytes read per step", "KL mean", "KL max",
                   "top-1 agreement", "perplexity (native)"], rows)


def weight_format_steps(data: dict[str, Any]) -> str:
    """``sfi bench --weights ... --json``: decode tokens/s and step times per format, context,
    batch and mode, with the byte floor, the ratio to the same format's dense step (where
    ``full-static`` ran) and to native weights in the same mode."""
    dense = {(r["weights"], r["context"], r["batch"]): r["decode_tok_s"] for r in data["rows"]
             if r["mode"] == "full-static"}
    rows = []
    for r in data["rows"]:
        step = r["fast_step_ms"] if r["fast_step_ms"] is not None else r["step_ms"]
        base = dense.get((r["weights"], r["context"], r["batch"]))
        native = r.get("speedup_vs_native")
        rows.append([r["weights"], f"{r['context']:,}", r["batch"], f"`{r['mode']}`",
                     f"{r['decode_tok_s']:.2f}", f"{step:.1f}", f"{r['floor_ms']:.1f}",
                     _ratio(r["decode_tok_s"], base),
                     "-" if native is None or r["weights"] == "native" else f"{native:.2f}x"])
    return _table(["weights", "context", "batch", "mode", "tokens/s", "step (fast step) ms",
                   "byte floor ms", "x dense, same weights", "x native, same mode"], rows)


def sfi_against_peers(data: dict[str, Any]) -> str:
    """``sfi bench --modes full-static,sfi,sfi-fast-only --gguf ... --json``, one line per
    context and weight format of sfi's rows: the decode tokens/s of the dense step
    (``full-static``), of the default preset (``sfi``) with its ratio to the dense step and of
    the fast step alone (``sfi-fast-only``), each GGUF's llama.cpp tokens/s at the same context
    and batch (the faster of flash attention on and off where both ran), and ``sfi``'s ratio to
    each."""
    from sfi.bench.llama_cpp import NO_FLASH_ATTN

    ours: dict[tuple[int, int, str], dict[str, float]] = {}
    peers: dict[tuple[int, int], dict[str, float]] = {}
    settings: dict[str, set[str]] = {}
    for r in data["rows"]:
        if r["mode"].startswith("llama.cpp"):
            gguf = r["mode"].removesuffix(f" {NO_FLASH_ATTN}")
            settings.setdefault(gguf, set()).add(r["mode"])
            cell = peers.setdefault((r["context"], r["batch"]), {})
            cell[gguf] = max(cell.get(gguf, 0.0), r["decode_tok_s"])
        else:
            ours.setdefault((r["context"], r["batch"], r["weights"]), {})[r["mode"]] = \
                r["decode_tok_s"]
    llamas = sorted(settings)

    def named(gguf: str) -> str:  # the mode as run, or both settings' faster
        modes = settings[gguf]
        return next(iter(modes)) if len(modes) == 1 else \
            f"{gguf} (faster of flash attn on/off, where both ran)"

    rows = []
    for (context, batch, weights), cell in ours.items():
        peer = peers.get((context, batch), {})
        sfi, dense = cell.get("sfi"), cell.get("full-static")
        rows.append([f"{context:,}", weights, _rate(dense), _rate(sfi), _ratio(sfi, dense),
                     _rate(cell.get("sfi-fast-only")), *(_rate(peer.get(m)) for m in llamas),
                     *(_ratio(sfi, peer.get(m)) for m in llamas)])
    return _table(["context", "weights", "dense, preallocated", "`sfi` (default preset)",
                   "x dense", "fast step alone", *map(named, llamas),
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


def eval_samples(data: dict[str, Any]) -> str:
    """``sfi eval``'s rows one sample at a time (for a few samples run again with levers):
    per context, task, sample and needle depth, each method's score, the start of its output
    and its reads."""
    from sfi.eval.report import label

    methods = list(dict.fromkeys(label(r) for r in data["rows"]))
    tasks = list(dict.fromkeys(r["task"] for r in data["rows"]))
    cells: dict[tuple[int, int, int, float], dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        key = (r["context"], tasks.index(r["task"]), r["sample"], r.get("depth") or 0.0)
        cells.setdefault(key, {})[label(r)] = r

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        start = " ".join(r["output"].split())[:14].replace("|", "/").replace("`", "'")
        return f"{r['score']:g}: `{start}` ({100 * r['retention']:.1f}%)"

    rows = []
    for (context, task, sample, _), by in sorted(cells.items()):
        depth = next(iter(by.values())).get("depth")
        rows.append([f"{context:,}", tasks[task], sample, "-" if depth is None else depth,
                     *(cell(by.get(m)) for m in methods)])
    return _table(["context", "task", "sample", "depth", *methods], rows)


def kv_drift(data: dict[str, Any]) -> str:
    """``scripts/kv_drift.py --out``: per variant of the decoded tokens' KV (as decoded,
    repaired at slow steps, repaired at every step) KL(full || SFI) per sample and its mean,
    top-1 agreement, slow steps per sample and the read fraction."""
    names = {"none": "as decoded", "slow": "repaired at slow steps",
             "every": "repaired at every step"}
    rows = []
    for variant, name in names.items():
        mine = sorted((r for r in data["rows"] if r["variant"] == variant),
                      key=lambda r: r["seed"])
        if not mine:
            continue
        mean = sum(r["kl"] for r in mine) / len(mine)
        rows.append([name, " / ".join(f"{r['kl']:.3f}" for r in mine), f"{mean:.3f}",
                     f"{100 * sum(r['top1'] for r in mine) / len(mine):.1f}",
                     " / ".join(str(r["slow_steps"]) for r in mine),
                     f"{100 * sum(r['read'] for r in mine) / len(mine):.1f}%"])
    return _table(["decoded tokens' KV", "KL by sample", "mean KL", "top-1 %",
                   "slow steps by sample", "read"], rows)


def exact_identity(data: dict[str, Any]) -> str:
    """``scripts/exact_identity.py``'s output: per model, the prompts decoded with
    ``mode="exact"`` whose tokens are full attention's, the tokens, verify steps and drafted
    tokens, the share of all drafts accepted and the lowest share of one prompt (of those that
    drafted)."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in data["rows"]:
        by_model.setdefault(r["model"], []).append(r)
    rows = []
    for model, mine in by_model.items():
        drafted = sum(r["drafted"] for r in mine)
        accepted = sum(r["acceptance"] * r["drafted"] for r in mine)
        shares = [r["acceptance"] for r in mine if r["drafted"]]
        rows.append([model, len(mine), sum(r["identical"] for r in mine),
                     f"{sum(r['new_tokens'] for r in mine):,}",
                     sum(r["verify_steps"] for r in mine), f"{drafted:,}",
                     f"{100 * accepted / drafted:.1f}%" if drafted else "-",
                     f"{100 * min(shares):.1f}%" if shares else "-"])
    return _table(["model", "prompts", "identical to full", "tokens",
                   "verifies (summed over rows)", "drafts", "acceptance (all drafts)",
                   "lowest per prompt"], rows)


def exact_steps(data: dict[str, Any]) -> str:
    """``sfi bench --modes full,sfi,sfi-exact --json``: per context and batch, decode tokens/s
    of full attention, lossy SFI and exact mode, exact mode against full attention, its
    drafts' acceptance, the tokens each verify kept and its dense steps per row."""
    cells: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        cells.setdefault((r["context"], r["batch"]), {})[r["mode"]] = r
    rows = []
    for (context, batch), cell in cells.items():
        exact = cell.get("sfi-exact")
        if exact is None:
            continue
        full, lossy = cell.get("full"), cell.get("sfi")
        rows.append([f"{context:,}", batch, _rate(full["decode_tok_s"] if full else None),
                     _rate(lossy["decode_tok_s"] if lossy else None),
                     _rate(exact["decode_tok_s"]),
                     _ratio(exact["decode_tok_s"], full["decode_tok_s"] if full else None),
                     f"{100 * exact['acceptance']:.0f}%", f"{exact['tokens_per_verify']:.1f}",
                     f"{exact['exact_dense_steps'] / batch:g}"])
    return _table(["context", "batch", "full tok/s", "sfi (lossy) tok/s", "sfi-exact tok/s",
                   "exact x full", "acceptance", "tokens / verify", "dense steps per row"], rows)


def loadtest(data: dict[str, Any]) -> str:
    """``sfi loadtest --json`` results, one line each: clients and mode (and the prompt
    lengths where several), requests done, errors, tokens/s, median time to first token,
    median and p99 inter-token latency, the join stall and the server's peak memory."""
    rows = []
    for r in data["rows"]:
        name = f"{r['clients']}, {r['mode']}"
        if len(r["prompt_chars"]) > 1:
            name += ", prompts of " + " and ".join(f"{c:,}" for c in r["prompt_chars"]) \
                + " characters"
        rows.append([name, r["requests"], r["errors"], f"{r['tokens_per_s']:.2f}",
                     f"{r['ttft_p50_ms'] / 1000:.1f} s",
                     f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} ms",
                     f"{r['join_stall_ms'] / 1000:.2f} s",
                     f"{r['server_peak_rss_mb'] / 1024:.2f} GiB"])
    return _table(["clients, mode", "requests", "errors", "tokens/s", "TTFT p50",
                   "inter-token p50 / p99", "join stall", "peak RSS"], rows)


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
    each llama.cpp row of its cell (``scripts/engines_table.py`` prints it); an engine the run
    left out (``--no-own-engine``) has no column. A row measured
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
    header = ["context", "batch", "vLLM", "vLLM + SFI", "sfi: full", "sfi: SFI",
              "sfi: fast step only",
              *(f"llama.cpp {m}" if m != "full" else "llama.cpp" for m in llamas)]
    ran = [i for i in range(len(header)) if any(row[i] != "-" for row in rows)]  # engines run
    return _table([header[i] for i in ran], [[row[i] for i in ran] for row in rows])


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "weight-products": weight_products, "weight-format-steps": weight_format_steps,
    "weight-fidelity": weight_fidelity,
    "sfi-against-peers": sfi_against_peers,
    "eval-scores": eval_scores, "eval-averages": eval_averages, "eval-items": eval_items,
    "eval-fidelity": eval_fidelity, "eval-samples": eval_samples,
    "kv-drift": kv_drift, "exact-identity": exact_identity, "exact-steps": exact_steps,
    "loadtest": loadtest, "eval-generation": eval_generation,
    "bench-modes": bench_modes, "vllm-engines": vllm_engines}


def load_data(files: list[Path], only: list[str] | None = None) -> dict[str, Any]:
    """The data a table renders: one JSON file, or several as one (``sfi eval`` results
    merged as ``sfi report`` merges them, other files' ``rows`` joined in order); ``only``
    keeps the ``sfi eval`` summary entries of those labels, in the report's order."""
    loaded = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    names = ", ".join(f.name for f in files)
    evals = sum("summary" in d for d in loaded)
    if len(loaded) == 1:
        data = loaded[0] if "rows" in loaded[0] or "summary" in loaded[0] else \
            {**loaded[0], "rows": [loaded[0]]}  # one ``sfi loadtest`` result: one row
    elif evals == len(loaded):
        from sfi.eval.report import merge_results

        data = merge_results(loaded)
    elif evals:
        raise ValueError(f"{names}: sfi eval results and other data cannot make one table")
    else:  # a file with no rows (one ``sfi loadtest`` result) is one row
        data = {**loaded[0], "rows": [r for d in loaded for r in d.get("rows", [d])],
                "parts": loaded}
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
