"""The other built-in models (recurrent state, running statistic, no inputs) lowered whole to
MLX with delegate-owned state, run through the pybind-runtime, equal to eager."""

from __future__ import annotations

import pytest
import torch
from writeback.zoo import builtin_models

from tests.mlx_backend.lowering import lower_mlx


@pytest.mark.parametrize("name", ["recurrent", "ema", "no-input"])
def test_builtin_model_lowered_to_mlx_matches_eager(name: str) -> None:
    case = builtin_models()[name]
    lowered = lower_mlx(case.build(), case.example_args(0))
    assert lowered.only_delegate_runs(), lowered.graph_targets()
    assert lowered.write_backs() == []
    method = lowered.method()
    model = case.build().eval()
    for step in range(4):
        inputs = case.step_inputs(step)
        outputs = method.execute(list(inputs))
        with torch.no_grad():
            expected = model(*inputs)
        torch.testing.assert_close(outputs[-1], expected, rtol=1e-5, atol=1e-6)
