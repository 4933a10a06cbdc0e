"""Weight quantization of a decoder before export, in the schemes ExecuTorch's Llama export
calls ``8da4w`` and ``8da8w``, each run by kernels ExecuTorch's stock runtime already has.

- ``8da4w``: every ``nn.Linear`` whose input width divides by the group size (the LM head
  included) gets 4-bit weights in groups of ``group_size`` along the input (symmetric, one
  scale per group) and 8-bit activations quantized per token at run time, through torchao's
  ``Int8DynamicActivationIntxWeightConfig``; XNNPACK's partitioner takes the pattern as its
  dynamically quantized linear. The embedding stays fp32.
- ``8da4w-e8``: ``8da4w``, and every ``nn.Embedding`` an 8-bit table, one symmetric scale
  per row, read by ``quantized_decomposed::embedding_byte`` (ExecuTorch's quantized kernels
  library, loaded by the lowering when a program runs it).
- ``8da8w``: linear layers 8-bit per output channel with 8-bit dynamic activations
  (XNNPACK's ``qc8w`` dynamically quantized linear), the embedding 8-bit as in ``8da4w-e8``.

A tied embedding/LM head becomes two tensors: the embedding table (int8, outside any
delegate) and the LM head's weight (packed into XNNPACK's blob). No stock kernel pair reads
one quantized tensor for both the lookup and the matmul, so each is stored once in its own
form. Norms and the state (the KV cache) are untouched, so every in-place write of the fp32
model is still in place.

torchao comes with ExecuTorch (exir imports it); nothing here is imported until a
model is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["QUANTIZATIONS", "ByteEmbedding", "Quantization", "QuantizationError", "quantize", "scheme"]


class QuantizationError(ValueError):
    """A scheme this package does not offer, or a model with nothing it can quantize."""


@dataclass(frozen=True)
class Quantization:
    """A scheme's name, what it does, and how far its arithmetic may stray from fp32's
    run of the same quantized model (XNNPACK's int8 kernels against torchao's eager
    reference: the activations' rounding differs in the last step)."""

    name: str
    description: str
    #: Inputs per scale of a linear weight; ``None``: one scale per output channel.
    group_size: int | None
    #: Bits of a linear layer's weights.
    linear_bits: int
    #: Bits of an embedding table; ``None``: left as it is (fp32).
    embedding_bits: int | None
    rtol: float
    atol: float

    @property
    def grouping(self) -> int:
        """What a linear layer's input width must divide by to be quantized (1: any width)."""
        return self.group_size or 1


_LINEAR4 = "linear layers (the LM head too): 8-bit dynamic activations, 4-bit weights in groups of 32"
_EMBEDDING8 = "embedding 8-bit, one scale per row (quantized_decomposed::embedding_byte)"

QUANTIZATIONS: dict[str, Quantization] = {
    "8da4w": Quantization(
        "8da4w",
        f"{_LINEAR4} (torchao Int8DynamicActivationIntxWeightConfig); embedding fp32",
        group_size=32,
        linear_bits=4,
        embedding_bits=None,
        # Measured on the tiny and 4-layer hf Llama cases: logits within 2e-2 of torchao's
        # eager, caches within 1e-2 (an activation rounded to the next int8 step).
        rtol=5e-2,
        atol=5e-2,
    ),
    "8da4w-e8": Quantization(
        "8da4w-e8",
        f"{_LINEAR4}; {_EMBEDDING8}",
        group_size=32,
        linear_bits=4,
        embedding_bits=8,
        # The lookup dequantizes exactly as eager does; the error is 8da4w's.
        rtol=5e-2,
        atol=5e-2,
    ),
    "8da8w": Quantization(
        "8da8w",
        "linear layers (the LM head too): 8-bit dynamic activations, 8-bit weights, one scale per "
        f"output channel; {_EMBEDDING8}",
        group_size=None,
        linear_bits=8,
        embedding_bits=8,
        rtol=5e-2,
        atol=5e-2,
    ),
}


def scheme(name: str, hidden: int | None = None) -> Quantization:
    """The scheme called ``name``; with ``hidden`` (a decoder's hidden size), checked to fit it.

    :raises QuantizationError: no such scheme, or ``hidden`` does not divide by its group size.
    """
    if name in QUANTIZATIONS and hidden is not None and hidden % QUANTIZATIONS[name].grouping:
        raise QuantizationError(
            f"{name}: hidden size {hidden} does not divide by the group size {QUANTIZATIONS[name].grouping}, "
            "so the attention and MLP input layers would stay fp32"
        )
    try:
        return QUANTIZATIONS[name]
    except KeyError:
        raise QuantizationError(f"unknown quantization {name!r}; offered: {', '.join(sorted(QUANTIZATIONS))}") from None


def quantize(module: nn.Module, name: str) -> nn.Module:
    """Quantize ``module``'s linear layers (and, where the scheme says so, its embeddings) in
    place as the scheme ``name`` says; returns ``module``.

    :raises QuantizationError: no scheme is called ``name``, or no linear layer's input width
        divides by the scheme's group size (nothing would be quantized).
    """
    chosen = scheme(name)
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    fits = [m for m in linears if m.in_features % chosen.grouping == 0]
    if not fits:
        widths = sorted({m.in_features for m in linears})
        raise QuantizationError(
            f"{name}: no linear layer's input width divides by the group size {chosen.grouping} "
            f"(widths {widths or 'none: the model has no nn.Linear'}); the model would stay fp32"
        )
    if chosen.embedding_bits is not None:
        _quantize_embeddings(module)
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if chosen.linear_bits == 4 else torch.int8,  # type: ignore[attr-defined]  # in torch, missing from its stubs
        weight_granularity=PerGroup(chosen.group_size) if chosen.group_size else PerAxis(0),
    )
    chosen_ids = {id(m) for m in fits}
    quantize_(module, config, filter_fn=lambda m, _fqn: id(m) in chosen_ids)
    return module


class ByteEmbedding(nn.Module):
    """An embedding table in 8 bits, one symmetric scale per row: row ``i`` is
    ``weight[i] * scales[i]``, looked up by ``quantized_decomposed::embedding_byte`` (ExecuTorch's
    quantized kernels at run time, its Python reference in eager)."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  # registers embedding_byte

        table = table.detach().float()
        scales = table.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.num_embeddings, self.embedding_dim = table.shape
        self.register_buffer("weight", torch.round(table / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = torch.ops.quantized_decomposed.embedding_byte.default(
            self.weight, self.scales, None, -128, 127, indices
        )
        return rows


def _quantize_embeddings(module: nn.Module) -> None:
    """Replace every ``nn.Embedding`` under ``module`` by a :class:`ByteEmbedding` of its table; a
    tied LM head keeps the fp32 parameter, which the linear quantization then takes."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                setattr(parent, child_name, ByteEmbedding(child.weight))
