"""float16 weights (``sfi.weights.fp16_linear``): the compiled product in both stored forms, at a
few rows and at many, AVX2's code path, the model-wide layout, and a compiled step equal to the
eager one on these weights."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import tied_tiny_qwen2

from sfi.weights import fp16_linear, reduction
from sfi.weights import layout as weight_layout
from sfi.weights.fp16_linear import Fp16Linear, fp16_product, worth_storing
from sfi.weights.layout import prefer_decode_layout, weight_byte_ratio

needs_fp16 = pytest.mark.skipif(not weight_layout.format_runs("fp16", torch.float32),
                                reason="fp16 needs inductor with a C++ compiler")


def _linear(out: int, inn: int, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inn, out, bias=bias).eval()


@needs_fp16
@pytest.mark.parametrize("rows", [1, 3, reduction.REDUCE_ROWS + 5])
@pytest.mark.parametrize("shape", [(40, 24), (24, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp16_linear_equals_the_widened_product(rows, shape, bias, monkeypatch):
    monkeypatch.setattr(reduction, "DEQUANT_BLOCK", 16)  # several blocks at many rows
    out, inn = shape
    linear = _linear(out, inn, bias)
    layer = Fp16Linear(linear)
    assert layer.weight.shape == (out, inn) and layer.w16.dtype == torch.float16
    x = torch.randn(rows, inn)
    with torch.inference_mode():
        got = layer(x)
        expected = F.linear(x, layer.weight, linear.bias)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the weights are all that is rounded: close to the fp32 layer, to half precision
    torch.testing.assert_close(got, linear(x).detach(), rtol=2e-3, atol=2e-3)


@needs_fp16
def test_the_avx2_code_path_computes_the_same_products():
    """inductor writes AVX-512 code on CPUs that have it; ``cpp.simdlen=256`` makes it write the
    AVX2 loop that AVX2-only CPUs run, checked here on any x86 machine with AVX2."""
    import torch._inductor.config as inductor_config

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 here")
    w16 = torch.randn(72, 40).half()
    x = torch.randn(2, 40)
    expected = x @ w16.float().T
    for simdlen in (256, 512):
        code = fp16_product.__code__.replace(co_name=f"fp16_product_simd{simdlen}")
        compiled = torch.compile(types.FunctionType(code, fp16_product.__globals__))
        with inductor_config.patch({"cpp.simdlen": simdlen}), torch.inference_mode():
            torch.testing.assert_close(compiled(x, w16), expected, rtol=1e-5, atol=1e-5)


def test_only_large_weights_are_stored_in_fp16():
    assert worth_storing(896, 4864) and worth_storing(896, 151936)
    assert not worth_storing(896, 896) and not worth_storing(576, 1536)


@needs_fp16
def test_fp16_layout_of_a_model_with_tied_embeddings(monkeypatch):
    model, ids, reference = tied_tiny_qwen2()
    size = model.config.vocab_size * model.config.hidden_size
    monkeypatch.setattr(fp16_linear, "MIN_ELEMENTS", size)  # the output layer alone
    table = model.model.embed_tokens.weight.detach().clone()
    keys = set(model.state_dict())
    assert prefer_decode_layout(model, "fp16") == 2 * 7 + 1
    stored = [m for m in model.modules() if isinstance(m, Fp16Linear)]
    assert [m.out_features for m in stored] == [model.config.vocab_size]
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())  # packed, the rest
    assert torch.equal(model.model.embed_tokens.weight, table)  # the embedding keeps fp32
    assert set(model.state_dict()) == keys
    assert 0.5 < weight_byte_ratio(model) < 1
    with torch.inference_mode():
        logits = model(ids).logits  # 12 rows: the compiled reduction
        last = model(ids[:, :1]).logits
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(logits, reference, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(last[:, -1], logits[:, 0], rtol=1e-4, atol=1e-4)


@needs_fp16
def test_a_compiled_step_on_fp16_weights_equals_the_eager_one(tiny_llama_with_tokenizer,
                                                              monkeypatch):
    from test_compiled import STEPS, _decode

    from sfi import SFIConfig
    from sfi.decoding.compiled import compile_decode, eager_decode

    model, tokenizer = tiny_llama_with_tokenizer
    monkeypatch.setattr(fp16_linear, "MIN_ELEMENTS", 1)  # every layer
    prefer_decode_layout(model, "fp16")
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    torch.manual_seed(1)
    ids = torch.randint(5, 5000, (2, 96))
    config = SFIConfig(sink=2, recent=8, k_head=8, force_sparse=True, trigger="fixed",
                       period=4, coverage_layers=0)
    expected, eager_kinds = _decode(model, tokenizer, "sfi", ids, config)
    compiled = compile_decode(model)
    try:
        got, kinds = _decode(model, tokenizer, "sfi", ids, config)
    finally:
        eager_decode(model)
    assert kinds == eager_kinds and {"slow", "fast"} <= {k for step in kinds for k in step}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert compiled.compiled_steps == STEPS
