"""Quantizing a slice of rows at a time (the memory of issue 54's 0.5B export): the weights are
torchao's own, bit for bit; eager's LM head and 8-bit lookup computed a slice at a time answer as
the whole-table computation; a traced module is the plain one, so the program is unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxUnpackedToInt8Tensor, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup
from writeback_core.memory import FilePages
from writeback_decoders.quantize import ByteEmbedding, RowChunkedLinear, _byte_rows, _quantize_linear

# 11 rows of 64 fp32 inputs a slice: 100 rows make 10 slices, the last one short.
SLICE = 11 * 64 * 4


def _linear(rows: int = 100, width: int = 64, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(width, rows, bias=bias).requires_grad_(False)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, None)])
def test_a_linear_quantized_a_slice_at_a_time_is_torchaos_whole_quantization_bit_for_bit(
    bits: int, group_size: int | None
) -> None:
    ours, theirs = _linear(), _linear()
    _quantize_linear(ours, bits, group_size, FilePages(), chunk_bytes=SLICE)
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if bits == 4 else torch.int8,  # type: ignore[attr-defined]
        weight_granularity=PerGroup(group_size) if group_size else PerAxis(0),
    )
    quantize_(theirs, config)
    mine, reference = ours.weight, theirs.weight
    assert isinstance(mine, IntxUnpackedToInt8Tensor) and isinstance(reference, IntxUnpackedToInt8Tensor)
    for name in ("qdata", "scale", "zero_point"):
        assert torch.equal(getattr(mine, name), getattr(reference, name)), name
    for name in ("target_dtype", "block_size", "dtype", "activation_quantization"):
        assert getattr(mine, name) == getattr(reference, name), name
    x = torch.randn(3, 64)
    # Sliced in eager (100 rows span more than two slices): the same sums, BLAS blocks them apart.
    assert torch.allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_an_lm_head_larger_than_two_slices_answers_in_eager_as_torchaos_layer_does() -> None:
    ours, theirs = _linear(), _linear()
    _quantize_linear(ours, 8, None, FilePages(), chunk_bytes=SLICE)
    quantize_(theirs, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
    assert type(ours) is RowChunkedLinear and type(theirs) is nn.Linear
    x = torch.randn(1, 5, 64)
    # Each output row is its own dot product over the same inputs.
    assert torch.allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    assert ours(x).shape == (1, 5, 100)


def test_an_lm_head_sliced_in_eager_exports_as_the_plain_quantized_linear() -> None:
    ours, theirs = _linear(bias=False), _linear(bias=False)
    _quantize_linear(ours, 8, None, FilePages(), chunk_bytes=SLICE)
    quantize_(theirs, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
    x = (torch.randn(1, 64),)
    targets = [
        [str(node.target) for node in torch.export.export(module, x).graph.nodes if node.op == "call_function"]
        for module in (ours, theirs)
    ]
    assert targets[0] == targets[1]
    assert "aten.cat.default" not in targets[0]


def test_a_small_linear_stays_a_plain_linear() -> None:
    small = _linear()
    _quantize_linear(small, 8, None, FilePages())  # 25 KiB of fp32: one slice
    assert type(small) is nn.Linear


def test_a_table_quantized_a_slice_at_a_time_equals_the_whole_tables_rows_and_scales() -> None:
    torch.manual_seed(1)
    table = torch.randn(100, 64)
    rows, scales = _byte_rows(table, chunk_bytes=SLICE)
    whole, whole_scales = _byte_rows(table, chunk_bytes=1 << 30)
    assert torch.equal(rows, whole) and torch.equal(scales, whole_scales)
    # Worked out directly: each row's largest magnitude is 127 steps.
    expected = table.abs().amax(dim=1) / 127
    assert torch.equal(scales, expected)
    assert torch.equal(rows.abs().amax(dim=1), torch.full((100,), 127, dtype=torch.int8))


def test_the_eager_byte_lookup_equals_the_ops_lookup_over_the_whole_table() -> None:
    torch.manual_seed(2)
    embedding = ByteEmbedding(torch.randn(50, 16))
    indices = torch.tensor([[0, 49, 7, 7], [3, 0, 12, 48]])
    whole = torch.ops.quantized_decomposed.embedding_byte.default(
        embedding.weight, embedding.scales, None, -128, 127, indices
    )
    assert torch.equal(embedding(indices), whole)
    assert embedding(indices).shape == (2, 4, 16)


def test_an_eager_byte_lookup_out_of_range_raises_and_changes_nothing() -> None:
    embedding = ByteEmbedding(torch.randn(50, 16))
    before = (embedding.weight.clone(), embedding.scales.clone())
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([[1, 50]]))
    assert torch.equal(embedding.weight, before[0]) and torch.equal(embedding.scales, before[1])


def test_the_traced_byte_lookup_reads_the_whole_table_with_embedding_byte() -> None:
    embedding = ByteEmbedding(torch.randn(50, 16))
    program = torch.export.export(embedding, (torch.tensor([[1, 2]]),))
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets == ["quantized_decomposed.embedding_byte.default"]
