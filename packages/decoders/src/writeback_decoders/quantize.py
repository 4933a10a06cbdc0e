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

With an 8-bit embedding (``8da4w-e8``, ``8da8w``), an LM head tied to the embedding (one
parameter for both, as Qwen2.5's) is quantized 8-bit per output channel whatever the scheme's
linear bits, and the embedding's table is that head's: the same int8 ``[vocab, hidden]`` rows and
fp32 ``[vocab]`` scales. The lookup reads them as program constants, XNNPACK's ``qc8w`` linear
as named data, and both files hold them once: a data file of their own (``writeback export
--separate-weights``) because ExecuTorch's data store keeps bytes two keys share once, a single
``.pte`` because the lowering points the delegate's named data at the constants' bytes
(``writeback_core.stored_once``). ``8da4w-e8``'s tied head is thereby 8-bit, as llama.cpp's
q4_0 files keep theirs (q8_0). Norms and the state (the KV cache) are untouched, so
every in-place write of the fp32 model is still in place.

torchao comes with ExecuTorch (exir imports it); nothing here is imported until a
model is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
_SHARED = "the embedding's own int8 table and scales (stored once)"

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
        f"{_LINEAR4}, except an LM head tied to the embedding: 8-bit, one scale per output channel, {_SHARED}; "
        f"{_EMBEDDING8}",
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
        f"output channel; {_EMBEDDING8}; an LM head tied to the embedding reads {_SHARED}",
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
    place as the scheme ``name`` says; returns ``module``. With an 8-bit embedding, a linear
    layer whose weight is an embedding's (a tied LM head) is 8-bit per output channel and the
    embedding's table is that layer's int8 weight and scales (see the module's docstring).

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
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    # Keyed by the id of the parameter the two modules share, taken before quantize_ replaces it.
    heads = _tied_heads(module, linears) if chosen.embedding_bits is not None else {}
    head_ids = {id(m) for m in heads.values()}
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if chosen.linear_bits == 4 else torch.int8,  # type: ignore[attr-defined]  # in torch, missing from its stubs
        weight_granularity=PerGroup(chosen.group_size) if chosen.group_size else PerAxis(0),
    )
    chosen_ids = {id(m) for m in fits} - head_ids
    quantize_(module, config, filter_fn=lambda m, _fqn: id(m) in chosen_ids)
    if heads:
        per_channel = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
        quantize_(module, per_channel, filter_fn=lambda m, _fqn: id(m) in head_ids)
    if chosen.embedding_bits is not None:
        _quantize_embeddings(module, heads)
    return module


class ByteEmbedding(nn.Module):
    """An embedding table in 8 bits, one symmetric scale per row: row ``i`` is
    ``weight[i] * scales[i]``, looked up by ``quantized_decomposed::embedding_byte`` (ExecuTorch's
    quantized kernels at run time, its Python reference in eager).

    Built from an fp32 ``table`` (each row's largest magnitude becomes 127), or, with
    ``scales``, from int8 rows already quantized (``table``) and their fp32 scale per row.
    """

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, table: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        super().__init__()
        import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  # registers embedding_byte

        table = table.detach()
        if scales is None:
            table = table.float()
            scales = table.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
            table = torch.round(table / scales[:, None]).clamp(-127, 127).to(torch.int8)
        elif table.dtype != torch.int8 or table.dim() != 2 or scales.numel() != table.shape[0]:
            raise QuantizationError(
                f"an 8-bit embedding takes int8 rows [rows, width] and one scale per row; got {table.dtype} "
                f"{list(table.shape)} and {scales.numel()} scales: pass an fp32 table alone to quantize it here"
            )
        self.num_embeddings, self.embedding_dim = table.shape
        self.register_buffer("weight", table.contiguous().clone())
        self.register_buffer("scales", scales.detach().to(torch.float32).reshape(-1).clone())

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = torch.ops.quantized_decomposed.embedding_byte.default(
            self.weight, self.scales, None, -128, 127, indices
        )
        return rows


def _tied_heads(module: nn.Module, linears: list[nn.Linear]) -> dict[int, nn.Linear]:
    """The linear layers whose weight is an ``nn.Embedding``'s (tied LM heads), keyed by the id
    of that shared parameter."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {id(m.weight): m for m in linears if id(m.weight) in tables}


def _quantize_embeddings(module: nn.Module, heads: dict[int, nn.Linear]) -> None:
    """Replace every ``nn.Embedding`` under ``module`` by a :class:`ByteEmbedding`: of the int8
    weight and scales of the LM head tied to it (``heads``, keyed by the id of the parameter
    they shared), else of its own table."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Embedding):
                continue
            head = heads.get(id(child.weight))
            if head is None:
                setattr(parent, child_name, ByteEmbedding(child.weight))
                continue
            quantized: Any = head.weight  # torchao's IntxUnpackedToInt8Tensor
            if bool(quantized.zero_point.ne(0).any()):  # symmetric: all zero
                raise QuantizationError(
                    f"the LM head tied to embedding {child_name!r} has non-zero zero points, which "
                    "quantized_decomposed::embedding_byte's table (symmetric, one scale per row) cannot share"
                )
            setattr(parent, child_name, ByteEmbedding(quantized.qdata, quantized.scale))
