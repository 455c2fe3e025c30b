"""What every command shares: the error console, loading a model, printing tables and
progress."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from sfi.cli.options import name_list, note
from sfi.errors import SFIError

err = Console(stderr=True)


def json_lines(path: Path | None) -> Callable[[Any], None] | None:
    """A function that appends each row (a dict or a dataclass) to ``path`` as one JSON line,
    or None without a path (``--log-rows``)."""
    if path is None:
        return None

    def write(row: Any) -> None:
        with path.open("a") as out:
            out.write(json.dumps(asdict(row) if is_dataclass(row) else row) + "\n")

    return write


def load_model(model: str, quiet: bool, weights: str = "auto",
               compile: bool | None = None, batch: int = 1):
    """``sfi.load(model)``, with a status line on the terminal unless ``quiet``; int8 weights
    on a CPU where they decode slowly get a note, and so does what ``auto`` chose, unless
    ``quiet`` (the library's notices, which the command line's logger level silences)."""
    from sfi.models import load
    from sfi.weights.int8_linear import SLOW_INT8, int8_runs_fast

    if weights == "int8" and not int8_runs_fast():
        note(SLOW_INT8)
    if quiet:
        return load(model, weights=weights, compile=compile, batch=batch)
    checks = ("; weights auto checks the formats once per model, and on AVX2 builds sfi's "
              "int8 kernel once" if weights == "auto" else "")
    with err.status(f"Loading {model} (the first load converts a GGUF once, 30-90 s{checks})"):
        loaded = load(model, weights=weights, compile=compile, batch=batch)
    choice = getattr(loaded[0], "sfi_weight_choice", None)
    if choice is not None:
        note(choice.summary())
    return loaded


def compile_seconds(model: Any) -> float | None:
    """Seconds the model's compiled decode steps spent building graphs, or None when its
    steps run eagerly."""
    from sfi.decoding.compiled import compiled_forward

    compiled = compiled_forward(model)
    return None if compiled is None else round(compiled.compile_seconds, 2)


def one_format(weights: str) -> str:
    """The one weight format ``--weights`` names (a clear error otherwise)."""
    from sfi.weights.choice import WEIGHT_CHOICES

    formats = name_list("--weights", weights, WEIGHT_CHOICES)
    if len(formats) != 1:
        raise SFIError(f"--weights takes one format here, got {weights!r}")
    return formats[0]


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]],
                wide: bool = False) -> None:
    """A rich table: the first column left-aligned, the others right-aligned. Cells are plain
    text, never markup (a method such as ``sfi[recent=512]`` keeps its brackets)."""
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=wide)
    for row in rows:
        table.add_row(*(Text("-" if v is None else f"{v:g}" if isinstance(v, float) else str(v))
                        for v in row))
    console = Console()
    if wide:
        console.width = max(console.width, 132)
    console.print(table)


def progress_bar() -> Progress:
    """A transient progress display on stderr: spinner, description, bar, done/total."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), console=err, transient=True)
