"""Linear layers with float16 weights: half fp32's bytes, products and sums in fp32.

The weight is stored in float16 and widened in registers by the compiled reduction
(:mod:`sfi.reduction`); the activations keep their dtype (nothing is rounded but the weight),
unlike ``bf16``, whose oneDNN product rounds its inputs too and needs a CPU with bfloat16
instructions. F16C (every AVX2 CPU) converts eight half floats per instruction.

Only large weights are stored so (:func:`worth_storing`): on a small matrix the compiled
product's call costs more than the bytes it saves, and such layers keep the model's dtype in
oneDNN's packed layout. The product converts each weight once per row, so it is a batch-1
format: at two rows and more it is slower than fp32's oneDNN product (measured in
``docs/eval/weight-formats.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from sfi.reduction import REDUCE_ROWS, blocked_linear, compiled_for_shape

#: what a server with batches of more than one sequence says of fp16 weights
BATCH_ONE = ("fp16 weights are a batch-1 format: batches of two or more sequences decode "
             "slower than with native weights (docs/eval/weight-formats.md); --max-batch 1 "
             "or --weights native")

#: the fewest weight elements a layer stores in float16 (:func:`worth_storing`)
MIN_ELEMENTS = 1 << 22


def worth_storing(in_features: int, out_features: int) -> bool:
    """Whether a weight of this shape is stored in float16: at least :data:`MIN_ELEMENTS`
    elements. One-row products on an AVX2 EPYC (2 threads, compiled reduction against fp32
    oneDNN): 4864 x 896 0.31 against 0.42 ms, 151936 x 896 12.1 against 24.6 ms, 49152 x 576
    3.6 against 5.7 ms; but 896 x 896 0.11 against 0.14, 576 x 576 0.12 against 0.08 and
    1536 x 576 0.18 against 0.15 ms, where the call's cost is as large as the bytes'."""
    return in_features * out_features >= MIN_ELEMENTS


def fp16_product(x: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """``x [..., in]``, ``w16 [out, in]`` float16 -> ``x @ w16.T`` ``[..., out]`` in ``x``'s
    dtype. Eagerly this materialises ``[..., out, in]``: it is meant to be compiled."""
    return (x[..., None, :] * w16.to(x.dtype)).sum(-1)


@cache
def compiled_product(in_features: int, out_features: int) -> Callable[..., torch.Tensor]:
    """:func:`fp16_product` compiled for one weight shape
    (:func:`sfi.reduction.compiled_for_shape`)."""
    return compiled_for_shape(fp16_product, in_features, out_features)


class Fp16Linear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored in float16.

    ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype. ``weight`` gives the ``[out, in]``
    matrix widened to fp32, made on each access and not a parameter: the model no longer
    trains through it; ``state_dict`` holds it under the linear layer's keys.
    """

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = "fp16"
        self.register_buffer("w16", linear.weight.detach().to(torch.float16).contiguous(),
                             persistent=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(),
                                                                 requires_grad=False)
        self._product = compiled_product(self.in_features, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.w16.float()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def stored_bytes(self) -> int:
        """Bytes of weight one product reads."""
        return self.w16.numel() * self.w16.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows <= REDUCE_ROWS:
            product = fp16_product if torch.compiler.is_compiling() else self._product
            y = product(x, self.w16)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return blocked_linear(x, lambda start, end: self.w16[start:end].to(x.dtype),
                                        self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=fp16")
