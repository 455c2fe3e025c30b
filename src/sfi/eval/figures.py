"""The figures of an evaluation report (``sfi eval --out``): score against retention, NIAH
depth heat maps, fidelity's KL per step; :func:`write_report` writes the results, the figures
and the report."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean

from sfi.eval.report import AS_CONFIGURED, Row, label, markdown, short_label


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
    for e in summary:  # sfi@default is a point of its own, not of the budget sweep
        method = f"{e['method']}@default" if e["budget"] == AS_CONFIGURED else e["method"]
        lines[(method, e["weights"], e["context"])].append(
            (100 * e["retention"], e["average"]))
    colours = plt.get_cmap("tab20").colors
    markers = "os^Dv<>pP*Xh"
    for i, ((method, weights, context), points) in enumerate(sorted(lines.items())):
        name = short_label(method) + ("" if weights == "native" else f" ({weights})")
        name = f"{name} ({context})" if len(result["contexts"]) > 1 else name
        points.sort()
        if method == "full":
            ax.axhline(points[0][1], color="black", linewidth=1, label=name,
                       linestyle="--" if weights == "native" else ":")
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


def write_report(result: Row, folder: Path) -> None:
    """``results.json`` first (so that nothing measured is lost), then the plots and
    ``report.md``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plots = plot_all(result, folder)
    (folder / "report.md").write_text(markdown(result, plots), encoding="utf-8")
