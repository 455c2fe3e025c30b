"""Linear layers with int8 weights: symmetric per output channel, fp32 activations and sums.

A one-token decode step's time is its weights' bytes over the memory bandwidth: int8 weights
are a quarter of fp32's. PyTorch's own int8 weight-only CPU kernel
(``aten._weight_int8pack_mm``) and torchao's run slower than fp32 on this project's CPUs
(``docs/eval/weight-formats.md``); the product written as a reduction,
``(x[..., None, :] * w8.to(x.dtype)).sum(-1) * scale`` (:func:`int8_product`), is the kernel
that inductor compiles (:mod:`sfi.weights.reduction`: up to ``REDUCE_ROWS`` rows; more rows multiply
dequantised blocks with ``F.linear``).

On a CPU with AVX2 but not AVX-512, inductor loads the int8 weights eight at a time through a
partial-vector copy, and the compiled loop reads a small share of the memory bandwidth; there the
product runs in sfi's own kernel (:mod:`sfi.weights.int8_kernel`, which rounds each row of ``x`` to
int16 and sums in int32) where it builds. Where neither is fast (:func:`int8_runs_fast`),
loading int8 weights says so (:func:`warn_if_slow`).
"""

from __future__ import annotations

import torch

import sfi.weights.int8_kernel as int8_kernel
from sfi.notices import notice_once
from sfi.weights.reduction import ReducedLinear

#: what :func:`warn_if_slow` says on a CPU where int8 products are slow
SLOW_INT8 = ("int8 weights decode several times slower than native ones on this CPU (no "
             "AVX-512, and sfi's AVX2 kernel does not run: the int8 product reads about 1.4 "
             "GB/s of weights here); use native weights")


def int8_runs_fast() -> bool:
    """Whether int8 products are fast on this CPU: inductor's loop with AVX-512, or sfi's
    kernel (:func:`sfi.weights.int8_kernel.available`; see the module)."""
    return (torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            or int8_kernel.available())


def warn_if_slow() -> None:
    """Say (once, :func:`sfi.notices.notice_once`) that int8 weights decode slowly here
    where they do."""
    if not int8_runs_fast():
        notice_once(SLOW_INT8)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> ``(w8 [out, in] int8, scale [out] fp32)`` with
    ``weight ~= w8 * scale[:, None]``: each output channel scaled by its largest magnitude
    over 127 (symmetric, round to nearest)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    w8 = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return w8, scale


def int8_product(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in]``, ``w8 [out, in]`` int8, ``scale [out]`` -> ``x @ (w8 * scale).T``
    ``[..., out]`` in ``x``'s dtype. Eagerly this materialises ``[..., out, in]``: it is
    meant to be compiled (:class:`sfi.weights.reduction.ReducedLinear`)."""
    return (x[..., None, :] * w8.to(x.dtype)).sum(-1) * scale.to(x.dtype)


class Int8Linear(ReducedLinear):
    """An ``nn.Linear`` whose weight is stored as int8 per output channel
    (:func:`quantize_rows`: ``w8 [out, in]``, ``scale [out]``); see
    :class:`sfi.weights.reduction.ReducedLinear`."""

    format = "int8"
    product = staticmethod(int8_product)

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__(linear)
        w8, scale = quantize_rows(linear.weight)
        self.register_buffer("w8", w8, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def operands(self) -> tuple[torch.Tensor, ...]:
        return (self.w8, self.scale)

    def kernel_runs(self, dtype: torch.dtype) -> bool:
        """sfi's AVX2 kernel (:mod:`sfi.weights.int8_kernel`) for an fp32 model, where it runs."""
        return dtype == torch.float32 and int8_kernel.available()

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.sfi.int8_gemv(x, self.w8, self.scale)

    def widened(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.w8[start:end].to(dtype) * self.scale[start:end, None].to(dtype)

    def stored_bytes(self) -> int:
        """Bytes of weight and scales one product reads."""
        return self.w8.numel() + self.scale.numel() * self.scale.element_size()
