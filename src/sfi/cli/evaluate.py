"""``sfi eval``, ``sfi diagnose``, ``sfi report`` and ``sfi analyze``: long-context quality."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

from sfi.cli.common import err, load_model, one_format, print_table
from sfi.cli.options import (
    CompileOpt,
    JsonOpt,
    ModelOpt,
    SetOpt,
    WeightsOpt,
    build_config,
    float_list,
    int_list,
    name_list,
    old_spellings,
    sfi_options,
)
from sfi.core.config import SFIConfig, parse_overrides
from sfi.errors import SFIError

DEFAULT_METHODS = "full,sfi,streamingllm,snapkv,pyramidkv,h2o,tova,quest"
ALL_TASKS = "passkey,niah,niah_multikey,niah_multivalue,niah_multiquery,vt,sequential,fidelity"


@old_spellings(budgets="--budget")
def eval_cmd(
    model: ModelOpt = "default",
    tasks: Annotated[str, typer.Option(
        show_default=False,
        help="comma-separated, from: " + ALL_TASKS.replace(",", ", ") + "; the long-answer "
             "tasks codes3, codes6, codes10 (N codes listed in a given order, scored item by "
             "item); the free-generation tasks generation, generation_code (256 tokens "
             "continuing an essay or Python source, judged by full attention's perplexity, "
             "repetition and first divergence) (default: all but those two families)")]
        = ALL_TASKS,
    contexts: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] =
        "4096",
    methods: Annotated[str, typer.Option(
        show_default=False,
        help="comma-separated, from: full, sfi, sfi:PRESET (sfi:paper), sfi:exact[:PRESET] "
             "(exact mode), sfi+SCORER, streamingllm, snapkv, pyramidkv, h2o, tova, quest; "
             "name@budget pins a method's budget, sfi@default runs SFI as sfi.generate "
             "does (its config's K and cost model, no budget split) (default: "
             + DEFAULT_METHODS.replace(",", ", ") + ")")] = DEFAULT_METHODS,
    budgets: Annotated[str, typer.Option(help="C, the tokens every method keeps per KV head "
                                         "(for SFI: S + K + R): a fraction of the context "
                                         "(<= 1) or tokens (> 1); comma-separated to sweep")]
        = "0.15",
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
    weights: WeightsOpt = "native",
    compile: CompileOpt = None,
) -> None:
    """Long-context quality of SFI against full attention and KV-eviction baselines.

    ``--set`` changes SFI's knobs other than the budget (which sets K and the recent window),
    on top of the defaults or of a method's preset."""
    from sfi.eval.figures import write_report
    from sfi.eval.report import summarize, table_rows
    from sfi.eval.runner import parse_runs, run_eval
    from sfi.eval.tasks import TASKS

    if tag and not tag.replace("-", "").replace("_", "").isalnum():
        raise SFIError(f"--tag takes letters, digits, '-' and '_', got {tag!r}")
    task_list = name_list("--tasks", tasks, TASKS)
    context_list = int_list("--contexts", contexts)
    method_list = name_list("--methods", methods)
    budget_list = float_list("--budgets", budgets)
    runs = parse_runs(method_list, budget_list)  # unknown methods fail before the model loads
    overrides = parse_overrides(set_ or [])
    build_config(extra=set_)  # a clear error for a value the config refuses
    if samples < 1 or fidelity_tokens < 1:
        raise SFIError("--samples and --fidelity-tokens must be >= 1")
    weights = one_format(weights)
    if resume and out is None:
        raise SFIError("--resume needs --out (the folder of the interrupted run)")
    journal = None if out is None else out / "rows.jsonl"
    if resume and weights != "auto":  # a journal of other weights, refused before the load
        _read_journal(journal, weights)
    loaded_model, tokenizer = load_model(model, as_json, weights=weights, compile=compile)
    weights = loaded_model.sfi_weights  # the rows name the format auto chose
    earlier = _read_journal(journal, weights) if resume else []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        journal.write_text("".join(json.dumps(r) + "\n" for r in earlier), encoding="utf-8")

    def keep(new_rows: list) -> None:
        if journal is not None:
            with journal.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r.to_dict()) + "\n" for r in new_rows)

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json) as progress:
        bar = progress.add_task("eval", total=len(task_list) * len(context_list) * samples)

        def advance(task: str, context: int, index: int) -> None:
            progress.update(bar, description=f"{task} @ {context}, sample {index + 1}")
            progress.advance(bar)

        rows = run_eval(loaded_model, tokenizer, task_list, context_list, method_list,
                        budget_list,
                        samples, seed=seed, fidelity_tokens=fidelity_tokens, tag=tag,
                        on_sample=advance, store=prefill_cache, overrides=overrides,
                        on_rows=keep, done={(r["task"], r["context"], r["sample"])
                                            for r in earlier}, weights=weights)
    result: dict[str, Any] = {
        "model": model, "tasks": task_list, "contexts": context_list, "methods": method_list,
        "budgets": budget_list, "samples": samples, "seed": seed, "weights": weights,
        "sfi_overrides": set_ or [],
        # each SFI method's configuration (its budget then sets K and the recent window), so
        # that a row named sfi@... still says what it ran after the library's defaults move
        "configs": {f"{m.name}:{tag}" if tag else m.name:
                    m.sfi_config(overrides=overrides).to_dict()
                    for m, _ in runs if m.kind == "sfi"},
        "command": "sfi eval " + " ".join(sys.argv[2:]),
        "rows": earlier + [r.to_dict() for r in rows]}
    result["summary"] = summarize(result["rows"])
    if out is not None:
        write_report(result, out)
    if as_json:
        print(json.dumps(result))
        return
    header, cells = table_rows(result["summary"])
    print_table(f"{model}: score (%) by task, {samples} sample(s) each", header, cells)
    if out is not None:
        err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")


def _read_journal(path: Path, weights: str) -> list[dict[str, Any]]:
    """The rows an interrupted ``sfi eval --out`` wrote, whole samples only; an error where
    they were decoded with other weights than ``weights``."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the interruption, and whatever follows
    other = {r.get("weights", "native") for r in rows} - {weights}
    if other:
        raise SFIError(f"--resume: {path} holds rows decoded with --weights "
                       f"{', '.join(sorted(other))}, not {weights}; resume with those weights "
                       "or write to another --out")
    return rows


def diagnose_cmd(
    model: ModelOpt = "default",
    task: Annotated[str, typer.Option(help="the task of the sample")] = "passkey",
    context: Annotated[int, typer.Option(help="prompt length in tokens")] = 4096,
    seed: Annotated[int, typer.Option(help="the sample's seed (as in sfi eval)")] = 0,
    depth: Annotated[float | None, typer.Option(
        help="where passkey's or niah's needle lies (0-1); sfi eval sweeps niah's over the "
             "samples, so give its row's depth to diagnose that sample (default: drawn from "
             "the seed)")] = None,
    budget: Annotated[float, typer.Option(help="C, the tokens kept per KV head (S + K + R): a "
                                          "fraction of the context (<= 1) or tokens")] = 0.15,
    methods: Annotated[str, typer.Option(help="SFI methods, e.g. sfi,sfi:paper,"
                                         "sfi[page_size=16,pin_fraction=0.5]")] =
        "sfi,sfi:paper",
    prefill_cache: Annotated[Path | None, typer.Option(help="reuse/keep the sample's prefill "
                                                       "here (as sfi eval)")] = None,
    as_json: JsonOpt = False,
    weights: WeightsOpt = "native",
    compile: CompileOpt = None,
) -> None:
    """Why SFI keeps or loses an answer, stage by stage of the Selector.

    Per Selector stage and (layer, KV head), whether the selection holds the answer's tokens;
    per answer step, the attention mass the memory holds."""
    from sfi.eval.diagnose import diagnose
    from sfi.eval.tasks import DEPTH_TASKS, TASKS, check_depth, found_in_order, make_sample
    from sfi.hf.methods import budget_tokens, parse_method

    if task not in TASKS or task == "fidelity":
        raise SFIError(f"--task must be a retrieval task, one of {', '.join(TASKS[:-1])}")
    method_list = name_list("--methods", methods)
    for name in method_list:
        if parse_method(name).kind != "sfi":
            raise SFIError(f"diagnose takes SFI methods; {name!r} is not one")
    check_depth(task, depth, "--depth")  # (before the model loads; make_sample checks too)
    budget_tokens(budget, context)
    weights = one_format(weights)
    loaded_model, tokenizer = load_model(model, as_json, weights=weights, compile=compile)
    weights = loaded_model.sfi_weights  # what auto chose, by name
    sample = make_sample(task, tokenizer, context, seed, depth=depth)
    with err.status("diagnosing") if not as_json else contextlib.nullcontext():
        result = diagnose(loaded_model, tokenizer, sample, seed, method_list, budget,
                          store=prefill_cache)
    if as_json:
        print(json.dumps({**result.to_dict(), "weights": weights}))
        return
    where = f" at depth {sample.depths[0]:g}" if task in DEPTH_TASKS else ""
    err.print(f"{task} seed {seed}{where}, {sample.context} tokens, {weights} weights; answers "
              f"{result.answers} at {result.positions}; full attention says "
              f"{result.full_output!r}")
    order = ("evidence", "pooled", "fused", "nms", "exclusive", "score", "selected")
    seen = {s for m in result.methods for s in m.token_coverage}
    stages = [s for s in order if s in seen]
    print_table(f"answer tokens held by each stage's top-K (share of layer x KV head), "
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
    if any(m.held_at_answer for m in result.methods):
        print_table("each answer: held by the memory when full attention writes it (share of "
                    "layer x KV head; - where the prompt's forward writes it or full never "
                    "does), and whether the method's output has it in the asked order",
                    ["method", *result.answers],
                    ([m.method, *(_held_cell(m.held_at_answer.get(a), found)
                                  for a, found in zip(result.answers,
                                                      found_in_order(m.output, result.answers)))]
                     for m in result.methods),
                    wide=True)


def _held_cell(share: float | None, found: bool) -> str:
    return f"{'-' if share is None else f'{share:.0%}'} {'found' if found else 'LOST'}"


def report_cmd(
    results: Annotated[list[Path], typer.Argument(metavar="RESULTS.json",
                                                  help="results.json files of sfi eval runs "
                                                  "of one model")],
    out: Annotated[Path, typer.Option(help="write the merged results.json, report.md and "
                                      "plots here")],
) -> None:
    """Merge several sfi eval --out runs of one model into one report.

    A later run's row replaces an earlier one for the same task, context, sample, method,
    budget and weights."""
    from sfi.eval.figures import write_report
    from sfi.eval.report import merge_results

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
    loaded_model, tokenizer = load_model(model, as_json, weights="native")  # as sfi eval
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
    print_table(f"{model}: support stability over {tokens} tokens after {context}",
                 ["measure", "value"],
                 ([name.replace("_", " "), ", ".join(f"{k}: {v}" for k, v in value.items())
                   if isinstance(value, dict) else value]
                  for name, value in result.summary.items()))
