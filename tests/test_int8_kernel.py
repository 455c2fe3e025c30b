"""sfi's AVX2 int8 kernel (``sfi.weights.int8_kernel``) agrees with its PyTorch reference, eagerly
and inside a compiled function, and ``Int8Linear`` gives the same products with it as with the
compiled reduction."""

from __future__ import annotations

import pytest
import torch

from sfi.weights import int8_kernel
from sfi.weights.int8_linear import Int8Linear

needs_kernel = pytest.mark.skipif(not int8_kernel.available(),
                                  reason="the kernel does not build or run on this machine")


def _operands(rows: int, out: int, inp: int):
    generator = torch.Generator().manual_seed(rows * 1000 + out + inp)
    x = torch.randn(rows, inp, generator=generator)
    w = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=generator)
    scale = torch.rand(out, generator=generator) / 100
    return x, w, scale


@needs_kernel
@pytest.mark.parametrize("rows, out, inp", [
    (1, 64, 64), (1, 67, 45), (3, 130, 896), (16, 9, 7), (1, 4864, 896), (4, 896, 4864),
    (2, 8, 9000)])
def test_the_kernel_agrees_with_its_reference(rows, out, inp):
    """Odd sizes too: outputs not a multiple of the four rows a step, inputs not of sixteen,
    and more inputs than one int32 flush (4,096)."""
    x, w, scale = _operands(rows, out, inp)
    got = torch.ops.sfi.int8_gemv(x, w, scale)
    expected = int8_kernel.reference_product(x, w, scale)
    assert int8_kernel.close(got, expected, 1e-4)
    assert not int8_kernel.close(got + 1e-2 * expected.abs().max(), expected)


@needs_kernel
def test_the_kernel_sums_the_largest_values_without_overflow():
    """Every weight and input at its largest magnitude: the int32 sums are flushed in time."""
    x = torch.full((1, 9000), -3.0)
    w = torch.full((4, 9000), -127, dtype=torch.int8)
    scale = torch.ones(4)
    got = torch.ops.sfi.int8_gemv(x, w, scale)
    assert int8_kernel.close(got, int8_kernel.reference_product(x, w, scale), 1e-5)


@needs_kernel
def test_the_kernel_keeps_the_leading_dimensions_and_runs_in_a_compiled_function():
    x, w, scale = _operands(2, 40, 24)
    x = x.view(2, 1, 24)
    eager = torch.ops.sfi.int8_gemv(x, w, scale)
    assert eager.shape == (2, 1, 40)
    compiled = torch.compile(lambda a, b, c: torch.ops.sfi.int8_gemv(a, b, c) + 1,
                             fullgraph=True)
    torch.testing.assert_close(compiled(x, w, scale), eager + 1)


@needs_kernel
def test_int8_linear_gives_the_reductions_products_with_the_kernel(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 200)
    with_kernel = Int8Linear(linear)
    monkeypatch.setattr(int8_kernel, "available", lambda: False)
    reduction = Int8Linear(linear)
    assert with_kernel.uses_kernel and not reduction.uses_kernel
    for rows in (1, 3):
        x = torch.randn(rows, 256)
        assert int8_kernel.close(with_kernel(x), reduction(x))


def test_the_kernel_is_for_avx2_without_avx512(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not int8_kernel.cpu_takes_kernel()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not int8_kernel.cpu_takes_kernel()


def test_without_the_kernel_the_operator_is_its_reference(monkeypatch):
    monkeypatch.setattr(int8_kernel, "_extension", lambda: None)
    x, w, scale = _operands(2, 12, 10)
    torch.testing.assert_close(torch.ops.sfi.int8_gemv(x, w, scale),
                               int8_kernel.reference_product(x, w, scale))


def test_a_stopped_builds_lock_is_cleared_and_a_running_ones_kept(tmp_path):
    """torch's extension build waits for its folder's lock with no end: a lock a stopped build
    left (older than a build takes) is removed, a fresh one (a build under way) is not."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    assert not int8_kernel.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - int8_kernel.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert int8_kernel.clear_stale_lock(tmp_path) and not lock.exists()
    assert not int8_kernel.clear_stale_lock(tmp_path)  # none there
