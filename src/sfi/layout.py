"""Weight memory layout for one-token decode steps on CPU.

A decode step multiplies a few row vectors by every weight matrix: matrix-vector products bound
by how fast the weights stream from memory. How fast a library streams them depends on the CPU
and on the weight's layout, measured on this project's machines (2 cores, fp32, 2 threads):

- MKL (what ``torch.nn.functional.linear`` calls on x86) streams a row-major ``[out, in]`` weight
  at 15-17 GB/s on an AMD EPYC and 9-11 GB/s on the Intel machine of earlier sessions, and the
  same matrix stored ``[in, out]`` at 22-27 GB/s. With 4 rows (batch 4) it drops to 10-14 GB/s:
  MKL takes a generic path on this AMD CPU.
- oneDNN (PyTorch's ``mkldnn`` ops, which ``torch.compile`` itself uses for frozen CPU linears)
  with the weight packed once into its blocked layout: 37-46 GB/s at 1-8 rows on the EPYC, and
  2.2x MKL's speed at 512 rows (prefill chunks), against a plain read's 70 GB/s.

So on x86 with oneDNN every CPU linear layer becomes a :class:`PackedLinear` (its weight packed
once, the dense copy freed); elsewhere, wide weights (``out >= in``) are stored transposed.
Results agree with ``nn.Linear`` to float rounding (about 1e-6 relative): the products are
summed in another order.
"""

from __future__ import annotations

import platform
from functools import cache

import torch

#: the batch size oneDNN packs weights for; 4 rows was as fast as 1 for one row and fastest
#: from 2 to 8 rows (decode batches) on the EPYC, and no slower at 512 rows (prefill)
PACK_ROWS = 4


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives packed in oneDNN's blocked layout (CPU only).

    ``forward(x [..., in]) -> [..., out]`` as the linear layer it replaced. The packed tensor is
    opaque; ``weight`` gives a dense ``[out, in]`` copy for code that inspects it (made on each
    access, not a parameter: the model no longer trains through it).
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed_weight", _pack(linear.weight.detach()), persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=oneDNN")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears run and agree with ``F.linear`` here for ``dtype``: x86,
    a PyTorch built with oneDNN, and a small product that matches."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=generator).to(dtype)
        x = torch.randn(3, 32, generator=generator).to(dtype)
        with torch.no_grad():
            got = torch.ops.mkldnn._linear_pointwise(x, _pack(weight), None, "none", [], "")
        expected = torch.nn.functional.linear(x.float(), weight.float())
    except (RuntimeError, AttributeError):
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got.float(), expected, atol=tolerance * 10, rtol=tolerance))


def prefer_decode_layout(model: torch.nn.Module) -> int:
    """Give every CPU ``nn.Linear`` of ``model`` the layout that decodes fastest here.

    With oneDNN (see :func:`onednn_packs`), each is replaced by a :class:`PackedLinear`. A
    weight shared with another module (tied embeddings) is packed as a copy, so the embedding
    keeps its table. Otherwise the weights with ``out_features >= in_features`` are stored
    transposed (values and ``[out, in]`` shape unchanged, only the strides). GPU weights are
    left alone (GPU GEMV kernels are indifferent). Returns the number of layers changed.
    """
    changed = 0
    shared = _shared_parameters(model)
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if not isinstance(module, torch.nn.Linear) or module.weight.device.type != "cpu":
                continue
            if module.weight.dim() != 2:
                continue
            if onednn_packs(module.weight.dtype):
                setattr(parent, name, PackedLinear(module))
                changed += 1
            elif _transpose_wide(module, id(module.weight) in shared):
                changed += 1
    return changed


def _transpose_wide(module: torch.nn.Linear, shared: bool) -> bool:
    weight = module.weight
    if module.out_features < module.in_features or weight.t().is_contiguous():
        return False
    transposed = weight.detach().t().contiguous()
    if not shared:
        weight.data = transposed.t()
    else:
        module.weight = torch.nn.Parameter(transposed.t(), requires_grad=False)
    return True


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}
