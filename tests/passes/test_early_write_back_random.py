"""Random stateful programs (reads, views, full/partial/in-place writes, one state copied into
another, large temporaries) lowered with the early pass run like eager in the runtime.

Seeded, not hypothesis-driven: each example costs a full lowering, so a fixed
set of seeds keeps the suite short while covering mixes the named hazard tests
do not.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from .hazard_models import seeded
from .lowering import assert_runs_like_eager, lower

_STATES = 3
_SIZE = 16


def _program(seed: int) -> list[tuple[str, int, int, float]]:
    """Steps ``(kind, state, other state, constant)`` for :class:`_Random`."""
    rng = random.Random(seed)
    kinds = ["prepare", "read", "read_view", "write_full", "write_add", "write_slice", "copy_state", "temporaries"]
    steps = []
    for _ in range(rng.randint(6, 12)):
        steps.append((rng.choice(kinds), rng.randrange(_STATES), rng.randrange(_STATES), rng.choice([0.5, 2.0, -1.0])))
    return steps


class _Random(nn.Module):
    def __init__(self, steps: list[tuple[str, int, int, float]]) -> None:
        super().__init__()
        self.steps = steps
        for i in range(_STATES):
            self.register_buffer(f"s{i}", torch.zeros(_SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x * 1.0
        prepared = []  # new values computed before the reads that precede their write
        for kind, i, j, c in self.steps:
            state = self.get_buffer(f"s{i}")
            if kind == "prepare":
                prepared.append(x * c + j)
            elif kind == "read":
                acc = acc + state * c
            elif kind == "read_view":
                acc = acc + state.view(4, 4).reshape(_SIZE) * c
            elif kind == "write_full":
                state.copy_(prepared.pop(0) if prepared else x * c + acc * 0.25)
            elif kind == "write_add":
                state.add_(x * c)
            elif kind == "write_slice":
                state[2:6] = x[0:4] * c
            elif kind == "copy_state" and i != j:
                state.copy_(self.get_buffer(f"s{j}").view(4, 4).view(_SIZE))
            elif kind == "temporaries":
                acc = torch.tanh(acc @ torch.ones(_SIZE, _SIZE) / _SIZE) + acc
        return acc


@pytest.mark.parametrize("seed", range(12))
def test_random_stateful_program_runs_like_eager(seed: int) -> None:
    steps = _program(seed)
    program = lower(_Random(steps), (seeded(seed, _SIZE),))
    assert_runs_like_eager(program, _Random(steps), lambda call: (seeded(1000 * seed + call, _SIZE),), calls=3)
