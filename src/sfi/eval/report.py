"""Summaries and the markdown report of an evaluation (``sfi eval --out``); its figures are
:mod:`sfi.eval.figures`, and :func:`sfi.eval.figures.write_report` writes both."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from sfi.core.triggers import REFRESH_REASONS
from sfi.errors import SFIError
from sfi.eval.tasks import GENERATION_TASKS, LIST_TASKS, RETRIEVAL_TASKS, TASKS

Row = dict[str, Any]


AS_CONFIGURED = 0.0  # a row's budget where SFI ran as configured (``sfi@default``)

SHORT_FIELDS = {"pool_kernel": "pool", "page_size": "page", "nms_strength": "nms",
                "coverage_layers": "cov", "coverage_gap": "gap", "coverage_top": "top",
                "coverage_threshold": "thr", "coverage_heads": "heads", "pin_fraction": "pin",
                "dense_layers": "dense",
                "exclusivity_strength": "excl", "lambda_cap_single": "lam1",
                "lambda_cap_multi": "lamN", "evidence_window": "W", "hysteresis": "hyst"}


def short_label(method: str) -> str:
    """A method name with its bracketed config fields abbreviated (for plots)."""
    head, sep, inner = method.partition("[")
    if not sep:
        return method
    fields = [f.split("=", 1) for f in inner.rstrip("]").split(",") if "=" in f]
    return f"{head}[" + ",".join(f"{SHORT_FIELDS.get(k, k)}={v}" for k, v in fields) + "]"


def label(row: Row) -> str:
    """``method@budget`` (``full`` alone), followed by the weight format in brackets where it
    is not ``native`` (``sfi@0.1 (int8)``); ``sfi@default`` where SFI ran as configured."""
    budget = "default" if row["budget"] == AS_CONFIGURED else f"{row['budget']:g}"
    name = "full" if row["method"] == "full" else f"{row['method']}@{budget}"
    return _with_weights(name, row.get("weights", "native"))


def _with_weights(name: str, weights: str) -> str:
    """``name``, with ``weights`` in brackets unless they are native."""
    return name if weights == "native" else f"{name} ({weights})"


def summarize(rows: list[Row]) -> list[Row]:
    """One entry per (context, method, budget, weights): mean score per task, the average over the
    retrieval tasks, mean measured retention, the fidelity metrics when that task ran, the
    generation metrics when one of those ran, and exact mode's mean acceptance of its
    drafts."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row["context"], label(row))].append(row)
    out = []
    for (context, name), members in groups.items():
        first = members[0]
        entry: Row = {"context": context, "method": first["method"], "budget": first["budget"],
                      "weights": first.get("weights", "native"), "label": name,
                      "retention": round(mean(r["retention"] for r in members), 4)}
        by_task: dict[str, list[float]] = defaultdict(list)
        for r in members:
            by_task[r["task"]].append(r["score"])
        entry["scores"] = {t: round(mean(v), 2) for t, v in by_task.items()}
        entry["samples"] = {t: len(v) for t, v in by_task.items()}
        retrieval = [v for t, v in entry["scores"].items() if t in RETRIEVAL_TASKS]
        entry["average"] = round(mean(retrieval), 2) if retrieval else None
        if retrieval:
            entry["average_ci"] = bootstrap_interval(_per_task(members))
        fidelity = [r for r in members if r["task"] == "fidelity"]
        if fidelity:
            entry["kl"] = round(mean(r["kl"] for r in fidelity), 5)
            entry["top1"] = round(mean(r["top1"] for r in fidelity), 4)
            entry["ppl"] = round(mean(r["ppl"] for r in fidelity), 3)
        generated = [r for r in members if r["task"] in GENERATION_TASKS]
        if generated:
            entry["generation"] = _generation_summary(generated)
        refreshed = [r["refresh_reasons"] for r in members if "refresh_reasons" in r]
        if refreshed:
            entry["refreshes"] = {cause: round(mean(r.get(cause, 0) for r in refreshed), 2)
                                  for cause in REFRESH_REASONS}
        accepted = [r["acceptance"] for r in members if r.get("acceptance") is not None]
        if accepted:
            entry["acceptance"] = round(mean(accepted), 4)
        out.append(entry)
    order = {t: i for i, t in enumerate(TASKS)}
    for entry in out:
        entry["scores"] = dict(sorted(entry["scores"].items(), key=lambda kv: order[kv[0]]))
    _add_paired_differences(out, groups)
    _add_items(out, groups)
    return sorted(out, key=_table_order)


def _generation_summary(rows: list[Row]) -> Row:
    """Free generation, over the samples (``sfi.eval.generation``): full attention's top-1
    agreement with the text, its perplexity of the text over that of its own, the text's
    distinct 4-grams over those of full attention's text (each mean with its bootstrap
    interval over the samples), and the median position where the text first departs."""
    def by_sample(value: Any) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = defaultdict(dict)
        for r in rows:
            v = value(r)
            if v is not None:
                out[r["task"]][r["sample"]] = v
        return out

    ratios = by_sample(lambda r: r["ppl"] / r["ppl_full"])
    distinct = by_sample(lambda r: None if not r.get("distinct_full") or r.get("distinct") is None
                         else r["distinct"] / r["distinct_full"])
    departs = sorted(r["divergence"] for r in rows if r.get("divergence") is not None)
    summary: Row = {"top1": round(mean(r["top1"] for r in rows), 4),
                    "ppl_ratio": round(_mean_of(ratios), 4),
                    "ppl_ratio_ci": bootstrap_interval(ratios, digits=3),
                    "samples": len(rows),
                    "identical": sum(r.get("divergence") is None for r in rows),
                    "divergence_median": departs[len(departs) // 2] if departs else None}
    if any(distinct.values()):
        summary["distinct_ratio"] = round(_mean_of(distinct), 4)
        summary["distinct_ratio_ci"] = bootstrap_interval(distinct, digits=3)
    return summary


def _mean_of(values: dict[str, dict[int, float]]) -> float:
    """The mean over tasks of each task's mean (as :func:`bootstrap_interval` resamples)."""
    return mean(mean(v.values()) for v in values.values() if v)


def _items(members: list[Row]) -> dict[tuple[str, int], list[bool]]:
    """The list answers' items found, by (task, sample)."""
    return {(r["task"], r["sample"]): r["items"] for r in members
            if r["task"] in LIST_TASKS and r.get("items") is not None}


def _add_items(entries: list[Row], groups: dict[tuple, list[Row]]) -> None:
    """For the long-answer tasks: each entry's items found of those asked, and against full
    attention on the same samples the items it lost (full found them, it did not) and
    gained."""
    for entry in entries:
        mine = _items(groups[(entry["context"], entry["label"])])
        if not mine:
            continue
        entry["items"] = {"found": sum(sum(v) for v in mine.values()),
                          "asked": sum(len(v) for v in mine.values())}
        reference = _with_weights("full", entry["weights"])
        full = _items(groups.get((entry["context"], reference), []))
        paired = [(a, b) for key, found in mine.items() if key in full
                  for a, b in zip(found, full[key])]
        if entry["label"] != reference and paired:
            entry["items"]["lost_vs_full"] = sum(b and not a for a, b in paired)
            entry["items"]["gained_vs_full"] = sum(a and not b for a, b in paired)


BOOTSTRAP_RESAMPLES = 2000


def _per_task(members: list[Row]) -> dict[str, dict[int, float]]:
    """Retrieval scores by task, then by sample."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in members:
        if r["task"] in RETRIEVAL_TASKS:
            out[r["task"]][r["sample"]] = r["score"]
    return out


def bootstrap_interval(scores: dict[str, dict[int, float]], level: float = 0.95,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, digits: int = 2
                       ) -> list[float] | None:
    """Percentile bootstrap interval of the task average: each resample draws, within every
    task, as many samples as it has, with replacement (the tasks are fixed, the samples are
    what varies). ``scores[task][sample]``; None with a single sample per task."""
    import numpy as np

    tasks = [np.array(list(v.values()), dtype=float) for v in scores.values() if v]
    if not tasks or all(len(t) < 2 for t in tasks):
        return None
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for values in tasks:
        draws = rng.integers(0, len(values), size=(resamples, len(values)))
        means += values[draws].mean(axis=1)
    means /= len(tasks)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return [round(float(low), digits), round(float(high), digits)]


def _add_paired_differences(entries: list[Row], groups: dict[tuple, list[Row]]) -> None:
    """Each entry's task-average difference to full attention with the same weights on the
    same samples, with its bootstrap interval (paired: a resample draws the same samples for
    both)."""
    for entry in entries:
        reference = _with_weights("full", entry["weights"])
        full = groups.get((entry["context"], reference))
        if full is None or entry["label"] == reference or entry["average"] is None:
            continue
        mine, theirs = _per_task(groups[(entry["context"], entry["label"])]), _per_task(full)
        paired = {task: {i: score - theirs[task][i] for i, score in samples.items()
                         if i in theirs.get(task, {})} for task, samples in mine.items()}
        if any(paired.values()):
            entry["delta_full"] = round(mean(mean(v.values()) for v in paired.values() if v), 2)
            entry["delta_full_ci"] = bootstrap_interval(paired)


def _table_order(entry: Row) -> tuple:
    """Full attention first, then SFI and its variants, then the baselines; budgets rising."""
    method = entry["method"]
    family = 0 if method.startswith("full") else 1 if method.startswith("sfi") else 2
    return (entry["context"], entry["weights"] != "native", entry["weights"], family, method,
            entry["budget"])


def tasks_of(summary: list[Row]) -> list[str]:
    seen = {t for entry in summary for t in entry["scores"]}
    return [t for t in TASKS if t in seen]


def table_rows(summary: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the task x method table."""
    tasks = tasks_of(summary)
    retrieval = [t for t in tasks if t in RETRIEVAL_TASKS]
    header = ["context", "method", "retention", *retrieval]
    if retrieval:
        header += ["avg", "95% CI", "vs full [95% CI]"]
    if "fidelity" in tasks:
        header += ["top1 %", "KL", "ppl"]
    cells = []
    for e in summary:
        row = [str(e["context"]), e["label"], f"{100 * e['retention']:.1f}%"]
        row += [_num(e["scores"].get(t)) for t in retrieval]
        if retrieval:
            row += [_num(e["average"]), _interval(e.get("average_ci")),
                    "-" if "delta_full" not in e else
                    f"{e['delta_full']:+.1f} {_interval(e.get('delta_full_ci'))}"]
        if "fidelity" in tasks:
            row += [_num(100 * e["top1"] if "top1" in e else None),
                    f"{e['kl']:.4f}" if "kl" in e else "-", _num(e.get("ppl"))]
        cells.append(row)
    return header, cells


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _interval(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"[{bounds[0]:.1f}, {bounds[1]:.1f}]"


def _interval3(bounds: list[float] | None) -> str:
    return "" if bounds is None else f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def _formats(summary: list[Row]) -> list[str]:
    """The weight formats of a summary's entries, native first (native where there is none)."""
    found = {e["weights"] for e in summary} or {"native"}
    return sorted(found, key=lambda w: (w != "native", w))


def markdown(result: Row, plots: list[str]) -> str:
    """The report: what ran, the table, per-sample outputs' location, the plots."""
    header, cells = table_rows(result["summary"])
    lines = [f"# sfi eval: {result['model']}", "",
             f"Tasks {', '.join(result['tasks'])}; contexts {result['contexts']}; "
             f"{result['samples']} sample(s) per task and context; seed {result['seed']}; "
             f"weights {', '.join(_formats(result['summary']))}.",
             f"Command: `{result.get('command', 'sfi eval')}`", "",
             "Scores are percentages (string match; `sequential` and `codesN` count needles "
             "recalled in the asked order; fidelity's score is top-1 agreement with full "
             "attention). Retention is the measured mean fraction of the context each decode step "
             "read. Intervals are 95% percentile bootstraps over the samples (resampled within "
             "each task); `vs full` is the paired difference to full attention with the same "
             "weights on the same samples.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    generated = [e for e in result["summary"] if "generation" in e]
    if generated:
        lines += ["", "Free generation (the `generation` tasks: essays and Python code "
                  "continued greedily): full attention's top-1 agreement with the method's "
                  "text, its perplexity of that text over its perplexity of its own, the text's "
                  "distinct 4-grams over those of full attention's text (below 1: more "
                  "repetition), each with a 95% bootstrap interval over the samples, and where "
                  "the text first departs from full attention's (median token; identical texts "
                  "counted apart).", "",
                  "| context | method | top1 % | ppl ratio | distinct-4 ratio | first departure "
                  "| identical |", "|---|---|---|---|---|---|---|"]
        for e in generated:
            g = e["generation"]
            lines.append(
                f"| {e['context']} | {e['label']} | {100 * g['top1']:.1f} | "
                f"{g['ppl_ratio']:.3f} {_interval3(g.get('ppl_ratio_ci'))} | "
                + (f"{g['distinct_ratio']:.3f} {_interval3(g.get('distinct_ratio_ci'))}"
                   if "distinct_ratio" in g else "-")
                + f" | {'-' if g['divergence_median'] is None else g['divergence_median']} | "
                f"{g['identical']} of {g['samples']} |")
    listed = [e for e in result["summary"] if "items" in e]
    if listed:
        lines += ["", "Long answers (the `codesN` tasks), item by item: items found of those "
                  "asked, and against full attention on the same samples the items lost (full "
                  "attention found them) and gained.", "",
                  "| context | method | items found | lost vs full | gained vs full |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['context']} | {e['label']} | {e['items']['found']} / "
                  f"{e['items']['asked']} | {e['items'].get('lost_vs_full', '-')} | "
                  f"{e['items'].get('gained_vs_full', '-')} |" for e in listed]
    refreshed = [e for e in result["summary"] if "refreshes" in e]
    if refreshed:
        lines += ["", "SFI's refreshes by cause, mean per sample (over the row's samples that "
                  "record them).",
                  "", "| context | method | " + " | ".join(REFRESH_REASONS) + " |",
                  "|---|---|" + "---|" * len(REFRESH_REASONS)]
        lines += [f"| {e['context']} | {e['label']} | "
                  + " | ".join(f"{e['refreshes'][cause]:g}" for cause in REFRESH_REASONS) + " |"
                  for e in refreshed]
    lines += ["", "Per-sample rows, with each output, are in `results.json`.", ""]
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def merge_results(results: list[Row]) -> Row:
    """Several runs of one model as one result: rows united (a row of a later run replaces one
    of an earlier run with the same task, context, sample, method, budget and weights),
    settings and SFI configurations united (a later run's configuration of a method name
    replaces an earlier's), the summary recomputed."""
    if not results:
        raise SFIError("nothing to merge")
    models = {r["model"] for r in results}
    if len(models) != 1:
        raise SFIError(f"merge runs of one model at a time, got {', '.join(sorted(models))}")
    latest: dict[tuple, Row] = {}
    for r in results:
        for row in r["rows"]:
            latest[(row["task"], row["context"], row["sample"], row["method"],
                    row["budget"], row.get("weights", "native"))] = row
    rows = list(latest.values())
    merged: Row = {
        "model": models.pop(),
        "tasks": [t for t in TASKS if any(t in r["tasks"] for r in results)],
        "contexts": sorted({c for r in results for c in r["contexts"]}),
        "samples": len({(row["task"], row["context"], row["sample"]) for row in rows}
                       ) // max(1, len({(row["task"], row["context"]) for row in rows})),
        "seed": results[0]["seed"],
        "configs": {name: config for r in results for name, config in r.get("configs", {}).items()},
        "command": " ; ".join(r.get("command", "sfi eval") for r in results),
        "rows": rows,
    }
    merged["summary"] = summarize(rows)
    return merged
