"""The code blocks of the README and the user pages, checked as a user pastes them.

The convention, on a page:

- A fenced block in a command language (``bash``, ``sh``, ``shell``, ``python``, ``py``) is
  run here unless the line just before its fence is ``<!-- not run: REASON -->``: a GPU, vLLM,
  a server that runs until stopped, an install, minutes of work. The reason is required.
  ``console`` and ``pycon`` blocks (prompts beside output) cannot run as pasted and must be
  marked. Other fences (``text``: diagrams, algorithms, printed output) are not commands and
  take no marker; a fence with no language is refused, so that no command hides in one.
- The Python blocks of a page run in order in one process, each compiled under the page's
  name and line numbers, so that a traceback names ``page:line``. A block may use only the
  names it defines or that a run block above it on the page defines: each either stands alone
  or visibly continues the blocks above. The shell blocks of a page run in order in one
  folder, with the environment's ``sfi`` on the ``PATH``.
- Every ``sfi`` command in a shell block, run or not, parses against the command line without
  running: the command and each option exist, values parse (integers, numbers, and the names
  and lists a command checks before it loads a model, with its own parsers), and no
  placeholder (``<file>``, ``...``, ``[--option]``) stands for a value.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from sfi.errors import SFIError

ROOT = Path(__file__).resolve().parents[1]

# The pages whose blocks are checked: README and every page of the manual with code blocks.
PAGES = ("README.md", "docs/index.md", "docs/usage.md", "docs/exact.md", "docs/server.md",
         "docs/vllm.md", "docs/gpu.md", "docs/troubleshooting.md", "docs/method.md",
         "docs/benchmarks.md", "docs/evaluation.md", "docs/studies.md",
         "docs/eval/weight-formats.md", "docs/supported-models.md", "docs/glossary.md",
         "docs/api.md", "docs/testing.md", "docs/sglang.md")

RUN_SHELL = {"bash", "sh", "shell"}
RUN_PYTHON = {"python", "py", "python3"}
MARKED_ONLY = {"console", "shell-session", "pycon", "zsh", "powershell"}  # prompts and output
COMMAND_LANGUAGES = RUN_SHELL | RUN_PYTHON | MARKED_ONLY

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`{]*)")
MARKER = re.compile(r"^\s*<!--\s*not run\b(?P<rest>.*?)-->\s*$")
PLACEHOLDER = re.compile(r"^<.*>$|\.\.\.|…|^\[")
OPERATORS = {"|", "||", "&&", ";", ";;", "&", "|&", "(", ")"}
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
SFI_KNOBS = ("preset", "sink", "recent", "k_head", "k_fraction", "refresh_interval",
             "min_refresh_gap", "evidence_window", "trigger", "force_sparse")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    not_run: str | None  # the marker's reason

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.not_run is None and self.lang in RUN_SHELL | RUN_PYTHON


def parse_page(page: str, markdown: str) -> tuple[list[Block], list[str]]:
    """A page's fenced blocks, and what breaks the convention: a marker without a reason or
    not just before a fence, a fence without a language, an unmarked block that cannot run
    as pasted, a fence never closed."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        marker = MARKER.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            problems.append(f"{page}:{i + 1}: a not-run marker that is not just before a fence")
        if not opened:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{page}:{i + 1}: a fence that is never closed")
            break
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        before = MARKER.match(lines[i - 1]) if i else None
        reason = None
        if before:
            rest = before["rest"].strip()
            reason = rest[1:].strip() if rest.startswith(":") else ""
            if not reason:
                problems.append(f"{page}:{i}: a not-run marker needs a reason: "
                                "<!-- not run: REASON -->")
        block = Block(page, i + 1, opened["lang"].lower(), "\n".join(body) + "\n", reason)
        if not block.lang:
            problems.append(f"{block.where}: a fence with no language: name it (text for "
                            "output or a diagram, bash or python for commands)")
        elif block.lang in MARKED_ONLY and reason is None:
            problems.append(f"{block.where}: a {block.lang} block cannot run as pasted: mark "
                            "it <!-- not run: REASON --> or make it a bash or python block")
        elif reason is not None and block.lang not in COMMAND_LANGUAGES:
            problems.append(f"{block.where}: a not-run marker on a {block.lang} block, which "
                            "is not a command")
        blocks.append(block)
        i = end + 1
    return blocks, problems


def page_blocks(page: str) -> list[Block]:
    return parse_page(page, (ROOT / page).read_text(encoding="utf-8"))[0]


def undefined_names(blocks: list[Block]) -> list[str]:
    """Python blocks, in page order, that use a name neither they nor a run block above
    them defines: ``page:line: uses NAME``. Every block must also compile."""
    import ast

    defined = set(dir(builtins))
    problems = []
    for block in blocks:
        try:
            tree = ast.parse(block.text)
        except SyntaxError as exc:
            problems.append(f"{block.where}: does not compile: {exc}")
            continue
        bound, used = set(), []
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (used.append(node.id) if isinstance(node.ctx, ast.Load) else bound.add(node.id))
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                            | ast.ExceptHandler) and node.name:
                bound.add(node.name)
        missing = sorted({name for name in used if name not in bound | defined})
        if missing and block.runs:
            problems.append(f"{block.where}: uses {', '.join(missing)}, which neither this "
                            "block nor a run block above it on the page defines")
        if block.runs:
            defined |= bound
    return problems


# --- sfi commands in shell blocks ----------------------------------------------------------

def _logical_lines(text: str, first: int) -> list[tuple[int, str]]:
    """A shell block's lines with backslash continuations joined, each with the page line
    it starts on (``first`` is the block's first line)."""
    lines: list[tuple[int, str]] = []
    start, parts = None, []
    for number, line in enumerate(text.splitlines(), first):
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        lines.append((start, " ".join([*parts, line])))
        start, parts = None, []
    if parts:
        lines.append((start, " ".join(parts)))
    return lines


def sfi_commands(text: str, first: int = 1) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """The ``sfi`` commands of a shell block as ``(line, argv after sfi)``, several a line
    (``;``, ``&&``, pipes, subshells), past ``NAME=value`` prefixes and without comments and
    redirections; and the lines where ``sfi`` appears other than at a command's start (a
    command this cannot check)."""
    commands: list[tuple[int, list[str]]] = []
    problems = []
    for number, line in _logical_lines(text, first):
        line = re.sub(r"(?<=\s)\d(?=[<>])", " ", line)  # 2>&1: the descriptor
        line = re.sub(r"<\w[\w.-]*>", lambda m: shlex.quote(m[0]), line)  # <file>: a word
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError as exc:
            problems.append(f"{number}: the shell cannot split this line: {exc}")
            continue
        segments: list[list[str]] = [[]]
        redirected = False
        for token in tokens:
            if redirected:
                redirected = False
            elif token in OPERATORS:
                segments.append([])
            elif set(token) <= set("<>&|") and ("<" in token or ">" in token):
                redirected = True  # and its target with it
            else:
                segments[-1].append(token)
        found = 0
        for segment in segments:
            while segment and ASSIGNMENT.match(segment[0]):
                segment = segment[1:]
            if segment and (segment[0] == "sfi" or segment[0].endswith("/sfi")):
                commands.append((number, segment[1:]))
                found += 1
            elif (len(segment) >= 3 and re.fullmatch(r"(\S*/)?python[\d.]*", segment[0])
                    and segment[1:3] == ["-m", "sfi"]):
                commands.append((number, segment[3:]))
                found += 1
        words = sum((token == "sfi" or token.endswith("/sfi"))
                    and not (i and tokens[i - 1].startswith("--"))  # --methods sfi: a value
                    for i, token in enumerate(tokens))
        if words != found:
            problems.append(f"{number}: sfi appears where no command starts: {line.strip()}")
    return commands, problems


def _check_values(command: str, params: dict[str, Any]) -> None:
    """The checks ``sfi COMMAND`` makes of its values before it loads a model, with its own
    parsers: an ``SFIError`` names the first that fails."""
    from sfi.bench.llama_cpp import flash_attn_settings
    from sfi.bench.throughput import MODES as BENCH_MODES
    from sfi.cli.common import one_format
    from sfi.cli.options import build_config, float_list, int_list, name_list
    from sfi.decoding.decode import MODES
    from sfi.eval.runner import parse_runs
    from sfi.eval.tasks import TASKS
    from sfi.weights.layout import WEIGHT_FORMATS

    if "set_" in params:
        build_config(**{k: params[k] for k in SFI_KNOBS if k in params}, extra=params["set_"])
    if "mode" in params and params["mode"] not in MODES:
        raise SFIError(f"--mode must be one of {', '.join(MODES)}, got {params['mode']!r}")
    for name in ("contexts", "batch"):
        if name in params:
            int_list(f"--{name}", params[name])
    if command == "bench":
        name_list("--modes", params["modes"], BENCH_MODES)
        name_list("--weights", params["weights"], WEIGHT_FORMATS)
        flash_attn_settings(params["gguf_flash_attn"])
    elif "weights" in params:
        one_format(params["weights"])
    if command == "eval":
        name_list("--tasks", params["tasks"], TASKS)
        parse_runs(name_list("--methods", params["methods"]),
                   float_list("--budgets", params["budgets"]))


def check_sfi(argv: list[str]) -> str | None:
    """None if ``sfi *argv`` parses as the command line would parse it (nothing runs), else
    why not."""
    from sfi.cli import app

    if not argv:
        return "sfi alone prints its help: name a command"
    placeholder = next((arg for arg in argv if PLACEHOLDER.search(arg)), None)
    if placeholder is not None:
        return f"{placeholder!r} is a placeholder: write a value that parses"
    root = typer.main.get_command(app)
    context = root.context_class(root, info_name="sfi")
    if argv[0].startswith("-"):
        options = {opt for param in root.get_params(context) for opt in param.opts}
        unknown = [arg for arg in argv if arg not in options]
        return f"sfi has no option {unknown[0]}" if unknown else None
    command = root.get_command(context, argv[0])
    if command is None:
        return f"sfi has no command {argv[0]!r}"
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help prints, then exits
            parsed = command.make_context(argv[0], list(argv[1:]), parent=context)
        _check_values(argv[0], parsed.params)
    except typer.Exit:
        return None
    except typer.TyperException as exc:
        return exc.format_message()
    except SFIError as exc:
        return str(exc)
    return None


# --- the checks ------------------------------------------------------------------------------

def test_every_command_block_is_run_or_marked_not_run():
    """Markers sit on the line before a fence and give a reason; every fence names its
    language. (Each bash and Python block without a marker is run by
    :func:`test_the_blocks_run_as_pasted`: a block is run or marked by construction.)"""
    problems = []
    for page in PAGES:
        problems += parse_page(page, (ROOT / page).read_text(encoding="utf-8"))[1]
    assert not problems, "\n".join(problems)


def test_a_block_neither_run_nor_marked_is_caught():
    """The checks fail, naming the page and line, on what breaks the convention."""
    page = ("Text.\n\n```console\n$ sfi demo\n```\n\n<!-- not run -->\n```bash\nmake\n```\n\n"
            "<!-- not run: a GPU -->\n\nA marker away from its fence.\n\n```\nsfi demo\n```\n"
            "<!-- not run: needs vLLM -->\n```python\nimport vllm\n```\n\n"
            "```python\nprint(prompt_a, len(vllm.__name__))\n```\n")
    blocks, problems = parse_page("p.md", page)
    assert problems == [
        "p.md:3: a console block cannot run as pasted: mark it <!-- not run: REASON --> or "
        "make it a bash or python block",
        "p.md:7: a not-run marker needs a reason: <!-- not run: REASON -->",
        "p.md:12: a not-run marker that is not just before a fence",
        "p.md:16: a fence with no language: name it (text for output or a diagram, bash or "
        "python for commands)"]
    assert [b.not_run for b in blocks] == [None, "", None, "needs vLLM", None]
    python = [b for b in blocks if b.lang == "python"]
    assert undefined_names(python) == [  # a not-run block's names do not count
        "p.md:24: uses prompt_a, vllm, which neither this block nor a run block above it on "
        "the page defines"]
    assert undefined_names([Block("p.md", 1, "python", "print(\n", None)])[0].startswith(
        "p.md:1: does not compile")


def test_every_python_block_compiles_and_defines_what_it_uses():
    """Every Python block compiles; a run block uses only names it or a run block above it on
    the same page defines (``prompt_a`` from nowhere would fail as pasted)."""
    problems = []
    for page in PAGES:
        problems += undefined_names([b for b in page_blocks(page) if b.lang in RUN_PYTHON])
    assert not problems, "\n".join(problems)


def test_every_sfi_command_in_the_pages_parses_against_the_cli():
    """Every ``sfi`` command of a shell block, run or not, names a command and options that
    exist, with values that parse; the examples in each command's ``--help`` likewise."""
    from sfi.cli import EXAMPLES

    problems, checked = [], 0
    for page in PAGES:
        for block in page_blocks(page):
            if block.lang not in RUN_SHELL | {"console", "shell-session"}:
                continue
            text = block.text
            if block.lang not in RUN_SHELL:  # "$ " commands; the rest is their output
                text = "\n".join(line[2:] if line.startswith("$ ") else ""
                                 for line in text.splitlines())
            commands, found = sfi_commands(text, block.line + 1)
            problems += [f"{page}:{problem}" for problem in found]
            for line, argv in commands:
                checked += 1
                if (why := check_sfi(argv)) is not None:
                    problems.append(f"{page}:{line}: sfi {shlex.join(argv)}: {why}")
    for name, examples in EXAMPLES.items():
        for line, argv in sfi_commands(examples)[0]:
            if (why := check_sfi(argv)) is not None:
                problems.append(f"sfi {name} --help, example {line}: {why}")
    assert not problems, "\n".join(problems)
    assert checked >= 15  # the pages' commands were found


@pytest.mark.parametrize(("command", "why"), [
    ("sfi generate --prompt hi --chat --k-fraction 0.15 --max-new-tokens 8", None),
    ("sfi --version", None),
    ("sfi generate --help", None),
    ("sfi genrate --prompt hi", "no command 'genrate'"),
    ("sfi generate --prompt hi --max-tokens 8", "No such option: --max-tokens"),
    ("sfi generate --prompt hi --max-new-tokens ten", "valid integer"),
    ("sfi generate --prompt hi --k-fraction much", "valid number"),
    ("sfi generate --prompt hi --mode fulll", "--mode must be one of sfi, full, exact"),
    ("sfi generate --prompt hi --chat extra", "unexpected extra argument"),
    ("sfi generate --prompt-file <file>", "placeholder"),
    ("sfi generate --prompt ... --chat", "placeholder"),
    ("sfi serve --preset papr", "papr"),
    ("sfi serve --set no_such_field=1", "no_such_field"),
    ("sfi serve --k-fraction 1.5", "k_fraction"),
    ("sfi bench --contexts 4k", "--contexts must be comma-separated integers"),
    ("sfi bench --modes full,sfi-fast", "sfi-fast"),
    ("sfi bench --weights int4", "int4"),
    ("sfi eval --tasks passkey,needle", "needle"),
    ("sfi eval --methods full,snap", "snap"),
    ("sfi demo --weights int8,fp16", "one format"),
])
def test_the_command_checker_catches_what_the_cli_refuses(command, why):
    """A made-up command the CLI would refuse before loading a model fails the check (and a
    good one passes): the check can fail."""
    commands, problems = sfi_commands(command)
    assert problems == [] and len(commands) == 1
    result = check_sfi(commands[0][1])
    if why is None:
        assert result is None
    else:
        assert result is not None and why in result, result


def test_sfi_commands_are_found_where_a_shell_would_run_them():
    """Continuations, several commands a line, environment prefixes, pipes, subshells,
    redirections and comments; ``sfi`` anywhere else is reported, not skipped."""
    block = ("# sfi demo, in a comment\n"
             "SFI_API_KEY=x sfi serve --port 8000 \\\n"
             "    --max-batch 8   # a comment\n"
             "(echo hi; sfi generate --prompt-file a.txt) > out.txt 2>&1 && sfi demo | tee log\n"
             ".venv-vllm/bin/sfi bench-vllm --contexts 4096 --json > b.json\n"
             "python -m sfi eval --tasks passkey\n"
             "sfi eval --methods sfi --tasks passkey\n"
             "time sfi demo\n")
    commands, problems = sfi_commands(block, 10)
    assert commands == [(11, ["serve", "--port", "8000", "--max-batch", "8"]),
                        (13, ["generate", "--prompt-file", "a.txt"]), (13, ["demo"]),
                        (14, ["bench-vllm", "--contexts", "4096", "--json"]),
                        (15, ["eval", "--tasks", "passkey"]),
                        (16, ["eval", "--methods", "sfi", "--tasks", "passkey"])]
    assert problems == ["17: sfi appears where no command starts: time sfi demo"]


# --- the blocks that run ---------------------------------------------------------------------

RUN_CHAINS: dict[str, list[Block]] = {
    page: chain for page in PAGES if (chain := [b for b in page_blocks(page) if b.runs])}

RUNNER = """import json, sys
namespace = {"__name__": "__main__"}
for path, line, source in json.loads(sys.argv[1]):
    exec(compile("\\n" * line + source, path, "exec"), namespace)
"""


def _run_python(blocks: list[Block], cwd: Path) -> subprocess.CompletedProcess:
    """A page's Python blocks in order in one fresh process, each compiled with the page's
    path and line numbers (a traceback names the page line that failed)."""
    chain = [(str(ROOT / b.page), b.line, b.text) for b in blocks]
    return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(chain)],
                          capture_output=True, text=True, timeout=900, cwd=cwd)


def _run_shell(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    """One shell block as ``bash -e`` runs it, with this environment's ``sfi`` on the PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text],
                          capture_output=True, text=True, timeout=900, cwd=cwd, env=env)


def _readme_python(result: subprocess.CompletedProcess) -> None:
    """The Python quick start prints SFI's text and a summary with fast steps, and the
    ``model.generate`` one a cache's stats with fast steps."""
    summary = re.search(r"SFI: (\d+) fast and (\d+) slow steps", result.stdout)
    assert summary and int(summary.group(1)) > 0, result.stdout
    stats = re.search(r"'fast_steps': (\d+)", result.stdout)
    assert stats and int(stats.group(1)) > 0, result.stdout
    text = result.stdout[:summary.start()].strip()
    assert len(text.split()) >= 5  # the answer itself, not an empty string


def _readme_shell(result: subprocess.CompletedProcess) -> None:
    """The command-line quick start prints an answer, and a summary with fast steps."""
    fast = re.search(r"fast (\d+) / dense", " ".join(result.stderr.split()))
    assert fast and int(fast.group(1)) > 0, result.stderr[-2000:]
    assert len(result.stdout.split()) >= 5


def _usage_python(result: subprocess.CompletedProcess) -> None:
    """The long prompt decodes with fast steps; the short prompt's result says why its steps
    were dense."""
    stats = re.search(r"'fast_steps': (\d+)", result.stdout)
    assert stats and int(stats.group(1)) > 0, result.stdout[-2000:]
    assert re.search(r"\nthe context is shorter than [\d,]+ tokens, where sparse decoding "
                     "starts to pay", result.stdout), result.stdout[-2000:]


# What a page's blocks print, beyond running: (page, "python") -> a check of the process
# that ran its Python blocks, (page, "shell") -> of its last shell block
EXPECT: dict[tuple[str, str], Callable[[subprocess.CompletedProcess], None]] = {
    ("README.md", "python"): _readme_python,
    ("README.md", "shell"): _readme_shell,
    ("docs/usage.md", "python"): _usage_python,
}


@pytest.mark.model
@pytest.mark.parametrize("page", sorted(RUN_CHAINS))
def test_the_blocks_run_as_pasted(page, default_model, tmp_path):
    """A page's unmarked blocks run as pasted, on the default model: its Python blocks in one
    process, its shell blocks one after the other in one folder."""
    python = [b for b in RUN_CHAINS[page] if b.lang in RUN_PYTHON]
    if python:
        result = _run_python(python, tmp_path)
        assert result.returncode == 0, f"{page}: {result.stderr[-3000:]}"
        EXPECT.get((page, "python"), lambda result: None)(result)
    shell = [b for b in RUN_CHAINS[page] if b.lang in RUN_SHELL]
    for block in shell:
        result = _run_shell(block, tmp_path)
        assert result.returncode == 0, f"{block.where}: {result.stderr[-3000:]}"
    if shell:
        EXPECT.get((page, "shell"), lambda result: None)(result)


def test_what_is_expected_of_a_page_is_expected_of_blocks_that_run():
    """Each check of :data:`EXPECT` belongs to a page with run blocks of its language (a
    check whose blocks were marked not run would pass by never running)."""
    languages = {"python": RUN_PYTHON, "shell": RUN_SHELL}
    for page, kind in EXPECT:
        assert any(b.lang in languages[kind] for b in RUN_CHAINS.get(page, [])), (page, kind)
