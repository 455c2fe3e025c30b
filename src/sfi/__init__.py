"""sfi: Slow-Fast Inference for HuggingFace transformers models.

Most decode steps attend to a small memory (sink + selected + recent tokens); at sentence
boundaries, or when a reuse budget runs out, a slow step attends densely and the Selector
refreshes the selected set. See ``docs/ARCHITECTURE.md`` for the modules.
"""

from sfi.attention import register_attention
from sfi.cache import SlowFastCache
from sfi.caches import DecodeCache, FullCache
from sfi.config import SFIConfig
from sfi.decode import GenerateResult, Timing, generate
from sfi.errors import (
    ModelNotFoundError,
    PromptError,
    SFIConfigError,
    SFIError,
    UnsupportedModelError,
)
from sfi.hf import routed
from sfi.methods import build_cache
from sfi.models import load
from sfi.runtime import keep_freed_memory
from sfi.scorers import Evidence, Scorer
from sfi.selector import SFISelector
from sfi.stats import DecodeStats

__all__ = [
    "DecodeCache",
    "DecodeStats",
    "Evidence",
    "FullCache",
    "GenerateResult",
    "ModelNotFoundError",
    "PromptError",
    "SFIConfig",
    "SFIConfigError",
    "SFIError",
    "SFISelector",
    "Scorer",
    "SlowFastCache",
    "Timing",
    "UnsupportedModelError",
    "build_cache",
    "generate",
    "keep_freed_memory",
    "load",
    "register_attention",
    "routed",
]
__version__ = "0.1.0"
