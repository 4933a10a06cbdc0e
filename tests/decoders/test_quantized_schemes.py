"""``--quantize 8da4w-e8`` and ``8da8w``: the embedding becomes an 8-bit table read by
ExecuTorch's ``quantized_decomposed::embedding_byte``, the linear layers (the LM head too) run
as XNNPACK's dynamically quantized linears, and each program matches eager PyTorch running the
same quantized model at the scheme's tolerance; the file shrinks by what the shapes say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from writeback.cli import QUANTIZATION_NAMES
from writeback.run import run_model
from writeback.session import assemble
from writeback_core.registry import load_registry
from writeback_decoders import hf_case, hf_config
from writeback_decoders.quantize import QUANTIZATIONS, ByteEmbedding, quantize

STEPS = 3


def test_the_cli_offers_exactly_the_decoders_schemes() -> None:
    assert QUANTIZATION_NAMES == tuple(QUANTIZATIONS)


def test_a_byte_embedding_row_is_the_fp32_row_within_half_a_step_of_its_own_scale() -> None:
    table = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    table[3] = 0.0  # an all-zero row: no division by zero, looked up as zeros
    embedding = ByteEmbedding(table)
    assert embedding.weight.dtype == torch.int8 and embedding.weight.shape == (10, 8)
    assert embedding.scales.shape == (10,)
    # One scale per row: the row's largest magnitude maps to 127.
    assert torch.allclose(embedding.scales[0], table[0].abs().max() / 127)
    rows = embedding(torch.tensor([[0, 3, 9]]))
    assert rows.shape == (1, 3, 8) and torch.equal(rows[0, 1], torch.zeros(8))
    step = (table.abs().amax(dim=1) / 127)[[0, 3, 9]]
    assert ((rows[0] - table[[0, 3, 9]]).abs() <= step[:, None] / 2 + 1e-7).all()


def test_8da8w_quantizes_the_embedding_and_every_linear_with_per_channel_8_bit_weights() -> None:
    model = nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 16))
    tied = nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 16, bias=False))
    tied[1].weight = tied[0].weight
    for module in (model, tied):
        quantize(module, "8da8w")
        assert isinstance(module[0], ByteEmbedding)
        assert type(module[1].weight) is not nn.Parameter  # torchao's quantized tensor
    plain = nn.Sequential(nn.Embedding(4, 32), nn.Linear(32, 8))
    quantize(plain, "8da4w")
    assert isinstance(plain[0], nn.Embedding)  # 8da4w leaves the embedding fp32


def _embedding_saving(vocab: int, hidden: int) -> int:
    """fp32 table minus the int8 table and its fp32 scale per row."""
    return vocab * hidden * 4 - (vocab * hidden + vocab * 4)


def _linear_8bit_saving(module: nn.Module) -> int:
    """fp32 linear weights minus int8 weights and an fp32 scale per output channel."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return sum(3 * m.in_features * m.out_features - 4 * m.out_features for m in linears)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "baseline"), [("8da4w-e8", "8da4w"), ("8da8w", None)])
def test_the_scheme_matches_its_quantized_eager_and_saves_what_the_shapes_say(
    tmp_path: Path, name: str, baseline: str | None
) -> None:
    config = hf_config("llama")
    fp32 = hf_case(config)
    assert fp32.quantized is not None and name in fp32.quantizations
    case = fp32.quantized(name)
    assert case.name == f"hf-llama-{name}" and "embedding 8-bit, one scale per row" in case.description
    assert (case.rtol, case.atol) == (QUANTIZATIONS[name].rtol, QUANTIZATIONS[name].atol)
    pipeline = assemble(load_registry(), "xnnpack")
    report = run_model(pipeline, case, STEPS, tmp_path / "q.pte")
    assert report.checked and report.failures == [], report.failures
    # The lookup runs outside the delegate, on the stock quantized kernel (its name is in the file).
    pte = (tmp_path / "q.pte").read_bytes()
    assert b"quantized_decomposed::embedding_byte" in pte
    # The 8-bit table is stored once, and the fp32 table not at all.
    table = next(m for m in case.build().modules() if isinstance(m, ByteEmbedding))
    assert pte.count(table.weight.numpy().tobytes()) == 1
    fp32_table = next(m for m in fp32.build().modules() if isinstance(m, nn.Embedding)).weight
    assert pte.count(fp32_table.detach().numpy().tobytes()) == 0

    reference_case = fp32 if baseline is None else fp32.quantized(baseline)
    reference = run_model(pipeline, reference_case, 1, tmp_path / "r.pte", check=False)
    saved = reference.lowered.pte_nbytes - report.lowered.pte_nbytes
    expected = _embedding_saving(config.vocab_size, config.hidden_size)
    if baseline is None:
        expected += _linear_8bit_saving(fp32.build())
    # Alignment, the lookup's instruction and XNNPACK's per-layer headers: within 3 %.
    assert abs(saved - expected) <= 0.03 * expected, (saved, expected)
