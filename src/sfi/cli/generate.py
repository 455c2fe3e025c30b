"""``sfi generate`` (with prefill progress, or the text streamed) and ``sfi demo``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sfi.cli.common import compile_seconds, err, load_model, one_format, progress_bar
from sfi.cli.options import (
    CompileOpt,
    JsonOpt,
    ModelOpt,
    WeightsOpt,
    note,
    old_spellings,
    sfi_options,
)
from sfi.core.config import SFIConfig
from sfi.errors import PromptError, SFIError


def _summary(result, compiled: float | None = None) -> str:
    s, t = result.stats, result.timing
    built = f"; compiling took {compiled:.1f} s" if compiled else ""
    if result.mode == "exact":
        return (f"[dim]exact: {result.prompt_tokens} prompt tokens, {result.new_tokens} new "
                f"(full attention's); prefill {t.prefill_s:.2f} s, decode {t.decode_tok_s:.1f} "
                f"tok/s; {s.verify_steps} verifies of {s.drafted} drafts, "
                f"{100 * s.acceptance_rate:.0f}% accepted, {s.tokens_per_verify:.2f} tokens per "
                f"verify; {s.exact_dense_steps} dense steps{built}[/dim]")
    return (f"[dim]{result.mode}: {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
            f"prefill {t.prefill_s:.2f} s, decode {t.decode_tok_s:.1f} tok/s; steps slow "
            f"{s.slow_steps} / fast {s.fast_steps} / dense {s.dense_steps}; fast steps read "
            f"{100 * s.fast_read_fraction:.1f}% of the context{_dense_why(result)}{built}[/dim]")


def _dense_why(result) -> str:
    """Why an SFI decode had dense steps (``DecodeStats.dense_reason``), for the summary."""
    reason = result.stats.dense_reason if result.mode == "sfi" else None
    return f"; dense because {reason}" if reason else ""


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


def _generate(model, tokenizer, prompt: str, quiet: bool, label: str, stream: bool = False,
              **kwargs: Any):
    """``sfi.generate``, showing on the terminal unless ``quiet`` the prefill's progress (by
    chunk, with ``prefill_chunk``) and then the decode's, or with ``stream`` the text itself."""
    from sfi.decoding.decode import generate

    printer = _StreamPrinter(tokenizer) if stream else None
    if quiet:
        return generate(model, tokenizer, prompt, on_token=printer, **kwargs)
    progress = progress_bar()
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
        result = generate(model, tokenizer, prompt, on_token=on_token, on_prefill=on_prefill,
                          **kwargs)
    if printer is not None:
        printer.finish(result.text)
    return result


@sfi_options
def generate_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    prompt: Annotated[str | None, typer.Option(help="the prompt text (or --prompt-file)")] = None,
    prompt_file: Annotated[Path | None, typer.Option(
        help="read the prompt from a UTF-8 text file (or --prompt)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 128,
    mode: Annotated[str, typer.Option(help="sfi | full | exact (fast steps draft, dense "
                                      "forwards verify: full attention's tokens)")] = "sfi",
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling: keep the likeliest tokens up "
                                         "to this probability mass (with --temperature > 0)")]
        = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="print the text as it is decoded")]
        = False,
    prefill_chunk: Annotated[int, typer.Option(help="prefill the prompt in forwards of this "
                                               "many tokens (0: one forward)")] = 512,
    weights: WeightsOpt = "auto",
    compile: CompileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate a continuation of a prompt with slow-fast decoding.

    --mode full decodes with full attention; --mode exact gives full attention's tokens at
    SFI's speed where its drafts are accepted. Instruct models (the default model is one)
    answer a question only with --chat."""
    if (prompt is None) == (prompt_file is None):
        raise SFIError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prefill_chunk < 0:
        raise SFIError(f"--prefill-chunk must be >= 0 (0: one forward), got {prefill_chunk}")
    if stream and as_json:
        raise SFIError("--stream prints the text as it comes and --json one object at the end: "
                       "choose one")
    text = prompt if prompt is not None else read_prompt_file(prompt_file)
    if not text.strip():
        raise PromptError("the prompt is empty: give some text to continue")
    from sfi.decoding.decode import MODES

    if mode not in MODES:
        raise SFIError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "full" and config is not None:
        raise SFIError("the SFI options apply to --mode sfi and exact; full attention takes "
                       "none")
    loaded_model, tokenizer = load_model(model, as_json, weights=one_format(weights),
                                         compile=compile)
    result = _generate(loaded_model, tokenizer, text, as_json, f"decoding ({mode})",
                       stream=stream, config=config, max_new_tokens=max_new_tokens, mode=mode,
                       chat=chat, temperature=temperature, top_p=top_p, seed=seed,
                       prefill_chunk=prefill_chunk or None)
    if as_json:
        print(json.dumps({"model": model, "weights": loaded_model.sfi_weights,
                          "compile_s": compile_seconds(loaded_model), **result.to_dict()}))
        return
    if not stream:
        Console().print(result.text, markup=False, highlight=False)
    err.print(_summary(result, compile_seconds(loaded_model)))
    if result.new_tokens == 0 and not chat and getattr(tokenizer, "chat_template", None):
        note("the model ended the text at once; an instruction-tuned model answers a question "
             "or an instruction with --chat")


@sfi_options
@old_spellings(max_new_tokens="--answer-tokens")
def demo_cmd(
    config: SFIConfig | None,
    model: ModelOpt = "default",
    context: Annotated[int, typer.Option(help="document length in tokens (essay text)")] =
        7500,
    seed: Annotated[int, typer.Option(help="which fact is hidden, and where")] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="length of the longer answer, in tokens")]
        = 128,
    weights: WeightsOpt = "auto",
    compile: CompileOpt = None,
) -> None:
    """Side by side: one long document with a hidden fact, answered by full attention and SFI.

    The document (essays, --context tokens) is prefilled once; both sides continue copies of
    that prefill, answering the fact's question and writing a short essay, where the decode
    speed shows."""
    from sfi.cli.demo import run_demo

    loaded_model, tokenizer = load_model(model, False, weights=one_format(weights),
                                         compile=compile)
    progress = progress_bar()
    reading = progress.add_task("reading the document (tokens)", total=context)
    answering = progress.add_task("", total=None, visible=False)

    def on_answer(question: str, mode: str) -> None:
        progress.update(reading, visible=False)
        side = "full attention" if mode == "full" else "SFI"
        progress.reset(answering, total=max_new_tokens if question == "explanation" else None,
                       description=f"answering the {question} question ({side})", visible=True)

    with progress:
        result = run_demo(loaded_model, tokenizer, context=context, config=config,
                          answer_tokens=max_new_tokens, seed=seed,
                          on_prefill=lambda done, total: progress.update(
                              reading, completed=done, total=total),
                          on_answer=on_answer,
                          on_token=lambda token: progress.advance(answering))
    _print_demo(result)


def read_prompt_file(path: Path) -> str:
    """The text of ``--prompt-file``, or a one-line error: no such file, a folder, unreadable,
    or not UTF-8 text."""
    if path.is_dir():
        raise SFIError(f"--prompt-file: {str(path)!r} is a folder, not a file")
    if not path.exists():
        raise SFIError(f"--prompt-file: no file {str(path)!r}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"--prompt-file: {str(path)!r} is not UTF-8 text (byte "
                          f"{exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise SFIError(f"--prompt-file: cannot read {str(path)!r}: "
                       f"{exc.strerror or exc}") from None


def _print_demo(result) -> None:
    """Both questions' answers side by side, then the speed-up on the longer answer."""
    console = Console()
    sample = result.sample
    console.print(f"[bold]Document:[/bold] {sample.context} tokens of essays; the "
                  f"{result.prefill_tokens} both questions share were prefilled once "
                  f"({result.prefill_s:.0f} s) and continued by every answer below. Hidden at "
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
        "context read per step (slow: all)": [f"{100 * a.read_fraction:.0f}%"
                                              for a in longer],
        "steps": [f"slow {a.stats.slow_steps} / fast {a.stats.fast_steps} / dense "
                  f"{a.stats.dense_steps}" for a in longer],
        "time": [f"{a.seconds:.1f} s" for a in longer],
        "decode speed": [f"{a.tokens_per_s:.1f} tokens/s" for a in longer],
    }))
    console.print(f"SFI wrote the longer answer [bold]{result.speedup:.2f}x[/bold] as fast as "
                  f"full attention (every step timed, slow steps included); the two answers "
                  f"agree on their first {result.agreeing_tokens} tokens.")
