"""sfi: Slow-Fast Inference for HuggingFace transformers models.

Most decode steps attend to a small memory (sink + selected + recent tokens); at sentence
boundaries, or when a reuse budget runs out, a slow step attends densely and the Selector
refreshes the selected set (Xie et al., https://arxiv.org/abs/2603.12038; the project's
documentation, in ``docs/`` of its source tree, describes the method and every option).

Start with :func:`load` and :func:`generate`, or :class:`SlowFastCache` inside
``model.generate``; ``help(sfi.SFIConfig)`` lists every knob.

The names below are imported on first use, so that ``import sfi`` (and ``sfi --help``) does
not load torch and transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "DecodeCache": "sfi.hf.decode_cache",
    "DecodeStats": "sfi.core.decode_stats",
    "Evidence": "sfi.core.scorers",
    "FullCache": "sfi.hf.decode_cache",
    "GenerateResult": "sfi.decoding.decode",
    "ModelNotFoundError": "sfi.errors",
    "PromptError": "sfi.errors",
    "SFIConfig": "sfi.core.config",
    "SFIConfigError": "sfi.errors",
    "SFIError": "sfi.errors",
    "SFISelector": "sfi.core.selector",
    "Scorer": "sfi.core.scorers",
    "SlowFastCache": "sfi.hf.slowfast_cache",
    "Timing": "sfi.decoding.decode",
    "UnsupportedModelError": "sfi.errors",
    "build_cache": "sfi.hf.methods",
    "generate": "sfi.decoding.decode",
    "load": "sfi.models",
    "routed": "sfi.hf.routing",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # the same names, for type checkers and editors (redundant aliases re-export)
    from sfi.core.config import SFIConfig as SFIConfig
    from sfi.core.decode_stats import DecodeStats as DecodeStats
    from sfi.core.scorers import Evidence as Evidence
    from sfi.core.scorers import Scorer as Scorer
    from sfi.core.selector import SFISelector as SFISelector
    from sfi.decoding.decode import GenerateResult as GenerateResult
    from sfi.decoding.decode import Timing as Timing
    from sfi.decoding.decode import generate as generate
    from sfi.errors import ModelNotFoundError as ModelNotFoundError
    from sfi.errors import PromptError as PromptError
    from sfi.errors import SFIConfigError as SFIConfigError
    from sfi.errors import SFIError as SFIError
    from sfi.errors import UnsupportedModelError as UnsupportedModelError
    from sfi.hf.decode_cache import DecodeCache as DecodeCache
    from sfi.hf.decode_cache import FullCache as FullCache
    from sfi.hf.methods import build_cache as build_cache
    from sfi.hf.routing import routed as routed
    from sfi.hf.slowfast_cache import SlowFastCache as SlowFastCache
    from sfi.models import load as load


def __getattr__(name: str) -> Any:
    """The public names of ``__all__``, each imported from its module when first asked for,
    and the submodules (``sfi.texts``)."""
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (sfi.texts, sfi.weights.layout, ...), else no such name
        try:
            return importlib.import_module(f"sfi.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"sfi.{name}":
                raise
            raise AttributeError(f"module 'sfi' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
