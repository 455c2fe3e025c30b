"""Weight memory layout for one-token decode steps on CPU.

A decode step multiplies a few row vectors by every weight matrix: matrix-vector products bound
by how fast the weights stream from memory. How fast a library streams them depends on the CPU
and on the weight's layout (``docs/eval/weight-formats.md``):

- MKL (what ``torch.nn.functional.linear`` calls on x86) streams a row-major ``[out, in]`` weight
  slower than the same matrix stored ``[in, out]``, and slower still at a few rows on AMD CPUs,
  where it takes a generic path.
- oneDNN (PyTorch's ``mkldnn`` ops, which ``torch.compile`` itself uses for frozen CPU linears)
  with the weight packed once into its blocked layout streams it close to a plain read's
  bandwidth at 1-8 rows, and multiplies prefill chunks faster than MKL.

So on x86 with oneDNN every CPU linear layer becomes a :class:`PackedLinear` (its weight packed
once, the dense copy freed); elsewhere, wide weights (``out >= in``) are stored transposed.
Results agree with ``nn.Linear`` to float rounding (about 1e-6 relative): the products are
summed in another order.
"""

from __future__ import annotations

import platform
from functools import cache

import torch

from sfi.core.cost_model import weight_positions
from sfi.errors import SFIError
from sfi.weights.fp16_linear import Fp16Linear, worth_storing
from sfi.weights.int8_linear import Int8Linear, warn_if_slow

#: the batch size oneDNN packs weights for; 4 rows was as fast as 1 for one row and fastest
#: from 2 to 8 rows (decode batches) on the EPYC, and no slower at 512 rows (prefill)
PACK_ROWS = 4

#: weight formats of :func:`prefer_decode_layout`: ``native`` keeps the loaded dtype (the
#: default, exact); ``bf16`` runs every linear layer's product in bfloat16 (inputs rounded,
#: fp32 accumulation, oneDNN); ``fp16`` stores every linear layer's weight in float16
#: (:class:`sfi.weights.fp16_linear.Fp16Linear`: half fp32's bytes, the activations and sums
#: unrounded, a kernel that inductor compiles; any x86 CPU with AVX2); ``int8`` stores every
#: linear layer's weight as int8 per output channel (:class:`sfi.weights.int8_linear.Int8Linear`: a
#: quarter of fp32's bytes, products in the activations' dtype, a kernel that inductor
#: compiles, fast with AVX-512; on AVX2 sfi's own kernel, :mod:`sfi.weights.int8_kernel`). Norms,
#: embeddings, attention and the KV cache stay in the model's dtype.
#: ``docs/eval/weight-formats.md`` measures each.
WEIGHT_FORMATS = ("native", "bf16", "fp16", "int8")
#: the formats whose products inductor compiles (:mod:`sfi.weights.reduction`), by layer class
REDUCED_FORMATS = {"fp16": Fp16Linear, "int8": Int8Linear}
#: the formats :class:`PackedLinear` runs (oneDNN)
PACKED_FORMATS = ("native", "bf16")


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives packed in oneDNN's blocked layout (x86 CPUs).

    ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype, as the linear layer it replaced
    (``torch.ops.mkldnn._linear_pointwise``); with ``weights="bf16"`` the product runs in
    bfloat16. ``weight`` gives a dense ``[out, in]`` copy of what is stored, made on each
    access and not a parameter: the model no longer trains through it.
    """

    def __init__(self, linear: torch.nn.Linear, weights: str = "native") -> None:
        super().__init__()
        if weights not in PACKED_FORMATS:
            raise ValueError(f"unknown packed format {weights!r}; one of {PACKED_FORMATS}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = weights
        weight = linear.weight.detach()
        bias = linear.bias
        if weights == "bf16":
            weight = weight.to(torch.bfloat16)
            if bias is not None:
                bias = torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.register_buffer("packed_weight", _pack(weight), persistent=False)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.to_dense()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` holds ``weight`` (dense) and ``bias`` under the linear layer's keys,
        so a packed model's checkpoint is complete."""
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def stored_bytes(self) -> int:
        """Bytes of weight one product reads."""
        return self.packed_weight.numel() * self.packed_weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias, self.format == "bf16")
        return _packed_product(x, self.packed_weight, self.bias, self.format == "bf16")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format}")


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    bf16: bool) -> torch.Tensor:
    if bf16:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, bias, "none", [],
                                               "")
        return y.to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("sfi::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  bf16: bool) -> torch.Tensor:
    """:class:`PackedLinear`'s product as an operator that ``torch.compile`` calls as it is:
    inductor lowers oneDNN's linear only for weights it froze itself, and refuses a packed
    weight that arrives as an input. ``x [..., in]`` -> ``[..., out]``."""
    return _packed_product(x, packed, bias, bf16)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         bf16: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


@cache
def format_runs(weights: str, dtype: torch.dtype) -> bool:
    """Whether the layer of format ``weights`` runs here for a model in ``dtype`` and agrees
    with ``F.linear`` on a small product: :class:`PackedLinear` needs x86 and a PyTorch with
    oneDNN, :class:`Int8Linear` and :class:`Fp16Linear` a working inductor (a C++
    compiler)."""
    if weights in PACKED_FORMATS and (platform.machine().lower() not in ("x86_64", "amd64")
                                      or not torch.backends.mkldnn.is_available()):
        return False
    layer = REDUCED_FORMATS.get(weights) or (lambda linear: PackedLinear(linear, weights))
    try:
        generator = torch.Generator().manual_seed(0)  # the caller's random stream untouched
        linear = torch.nn.Linear(32, 48, device="meta", dtype=dtype).to_empty(device="cpu")
        x = torch.randn(3, 32, generator=generator).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(48, 32, generator=generator))
            linear.bias.copy_(torch.randn(48, generator=generator))
            got = layer(linear)(x)
            expected = linear.float()(x.float())
    except Exception:  # a probe: any failure (oneDNN, inductor, no compiler) means "not here"
        return False
    tolerance = 1e-4 if weights == "native" and dtype == torch.float32 else 5e-2
    return got.dtype == dtype and bool(torch.allclose(got.float(), expected,
                                                      atol=tolerance * 10, rtol=tolerance))


def require_format(weights: str, dtype: torch.dtype = torch.float32) -> None:
    """Raise :class:`SFIError` naming what ``weights`` needs when it does not run here for a
    model in ``dtype`` (:func:`format_runs`); a command checks this before it loads anything."""
    if weights == "native" or format_runs(weights, dtype):
        return
    if weights in REDUCED_FORMATS:
        needs = "torch.compile's inductor with a working C++ compiler"
    elif weights == "bf16" and platform.machine().lower() in ("x86_64", "amd64") and \
            torch.backends.mkldnn.is_available():
        needs = (f"oneDNN's bfloat16 products, which this CPU (PyTorch reports "
                 f"{torch.backends.cpu.get_cpu_capability()}) does not run")
    else:
        needs = "an x86 CPU and a PyTorch built with oneDNN"
    raise SFIError(f"weights={weights!r} needs {needs}; it does not run here for {dtype} "
                   "weights (use weights='native')")


def prefer_decode_layout(model: torch.nn.Module, weights: str = "native") -> int:
    """Give every CPU ``nn.Linear`` of ``model`` the layout that decodes fastest here.

    ``weights="native"``: with oneDNN (see :func:`format_runs`), each linear layer is replaced
    by a :class:`PackedLinear`; otherwise the weights with ``out_features >= in_features`` are
    stored transposed (values and ``[out, in]`` shape unchanged, only the strides). ``bf16``,
    ``fp16`` and ``int8`` (:data:`WEIGHT_FORMATS`) change the numbers, so they are asked for by
    name, and refused where they cannot run. A weight shared with another module (tied
    embeddings) is stored as a copy, so the embedding keeps its table. GPU weights are left
    alone (GPU GEMV kernels are indifferent). Returns the number of layers changed.
    """
    if weights not in WEIGHT_FORMATS:
        raise SFIError(f"unknown weight format {weights!r}; choose one of "
                       f"{', '.join(WEIGHT_FORMATS)}")
    changed = packed = 0
    shared = _shared_parameters(model)
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if not isinstance(module, torch.nn.Linear) or module.weight.device.type != "cpu":
                continue
            if module.weight.dim() != 2:
                continue
            layer_format = linear_format(module, weights)
            if format_runs(layer_format, module.weight.dtype):
                reduced = REDUCED_FORMATS.get(layer_format)
                replaced = reduced(module) if reduced else PackedLinear(module, layer_format)
                setattr(parent, name, replaced)
                packed += 1
            elif layer_format != "native":
                require_format(layer_format, module.weight.dtype)
            elif _transpose_wide(module, id(module.weight) in shared):
                changed += 1
    if packed:
        _own_memory(model)
        if weights == "int8":
            warn_if_slow()
    return changed + packed


def linear_format(linear: torch.nn.Linear, weights: str) -> str:
    """The format ``linear`` takes when the model asks for ``weights``: fp16 stores only the
    weights worth it (:func:`sfi.weights.fp16_linear.worth_storing`); the others take the native
    layout, as under ``weights="native"``."""
    if weights == "fp16" and not worth_storing(linear.in_features, linear.out_features):
        return "native"
    return weights


def format_byte_saving(model: torch.nn.Module, weights: str) -> float:
    """The share of the bytes of ``model``'s linear weights (plain ``nn.Linear`` layers, as
    loaded) that format ``weights`` would save: fp16 over fp32 saves half of each layer it
    stores (:func:`linear_format`), int8 three quarters."""
    widths = {"int8": 1, "fp16": 2, "bf16": 2}
    stored = total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dim() == 2:
            native = module.weight.element_size()
            count = module.weight.numel()
            stored += count * min(native, widths.get(linear_format(module, weights), native))
            total += count * native
    return 1 - stored / total if total else 0.0


def stored_weight_positions(model: torch.nn.Module) -> int:
    """W of ``SFIConfig.min_gain`` for ``model`` as loaded: its weights in KV positions
    (:func:`sfi.core.cost_model.weight_positions`) at the bytes they are stored in
    (:func:`weight_byte_ratio`); what sfi's engine decides sparse decoding with, and what a
    benchmark's byte floor must decide it with too."""
    return int(weight_positions(model) * weight_byte_ratio(model))


def weight_byte_ratio(model: torch.nn.Module) -> float:
    """Bytes a linear layer's weight element takes as stored (int8: 1, bf16 and fp16: 2), on
    average over the model's linear layers, over the bytes of the model's dtype, the KV's:
    what scales the cost model's W (:func:`sfi.core.cost_model.weight_positions`, counted at the
    KV's width) to the bytes a step reads. 1.0 for native weights."""
    dtype_bytes = next(model.parameters()).element_size()
    stored = elements = 0
    for module in model.modules():
        if isinstance(module, (Int8Linear, Fp16Linear, PackedLinear)):
            width = {"int8": 1, "fp16": 2, "bf16": 2}.get(module.format, dtype_bytes)
            count = module.in_features * module.out_features
            stored, elements = stored + width * count, elements + count
    return stored / (elements * dtype_bytes) if elements else 1.0


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the CPU parameters and buffers that packing left (embeddings, norms) into memory
    of their own, so that the checkpoint's memory map, which the packed layers no longer read,
    is released: SmolLM2's process went from 1.47 to 1.00 GB resident."""
    with torch.no_grad():
        for param in model.parameters():  # each once, tied ones too
            if param.device.type == "cpu":
                param.data = param.data.clone()
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.device.type == "cpu" and not buffer.is_mkldnn:
                    setattr(module, name, buffer.clone())


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
