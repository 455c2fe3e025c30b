"""Summaries, the markdown report and the plots of an evaluation (``sfi eval --out``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from sfi.errors import SFIError
from sfi.eval.tasks import TASKS

Row = dict[str, Any]


SHORT_FIELDS = {"pool_kernel": "pool", "page_size": "page", "nms_strength": "nms",
                "coverage_layers": "cov", "coverage_gap": "gap", "coverage_top": "top",
                "coverage_threshold": "thr", "pin_fraction": "pin", "dense_layers": "dense",
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
    """``method@budget`` (``full`` alone)."""
    return "full" if row["method"] == "full" else f"{row['method']}@{row['budget']:g}"


def summarize(rows: list[Row]) -> list[Row]:
    """One entry per (context, method, budget): mean score per task, the average over the
    retrieval tasks (every task but fidelity), mean measured retention, the fidelity
    metrics when that task ran, and exact mode's mean acceptance of its drafts."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row["context"], label(row))].append(row)
    out = []
    for (context, name), members in groups.items():
        first = members[0]
        entry: Row = {"context": context, "method": first["method"], "budget": first["budget"],
                      "label": name, "retention": round(mean(r["retention"] for r in members), 4)}
        by_task: dict[str, list[float]] = defaultdict(list)
        for r in members:
            by_task[r["task"]].append(r["score"])
        entry["scores"] = {t: round(mean(v), 2) for t, v in by_task.items()}
        entry["samples"] = {t: len(v) for t, v in by_task.items()}
        retrieval = [v for t, v in entry["scores"].items() if t != "fidelity"]
        entry["average"] = round(mean(retrieval), 2) if retrieval else None
        if retrieval:
            entry["average_ci"] = bootstrap_interval(_per_task(members))
        fidelity = [r for r in members if r["task"] == "fidelity"]
        if fidelity:
            entry["kl"] = round(mean(r["kl"] for r in fidelity), 5)
            entry["top1"] = round(mean(r["top1"] for r in fidelity), 4)
            entry["ppl"] = round(mean(r["ppl"] for r in fidelity), 3)
        accepted = [r["acceptance"] for r in members if r.get("acceptance") is not None]
        if accepted:
            entry["acceptance"] = round(mean(accepted), 4)
        out.append(entry)
    order = {t: i for i, t in enumerate(TASKS)}
    for entry in out:
        entry["scores"] = dict(sorted(entry["scores"].items(), key=lambda kv: order[kv[0]]))
    _add_paired_differences(out, groups)
    return sorted(out, key=_table_order)


BOOTSTRAP_RESAMPLES = 2000


def _per_task(members: list[Row]) -> dict[str, dict[int, float]]:
    """Retrieval scores by task, then by sample."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in members:
        if r["task"] != "fidelity":
            out[r["task"]][r["sample"]] = r["score"]
    return out


def bootstrap_interval(scores: dict[str, dict[int, float]], level: float = 0.95,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
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
    return [round(float(low), 2), round(float(high), 2)]


def _add_paired_differences(entries: list[Row], groups: dict[tuple, list[Row]]) -> None:
    """Each entry's task-average difference to full attention on the same samples, with its
    bootstrap interval (paired: a resample draws the same samples for both)."""
    for entry in entries:
        full = groups.get((entry["context"], "full"))
        if full is None or entry["label"] == "full" or entry["average"] is None:
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
    return entry["context"], family, method, entry["budget"]


def tasks_of(summary: list[Row]) -> list[str]:
    seen = {t for entry in summary for t in entry["scores"]}
    return [t for t in TASKS if t in seen]


def table_rows(summary: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the task x method table."""
    tasks = tasks_of(summary)
    retrieval = [t for t in tasks if t != "fidelity"]
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


def markdown(result: Row, plots: list[str]) -> str:
    """The report: what ran, the table, per-sample outputs' location, the plots."""
    header, cells = table_rows(result["summary"])
    lines = [f"# sfi eval: {result['model']}", "",
             f"Tasks {', '.join(result['tasks'])}; contexts {result['contexts']}; "
             f"{result['samples']} sample(s) per task and context; seed {result['seed']}.",
             f"Command: `{result.get('command', 'sfi eval')}`", "",
             "Scores are percentages (string match; `sequential` counts needles recalled in "
             "the asked order; fidelity's score is top-1 agreement with full attention). "
             "Retention is the measured mean fraction of the context each decode step read. "
             "Intervals are 95% percentile bootstraps over the samples (resampled within each "
             "task); `vs full` is the paired difference to full attention on the same "
             "samples.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    lines += ["", "Per-sample rows, with each output, are in `results.json`.", ""]
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(result: Row, folder: Path) -> None:
    """``results.json`` first (so that nothing measured is lost), then the plots and
    ``report.md``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plots = plot_all(result, folder)
    (folder / "report.md").write_text(markdown(result, plots), encoding="utf-8")


def merge_results(results: list[Row]) -> Row:
    """Several runs of one model as one result: rows united (a row of a later run replaces one
    of an earlier run with the same task, context, sample, method and budget), settings
    united, the summary recomputed."""
    if not results:
        raise SFIError("nothing to merge")
    models = {r["model"] for r in results}
    if len(models) != 1:
        raise SFIError(f"merge runs of one model at a time, got {', '.join(sorted(models))}")
    latest: dict[tuple, Row] = {}
    for r in results:
        for row in r["rows"]:
            latest[(row["task"], row["context"], row["sample"], row["method"],
                    row["budget"])] = row
    rows = list(latest.values())
    merged: Row = {
        "model": models.pop(),
        "tasks": [t for t in TASKS if any(t in r["tasks"] for r in results)],
        "contexts": sorted({c for r in results for c in r["contexts"]}),
        "samples": len({(row["task"], row["context"], row["sample"]) for row in rows}
                       ) // max(1, len({(row["task"], row["context"]) for row in rows})),
        "seed": results[0]["seed"],
        "command": " ; ".join(r.get("command", "sfi eval") for r in results),
        "rows": rows,
    }
    merged["summary"] = summarize(rows)
    return merged


def plot_all(result: Row, folder: Path) -> list[str]:
    """Write every plot that the result has data for; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    for fn in (plot_score_vs_budget, plot_niah_heatmaps, plot_fidelity_kl):
        path = fn(result, folder)
        if path is not None:
            paths.append(path)
    return paths


def plot_score_vs_budget(result: Row, folder: Path) -> str | None:
    """Task-average score against measured retention, one line per method and context."""
    import matplotlib.pyplot as plt

    summary = [e for e in result["summary"] if e["average"] is not None]
    if not summary:
        return None
    fig, ax = plt.subplots(figsize=(11, 5))
    lines: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for e in summary:
        lines[(e["method"], e["context"])].append((100 * e["retention"], e["average"]))
    colours = plt.get_cmap("tab20").colors
    markers = "os^Dv<>pP*Xh"
    for i, ((method, context), points) in enumerate(sorted(lines.items())):
        name = short_label(method)
        name = f"{name} ({context})" if len(result["contexts"]) > 1 else name
        points.sort()
        if method == "full":
            ax.axhline(points[0][1], color="black", linestyle="--", linewidth=1, label=name)
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=markers[i % len(markers)], label=name,
                color=colours[(2 * i) % 20 + (i // 10) % 2],
                linewidth=2.5 if method.startswith("sfi") else 1.2)
    ax.set_xlabel("measured retention (% of the context read per decode step)")
    ax.set_ylabel("task-average score (%)")
    ax.set_title(f"{result['model']}: score against budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path = folder / "score_vs_budget.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def plot_niah_heatmaps(result: Row, folder: Path) -> str | None:
    """Single-needle NIAH score over depth x context, one panel per method@budget."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in result["rows"] if r["task"] == "niah"]
    if not rows:
        return None
    names = list(dict.fromkeys(label(r) for r in rows))
    depths = sorted({round(r["depth"], 3) for r in rows})
    contexts = sorted({r["context"] for r in rows})
    cols = min(4, len(names))
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, squeeze=False,
                             figsize=(3.2 * cols, 2.8 * ((len(names) + cols - 1) // cols)))
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        grid = np.full((len(depths), len(contexts)), np.nan)
        for r in rows:
            if label(r) == name:
                grid[depths.index(round(r["depth"], 3)), contexts.index(r["context"])] = \
                    r["score"]
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(contexts)), [str(c) for c in contexts], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_xlabel("context", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    fig.suptitle(f"{result['model']}: single-needle retrieval (green = found)")
    fig.tight_layout()
    path = folder / "niah_heatmap.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


SMOOTHING = 16


def _moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average (shorter windows at the ends)."""
    half = window // 2
    return [mean(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


def plot_fidelity_kl(result: Row, folder: Path) -> str | None:
    """KL(full || method) along the teacher-forced continuation of the first fidelity sample,
    SFI's slow steps marked."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["task"] == "fidelity" and r.get("kl_per_step")]
    if not rows:
        return None
    first = rows[0]
    rows = [r for r in rows if r["context"] == first["context"] and r["sample"] == first["sample"]]
    context = first["context"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in rows:
        kl = _moving_average(r["kl_per_step"], SMOOTHING)
        line, = ax.plot(range(len(kl)), kl, linewidth=1.8 if r["method"].startswith("sfi")
                        else 0.9, label=f"{label(r)} (mean {r['kl']:.3f})")
        slow = r.get("slow_step_indices") or []
        if slow:
            ax.scatter(slow, [kl[i] for i in slow], marker="v", s=22, color=line.get_color(),
                       zorder=3)
    ax.set_yscale("log")
    ax.set_xlabel("continuation token (teacher-forced)")
    ax.set_ylabel(f"KL(full || method), nats ({SMOOTHING}-token moving average)")
    ax.set_title(f"{result['model']}: fidelity at {context} tokens of context "
                 "(triangles: SFI slow steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = folder / "fidelity_kl.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
