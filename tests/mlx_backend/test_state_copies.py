"""Whole-state copies left on MLX: a state owned by the caller (a user input the model
mutates) is written in place as the same state is when it is a module buffer.

Three states replaced whole each call: a rolling buffer (``state.copy_(cat([state[:, :, 1:],
x], -1))``) whose new value a convolution outside the delegate also reads, a GRU state, and
running statistics (mean and variance, updated with ``mul_`` then ``add_``). Each is lowered
as buffers and as caller-owned inputs; the whole-state ``copy_`` write-backs left in the
final program are counted (none, worked out by hand: every write is the delegate's), and
each step's outputs and states are compared with eager PyTorch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from writeback_mlx_backend import empty

from tests.mlx_backend.lowering import lower_mlx

C, K = 3, 4  # channels; the rolling buffer keeps the last K - 1 inputs
STEPS = 6


class Rolling(nn.Module):
    """A causal convolution over a rolling buffer of the last ``K - 1`` inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(C, C, K - 1)

    def step(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        new = torch.cat([window[:, :, 1:], x.unsqueeze(-1)], -1)
        window.copy_(new)
        out: torch.Tensor = self.conv(new).squeeze(-1)  # aten.convolution: outside the MLX delegate
        return out


class Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.cell = nn.GRUCell(C, C)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.copy_(self.cell(x, h))
        return h * 2


class Stats(nn.Module):
    """Running mean and variance, normalizing the input with them."""

    def step(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        m = x.mean(0)
        var.mul_(0.9).add_(((x - m) ** 2).mean(0) * 0.1)
        mean.mul_(0.9).add_(m * 0.1)
        return (x - mean) * torch.rsqrt(var + 1e-5)


KINDS: dict[str, tuple[type[nn.Module], list[tuple[int, ...]]]] = {
    "rolling_buffer": (Rolling, [(1, C, K - 1)]),
    "gru_state": (Gru, [(1, C)]),
    "running_statistics": (Stats, [(C,), (C,)]),
}


def _initial(kind: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.rand(shape, generator=generator) + 0.5 for shape in KINDS[kind][1]]


class AsBuffers(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = KINDS[kind][0]()
        self.names = []
        for index, value in enumerate(_initial(kind)):
            self.register_buffer(f"s{index}", value.clone())
            self.names.append(f"s{index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.step(x, *[getattr(self, n) for n in self.names])  # type: ignore[operator]  # a step of one of KINDS
        return out


class AsCaller(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = KINDS[kind][0]()

    def forward(self, x: torch.Tensor, *states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.step(x, *states)  # type: ignore[operator]  # a step of one of KINDS
        return out


def _input(step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, C).reshape(1, C) * (step + 1) + step


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_buffer_owned_state_leaves_no_whole_copy_and_matches_eager_every_step(kind: str) -> None:
    lowered = lower_mlx(AsBuffers(kind), (_input(0),))
    assert lowered.write_backs() == []
    method = lowered.method()
    eager = AsBuffers(kind)
    for step in range(STEPS):
        (out,) = method.execute([_input(step)])
        with torch.no_grad():
            expected = eager(_input(step))
        torch.testing.assert_close(out, expected, msg=f"{kind}, step {step}")


@pytest.mark.parametrize("allocate", ["torch", "mlx"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_caller_owned_state_is_written_in_place_no_whole_copy_and_matches_eager_every_step(
    kind: str, allocate: str
) -> None:
    lowered = lower_mlx(AsCaller(kind), (_input(0), *_initial(kind)))
    assert lowered.write_backs() == []  # as many whole copies as the buffer form: none
    method = lowered.method()
    states: list[Any] = _initial(kind)
    if allocate == "mlx":
        allocated = [empty(s.shape, s.dtype) for s in states]
        for mine, value in zip(allocated, states, strict=True):
            mine.copy_(value)
        states = allocated
    expected_states = _initial(kind)
    eager = AsCaller(kind)
    for step in range(STEPS):
        *_, out = method.execute([_input(step), *states])
        with torch.no_grad():
            expected = eager(_input(step), *expected_states)
        torch.testing.assert_close(out, expected, msg=f"{kind}, step {step}")
        for index, (state, want) in enumerate(zip(states, expected_states, strict=True)):
            torch.testing.assert_close(state, want, msg=f"{kind} state {index}, step {step}")


class ZeroDim(nn.Module):
    """A caller's 0-d total, replaced whole each call from the input and itself."""

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.copy_(total * 0.5 + x.sum())
        return x * total


def test_a_zero_dimensional_caller_state_is_copied_back_and_matches_eager_every_step() -> None:
    """0-d state has no region to write: the delegate declines it, the copy stays."""
    lowered = lower_mlx(ZeroDim(), (_input(0), torch.tensor(1.0)))
    (decision,) = lowered.decisions
    assert not decision.accepted and decision.declined_by == ("mlx-backend",)
    assert lowered.write_backs() == [decision.placeholder]
    method = lowered.method()
    total, expected_total = torch.tensor(1.0), torch.tensor(1.0)
    for step in range(STEPS):
        # The new total comes first (the program returns a mutated input), then the output.
        _, out = method.execute([_input(step), total])
        with torch.no_grad():
            expected = ZeroDim()(_input(step), expected_total)
        torch.testing.assert_close(out, expected, msg=f"step {step}")
        torch.testing.assert_close(total, expected_total, msg=f"step {step}: the caller's total")
