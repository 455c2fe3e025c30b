"""The ``sfi`` command line: generate, demo, bench, eval, analyze, serve, loadtest."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from sfi.config import SFIConfig
from sfi.errors import PromptError, SFIError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Slow-Fast Inference: fast long-context decoding for transformers models.")
err = Console(stderr=True)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="default, qwen2.5-0.5b, a folder, "
                                       "a .gguf file or a hub id")]
SinkOpt = Annotated[int | None, typer.Option(help="S: sink tokens [4]")]
RecentOpt = Annotated[int | None, typer.Option(help="R: recent window [256]")]
KHeadOpt = Annotated[int | None, typer.Option("--k-head", help="K: selected tokens per KV head "
                                              "[2048]")]
KFracOpt = Annotated[float | None, typer.Option("--k-fraction", help="K as a fraction of the "
                                                "context, in (0, 1] (instead of --k-head)")]
IntervalOpt = Annotated[int | None, typer.Option("--refresh-interval", help="reuse budget [96]")]
GapOpt = Annotated[int | None, typer.Option("--min-refresh-gap", help="[16]")]
WindowOpt = Annotated[int | None, typer.Option("--evidence-window", help="W after prefill [16]")]
TriggerOpt = Annotated[str | None, typer.Option(help="sentence | fixed | random | bootstrap")]
ForceOpt = Annotated[bool, typer.Option("--force-sparse", help="slow/fast steps even on short "
                                        "contexts")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="any other SFIConfig field, "
                                                  "as name=value (repeatable)")]


def build_config(*, sink: int | None = None, recent: int | None = None, k_head: int | None = None,
                 k_fraction: float | None = None, refresh_interval: int | None = None,
                 min_refresh_gap: int | None = None, evidence_window: int | None = None,
                 trigger: str | None = None, force_sparse: bool = False,
                 extra: list[str] | None = None) -> SFIConfig:
    """An SFIConfig from command-line values; unset ones keep their defaults."""
    values: dict[str, Any] = {k: v for k, v in {
        "sink": sink, "recent": recent, "k_head": k_head, "k_fraction": k_fraction,
        "refresh_interval": refresh_interval, "min_refresh_gap": min_refresh_gap,
        "evidence_window": evidence_window, "trigger": trigger}.items() if v is not None}
    if force_sparse:
        values["force_sparse"] = True
    types = {f.name: f.type for f in fields(SFIConfig)}
    for item in extra or []:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise SFIError(f"--set expects name=value with a field of SFIConfig, got {item!r}; "
                           f"fields: {', '.join(types)}")
        values[name] = _parse_value(name, raw.strip(), str(types[name]))
    if "k_fraction" in values and "k_head" not in values:
        values["k_head"] = None
    return SFIConfig(**values)


def _parse_value(name: str, raw: str, type_name: str) -> Any:
    try:
        if "bool" in type_name:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if "float" in type_name:
            return float(raw)
        if "int" in type_name:
            return None if raw.lower() == "none" else int(raw)
    except ValueError:
        raise SFIError(f"--set {name}: {raw!r} is not a valid value ({type_name})") from None
    return raw


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise SFIError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise SFIError(f"prompt file {prompt_file} does not exist")
        return prompt_file.read_text(encoding="utf-8")
    return prompt


def _load(model: str, quiet: bool):
    from sfi.models import load

    if quiet:
        return load(model)
    with err.status(f"Loading {model} (the first load converts a GGUF once, 30-90 s)"):
        return load(model)


def _run(model, tokenizer, prompt: str, quiet: bool, label: str, **kwargs: Any):
    from sfi.decode import generate

    if quiet:
        return generate(model, tokenizer, prompt, **kwargs)
    columns = (SpinnerColumn(), TextColumn(label), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(label, total=kwargs["max_new_tokens"])
        return generate(model, tokenizer, prompt, on_token=lambda row, tok: progress.advance(task),
                        **kwargs)


@app.command("generate")
def generate_cmd(
    model: ModelOpt = "default",
    prompt: Annotated[str | None, typer.Option(help="the prompt text")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="read the prompt from a file")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 128,
    mode: Annotated[str, typer.Option(help="sfi | full")] = "sfi",
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed")] = None,
    sink: SinkOpt = None, recent: RecentOpt = None, k_head: KHeadOpt = None,
    k_fraction: KFracOpt = None, refresh_interval: IntervalOpt = None,
    min_refresh_gap: GapOpt = None, evidence_window: WindowOpt = None,
    trigger: TriggerOpt = None, force_sparse: ForceOpt = False, set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Generate a continuation of a prompt with slow-fast decoding (or full attention)."""
    text = _read_prompt(prompt, prompt_file)
    if not text.strip():
        raise PromptError("the prompt is empty: give some text to continue")
    config = None
    if mode == "sfi":
        config = build_config(sink=sink, recent=recent, k_head=k_head, k_fraction=k_fraction,
                              refresh_interval=refresh_interval, min_refresh_gap=min_refresh_gap,
                              evidence_window=evidence_window, trigger=trigger,
                              force_sparse=force_sparse, extra=set_)
    loaded_model, tokenizer = _load(model, as_json)
    result = _run(loaded_model, tokenizer, text, as_json, f"decoding ({mode})", config=config,
                  max_new_tokens=max_new_tokens, mode=mode, chat=chat, temperature=temperature,
                  top_p=top_p, seed=seed)
    if as_json:
        print(json.dumps({"model": model, **result.to_dict()}))
        return
    Console().print(result.text, markup=False, highlight=False)
    err.print(_summary(result))


def _summary(result) -> str:
    s, t = result.stats, result.timing
    return (f"[dim]{result.mode}: {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
            f"prefill {t.prefill_s:.2f} s, decode {t.decode_tok_s:.1f} tok/s; steps slow "
            f"{s.slow_steps} / fast {s.fast_steps} / dense {s.dense_steps}; fast steps read "
            f"{100 * s.fast_read_fraction:.1f}% of the context[/dim]")


@app.command("demo")
def demo_cmd(
    model: ModelOpt = "default",
    context: Annotated[int, typer.Option(help="prompt length in tokens (essay text)")] = 4096,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 96,
    k_fraction: Annotated[float, typer.Option("--k-fraction", help="K as a fraction of the "
                                              "context")] = 0.15,
) -> None:
    """The main job: one long prompt decoded with full attention and with SFI, side by side."""
    from sfi.texts import long_text

    loaded_model, tokenizer = _load(model, False)
    prompt = long_text(tokenizer, context)
    config = SFIConfig(k_head=None, k_fraction=k_fraction)
    results = {}
    for mode in ("full", "sfi"):
        with err.status(f"prefilling {context} tokens ({mode})"):
            results[mode] = _run(loaded_model, tokenizer, prompt, True, mode,
                                 config=config if mode == "sfi" else None,
                                 max_new_tokens=max_new_tokens, mode=mode)
    full, fast = results["full"], results["sfi"]
    table = Table(title=f"{model}: {full.prompt_tokens}-token essay prompt, greedy, "
                        f"{max_new_tokens} new tokens")
    table.add_column("full attention", ratio=1)
    table.add_column(f"SFI (K = {k_fraction:.0%} of the context, S = {config.sink}, "
                     f"R = {config.recent})", ratio=1)
    table.add_row(full.text, fast.text)
    table.add_row(_summary(full), _summary(fast))
    Console().print(table)
    same = sum(a == b for a, b in zip(full.token_ids, fast.token_ids))
    speed = fast.timing.decode_tok_s / full.timing.decode_tok_s if full.timing.decode_tok_s else 0
    Console().print(f"token agreement with full attention: {same}/{len(full.token_ids)}; "
                    f"SFI decode speed {speed:.2f}x full attention")


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SFIError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SFIError(f"{name} must list positive integers, got {text!r}")
    return values


@app.command("bench")
def bench_cmd(
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
    sink: SinkOpt = None, recent: RecentOpt = None, k_head: KHeadOpt = None,
    k_fraction: KFracOpt = None, refresh_interval: IntervalOpt = None,
    min_refresh_gap: GapOpt = None, evidence_window: WindowOpt = None,
    trigger: TriggerOpt = None, set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    plot: Annotated[Path | None, typer.Option(help="write tokens/s against context (PNG)")] =
        None,
) -> None:
    """Decode throughput of SFI against full attention and the memory-bandwidth floor."""
    from sfi.bench.throughput import plot_throughput, run_bench

    context_list = _int_list("--contexts", contexts)
    batch_list = _int_list("--batch", batch)
    if new_tokens < 1:
        raise SFIError(f"--new-tokens must be >= 1, got {new_tokens}")
    config = build_config(sink=sink, recent=recent, k_head=k_head, k_fraction=k_fraction,
                          refresh_interval=refresh_interval, min_refresh_gap=min_refresh_gap,
                          evidence_window=evidence_window, trigger=trigger, extra=set_)
    loaded_model, tokenizer = _load(model, as_json)
    say = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    result = run_bench(loaded_model, tokenizer, contexts=context_list, batches=batch_list,
                       new_tokens=new_tokens, config=config,
                       modes=[m.strip() for m in modes.split(",") if m.strip()],
                       synthetic_kv=synthetic_kv, memory_limit=int(memory_limit_gb * 1e9),
                       progress=say)
    result["model"] = model
    if plot is not None:
        plot_throughput(result, str(plot))
    if as_json:
        print(json.dumps(result))
        return
    _print_bench(result)


def _print_bench(result: dict[str, Any]) -> None:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    table = Table(title=f"{result['model']}: decode throughput ({result['bandwidth_gb_s']} GB/s "
                        "measured memory bandwidth)")
    columns = {"mode": "mode", "context": "context", "batch": "B", "kv": "KV",
               "decode_tok_s": "tok/s", "fast_step_ms": "fast ms", "slow_step_ms": "slow ms",
               "dense_step_ms": "dense ms", "slow_fraction": "slow frac",
               "floor_ms": "floor ms", "speedup_vs_full": "x full",
               "speedup_vs_full_static": "x static"}
    for header in columns.values():
        table.add_column(header, justify="right", no_wrap=True)
    for row in result["rows"]:
        table.add_row(*(fmt(row[c]) for c in columns))
    console = Console()
    console.width = max(console.width, 132)
    console.print(table)
    for skip in result["skipped"]:
        err.print(f"skipped context {skip['context']} batch {skip['batch']}: {skip['reason']}")

def _name_list(name: str, text: str, choices: tuple[str, ...] | None = None) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise SFIError(f"{name} must list at least one name")
    unknown = [v for v in values if choices is not None and v not in choices]
    if unknown:
        raise SFIError(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return values


def _float_list(name: str, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SFIError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise SFIError(f"{name} must list at least one number")
    return values


DEFAULT_METHODS = "full,sfi,streamingllm,snapkv,pyramidkv,h2o,tova,quest"


@app.command("eval")
def eval_cmd(
    model: ModelOpt = "default",
    tasks: Annotated[str, typer.Option(help="comma-separated: passkey, niah, niah_multikey, "
                                       "niah_multivalue, niah_multiquery, vt, sequential, "
                                       "fidelity")] =
        "passkey,niah,niah_multikey,niah_multivalue,niah_multiquery,vt,sequential,fidelity",
    contexts: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] =
        "4096",
    methods: Annotated[str, typer.Option(help="full, sfi, sfi+<scorer>, streamingllm, snapkv, "
                                         "pyramidkv, h2o, tova, quest; name@budget pins a "
                                         "method's budget")] = DEFAULT_METHODS,
    budget: Annotated[str, typer.Option(help="tokens kept per KV head: a fraction of the "
                                        "context (<= 1) or tokens (> 1); comma-separated to "
                                        "sweep")] = "0.15",
    samples: Annotated[int, typer.Option(help="samples per task and context")] = 4,
    seed: Annotated[int, typer.Option(help="seed of the task generators")] = 0,
    fidelity_tokens: Annotated[int, typer.Option(help="teacher-forced continuation length")] =
        512,
    set_: Annotated[list[str] | None, typer.Option("--set", help="an SFIConfig field for the "
                                                   "SFI methods, name=value (repeatable); the "
                                                   "budget sets sink + K + recent")] = None,
    tag: Annotated[str, typer.Option(help="appended to the method names of this run's rows "
                                     "(method:tag), to merge variants with sfi report")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    out: Annotated[Path | None, typer.Option(help="write results.json, report.md and plots "
                                             "here")] = None,
) -> None:
    """Long-context quality of SFI against full attention and KV-eviction baselines."""
    from sfi.eval.report import summarize, write_report
    from sfi.eval.runner import parse_runs, run_eval
    from sfi.eval.tasks import TASKS

    if tag and not tag.replace("-", "").replace("_", "").isalnum():
        raise SFIError(f"--tag takes letters, digits, '-' and '_', got {tag!r}")
    task_list = _name_list("--tasks", tasks, TASKS)
    context_list = _int_list("--contexts", contexts)
    method_list = _name_list("--methods", methods)
    budgets = _float_list("--budget", budget)
    parse_runs(method_list, budgets)  # unknown methods fail before the model loads
    base = build_config(extra=set_)
    if samples < 1 or fidelity_tokens < 1:
        raise SFIError("--samples and --fidelity-tokens must be >= 1")
    loaded_model, tokenizer = _load(model, as_json)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn())
    total = len(task_list) * len(context_list) * samples
    with Progress(*columns, console=err, transient=True, disable=as_json) as progress:
        bar = progress.add_task("eval", total=total)

        started = [0]

        def advance(task: str, context: int, index: int) -> None:
            progress.update(bar, completed=started[0],
                            description=f"{task} @ {context}, sample {index + 1}")
            started[0] += 1

        rows = run_eval(loaded_model, tokenizer, task_list, context_list, method_list, budgets,
                        samples, seed=seed, fidelity_tokens=fidelity_tokens, base=base,
                        tag=tag, on_sample=advance)
    result: dict[str, Any] = {
        "model": model, "tasks": task_list, "contexts": context_list, "methods": method_list,
        "budgets": budgets, "samples": samples, "seed": seed, "sfi_overrides": set_ or [],
        "command": "sfi eval " + " ".join(sys.argv[2:]),
        "rows": [r.to_dict() for r in rows]}
    result["summary"] = summarize(result["rows"])
    if out is not None:
        write_report(result, out)
    if as_json:
        print(json.dumps(result))
        return
    _print_eval(result)
    if out is not None:
        err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")


def _print_eval(result: dict[str, Any]) -> None:
    from sfi.eval.report import table_rows

    header, cells = table_rows(result["summary"])
    table = Table(title=f"{result['model']}: score (%) by task, {result['samples']} sample(s) "
                        "each")
    for name in header:
        table.add_column(name, justify="left" if name == "method" else "right")
    for row in cells:
        table.add_row(*row)
    Console().print(table)
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
def analyze_cmd(
    model: ModelOpt = "default",
    context: Annotated[int, typer.Option(help="essay tokens before the analysed continuation")]
        = 4096,
    tokens: Annotated[int, typer.Option(help="continuation tokens fed one by one")] = 512,
    top_k: Annotated[int, typer.Option("--top-k", help="size of the support per KV head")] = 64,
    k_fraction: Annotated[float, typer.Option("--k-fraction", help="SFI's K as a fraction of "
                                              "the context, for the captured mass")] = 0.15,
    seed: Annotated[int, typer.Option(help="picks the essay offset")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    out: Annotated[Path | None, typer.Option(help="write stability.json and stability.png "
                                             "here")] = None,
) -> None:
    """Support stability while decoding real text: within vs across sentences (paper Fig. 1)."""
    import torch

    from sfi.eval.stability import plot_stability, support_stability
    from sfi.eval.tasks import make_sample

    if tokens < 2 or top_k < 1:
        raise SFIError("--tokens must be >= 2 and --top-k >= 1")
    config = build_config(k_fraction=k_fraction)
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
    table = Table(title=f"{model}: support stability over {tokens} tokens after {context}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in result.summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        table.add_row(name.replace("_", " "), str(value))
    Console().print(table)


@app.command("serve")
def serve_cmd(
    model: ModelOpt = "default",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    max_batch: Annotated[int, typer.Option(help="sequences decoded together at most")] = 8,
    max_queue: Annotated[int, typer.Option(help="waiting requests before 429")] = 64,
    sink: SinkOpt = None, recent: RecentOpt = None, k_head: KHeadOpt = None,
    k_fraction: KFracOpt = None, refresh_interval: IntervalOpt = None,
    min_refresh_gap: GapOpt = None, evidence_window: WindowOpt = None,
    trigger: TriggerOpt = None, set_: SetOpt = None,
) -> None:
    """An OpenAI-compatible server with continuous batching over slow-fast decoding."""
    import uvicorn

    from sfi.decode import context_length
    from sfi.server.app import create_app
    from sfi.server.engine import Engine

    if max_batch < 1 or max_queue < 0:
        raise SFIError(f"--max-batch must be >= 1 and --max-queue >= 0 (got {max_batch}, "
                       f"{max_queue})")
    config = build_config(sink=sink, recent=recent, k_head=k_head, k_fraction=k_fraction,
                          refresh_interval=refresh_interval, min_refresh_gap=min_refresh_gap,
                          evidence_window=evidence_window, trigger=trigger, extra=set_)
    loaded_model, tokenizer = _load(model, False)
    engine = Engine(loaded_model, tokenizer, config, max_batch=max_batch, max_queue=max_queue)
    engine.start()
    try:
        uvicorn.run(create_app(engine, model, context_length(loaded_model)), host=host,
                    port=port, log_level="info")
    finally:
        engine.stop()


@app.command("loadtest")
def loadtest_cmd(
    url: Annotated[str, typer.Option(help="a running sfi serve (loopback)")] =
        "http://127.0.0.1:8000",
    clients: Annotated[int, typer.Option(help="concurrent streaming clients")] = 4,
    duration: Annotated[float, typer.Option(help="seconds to keep sending")] = 60.0,
    max_tokens: Annotated[int, typer.Option(help="tokens per request")] = 64,
    mode: Annotated[str, typer.Option(help="sfi | full")] = "sfi",
    prompt_chars: Annotated[int, typer.Option(help="prompt length in characters")] = 4000,
    model: Annotated[str, typer.Option(help="model name to send")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """N concurrent streaming clients against a running server, for a bounded time."""
    from urllib.parse import urlparse

    from sfi.bench.loadtest import run_loadtest

    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise SFIError(f"loadtest sends traffic to loopback addresses only, not {host!r}")
    if clients < 1 or duration <= 0 or max_tokens < 1 or mode not in ("sfi", "full"):
        raise SFIError("--clients and --max-tokens must be >= 1, --duration > 0, --mode sfi|full")
    result = run_loadtest(url, clients, duration, max_tokens, mode, prompt_chars, model)
    if as_json:
        print(json.dumps(result))
        return
    keys = ("requests", "errors", "requests_per_s", "tokens_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "server_peak_rss_mb")
    table = Table(title=f"loadtest: {clients} clients, mode {mode}, {duration:g} s")
    for key in keys:
        table.add_column(key.replace("_", " "), justify="right")
    table.add_row(*(str(result[k]) for k in keys))
    Console().print(table)


def main() -> None:
    try:
        app()
    except SFIError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
