"""Weight-only products written as reductions that inductor compiles into the kernel.

A one-token decode step multiplies a few rows by every weight matrix: the time is the weights'
bytes over the memory bandwidth, so a narrower stored weight (int8, fp16) is faster only if the
product reads it at that width and widens it in registers. PyTorch's own CPU kernels for
narrow weights do not (``docs/eval/weight-formats.md``), but inductor turns the plain
expression of the product, ``(x[..., None, :] * w.to(x.dtype)).sum(-1)``, into one vectorised
loop that reads each weight element once per row: that expression is the kernel, compiled
once per weight shape (:func:`compiled_for_shape`), or inlined into the decode step where the
whole step is compiled (:mod:`sfi.decoding.compiled`).

The loop widens each weight once per row, so it is bound by arithmetic beyond a few rows: up
to :data:`REDUCE_ROWS` rows take it, more rows (a prefill chunk, teacher forcing) multiply
widened blocks of the weight with ``F.linear`` (:func:`blocked_linear`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from sfi.cache_folder import use_sfi_inductor_cache

#: rows a product takes through the compiled reduction; above, widened blocks and
#: ``F.linear`` (faster from 16 rows up on a 4864 x 896 int8 weight, on this project's EPYC)
REDUCE_ROWS = 16
#: weights widened for ``F.linear`` in blocks of this many output rows (an fp32 block of a
#: 151,936-row output layer would be 545 MB)
DEQUANT_BLOCK = 8192


@cache
def compiled_for_shape(product: Callable[..., torch.Tensor], in_features: int,
                       out_features: int) -> Callable[..., torch.Tensor]:
    """``product`` compiled for one weight shape (one compiled function per product and shape,
    shared by the layers of that shape).

    Each shape gets its own copy of the function's code object: dynamo keeps its compiled
    variants, and counts them against its recompile limit (8), per code object, so a model's
    six or seven weight shapes, each at one row and at a dynamic number of rows, under
    inference and no-grad modes, would otherwise run out of variants and fall back to eager.
    """
    use_sfi_inductor_cache()
    name = f"{product.__name__}_{out_features}x{in_features}"
    code = product.__code__.replace(co_name=name)
    return torch.compile(types.FunctionType(code, product.__globals__, name), dynamic=None)


def blocked_linear(x: torch.Tensor, block: Callable[[int, int], torch.Tensor],
                   out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in]`` times the weight ``[out, in]`` that ``block(start, end)`` widens
    :data:`DEQUANT_BLOCK` output rows at a time (``[end - start, in]`` in ``x``'s dtype), plus
    ``bias``: ``[..., out]`` with ``F.linear``, for products of many rows."""
    parts = []
    for start in range(0, out_features, DEQUANT_BLOCK):
        end = min(start + DEQUANT_BLOCK, out_features)
        part_bias = None if bias is None else bias[start:end].to(x.dtype)
        parts.append(F.linear(x, block(start, end), part_bias))
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


class ReducedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored narrow and multiplied by a compiled reduction.

    A subclass stores its weight (buffers) and gives :attr:`format`, :meth:`product` (the
    reduction, a plain function of ``x`` and :meth:`operands`), :meth:`widened` (output rows
    of the weight in a dtype) and :meth:`stored_bytes`, and may give a kernel of its own
    (:meth:`kernel_runs`, :meth:`kernel_product`). ``forward(x [..., in]) -> [..., out]`` in
    ``x``'s dtype: up to :data:`REDUCE_ROWS` rows the format's kernel where it runs, else the
    product compiled for the weight's shape (inlined where the whole step is compiled); more
    rows :func:`blocked_linear`.
    ``weight`` gives the ``[out, in]`` matrix widened to fp32, made on each access and not a
    parameter: the model no longer trains through it; ``state_dict`` holds it under the
    linear layer's keys.
    """

    format = ""
    product: Callable[..., torch.Tensor]

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(),
                                                                 requires_grad=False)
        #: a few rows' products run in the format's own kernel (:meth:`kernel_runs`), else in
        #: the compiled reduction
        self.uses_kernel = self.kernel_runs(linear.weight.dtype)
        self._compiled = None if self.uses_kernel else compiled_for_shape(
            type(self).product, self.in_features, self.out_features)

    def operands(self) -> tuple[torch.Tensor, ...]:
        """What :meth:`product` takes after ``x`` (the stored weight)."""
        raise NotImplementedError

    def kernel_runs(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`kernel_product` serves this layer here (a model in ``dtype``);
        none by default."""
        return False

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` (no bias) in the format's own kernel."""
        raise NotImplementedError

    def widened(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``[end - start, in]``: output rows ``start:end`` of the weight in ``dtype``."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        """Bytes of weight one product reads."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        return self.widened(0, self.out_features, torch.float32)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows > REDUCE_ROWS:
            return blocked_linear(x, lambda start, end: self.widened(start, end, x.dtype),
                                  self.out_features, self.bias)
        if self.uses_kernel:
            y = self.kernel_product(x)
        else:
            product = type(self).product if torch.compiler.is_compiling() else self._compiled
            y = product(x, *self.operands())
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format}")
