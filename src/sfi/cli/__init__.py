"""The ``sfi`` command line: generate, demo, bench, bench-vllm, eval, diagnose, report, analyze,
serve, loadtest.

Each command parses its options, calls the library, and prints a table or ``--json``; the SFI
knobs are declared once (``sfi.cli.options``). One module per group of commands
(``generate``, ``bench``, ``evaluate``, ``serve``), registered here on the one Typer app in the
order ``sfi --help`` lists them.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import click
import typer
from typer.core import TyperCommand, TyperGroup

from sfi.cli import bench, evaluate, generate, serve
from sfi.cli.common import err
from sfi.cli.options import build_config
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

# Each command's help ends with these, as a block of code (help texts are Markdown).
EXAMPLES: dict[str, str] = {
    "generate": """sfi generate --prompt-file report.txt --chat --max-new-tokens 200 --stream
sfi generate --prompt "Explain KV caches." --chat --mode full --json
sfi generate -m qwen2.5-0.5b --prompt-file long.txt --k-fraction 0.1""",
    "demo": """sfi demo
sfi demo --context 6000 --max-new-tokens 256
sfi demo -m qwen2.5-0.5b --context 12000""",
    "bench": """sfi bench --contexts 4096,16384 --batch 1,4
sfi bench --contexts 32768 --synthetic-kv --modes full-static,sfi --plot bench.png""",
    "bench-vllm": """.venv-vllm/bin/sfi bench-vllm --contexts 4096,8192 --batch 1 --no-llama-cpp
.venv-vllm/bin/sfi bench-vllm --preset paper --k-fraction 0.1 --json""",
    "eval": """sfi eval --tasks passkey,niah --contexts 4096 --samples 2
sfi eval --contexts 8192 --methods full,sfi,quest --budgets 0.1,0.15
sfi eval -m qwen2.5-0.5b --contexts 8192 --out results/qwen-8k --resume""",
    "report": """sfi report run-a/results.json run-b/results.json --out merged""",
    "diagnose": """sfi diagnose --task niah_multikey --context 8192 --budget 0.15
sfi diagnose --methods sfi,sfi:paper --budget 1024""",
    "analyze": """sfi analyze --context 4096 --tokens 512 --out stability""",
    "serve": """sfi serve --port 8000 --max-batch 8 --k-fraction 0.15
sfi serve -m qwen2.5-0.5b --api-key secret --mode exact""",
    "loadtest": """sfi loadtest --clients 8 --duration 60 --max-new-tokens 64""",
}


class _Quiet:
    """Flags (``--json``, ``--stream``, ``--help``) listed without a type: typer >= 0.20 shows
    ``<bool>`` beside every option, which reads as a value to give."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_Quiet, TyperCommand):
    """A subcommand: typer's, with :class:`_Quiet` flags."""


class Group(_Quiet, TyperGroup):
    """The ``sfi`` group: typer's, with :class:`_Quiet` flags."""


def _version(value: bool) -> None:
    if value:
        from sfi import __version__

        typer.echo(f"sfi {__version__}")
        raise typer.Exit()


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=Group,
                  rich_markup_mode="markdown",
                  help="Slow-Fast Inference: fast long-context decoding for transformers models.")


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print sfi's version and exit")]
        = False) -> None:
    """Slow-Fast Inference: fast long-context decoding for transformers models."""


for _name, _command in COMMANDS:
    app.command(_name, cls=Command, epilog=f"Examples:\n\n```\n{EXAMPLES[_name]}\n```")(_command)


def main() -> None:
    """The ``sfi`` command: bad input ends with its message and exit status 2. The process
    keeps freed memory for reuse (:func:`sfi.runtime.keep_freed_memory`); the library's
    notices stay quiet, as the commands print the same facts themselves."""
    keep_freed_memory()
    logging.getLogger("sfi").setLevel(logging.ERROR)
    try:
        app()
    except SFIError as exc:
        # one line however long (a path, a list of choices): not wrapped at the console's width
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        sys.exit(2)
