"""The plugin on tiny random-weight models of two architectures (own engines, after the
default model's module has closed its engine: vLLM keeps one engine's process groups)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import SFI, close_engine, generate, make_engine, save_tiny

from sfi.vllm import backend

EVERYTHING = replace(SFI, k_head=4096, force_sparse=True)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_models_exact_with_a_covering_budget(arch, tmp_path_factory, tokenizer):
    folder = save_tiny(arch, tmp_path_factory.mktemp(arch), tokenizer)
    llm = make_engine(folder)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(300, 20000, (n,), generator=g).tolist() for n in (400, 650)]
        stock = generate(llm, prompts, None, max_tokens=24)
        assert len({t for row in stock for t in row}) > 4  # outputs depend on the context
        assert generate(llm, prompts, EVERYTHING, max_tokens=24) == stock
        small = replace(SFI, k_head=32, recent=32)
        assert generate(llm, prompts, small, max_tokens=24) != stock
        assert backend.book().stats.rows["fast"] >= 2 * 15
    finally:
        close_engine(llm)


def test_a_model_class_that_records_no_input_ids_is_planned_by_the_builder(tmp_path_factory,
                                                                           tokenizer,
                                                                           monkeypatch):
    """Where the model class vLLM loads hands no input ids to the step (stock Qwen2 here, as
    for an architecture sfi does not subclass), the builder plans each step: a token-free
    trigger gives the tokens and the fast rows it gives with sfi's recording class, and the
    sentence trigger, which needs the tokens, is refused by name."""
    from vllm.model_executor.models import ModelRegistry

    from sfi.vllm import configure

    def recording(model: torch.nn.Module) -> bool:
        return hasattr(type(model), backend.STOCK_ENTRY)

    built: list[bool] = []  # whether each SFI step's metadata left build() planned
    build = backend.SFIBuilder.build

    def watched(self, *args, **kwargs):
        md = build(self, *args, **kwargs)
        if isinstance(md, backend.SFIMetadata):
            built.append(md.planned)
        return md

    monkeypatch.setattr(backend.SFIBuilder, "build", watched)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(300, 20000, (n,), generator=g).tolist() for n in (400, 650)]
    small = replace(SFI, k_head=32, recent=32)
    llm = make_engine(save_tiny("qwen2", tmp_path_factory.mktemp("recorded"), tokenizer))
    try:
        assert llm.apply_model(recording) == [True]
        recorded = generate(llm, prompts, small, max_tokens=24)
        fast = backend.book().stats.rows["fast"]
    finally:
        close_engine(llm)
    assert fast >= 2 * 15
    assert built and not any(built)  # planned by the model's forward, after build
    built.clear()
    arch = "Qwen2ForCausalLM"
    entry = ModelRegistry.models[arch]
    ModelRegistry.models[arch] = getattr(entry.model_cls, backend.STOCK_ENTRY)
    try:  # another folder: vLLM caches the class it resolved per model path
        llm = make_engine(save_tiny("qwen2", tmp_path_factory.mktemp("stock"), tokenizer))
        try:
            assert llm.apply_model(recording) == [False]
            assert generate(llm, prompts, small, max_tokens=24) == recorded
            assert backend.book().stats.rows["fast"] == fast
            assert built and all(built)  # planned by the builder, before any layer
            with pytest.raises(Exception, match="sentence trigger needs the input tokens"):
                generate(llm, prompts, replace(small, trigger="sentence"), max_tokens=4)
        finally:
            configure(None)
            close_engine(llm)
    finally:
        ModelRegistry.models[arch] = entry
