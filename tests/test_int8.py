"""int8 weights (``sfi.weights.int8_linear``): the quantization, the compiled product at a few rows
and the blocked product at many, AVX2's code path, and the model-wide layout."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import tied_tiny_qwen2, tiny_model

from sfi.weights import int8_kernel, int8_linear, reduction
from sfi.weights import layout as weight_layout
from sfi.weights.int8_linear import Int8Linear, int8_product, quantize_rows
from sfi.weights.layout import prefer_decode_layout, weight_byte_ratio

needs_int8 = pytest.mark.skipif(not weight_layout.format_runs("int8", torch.float32),
                                reason="int8 needs inductor with a C++ compiler")


def _linear(out: int, inn: int, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inn, out, bias=bias).eval()


def test_quantize_rows_is_within_half_a_step_per_channel():
    weight = torch.randn(40, 24) * torch.logspace(-3, 1, 40)[:, None]  # scales far apart
    w8, scale = quantize_rows(weight)
    assert w8.dtype == torch.int8 and scale.shape == (40,)
    assert int(w8.abs().max()) == 127
    error = (weight - w8.float() * scale[:, None]).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())


@needs_int8
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("rows", [1, 3, reduction.REDUCE_ROWS + 5])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_equals_the_dequantised_product(rows, bias, kernel, monkeypatch):
    """With sfi's kernel (which rounds the rows to int16: within 1e-3 of the largest output)
    or with the compiled reduction (float rounding alone)."""
    if kernel and not int8_kernel.available():
        pytest.skip("the kernel does not build or run here")
    if not kernel:
        monkeypatch.setattr(int8_kernel, "available", lambda: False)
    monkeypatch.setattr(reduction, "DEQUANT_BLOCK", 16)  # several blocks at many rows
    linear = _linear(40, 24, bias)
    layer = Int8Linear(linear)
    assert layer.uses_kernel is kernel
    x = torch.randn(rows, 24)
    with torch.inference_mode():
        got = layer(x)
        expected = F.linear(x, layer.weight, linear.bias)
    assert got.shape == (rows, 40)
    if kernel and rows <= reduction.REDUCE_ROWS:
        assert int8_kernel.close(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and close to the fp32 layer it replaced, within the quantization's error
    torch.testing.assert_close(got, linear(x).detach(), rtol=0.05, atol=0.05)


@needs_int8
def test_the_avx2_code_path_computes_the_same_product():
    """inductor writes AVX-512 code on CPUs that have it; ``cpp.simdlen=256`` makes it write the
    AVX2 loop that AVX2-only CPUs run, checked here on any x86 machine with AVX2."""
    import torch._inductor.config as inductor_config

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 here")
    w8, scale = quantize_rows(torch.randn(72, 40))
    x = torch.randn(2, 40)
    expected = x @ (w8.float() * scale[:, None]).T
    for simdlen in (256, 512):
        code = int8_product.__code__.replace(co_name=f"int8_product_simd{simdlen}")
        product = torch.compile(types.FunctionType(code, int8_product.__globals__))
        with inductor_config.patch({"cpp.simdlen": simdlen}), torch.inference_mode():
            torch.testing.assert_close(product(x, w8, scale), expected, rtol=1e-5, atol=1e-5)


@needs_int8
def test_int8_layout_of_a_model_with_tied_embeddings():
    model, ids, reference = tied_tiny_qwen2()
    table = model.model.embed_tokens.weight.detach().clone()
    keys = set(model.state_dict())
    assert prefer_decode_layout(model, "int8") == 2 * 7 + 1
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, table)  # the embedding keeps fp32
    assert set(model.state_dict()) == keys
    assert weight_byte_ratio(model) == 0.25
    with torch.inference_mode():
        logits = model(ids).logits  # 12 rows: the compiled reduction
        last = model(ids[:, :1]).logits
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(logits, reference, rtol=0.05, atol=0.05)
    torch.testing.assert_close(last[:, -1], logits[:, 0], rtol=1e-4, atol=1e-4)


def test_int8_is_refused_where_inductor_cannot_build(monkeypatch):
    from sfi.errors import SFIError

    monkeypatch.setattr(weight_layout, "format_runs", lambda weights, dtype: False)
    with pytest.raises(SFIError, match=r"int8.*C\+\+ compiler"):
        prefer_decode_layout(tiny_model("llama"), "int8")


@needs_int8
@pytest.mark.parametrize("capability, kernel, slow", [
    ("AVX2", False, True), ("AVX2", True, False), ("AVX512", False, False),
    ("AVX512_BF16", False, False)])
def test_int8_where_it_is_slow_says_so(capability, kernel, slow, monkeypatch, caplog):
    """Slow: no AVX-512 for inductor's loop, and no sfi kernel."""
    from sfi import notices

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(int8_kernel, "available", lambda: kernel)
    monkeypatch.setattr(notices, "_said", set())
    with caplog.at_level("WARNING", logger="sfi"):
        prefer_decode_layout(tiny_model("llama"), "int8")
    said = [r.getMessage() for r in caplog.records if "int8 weights" in r.getMessage()]
    assert said == ([int8_linear.SLOW_INT8] if slow else [])


def test_a_format_this_cpu_cannot_run_is_refused_before_the_bench_loads(monkeypatch):
    from test_cli import run_cli_here

    from sfi import models

    monkeypatch.setattr(weight_layout, "format_runs", lambda weights, dtype: weights == "native")
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(weight_layout.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    result = run_cli_here("bench", "--weights", "native,bf16", "--contexts", "64")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "weights='bf16' needs oneDNN's bfloat16 products, which this CPU (PyTorch " \
           "reports AVX2) does not run" in " ".join(result.stderr.split())
