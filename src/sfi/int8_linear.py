"""Linear layers with int8 weights: symmetric per output channel, fp32 activations and sums.

A one-token decode step multiplies a few rows by every weight matrix, so its time is the
weights' bytes over the memory bandwidth: int8 weights are a quarter of fp32's. PyTorch's own
int8 weight-only CPU kernel (``aten._weight_int8pack_mm``) and torchao's run slower than fp32
on this project's CPUs (``docs/eval/weight-formats.md``), but inductor turns the plain
expression of the product, ``(x[..., None, :] * w8.to(x.dtype)).sum(-1) * scale``, into one
vectorised loop (AVX-512 or AVX2) that reads each weight byte once per row: that expression is
the kernel (:func:`int8_product`), compiled here once per weight shape, or inlined into the
decode step where the whole step is compiled (:mod:`sfi.compiled`).

The loop converts each weight to fp32 once per row, so it is bound by arithmetic beyond one
or two rows: up to :data:`REDUCE_ROWS` rows take it, more rows (a prefill chunk, teacher
forcing) multiply dequantised blocks of the weight with ``F.linear``.

The loop is fast only where the CPU has AVX-512 (:func:`int8_runs_fast`): with AVX2 alone
inductor loads the int8 weights eight at a time through a partial-vector copy, and the product
reads about 1.5 GB/s of weights (fp32's ``F.linear`` about 36 GB/s on the same CPU); neither
packing four weights per int32 lane nor PyTorch's ``_weight_int8pack_mm`` passed 5.5 GB/s
there. Loading int8 weights on such a CPU says so (:func:`warn_if_slow`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from sfi.cache_folder import use_sfi_inductor_cache
from sfi.notices import notice_once

#: rows a product takes through :func:`int8_product`; above, dequantised blocks and
#: ``F.linear`` (faster from 16 rows up on a 4864 x 896 weight, on this project's EPYC)
REDUCE_ROWS = 16
#: weights dequantised for ``F.linear`` in blocks of this many output rows (an fp32 block of
#: a 151,936-row output layer would be 545 MB)
DEQUANT_BLOCK = 8192


#: what :func:`warn_if_slow` says on a CPU without AVX-512
SLOW_INT8 = ("int8 weights decode several times slower than native ones on this CPU (no "
             "AVX-512: the int8 product reads about 1.5 GB/s of weights here); use native "
             "weights")


def int8_runs_fast() -> bool:
    """Whether the compiled int8 product is fast on this CPU: PyTorch runs it with AVX-512
    (on AVX2 alone it is several times slower than fp32; see the module)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


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
    meant to be compiled (:func:`compiled_product`)."""
    return (x[..., None, :] * w8.to(x.dtype)).sum(-1) * scale.to(x.dtype)


@cache
def compiled_product(in_features: int, out_features: int) -> Callable[..., torch.Tensor]:
    """:func:`int8_product` compiled for one weight shape.

    Each shape gets its own copy of the function's code object: dynamo keeps its compiled
    variants, and counts them against its recompile limit (8), per code object, so a model's
    six or seven weight shapes, each at one row and at a dynamic number of rows, under
    inference and no-grad modes, would otherwise run out of variants and fall back to eager.
    """
    use_sfi_inductor_cache()
    code = int8_product.__code__.replace(co_name=f"int8_product_{out_features}x{in_features}")
    function = types.FunctionType(code, int8_product.__globals__, code.co_name)
    return torch.compile(function, dynamic=None)


class Int8Linear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored as int8 per output channel (:func:`quantize_rows`).

    ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype. ``weight`` gives the dequantised
    ``[out, in]`` matrix, made on each access and not a parameter: the model no longer trains
    through it; ``state_dict`` holds it under the linear layer's keys.
    """

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = "int8"
        w8, scale = quantize_rows(linear.weight)
        self.register_buffer("w8", w8, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(),
                                                                 requires_grad=False)
        self._product = compiled_product(self.in_features, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.w8.float() * self.scale[:, None]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def stored_bytes(self) -> int:
        """Bytes of weight (and scales) one product reads."""
        return self.w8.numel() + self.scale.numel() * self.scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows <= REDUCE_ROWS:
            product = int8_product if torch.compiler.is_compiling() else self._product
            y = product(x, self.w8, self.scale)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return self._blocked_linear(x)

    def _blocked_linear(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: ``F.linear`` with the weight dequantised :data:`DEQUANT_BLOCK` output
        rows at a time."""
        parts = []
        for start in range(0, self.out_features, DEQUANT_BLOCK):
            end = min(start + DEQUANT_BLOCK, self.out_features)
            block = self.w8[start:end].to(x.dtype) * self.scale[start:end, None].to(x.dtype)
            bias = None if self.bias is None else self.bias[start:end].to(x.dtype)
            parts.append(F.linear(x, block, bias))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=int8")
