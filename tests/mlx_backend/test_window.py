"""Attention windows on the MLX delegate's compiled path: a softmax whose mask, built from
the position input, sets later columns to -inf is computed over the first L columns only,
L the smallest traced length at or above the mask's extent. Real export and lowering,
real pybind-runtime, real MLX; every value compared with eager PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from writeback.session import Eager, Session, assemble, compare, lower_case
from writeback.zoo import DecoderConfig, TinyDecoder
from writeback_core.registry import load_registry
from writeback_decoders.et_llama import ETLlamaConfig, et_llama_case
from writeback_mlx_backend import MLXDelegate
from writeback_mlx_backend.window import lengths

from tests.mlx_backend.lowering import lower_mlx

ATOL = RTOL = 1e-4


def test_traced_lengths_grow_by_at_most_half_and_stay_below_the_axis() -> None:
    assert lengths(100) == [32, 48, 64, 96]
    assert lengths(32) == []
    assert lengths(200) == [32, 48, 64, 96, 128, 192]


def _expected_length(position: int, size: int) -> int:
    """Worked out by hand: a causal mask lets columns 0..position through, so the extent is
    position + 1, rounded up to a traced length, or the whole axis when none is that long."""
    return next((n for n in lengths(size) if n >= position + 1), size)


# The same windows on ExecuTorch's Llama (below) run in the fast tier.
@pytest.mark.slow
def test_decoder_attends_over_the_filled_positions_and_matches_eager_at_every_position() -> None:
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=100, layers=2, hidden=128)
    mine, eager = TinyDecoder(cfg, seed=3), TinyDecoder(cfg, seed=3)
    lowered = lower_mlx(mine, (torch.tensor([[1]]), torch.tensor([0])))
    assert lowered.only_delegate_runs()
    method, delegate = lowered.method(), lowered.delegate()
    (path,) = delegate.execution_paths
    assert path.startswith("compiled; attention over 2 masked softmax(es) bounded by input_pos"), path
    for position in range(cfg.max_seq):
        tokens, pos = torch.tensor([[(5 * position + 2) % 32]]), torch.tensor([position])
        (logits,) = method.execute([tokens, pos])
        with torch.no_grad():
            expected = eager(tokens, pos)
        torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL, msg=f"position {position}")
        assert delegate.attention_lengths[-1] == _expected_length(position, cfg.max_seq), position


def test_et_llama_attends_over_the_filled_positions_and_matches_eager_at_every_position() -> None:
    cfg = ETLlamaConfig(max_seq=72)
    case = et_llama_case(config=cfg)
    registry = load_registry()
    pipeline = assemble(registry, "mlx")
    lowered = lower_case(case, pipeline)
    delegate = pipeline.delegates["WritebackMLXBackend"]
    assert isinstance(delegate, MLXDelegate)
    session = Session.open(pipeline, lowered)
    path = delegate.execution_paths[-1]
    # One softmax per layer, each with the example's mask row picked by input_pos.
    expected = f"compiled; attention over {cfg.layers} masked softmax(es) bounded by attn_options_input_pos"
    assert path.startswith(expected), path
    eager = Eager(case)
    for step in range(cfg.max_seq):
        result = session.step(step)
        check = compare(result, eager.step(step), session.state, eager.state)
        assert check.ok, (step, check.problems)
        assert delegate.attention_lengths[-1] == _expected_length(step, cfg.max_seq), step


class MaskedAttention(nn.Module):
    """One head of attention over a cache, with the mask a test picks (columns the mask
    allows: ``lo(pos) <= j <= hi(pos)``; the rest get ``fill``)."""

    def __init__(self, size: int = 80, width: int = 8, fill: float = float("-inf"), ahead: int = 0) -> None:
        super().__init__()
        self.fill, self.ahead = fill, ahead
        self.register_buffer("k", torch.zeros(1, size, width))
        self.register_buffer("v", torch.zeros(1, size, width))
        self.register_buffer("slots", torch.arange(size))
        self.window: int | None = None

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(1, pos, x)
        self.v.index_copy_(1, pos, 2 * x + 1)
        allowed = self.slots <= pos + self.ahead
        if self.window is not None:
            allowed = allowed & (self.slots > pos - self.window)
        mask = torch.where(allowed, 0.0, self.fill)
        scores = (x @ self.k.transpose(1, 2)) / 3.0 + mask
        return torch.softmax(scores, dim=-1) @ self.v


def _run(module: MaskedAttention, positions: list[int]) -> tuple[MLXDelegate, list[int]]:
    eager = MaskedAttention(module.k.shape[1], module.k.shape[2], module.fill, module.ahead)
    eager.window = module.window
    lowered = lower_mlx(module, (torch.ones(1, 1, 8), torch.tensor([0])))
    assert lowered.only_delegate_runs()
    method, delegate = lowered.method(), lowered.delegate()
    seen = []
    for position in positions:
        x, pos = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(position)), torch.tensor([position])
        (out,) = method.execute([x, pos])
        with torch.no_grad():
            expected = eager(x, pos)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL, msg=f"position {position}")
        seen.append(delegate.attention_lengths[-1] if delegate.attention_lengths else -1)
    return delegate, seen


def test_a_mask_that_lets_later_columns_through_extends_the_window_and_matches_eager() -> None:
    delegate, seen = _run(MaskedAttention(ahead=5), [0, 1, 26, 27, 30, 42, 43, 59, 60, 79])
    assert delegate.execution_paths[-1].startswith("compiled; attention over 1"), delegate.execution_paths[-1]
    # Columns up to pos + 5 count: extent pos + 6, rounded up (lengths(80) = 32, 48, 64).
    assert seen == [32, 32, 32, 48, 48, 48, 64, 80, 80, 80]


def test_a_sliding_window_mask_is_bounded_by_its_last_allowed_column_and_matches_eager() -> None:
    module = MaskedAttention()
    module.window = 4
    _, seen = _run(module, [0, 3, 31, 32, 50, 70])
    assert seen == [32, 32, 32, 48, 64, 80]


def test_a_finite_mask_value_keeps_the_whole_axis_and_matches_eager() -> None:
    # finfo.min is not -inf: its columns weigh exp(min - max), which is not proved zero.
    delegate, seen = _run(MaskedAttention(fill=torch.finfo(torch.float32).min), [0, 5, 40])
    assert delegate.execution_paths[-1] == (
        "compiled; attention over the whole axis: the masks let every position through at every position value"
    )
    assert seen == [-1, -1, -1]


class ScoresOut(MaskedAttention):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        self.k.index_copy_(1, pos, x)
        mask = torch.where(self.slots <= pos, 0.0, float("-inf"))
        scores = x @ self.k.transpose(1, 2) + mask
        return torch.softmax(scores, dim=-1), scores


def test_scores_returned_as_an_output_keep_the_whole_axis_and_say_why() -> None:
    module, eager = ScoresOut(), ScoresOut()
    lowered = lower_mlx(module, (torch.ones(1, 1, 8), torch.tensor([0])))
    method, delegate = lowered.method(), lowered.delegate()
    assert "leaves the step over the bounded axis" in delegate.execution_paths[-1], delegate.execution_paths[-1]
    x, pos = torch.randn(1, 1, 8), torch.tensor([3])
    weights, scores = method.execute([x, pos])
    with torch.no_grad():
        expected = eager(x, pos)
    torch.testing.assert_close(weights, expected[0])
    torch.testing.assert_close(scores, expected[1])


def test_position_out_of_range_on_a_bounded_program_raises_and_changes_nothing() -> None:
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=100, layers=1, hidden=128)
    mine, eager = TinyDecoder(cfg, seed=3), TinyDecoder(cfg, seed=3)
    lowered = lower_mlx(mine, (torch.tensor([[1]]), torch.tensor([0])))
    method, delegate = lowered.method(), lowered.delegate()
    method.execute([torch.tensor([[4]]), torch.tensor([0])])
    with torch.no_grad():
        eager(torch.tensor([[4]]), torch.tensor([0]))
    calls = len(delegate.attention_lengths)
    with pytest.raises(Exception, match="100"):
        method.execute([torch.tensor([[4]]), torch.tensor([100])])
    assert len(delegate.attention_lengths) == calls
    # The state is unchanged: the next step goes on from position 0's cache.
    (logits,) = method.execute([torch.tensor([[7]]), torch.tensor([1])])
    with torch.no_grad():
        expected = eager(torch.tensor([[7]]), torch.tensor([1]))
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL)


class ShiftedWeights(MaskedAttention):
    """Adds 0.1 to the weights after the softmax: the masked columns then weigh 0.1 each."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(1, pos, x)
        self.v.index_copy_(1, pos, 2 * x + 1)
        mask = torch.where(self.slots <= pos, 0.0, float("-inf"))
        weights = torch.softmax(x @ self.k.transpose(1, 2) + mask, dim=-1) + 0.1
        return weights @ self.v


def test_masked_columns_that_weigh_something_after_the_softmax_keep_the_whole_axis_and_match_eager() -> None:
    module, eager = ShiftedWeights(), ShiftedWeights()
    lowered = lower_mlx(module, (torch.ones(1, 1, 8), torch.tensor([0])))
    method, delegate = lowered.method(), lowered.delegate()
    assert "contracts columns not proved zero" in delegate.execution_paths[-1], delegate.execution_paths[-1]
    for position in (0, 4, 9):
        x, pos = torch.randn(1, 1, 8), torch.tensor([position])
        (out,) = method.execute([x, pos])
        with torch.no_grad():
            expected = eager(x, pos)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
