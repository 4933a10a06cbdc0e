"""Every refusal of :func:`writeback_mlx_backend.plugin.in_place_refusal` made to fire by a real program.

Each program is exported and lowered for real; the refusal is read where a user reads it
(``writeback explain``'s "mlx" column, through the registry's hook), core's decision is read
from the lowering, and the lowered program is run against eager PyTorch for a few calls: a
refused state is copied back whole, so no call is wrong. (The 0-d state and the buffer also
returned fire in ``test_in_place.py`` and ``test_explain_agrees.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from writeback_core import find_mutations

from tests.mlx_backend.lowering import export_module, lower_mlx, registry


class ScatterInput(torch.nn.Module):
    """``scatter_`` has no MLX handler: the write op stays outside every partition."""

    def forward(self, idx: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        a.scatter_(0, idx, x)
        return a.sum(0)


class Float64Input(torch.nn.Module):
    """A float64 state written by a float32 ``index_copy`` in MLX, cast back by ``copy_``
    outside it (MLX has no float64): the write runs in the delegate, its new value does not."""

    def forward(self, idx: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c.copy_(c.float().index_copy(0, idx, x))
        return x.sum(0)


class ChainedWrites(torch.nn.Module):
    """A slice write, then an ``index_copy`` into its result: one write of no form the delegate models."""

    def forward(self, idx: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        a[1:2] = 5.0
        a.index_copy_(0, idx, x)
        return a.sum(0)


class ReplacedUnread(torch.nn.Module):
    """A buffer read by an op outside MLX (``scatter``) and replaced whole inside it: the
    partition replacing it never reads it, so it is never handed the buffer."""

    c: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.zeros(3, 2))

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        old = self.c.scatter(0, idx, x)
        self.c.copy_(x.expand(3, 2) * 2.0)
        return old.sum(0)


def _index_and_row(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([step % 3]), torch.full((1, 2), step + 1.0)


def scatter_inputs(step: int) -> tuple[torch.Tensor, ...]:
    return torch.tensor([[step % 3, (step + 1) % 3]]), torch.full((1, 2), step + 1.0)


# name -> (module, per-call inputs, state tensors passed after them, refusal as explain states it)
_Case = tuple[
    Callable[[], torch.nn.Module], Callable[[int], tuple[torch.Tensor, ...]], Callable[[], tuple[Any, ...]], str
]
CASES: dict[str, _Case] = {
    "write_outside": (
        ScatterInput,
        scatter_inputs,
        lambda: (torch.zeros(3, 2),),
        "the write runs outside the MLX delegate",
    ),
    "value_outside": (
        Float64Input,
        _index_and_row,
        lambda: (torch.zeros(3, 2, dtype=torch.float64),),
        "its new value is produced outside this MLX partition",
    ),
    "unmodelled_write": (
        ChainedWrites,
        _index_and_row,
        lambda: (torch.zeros(3, 2),),
        "its write, a partial write of a form writeback does not recognise (other (aten.index_put.default)), "
        "is not one the delegate does in place",
    ),
    "full_write_unread": (
        ReplacedUnread,
        scatter_inputs,
        lambda: (),
        "the partition replacing it does not read it, so it is not passed the state",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refusal_fires_and_the_state_is_copied_back_not_wrong(name: str) -> None:
    build, inputs, state, refusal = CASES[name]
    args = (*inputs(0), *state())
    program = export_module(build(), args)
    (mutation,) = find_mutations(program.run_decompositions())

    columns = registry().hook.writeback_explain_columns(program=program, mutation=mutation)
    (column,) = (c["mlx"] for c in columns if "mlx" in c)
    assert column.startswith("copied back, ") and column.endswith(f": {refusal}")

    lowered = lower_mlx(build(), args)
    # No MLX acceptance recorded (a write no partition touches is not asked about at all).
    assert not any(d.accepted for d in lowered.decisions)
    method = lowered.method()
    eager, ours = build(), state()
    expected_state = tuple(t.clone() for t in ours)
    for step in range(3):
        step_inputs = inputs(step)
        out = method.execute([*step_inputs, *ours])
        with torch.no_grad():
            expected = eager(*step_inputs, *expected_state)
        torch.testing.assert_close(out[-1], expected)
        for got, want in zip(ours, expected_state, strict=True):
            torch.testing.assert_close(got, want)
