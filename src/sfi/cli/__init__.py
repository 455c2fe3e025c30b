"""The ``sfi`` command line: generate, demo, bench, bench-vllm, eval, diagnose, report, analyze,
serve, loadtest.

Each command parses its options, calls the library, and prints a table or ``--json``; the SFI
knobs are declared once (``sfi.cli_options``). One module per group of commands
(``generate``, ``bench``, ``evaluate``, ``serve``), registered here on the one Typer app in the
order ``sfi --help`` lists them.
"""

from __future__ import annotations

import sys

import typer

from sfi.cli import bench, evaluate, generate, serve
from sfi.cli.common import err
from sfi.cli_options import build_config
from sfi.errors import SFIError
from sfi.runtime import keep_freed_memory

__all__ = ["app", "build_config", "main"]

COMMANDS = (
    ("generate", generate.generate_cmd),
    ("demo", generate.demo_cmd),
    ("bench", bench.bench_cmd),
    ("bench-vllm", bench.bench_vllm_cmd),
    ("eval", evaluate.eval_cmd),
    ("report", evaluate.report_cmd),
    ("diagnose", evaluate.diagnose_cmd),
    ("analyze", evaluate.analyze_cmd),
    ("serve", serve.serve_cmd),
    ("loadtest", serve.loadtest_cmd),
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Slow-Fast Inference: fast long-context decoding for transformers models.")
for _name, _command in COMMANDS:
    app.command(_name)(_command)


def main() -> None:
    """The ``sfi`` command: bad input ends with its message and exit status 2. The process
    keeps freed memory for reuse (:func:`sfi.runtime.keep_freed_memory`)."""
    keep_freed_memory()
    try:
        app()
    except SFIError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)

