"""Where sfi keeps what it builds once: converted models (``models/``, ``gguf/``) and inductor's
compiled kernels (``inductor/``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SFI_CACHE_DIR``, else ``$XDG_CACHE_HOME/sfi``, else ``~/.cache/sfi``."""
    if os.environ.get("SFI_CACHE_DIR"):
        return Path(os.environ["SFI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sfi"


def use_sfi_inductor_cache() -> str:
    """Point inductor's on-disk cache at ``<sfi cache>/inductor`` unless the user set
    ``TORCHINDUCTOR_CACHE_DIR``; returns the folder in use. Called before sfi compiles
    anything, so that a second process reuses the kernels the first one built."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
