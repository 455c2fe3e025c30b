"""Options the ``sfi`` commands share, and the one place command-line values become an
``SFIConfig``.

:func:`sfi_options` gives a command every SFI knob as an option (``--sink``, ``--recent``,
``--preset``, ``--k-head`` / ``--k-fraction``, ``--refresh-interval``, ``--min-refresh-gap``,
``--evidence-window``, ``--trigger``, ``--force-sparse``, ``--set name=value``) and hands it one
``config`` argument: the :class:`SFIConfig` they describe, or None when none was given.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from sfi.core.config import SFIConfig, parse_overrides
from sfi.errors import SFIError

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="default, qwen2.5-0.5b, a folder, "
                                       "a .gguf file or a hub id")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object")]
WeightsOpt = Annotated[str, typer.Option(
    "--weights", help="linear-layer weights on a CPU: auto (the fastest format here that "
    "stays within KL 0.01 and 97% top-1 of native, checked once per model) | native (exact) | "
    "bf16 (x86) | fp16 (batch 1) | int8 (AVX-512, or AVX2 with sfi's kernel) (faster, not "
    "exact: docs/eval/weight-formats.md)")]
CompileOpt = Annotated[bool | None, typer.Option(
    "--compile/--no-compile", help="compile the one-token decode steps with torch.compile "
    "(10-90 s on first use, cached on disk) [default: with fp16 or int8 weights]")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="NAME=VALUE", help="any other SFIConfig field (repeatable)")]

# name -> (annotation, default) of every SFI option, in the order --help lists them
SFI_OPTIONS: dict[str, tuple[Any, Any]] = {
    "preset": (Annotated[str | None, typer.Option(
        help="default (what measures best; used when none is named) | paper (the paper's "
             "Selector and defaults, exactly)")], None),
    "sink": (Annotated[int | None, typer.Option(help="S: sink tokens [4]")], None),
    "recent": (Annotated[int | None, typer.Option(help="R: recent window [256]")], None),
    "k_head": (Annotated[int | None, typer.Option(
        "--k-head", help="K: selected tokens per KV head [2048]")], None),
    "k_fraction": (Annotated[float | None, typer.Option(
        "--k-fraction", help="K as a fraction of the context, in (0, 1] (instead of --k-head)")],
        None),
    "refresh_interval": (Annotated[int | None, typer.Option(
        "--refresh-interval", help="reuse budget: a slow step after at most this many steps "
        "[96]")], None),
    "min_refresh_gap": (Annotated[int | None, typer.Option(
        "--min-refresh-gap", help="fewest steps between two sentence-triggered refreshes [16]")],
        None),
    "evidence_window": (Annotated[int | None, typer.Option(
        "--evidence-window", help="W after prefill [16]")], None),
    "trigger": (Annotated[str | None, typer.Option(
        help="sentence | fixed | random | bootstrap")], None),
    "force_sparse": (Annotated[bool, typer.Option(
        "--force-sparse", help="slow/fast steps even where the cost model says dense pays")],
        False),
    "set_": (SetOpt, None),
}


def build_config(*, sink: int | None = None, recent: int | None = None, k_head: int | None = None,
                 k_fraction: float | None = None, refresh_interval: int | None = None,
                 min_refresh_gap: int | None = None, evidence_window: int | None = None,
                 trigger: str | None = None, force_sparse: bool = False,
                 extra: list[str] | None = None, preset: str | None = None) -> SFIConfig:
    """An SFIConfig from command-line values: the preset (``default`` unless named) with the
    values that were given."""
    values: dict[str, Any] = {k: v for k, v in {
        "sink": sink, "recent": recent, "k_head": k_head, "k_fraction": k_fraction,
        "refresh_interval": refresh_interval, "min_refresh_gap": min_refresh_gap,
        "evidence_window": evidence_window, "trigger": trigger}.items() if v is not None}
    if force_sparse:
        values["force_sparse"] = True
    values.update(parse_overrides(extra or [], "--set"))
    return SFIConfig.from_preset(preset or "default", **values)


def sfi_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the SFI options to a typer command, which then takes ``config: SFIConfig | None``
    (None when no SFI option was given)."""
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                               default=default)
             for name, (annotation, default) in SFI_OPTIONS.items()]

    def call(kwargs: dict[str, Any]) -> Any:
        values = {name: kwargs.pop(name) for name in SFI_OPTIONS}
        given = any(value not in (None, False) for value in values.values())
        extra = values.pop("set_")
        config = build_config(**values, extra=extra) if given else None
        return command(config=config, **kwargs)

    return _with_options(command, call, added, drop="config")


def _with_options(command: Callable[..., Any], call: Callable[[dict[str, Any]], Any],
                  added: list[inspect.Parameter], drop: str | None = None) -> Callable[..., Any]:
    """``command`` as typer sees it with the parameters ``added`` (and without ``drop``):
    typer parses the options of the new signature and ``call(kwargs)`` runs the command."""
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.name != drop] + added

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        return call(kwargs)

    del wrapper.__wrapped__  # typer must read the signature below, not the command's
    wrapper.__signature__ = signature.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def note(text: str) -> None:
    """A one-line note on stderr (a deprecated spelling, a choice made for the user)."""
    typer.echo(f"note: {text}", err=True)


def renamed(value: Any, old_value: Any, new: str, old: str, default: Any = None) -> Any:
    """The value of an option that was renamed in this release: ``old_value`` (given under the
    old spelling ``old``, which then gets a deprecation note) or ``value`` (under ``new``);
    both at once is refused."""
    if old_value is None:
        return value
    if value != default:
        raise SFIError(f"{old} is the old spelling of {new}: give only {new}")
    note(f"{old} is deprecated and will be removed in the next release; use {new}")
    return old_value


def old_spellings(**names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Accept deprecated spellings of a command's options for one release: ``names`` maps an
    option's parameter name to its old flag (``max_new_tokens="--new-tokens"``). Each old flag
    is a hidden option of the same type; given, it fills the parameter, with a note."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        params = inspect.signature(command, eval_str=True).parameters
        hidden = []
        for name, flag in names.items():
            base = getattr(params[name].annotation, "__origin__", params[name].annotation)
            hidden.append(inspect.Parameter(
                f"{name}__old", inspect.Parameter.KEYWORD_ONLY, default=None,
                annotation=Annotated[base | None, typer.Option(flag, hidden=True)]))

        def call(kwargs: dict[str, Any]) -> Any:
            for name, flag in names.items():
                kwargs[name] = renamed(kwargs[name], kwargs.pop(f"{name}__old"),
                                       _flag(params[name]), flag, params[name].default)
            return command(**kwargs)

        return _with_options(command, call, hidden)

    return decorate


def _flag(param: inspect.Parameter) -> str:
    """The first flag of a typer option parameter (``--max-new-tokens``)."""
    for meta in getattr(param.annotation, "__metadata__", ()):
        decls = getattr(meta, "param_decls", None)
        if decls:
            return next(d for d in decls if d.startswith("--"))
    return "--" + param.name.replace("_", "-")


def int_list(name: str, text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``, positive integers only."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SFIError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SFIError(f"{name} must list positive integers, got {text!r}")
    return values


def float_list(name: str, text: str) -> list[float]:
    """``"0.1,0.5"`` -> ``[0.1, 0.5]``."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SFIError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise SFIError(f"{name} must list at least one number")
    return values


def name_list(name: str, text: str, choices: tuple[str, ...] | None = None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each among ``choices`` when given; commas inside brackets
    do not split (``sfi[pool_kernel=9,page_size=16],quest``)."""
    values, depth, current = [], 0, ""
    for char in text + ",":
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            values.append(current.strip())
            current = ""
        else:
            current += char
    values = [v for v in values if v]
    if not values:
        raise SFIError(f"{name} must list at least one name")
    unknown = [v for v in values if choices is not None and v not in choices]
    if unknown:
        raise SFIError(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return values
