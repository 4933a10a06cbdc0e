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
from typing import Any, cast

import torch
from torch import nn
from writeback_core.memory import FilePages

__all__ = [
    "QUANTIZATIONS",
    "ByteEmbedding",
    "Quantization",
    "QuantizationError",
    "RowChunkedLinear",
    "quantize",
    "scheme",
]


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
    # Keyed by the id of the parameter the two modules share, taken before a head is quantized.
    heads = _tied_heads(module, linears) if chosen.embedding_bits is not None else {}
    head_ids = {id(m) for m in heads.values()}
    # The fp32 weights read from a mapped file give their pages back once quantized: the
    # quantized model is then resident alone, not beside the whole file.
    pages = FilePages()
    for linear in fits:
        if id(linear) in head_ids:
            continue
        _quantize_linear(linear, chosen.linear_bits, chosen.group_size, pages)
    for head in heads.values():
        _quantize_linear(head, 8, None, pages)
    if chosen.embedding_bits is not None:
        _quantize_embeddings(module, heads, pages)
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
            table, scales = _byte_rows(table)
        elif table.dtype != torch.int8 or table.dim() != 2 or scales.numel() != table.shape[0]:
            raise QuantizationError(
                f"an 8-bit embedding takes int8 rows [rows, width] and one scale per row; got {table.dtype} "
                f"{list(table.shape)} and {scales.numel()} scales: pass an fp32 table alone to quantize it here"
            )
        else:
            table = table.contiguous().clone()
        self.num_embeddings, self.embedding_dim = table.shape
        self.register_buffer("weight", table)
        self.register_buffer("scales", scales.detach().to(torch.float32).reshape(-1).clone())

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        lookup = torch.ops.quantized_decomposed.embedding_byte.default
        if _tracing(indices):
            rows: torch.Tensor = lookup(self.weight, self.scales, None, -128, 127, indices)
            return rows
        # Eager: the op's Python reference dequantizes the whole table at each call (1.1 GB of
        # temporaries for a 151,936-row table); the same op on the rows read gives the same values.
        flat = indices.reshape(-1)
        picked = torch.arange(flat.numel(), dtype=indices.dtype).reshape(indices.shape)
        rows = lookup(self.weight.index_select(0, flat), self.scales.index_select(0, flat), None, -128, 127, picked)
        return rows


# Rows quantized (or dequantized) at a time: the fp32 temporaries of a 151,936-row LM head or
# table would otherwise be several times its 545 MB (Qwen2.5-0.5B's) at once. Above glibc's
# largest mmap threshold (32 MiB), so that each temporary is a map of its own, returned when freed:
# smaller ones come from the heap, which kept them all (+590 MB over a 0.5B head's call).
_CHUNK_BYTES = 64 << 20


def _row_chunks(rows: int, row_bytes: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    step = max(1, (chunk_bytes or _CHUNK_BYTES) // max(1, row_bytes))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _byte_rows(table: torch.Tensor, chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 ``table``'s int8 rows and fp32 scale per row (each row's largest magnitude
    becomes 127), computed a bounded number of rows at a time."""
    rows, width = table.shape
    quantized = torch.empty((rows, width), dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    for start, end in _row_chunks(rows, width * 4, chunk_bytes):
        part = table[start:end].float()
        scale = part.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        quantized[start:end] = torch.round(part / scale[:, None]).clamp(-127, 127).to(torch.int8)
        scales[start:end] = scale
    return quantized, scales


def _quantize_linear(
    linear: nn.Linear, bits: int, group_size: int | None, pages: FilePages, chunk_bytes: int | None = None
) -> None:
    """Replace ``linear``'s weight by torchao's ``IntxUnpackedToInt8Tensor`` exactly as
    ``quantize_(linear, Int8DynamicActivationIntxWeightConfig(...))`` makes it (symmetric
    ``bits``-bit weights in groups of ``group_size`` along the input, or one scale per output
    channel; 8-bit asymmetric activations per token), a bounded number of output rows at a time
    (a row's groups never span rows), then give the fp32 weight's file pages back (``pages``)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_primitives import MappingType

    weight = linear.weight.detach()
    rows, width = weight.shape
    block = (1, group_size or width)
    target = torch.int4 if bits == 4 else torch.int8  # type: ignore[attr-defined]  # in torch, missing from its stubs
    qdata = torch.empty((rows, width), dtype=torch.int8)
    scale = torch.empty((rows, width // block[1]), dtype=weight.dtype)
    zero_point = torch.empty((rows, width // block[1]), dtype=torch.int8)
    for start, end in _row_chunks(rows, width * weight.element_size(), chunk_bytes):
        part: Any = IntxUnpackedToInt8Tensor.from_hp(
            weight[start:end],
            block,
            target,
            mapping_type=MappingType.SYMMETRIC,
            activation_quantization="int8_asym_per_token",
        )
        qdata[start:end] = part.qdata
        scale[start:end] = part.scale
        zero_point[start:end] = part.zero_point
    quantized = IntxUnpackedToInt8Tensor(qdata, scale, zero_point, target, block, weight.dtype, "int8_asym_per_token")
    linear.weight = nn.Parameter(quantized, requires_grad=False)
    pages.release(weight)
    if rows * width * 4 > 2 * (chunk_bytes or _CHUNK_BYTES):
        # Eager would dequantize the whole weight at each call (an LM head: 545 MB at 0.5B).
        linear.__class__ = RowChunkedLinear
        cast("RowChunkedLinear", linear).chunk_bytes = chunk_bytes or _CHUNK_BYTES


def _tracing(value: torch.Tensor) -> bool:
    """Whether torch is tracing the call (``torch.export``, ``torch.compile``, a fake tensor):
    then a module computes as its graph must hold it, not as eager's memory wants."""
    from torch._subclasses.fake_tensor import FakeTensor

    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or isinstance(value, FakeTensor)


class RowChunkedLinear(nn.Linear):
    """A linear layer with a torchao quantized weight whose eager calls compute a bounded number
    of output rows at a time.

    torchao's eager linear dequantizes the whole weight to fp32 at each call: for an LM head of
    151,936 rows that is 545 MB of temporaries per call (Qwen2.5-0.5B), on top of the model,
    whenever eager runs it (checking the state it carries before export, eager's steps in
    ``writeback run``). Each output row depends only on its own weight row, so the rows are
    computed in slices of the same quantized weight and joined. While torch traces it
    (``torch.export``, ``torch.compile``) it is the plain linear layer, so the program is the
    one torchao's layer exports."""

    chunk_bytes: int = _CHUNK_BYTES

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own name
        from torchao.quantization import IntxUnpackedToInt8Tensor

        weight: Any = self.weight
        if _tracing(input) or not isinstance(weight, IntxUnpackedToInt8Tensor):
            return super().forward(input)
        rows, width = weight.shape
        parts = []
        for start, end in _row_chunks(rows, width * 4, self.chunk_bytes):
            part = IntxUnpackedToInt8Tensor(
                weight.qdata[start:end],
                weight.scale[start:end],
                weight.zero_point[start:end],
                weight.target_dtype,
                weight.block_size,
                weight.dtype,
                weight.activation_quantization,
            )
            bias = None if self.bias is None else self.bias[start:end]
            parts.append(torch.nn.functional.linear(input, part, bias))
        return torch.cat(parts, dim=-1)


def _tied_heads(module: nn.Module, linears: list[nn.Linear]) -> dict[int, nn.Linear]:
    """The linear layers whose weight is an ``nn.Embedding``'s (tied LM heads), keyed by the id
    of that shared parameter."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {id(m.weight): m for m in linears if id(m.weight) in tables}


def _quantize_embeddings(module: nn.Module, heads: dict[int, nn.Linear], pages: FilePages) -> None:
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
                pages.release(child.weight)
                continue
            quantized: Any = head.weight  # torchao's IntxUnpackedToInt8Tensor
            if bool(quantized.zero_point.ne(0).any()):  # symmetric: all zero
                raise QuantizationError(
                    f"the LM head tied to embedding {child_name!r} has non-zero zero points, which "
                    "quantized_decomposed::embedding_byte's table (symmetric, one scale per row) cannot share"
                )
            setattr(parent, child_name, ByteEmbedding(quantized.qdata, quantized.scale))
            pages.release(child.weight)
