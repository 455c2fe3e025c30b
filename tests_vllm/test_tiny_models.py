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
