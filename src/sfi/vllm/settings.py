"""Where the vLLM plugin's SFI configuration comes from: ``SFI_VLLM``, or :func:`configure`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sfi.core.config import REDO_FIELDS, SFIConfig, parse_overrides
from sfi.errors import SFIConfigError

if TYPE_CHECKING:
    from sfi.vllm.requests import RequestBook

ENV = "SFI_VLLM"
DEFAULT_SLOTS = 8  # fast memories held at once (each S + K + R + reuse entries per layer)
EXACT_FIELDS = ("draft_tokens", "draft_min", "draft_max", "draft_fallback")  # sfi.decoding.exact's


def parse_config(spec: str) -> SFIConfig:
    """The SFI configuration of an ``SFI_VLLM`` value: ``name=value`` items separated by
    commas, ``preset`` (``default`` or ``paper``) and any :class:`sfi.SFIConfig` field (and
    the plugin's ``slots``, see :func:`parse_settings`)."""
    return parse_settings(spec)[0]


def parse_settings(spec: str) -> tuple[SFIConfig, int | None]:
    """An ``SFI_VLLM`` value's configuration and ``slots=N``, how many requests hold a fast
    memory at once (None: ``min(max_num_seqs, DEFAULT_SLOTS)``; requests beyond run at full
    attention)."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    preset = "default"
    slots = None
    rest = []
    for item in items:
        name, _, value = item.partition("=")
        if name.strip() == "preset":
            preset = value.strip()
        elif name.strip() == "slots":
            if not value.strip().isdigit() or int(value) < 1:
                raise SFIConfigError(f"{ENV}: slots must be a whole number >= 1, got {value!r}")
            slots = int(value)
        else:
            rest.append(item)
    overrides = parse_overrides(rest, where=ENV)
    config = SFIConfig.from_preset(preset, **overrides)
    refuse_transformers_only(config, where=f"{ENV}: ", named=overrides)
    return config, slots


def refuse_transformers_only(config: SFIConfig, where: str = "",
                             named: Collection[str] | None = None) -> None:
    """Refuse, naming it, a field of :data:`REDO_FIELDS` that ``config`` turns on, or exact
    mode's drafts where they were ``named`` (None: where they differ from the defaults): the
    transformers path's alone."""
    redo = [name for name in REDO_FIELDS if getattr(config, name)]
    if redo:
        raise SFIConfigError(f"{where}{', '.join(redo)} runs a step or positions again, which "
                             "the vLLM plugin does not (vLLM schedules each step once)")
    default = SFIConfig()
    exact = [name for name in EXACT_FIELDS
             if (name in named if named is not None
                 else getattr(config, name) != getattr(default, name))]
    if exact:
        raise SFIConfigError(f"{where}{', '.join(exact)} set exact mode's drafts, which the "
                             "vLLM plugin does not run (exact mode is sfi.generate's and "
                             "sfi generate's)")


@dataclass
class PluginState:
    """What the plugin holds in this process, the one owner of its state between steps.

    vLLM constructs the metadata builders and attention impls itself, with no argument sfi
    controls, so they find this object through :func:`plugin_state`; everything below it (the
    book's requests, each impl's slot records) is passed along as arguments.

    Attributes:
        config: the configuration in force (``SFI_VLLM`` or :func:`configure`; None: stock).
        slots: ``slots=N`` of that setting (None: :data:`DEFAULT_SLOTS`).
        book: the request book made under ``config`` at its first step (None before that);
            :func:`configure` starts a new one.
    """

    config: SFIConfig | None = None
    slots: int | None = None
    book: RequestBook | None = None


_STATE = PluginState()


def plugin_state() -> PluginState:
    """The plugin's state in this process (see :class:`PluginState`)."""
    return _STATE


def active_config() -> SFIConfig | None:
    """The configuration the plugin applies now (None: vLLM runs stock)."""
    return _STATE.config


def active_slots(max_num_seqs: int) -> int:
    """How many fast memories the plugin holds for an engine of ``max_num_seqs``."""
    return min(max_num_seqs, _STATE.slots or DEFAULT_SLOTS)


def configure(config: SFIConfig | None, slots: int | None = None) -> None:
    """Set (or, with None, switch off) the configuration in this process, for an engine that
    runs in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the next step starts from a new book.
    ``slots``: see :func:`parse_settings`."""
    if slots is not None and slots < 1:
        raise SFIConfigError(f"slots must be >= 1, got {slots}")
    if config is not None:
        refuse_transformers_only(config)
    _STATE.config, _STATE.slots, _STATE.book = config, slots, None
