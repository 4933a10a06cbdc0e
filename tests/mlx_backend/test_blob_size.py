"""The MLX blob carries no zero-filled initial state: a decoder's ``.pte`` lowered to MLX is
no larger than stock ExecuTorch's (``to_edge(...).to_executorch()``, no delegate) of the
same exported program, and a buffer that starts non-zero still starts with its values.

Before, the blob held every delegate-owned cache's zeros: the ET Llama example at a 32 MiB
cache gave a 61 MiB ``.pte`` against stock's 29 MiB.
"""

from __future__ import annotations

import pytest
import torch
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
import writeback_pybind_runtime.plugin as runtime_plugin
from executorch.exir import to_edge
from writeback.model_build import export_case
from writeback.session import Eager, Session, assemble, compare
from writeback.zoo import DecoderConfig, decoder_case
from writeback_core import lowering
from writeback_core.registry import Registry, load_registry
from writeback_core.types import ModelCase
from writeback_decoders import ETLlamaConfig, et_llama_case

# What the writeback .pte may exceed stock's by: the delegate call and its blob header.
SLACK = 2 << 10
STEPS = 4


def _registry() -> Registry:
    return load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])


def _sizes_and_steps(case: ModelCase) -> tuple[int, int]:
    """``(writeback .pte bytes, stock .pte bytes)`` of ``case``; its steps checked against eager."""
    registry = _registry()
    pipeline = assemble(registry, "mlx")
    exported = export_case(case)
    lowered = lowering.lower(exported, registry, pipeline.backend, "state", case)
    stock = len(to_edge(exported).to_executorch().buffer)
    session, eager = Session.open(pipeline, lowered), Eager(case)
    for step in range(STEPS):
        check = compare(session.step(step), eager.step(step), session.state, eager.state)
        assert check.ok, (step, check.problems)
    return len(lowered.pte), stock


@pytest.mark.slow
def test_decoder_with_a_1_mib_delegate_owned_cache_is_no_larger_than_stock() -> None:
    config = DecoderConfig(vocab=64, dim=64, heads=2, max_seq=2048, layers=1, hidden=128)
    cache = 2 * config.layers * 4 * torch.Size(config.cache_shape).numel()
    assert cache == 1 << 20
    mine, stock = _sizes_and_steps(decoder_case(config))
    assert mine <= stock + SLACK, (mine, stock)


class StartsNonZero(torch.nn.Module):
    """A running sum whose buffer starts at ``arange``: the first step reads those values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.arange(64, dtype=torch.float32).reshape(8, 8))

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.total.index_copy_(0, pos, x)
        return self.total.sum(0) * 2.0


def test_non_zero_initial_buffer_comes_back_on_the_first_step() -> None:
    case = ModelCase(
        "starts-non-zero",
        "a buffer that starts at arange",
        StartsNonZero,
        lambda step: (torch.tensor([step + 1]), torch.full((1, 8), -1.0)),
    )
    registry = _registry()
    pipeline = assemble(registry, "mlx")
    lowered = lowering.lower(export_case(case), registry, pipeline.backend, "state", case)
    (first,) = Session.open(pipeline, lowered).step(0).outputs
    # Worked out by hand: column j sums 8 * j + (0 + 8 + ... + 56) = 8j + 224; row 1 (8 + j)
    # becomes -1, so the sum drops by 9 + j; doubled.
    expected = torch.tensor([2.0 * (8 * j + 224 - 9 - j) for j in range(8)])
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(first, Eager(case).step(0)[0])


@pytest.mark.slow
def test_et_llama_example_with_a_1_mib_cache_is_no_larger_than_stock() -> None:
    # writeback-decoders' case of the example: 2 layers x (K + V) x 2 heads x 1024 x 32 x fp32.
    config = ETLlamaConfig(dim=64, layers=2, heads=2, kv_heads=2, head_dim=32, hidden=128, vocab=128, max_seq=1024)
    assert config.cache_nbytes == 1 << 20
    case = et_llama_case(config=config)
    mine, stock = _sizes_and_steps(case)
    assert mine <= stock + SLACK, (mine, stock)
