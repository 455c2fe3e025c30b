"""The sfi command, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sfi.cli import build_config
from sfi.errors import SFIError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfi.cli", *args], capture_output=True,
                          text=True, timeout=600)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """``sfi ARGS`` run in this process (for input refused before any model loads: a process
    of its own costs seconds of imports); an exception that escapes the command shows up as
    its traceback in ``stderr``, as it would from the ``sfi`` command."""
    import contextlib
    import io
    import os
    import traceback

    from sfi.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        patch.setattr(sys, "argv", ["sfi", *args])
        patch.setitem(os.environ, "SFI_KEEP_FREED_MEMORY", "0")  # (this process's malloc)
        patch.setitem(os.environ, "COLUMNS", "200")  # rich wraps messages to the terminal
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:  # (what the command would print)
            err.write(traceback.format_exc())
            code = 1
    return subprocess.CompletedProcess(["sfi", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.model
def test_generate_json_schema_both_modes(default_model):  # the fixture converts the model once
    common = ["generate", "--prompt", "The sea is calm. The sky is blue. Birds", "--json",
              "--max-new-tokens", "12"]
    fast = run_cli(*common, "--recent", "4", "--k-head", "4", "--force-sparse",
                   "--set", "min_refresh_gap=2")
    assert fast.returncode == 0, fast.stderr
    out = json.loads(fast.stdout)
    assert {"text", "new_tokens", "stats", "timing"} <= set(out)
    assert {"slow_steps", "fast_steps", "refresh_reasons", "fast_read_fraction"} <= set(
        out["stats"])
    assert {"prefill_s", "decode_s", "decode_tok_s"} <= set(out["timing"])
    assert out["new_tokens"] >= 1 and out["stats"]["fast_steps"] >= 1
    assert out["config"]["min_refresh_gap"] == 2
    assert out["weights"] in ("native", "bf16", "fp16", "int8")  # what auto chose, by name
    full = json.loads(run_cli(*common, "--mode", "full").stdout)
    assert full["mode"] == "full" and full["stats"]["fast_steps"] == 0
    exact = json.loads(run_cli(*common, "--mode", "exact", "--recent", "4", "--k-head", "4",
                               "--force-sparse", "--set", "draft_fallback=false").stdout)
    assert exact["mode"] == "exact" and exact["text"] == full["text"]
    assert exact["stats"]["exact"]["verify_steps"] >= 1


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "hi", "--mode", "fastest"], "--mode must be one of sfi, full, exact"),
    (["--prompt", "hi", "--k-head", "-3"], "k_head must be >= 0"),
    (["--prompt", "hi", "--k-fraction", "1.5"], "k_fraction must be <= 1.0"),
    (["--prompt", "hi", "--model", "nope"], "unknown model 'nope'"),
    ([], "give exactly one of --prompt TEXT or --prompt-file FILE"),
    (["--prompt", "hi", "--set", "alpha=abc"], "not a valid value"),
    (["--prompt", "hi", "--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
])
def test_generate_bad_input_exits_with_a_message(args, message):
    result = run_cli_here("generate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_build_config_from_flags():
    config = build_config(k_fraction=0.2, sink=8, extra=["nms_strength=0", "force_sparse=true"])
    assert config.k_head is None and config.k_fraction == 0.2 and config.sink == 8
    assert config.nms_strength == 0.0 and config.force_sparse is True
    with pytest.raises(SFIError, match="--set expects name=value"):
        build_config(extra=["nonsense=1"])


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "max_batch must be >= 1"),
    (["--max-queue", "-1"], "max_queue must be >= 0"),
    (["--prefill-chunk", "-2"], "--prefill-chunk must be >= 0"),
    (["--max-stall-ms", "-5"], "max_stall must be >= 0"),
    (["--api-key", " "], "the API key is set but empty"),
    (["--max-body-mb", "0"], "request body limit must be > 0"),
])
def test_serve_refuses_bad_limits_before_loading_the_model(args, message):
    """The engine's and the guard's own checks, run before the model loads (the model named
    here does not exist: a check that came after loading would report that instead)."""
    result = run_cli_here("serve", "--model", "no-such-model", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("batch, said", [("8", True), ("1", False)])
def test_serve_says_fp16_weights_are_a_batch_one_format(batch, said):
    from sfi.weights.fp16_linear import BATCH_ONE

    result = run_cli_here("serve", "--model", "no-such-model", "--weights", "fp16",
                          "--max-batch", batch)
    assert result.returncode != 0 and "no-such-model" in result.stderr  # noted before loading
    assert (BATCH_ONE in " ".join(result.stderr.split())) == said


def test_access_defaults_follow_the_listening_address():
    from sfi.server.guard import Access

    local = Access.listening_on("127.0.0.1")
    assert "localhost" in local.allowed_hosts and not local.open_to_anyone("127.0.0.1")
    public = Access.listening_on("0.0.0.0")
    assert public.allowed_hosts == ("*",) and public.open_to_anyone("0.0.0.0")
    assert not Access.listening_on("0.0.0.0", api_key="k").open_to_anyone("0.0.0.0")
    assert Access.listening_on("0.0.0.0", allowed_hosts=["a.example"]).allowed_hosts == (
        "a.example",)


def test_loadtest_refuses_non_loopback_targets():
    result = run_cli_here("loadtest", "--url", "http://10.1.2.3:8000", "--duration", "1")
    assert result.returncode == 2
    assert "loopback addresses only" in result.stderr


def test_bench_vllm_without_vllm_says_how_to_get_it():
    """The main environment has no vLLM: a clear error naming the fix, no traceback."""
    result = run_cli_here("bench-vllm", "--contexts", "4096")
    assert result.returncode == 2
    assert "sfi bench-vllm needs vLLM" in result.stderr and "make install-vllm" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli_here("bench-vllm", "--own-kv", "random")
    assert result.returncode == 2 and "--own-kv must be one of prefill, synthetic" in result.stderr
    result = run_cli_here("bench-vllm", "--gguf", "no/such.gguf")
    assert result.returncode == 2 and "--gguf: no file 'no/such.gguf'" in result.stderr
    result = run_cli_here("bench-vllm", "--gguf", __file__)
    assert result.returncode == 2 and "is not a GGUF file" in result.stderr


def test_bench_checks_its_gguf_files_before_it_loads_a_model():
    result = run_cli_here("bench", "--gguf", "no/such.gguf")
    assert result.returncode == 2 and "--gguf: no file 'no/such.gguf'" in result.stderr
    result = run_cli_here("bench", "--gguf", __file__)
    assert result.returncode == 2 and "is not a GGUF file" in result.stderr
    result = run_cli_here("bench", "--model", "./no/such/dir", "--gguf", "packaged")
    assert result.returncode == 2 and "--gguf packaged" in result.stderr
    for value in ("maybe", "on,on", ""):
        result = run_cli_here("bench", "--gguf-flash-attn", value)
        assert result.returncode == 2, value
        assert f"--gguf-flash-attn takes on, off or on,off; got {value!r}" in result.stderr


@pytest.mark.model
def test_generate_streams_the_text_it_prints(default_model):
    common = ["generate", "--prompt", "The sea is calm. The sky is blue. Birds",
              "--max-new-tokens", "16"]
    plain = run_cli(*common)
    streamed = run_cli(*common, "--stream")
    assert plain.returncode == 0 and streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() and streamed.stdout.strip() == plain.stdout.strip()
    refused = run_cli(*common, "--stream", "--json")
    assert refused.returncode == 2 and "choose one" in refused.stderr


@pytest.mark.model
def test_generate_says_when_an_instruction_needs_chat(default_model):
    common = ["generate", "--prompt", "Write three short sentences about the sea.",
              "--max-new-tokens", "12"]
    plain = run_cli(*common)  # the instruction-tuned model ends a raw instruction at once
    assert plain.returncode == 0 and "0 new" in plain.stderr, plain.stderr
    assert "answers a question or an instruction with --chat" in " ".join(plain.stderr.split())
    chat = run_cli(*common, "--chat")
    assert chat.returncode == 0 and chat.stdout.strip() and "--chat" not in chat.stderr


@pytest.mark.model
def test_demo_prints_both_answers_and_the_speedup(default_model):
    result = run_cli("demo", "--context", "1500", "--seed", "0", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "What is the special magic number" in out and "correct │ yes │ yes" in out
    assert "Write a short essay" in out and "tokens/s" in out
    assert "x as fast as full attention" in out and "Traceback" not in result.stderr


# --- bad prompt files --------------------------------------------------------------------------
def test_a_prompt_file_that_is_not_utf8_gets_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad\xc3")
    result = run_cli_here("generate", "--prompt-file", str(bad))
    assert result.returncode == 2
    assert "is not UTF-8 text" in result.stderr and "Traceback" not in result.stderr


def test_a_prompt_file_that_is_a_folder_or_missing_says_which(tmp_path):
    folder = run_cli_here("generate", "--prompt-file", str(tmp_path))
    assert folder.returncode == 2 and "is a folder, not a file" in folder.stderr
    missing = run_cli_here("generate", "--prompt-file", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "no file" in missing.stderr
    assert "Traceback" not in folder.stderr + missing.stderr
    assert folder.stderr.strip().count("\n") == 0  # one line, a long path included


def test_an_unreadable_prompt_file_gets_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    locked = tmp_path / "locked.txt"
    locked.write_text("hello")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)  # (root reads any file: refused by hand)
    result = run_cli_here("generate", "--prompt-file", str(locked))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and "Permission denied" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_model_folder_says_so():
    result = run_cli_here("generate", "--prompt", "hi", "--model", "./no/such/dir")
    assert result.returncode == 2
    assert "no such folder or file: './no/such/dir'" in result.stderr


# --- one vocabulary ----------------------------------------------------------------------------
def _visible_options() -> dict[str, set[str]]:
    """Every subcommand's visible option flags."""
    import typer.main

    from sfi.cli import app

    group = typer.main.get_command(app)
    out = {}
    for name, command in group.commands.items():
        out[name] = {flag for param in command.params if not getattr(param, "hidden", False)
                     for flag in (*param.opts, *param.secondary_opts) if flag.startswith("--")}
    return out


# one spelling per concept: (the spelling, the commands that have it), and the spellings that
# no command shows any more
SFI_COMMANDS = {"generate", "demo", "bench", "bench-vllm", "serve", "analyze"}
CONCEPTS = {
    "tokens to generate": ("--max-new-tokens",
                           {"generate", "demo", "bench", "bench-vllm", "loadtest"}),
    "one context length": ("--context", {"demo", "diagnose", "analyze"}),
    "several context lengths": ("--contexts", {"bench", "bench-vllm", "eval"}),
    "K as a fraction": ("--k-fraction", SFI_COMMANDS),
    "K as tokens": ("--k-head", SFI_COMMANDS),
    "any other SFIConfig field": ("--set", SFI_COMMANDS | {"eval"}),
    "one kept budget C = S + K + R": ("--budget", {"diagnose"}),
    "several kept budgets": ("--budgets", {"eval"}),
}
RETIRED = {"--new-tokens", "--max-tokens", "--answer-tokens", "--sfi", "--k-fractions",
           "--k-heads", "--tokens-to-generate"}


def test_every_concept_has_one_spelling_across_the_commands():
    options = _visible_options()
    assert set(options) == {"generate", "demo", "bench", "bench-vllm", "eval", "report",
                            "diagnose", "analyze", "serve", "loadtest"}
    for concept, (flag, commands) in CONCEPTS.items():
        having = {name for name, flags in options.items() if flag in flags}
        assert having == commands, (concept, flag, having ^ commands)
    for name, flags in options.items():
        assert not flags & RETIRED, (name, flags & RETIRED)


@pytest.mark.parametrize("args, note, message", [
    (["bench", "--new-tokens", "0"], "--new-tokens is deprecated",
     "--max-new-tokens must be >= 1"),
    (["loadtest", "--max-tokens", "0"], "--max-tokens is deprecated",
     "--max-new-tokens must be >= 1"),
    (["eval", "--budget", "0"], "--budget is deprecated", "positive"),
])
def test_old_spellings_still_work_for_one_release_with_a_note(args, note, message):
    result = run_cli_here(*args)
    assert result.returncode == 2
    assert note in result.stderr and "use --" in result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_an_old_and_a_new_spelling_together_are_refused():
    result = run_cli_here("bench", "--new-tokens", "4", "--max-new-tokens", "8")
    assert result.returncode == 2
    assert "--new-tokens is the old spelling of --max-new-tokens" in result.stderr
    both = run_cli_here("bench-vllm", "--sfi", "k_head=4", "--k-head", "8")
    assert both.returncode == 2 and "--sfi is the old spelling" in both.stderr


@pytest.mark.parametrize("command", ["generate", "demo", "bench", "bench-vllm", "eval",
                                     "report", "diagnose", "analyze", "serve", "loadtest"])
def test_every_subcommand_help_describes_its_options_and_shows_examples(command):
    result = run_cli_here(command, "--help")
    assert result.returncode == 0
    assert "Examples:" in result.stdout and f"sfi {command}" in result.stdout
    assert "<bool>" not in result.stdout
    import typer.main

    from sfi.cli import app

    params = typer.main.get_command(app).commands[command].params
    undescribed = [p.name for p in params if not getattr(p, "hidden", False)
                   and not (getattr(p, "help", None) or "").strip("[]0123456789. ")]
    assert not undescribed


def test_the_command_line_starts_without_torch():
    """``sfi --help`` stays quick: the commands import torch and transformers only when they
    run (``sfi`` imports its names on first use)."""
    probe = "import sys, sfi, sfi.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_version():
    from sfi import __version__

    result = run_cli_here("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"sfi {__version__}"


def test_every_command_quoted_in_the_docs_names_real_options():
    """The README's and the docs' ``sfi COMMAND --option`` lines use options the command has
    (under their current spelling), so that they run as written."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    options = _visible_options()
    pages = [root / "README.md", *(root / "docs").rglob("*.md")]
    checked = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for match in re.finditer(r"(?:^|[\s/(])sfi ([a-z-]+)((?:\s+[^|;&#\s]+)*)", line):
                    command, rest = match.group(1), match.group(2)
                    if command not in options:
                        continue
                    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
                    unknown = flags - options[command] - {"--help"}
                    assert not unknown, (page.name, line.strip(), unknown)
                    checked += 1
    assert checked > 20  # the docs do quote commands


def test_the_demos_default_seed_is_the_demos_own():
    import inspect

    from sfi.cli.demo import DEMO_SEED
    from sfi.cli.generate import demo_cmd

    assert inspect.signature(demo_cmd).parameters["seed"].default == DEMO_SEED


def test_tables_print_method_names_with_brackets(capsys):
    from sfi.cli.common import print_table

    print_table("t", ["method", "score"], [["sfi[recent=512]@0.15", 91.7], ["full", None]],
                wide=True)
    out = capsys.readouterr().out
    assert "sfi[recent=512]@0.15" in out and "91.7" in out
