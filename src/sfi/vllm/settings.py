"""Where the vLLM plugin's SFI configuration comes from: ``SFI_VLLM``, or :func:`configure`."""

from __future__ import annotations

from sfi.config import SFIConfig, parse_overrides
from sfi.vllm.requests import check_plugin_config

ENV = "SFI_VLLM"


def parse_config(spec: str) -> SFIConfig:
    """The SFI configuration of an ``SFI_VLLM`` value: ``name=value`` items separated by
    commas, ``preset`` (``default`` or ``paper``) and any :class:`sfi.SFIConfig` field."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    preset = "default"
    rest = []
    for item in items:
        name, _, value = item.partition("=")
        if name.strip() == "preset":
            preset = value.strip()
        else:
            rest.append(item)
    config = SFIConfig.from_preset(preset, **parse_overrides(rest, where=ENV))
    check_plugin_config(config)
    return config


_config: SFIConfig | None = None
_generation = 0


def active_config() -> tuple[SFIConfig | None, int]:
    """The configuration the plugin applies now (None: vLLM runs stock), and how many times
    it was set (a new setting starts a new request book)."""
    return _config, _generation


def configure(config: SFIConfig | None) -> None:
    """Set (or, with None, switch off) the configuration in this process, for an engine that
    runs in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the next step starts from a new book."""
    global _config, _generation
    if config is not None:
        check_plugin_config(config)
    _config = config
    _generation += 1
