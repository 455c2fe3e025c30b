"""Linear layers with float16 weights: half fp32's bytes, products and sums in fp32.

The weight is stored in float16 and widened in registers by the compiled reduction
(:mod:`sfi.weights.reduction`); the activations keep their dtype (nothing is rounded but the
weight), unlike ``bf16``, whose oneDNN product rounds its inputs too and needs a CPU with bfloat16
instructions. F16C (every AVX2 CPU) converts eight half floats per instruction.

Only large weights are stored so (:func:`worth_storing`): on a small matrix the compiled
product's call costs more than the bytes it saves, and such layers keep the model's dtype in
oneDNN's packed layout. The product converts each weight once per row, so it is a batch-1
format: at two rows and more it is slower than fp32's oneDNN product (measured in
``docs/eval/weight-formats.md``).
"""

from __future__ import annotations

import torch

from sfi.weights.reduction import ReducedLinear

#: what a server with batches of more than one sequence says of fp16 weights
BATCH_ONE = ("fp16 weights are a batch-1 format: batches of two or more sequences decode "
             "slower than with native weights (docs/eval/weight-formats.md); --max-batch 1 "
             "or --weights native")

#: the fewest weight elements a layer stores in float16 (:func:`worth_storing`)
MIN_ELEMENTS = 1 << 22


def worth_storing(in_features: int, out_features: int) -> bool:
    """Whether a weight of this shape is stored in float16: at least :data:`MIN_ELEMENTS`
    elements. Below that a one-row product's fixed cost is as large as its bytes', and the
    compiled fp16 reduction is not faster than oneDNN's fp32 product
    (``docs/eval/weight-formats.md``)."""
    return in_features * out_features >= MIN_ELEMENTS


def fp16_product(x: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """``x [..., in]``, ``w16 [out, in]`` float16 -> ``x @ w16.T`` ``[..., out]`` in ``x``'s
    dtype. Eagerly this materialises ``[..., out, in]``: it is meant to be compiled."""
    return (x[..., None, :] * w16.to(x.dtype)).sum(-1)


class Fp16Linear(ReducedLinear):
    """An ``nn.Linear`` whose weight is stored in float16 (``w16 [out, in]``); see
    :class:`sfi.weights.reduction.ReducedLinear`."""

    format = "fp16"
    product = staticmethod(fp16_product)

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__(linear)
        self.register_buffer("w16", linear.weight.detach().to(torch.float16).contiguous(),
                             persistent=False)

    def operands(self) -> tuple[torch.Tensor, ...]:
        return (self.w16,)

    def widened(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.w16[start:end].to(dtype)

    def stored_bytes(self) -> int:
        return self.w16.numel() * self.w16.element_size()
