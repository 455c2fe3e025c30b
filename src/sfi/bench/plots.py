"""The figures of ``sfi bench --plot``: tokens/s against context per mode, and exact mode's
speed-up against the measured fast/dense step ratio, beside what the ratio allows."""

from __future__ import annotations

from typing import Any

from sfi.bench.throughput import MODES
from sfi.core.draft_length import expected_tokens


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Tokens/s against context length per mode (and weight format), llama.cpp's rows beside
    them, one panel per batch size (log-scale x)."""
    plt = _pyplot()
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    formats = list(dict.fromkeys(r.get("weights", "native") for r in rows))
    for ax, batch in zip(axes[0], batches):
        for name in formats:
            for mode in MODES:
                points = sorted((r["context"], r["decode_tok_s"]) for r in rows
                                if r["mode"] == mode and r["batch"] == batch
                                and r.get("weights", "native") == name)
                if points:
                    label = mode if len(formats) == 1 else f"{mode}, {name} weights"
                    ax.plot(*zip(*points), marker="o", label=label)
        for peer in dict.fromkeys(r["mode"] for r in rows if r["mode"] not in MODES):
            points = sorted((r["context"], r["decode_tok_s"]) for r in rows
                            if r["mode"] == peer and r["batch"] == batch)
            if points:  # llama.cpp's rows (``--gguf``), dashed
                ax.plot(*zip(*points), marker="s", linestyle="--", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        kv = {r["kv"] for r in rows}
        ax.set_title(f"batch {batch} ({', '.join(sorted(kv))} KV)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_engines(result: dict[str, Any], path: str) -> None:
    """``sfi bench-vllm --plot``: tokens/s against context for each engine and mode (stock
    vLLM, vLLM + SFI, sfi's engine with full attention, SFI and SFI's fast step alone,
    llama.cpp), one panel per batch size (log-scale x)."""
    plt = _pyplot()
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    series = list(dict.fromkeys((r["engine"], r["mode"]) for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for engine, mode in series:
            points = sorted((r["context"], r["decode_tok_s"]) for r in rows
                            if (r["engine"], r["mode"]) == (engine, mode) and r["batch"] == batch)
            if points:
                llama = "llama.cpp" if mode == "full" else f"llama.cpp, {mode} weights"
                label = {"vllm": mode, "llama.cpp": llama}.get(engine, f"sfi engine, {mode}")
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}, {result.get('device', '')}".rstrip(", "))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def exact_points(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per ``sfi-exact`` row of ``sfi bench`` results: its cell, the cell's measured
    fast/dense ratio (the ``sfi`` row's fast step over the ``full`` row's step), its speed-up
    over full attention, its acceptance and tokens per verify. Cells without both rows are
    left out."""
    points = []
    for result in results:
        rows = result["rows"]
        cells = {(r["mode"], r["context"], r["batch"], r.get("weights", "native")): r
                 for r in rows}
        for row in rows:
            if row["mode"] != "sfi-exact":
                continue
            cell = (row["context"], row["batch"], row.get("weights", "native"))
            sparse, full = cells.get(("sfi", *cell)), cells.get(("full", *cell))
            if not sparse or not full or not sparse.get("fast_step_ms"):
                continue
            points.append({"context": row["context"], "batch": row["batch"],
                           "ratio": sparse["fast_step_ms"] / full["step_ms"],
                           "speedup": row["speedup_vs_full"],
                           "acceptance": row["acceptance"],
                           "tokens_per_verify": row["tokens_per_verify"]})
    return points


def plot_exact_speedup(results: list[dict[str, Any]], path: str, gamma: int = 4) -> None:
    """Exact mode's measured speed-up over full attention against the measured fast/dense
    ratio, and the ideal ``expected_tokens(gamma, a) / (gamma * ratio + 1)`` (a verify
    costing one dense step) for a few per-token acceptances ``a``."""
    plt = _pyplot()
    points = exact_points(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ratios = [i / 100 for i in range(5, 101)]
    for a in (1.0, 0.9, 0.7):
        ax.plot(ratios, [expected_tokens(gamma, a) / (gamma * r + 1) for r in ratios],
                linestyle="--", alpha=0.7,
                label=f"ideal, gamma={gamma}, acceptance {a:.0%} (verify = 1 dense step)")
    for batch in sorted({p["batch"] for p in points}):
        mine = [p for p in points if p["batch"] == batch]
        ax.scatter([p["ratio"] for p in mine], [p["speedup"] for p in mine], zorder=3,
                   label=f"measured, batch {batch}")
        for p in mine:
            ax.annotate(f"{p['context'] / 1024:g}K, {p['acceptance']:.0%}",
                        (p["ratio"], p["speedup"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("measured fast step / dense step")
    ax.set_ylabel("exact mode tokens/s / full attention's")
    ax.set_title("exact mode: speed-up against the fast/dense ratio")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
