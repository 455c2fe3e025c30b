"""Weight memory layout for one-token decode steps on CPU.

A decode step multiplies one row vector by every weight matrix: a matrix-vector product bound by
how fast the weights stream from memory. On the 2-core x86 machines this project runs on, MKL
streams a ``[out, in]`` row-major weight at 9-11 GB/s when ``out >= in`` but at 11-23 GB/s when
the same matrix is stored ``[in, out]`` (transposed-contiguous); for ``out < in`` (MLP down
projections) the stock layout is the faster one. The values are unchanged: ``linear.weight``
stays an ``[out, in]`` tensor, only its strides differ, so every module works as before.
"""

from __future__ import annotations

import torch


def prefer_decode_layout(model: torch.nn.Module) -> int:
    """Store the weight of every ``nn.Linear`` with ``out_features >= in_features`` transposed.

    Only on CPU (GPU GEMV kernels are indifferent). A weight shared with another module (tied
    embeddings) is given its own copy for the linear layer, so the embedding keeps its layout.
    Returns the number of linear layers changed.
    """
    changed = 0
    shared = _shared_parameters(model)
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or module.out_features < module.in_features:
            continue
        if weight.dim() != 2 or weight.t().is_contiguous():
            continue
        transposed = weight.detach().t().contiguous()
        if id(weight) not in shared:
            weight.data = transposed.t()
        else:
            module.weight = torch.nn.Parameter(transposed.t(), requires_grad=False)
        changed += 1
    return changed


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}
