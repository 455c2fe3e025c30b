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
def test_demo_prints_both_answers_and_the_speedup(default_model):
    result = run_cli("demo", "--context", "1500", "--seed", "0", "--answer-tokens", "16")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "What is the special magic number" in out and "correct │ yes │ yes" in out
    assert "Write a short essay" in out and "tokens/s" in out
    assert "x as fast as full attention" in out and "Traceback" not in result.stderr
