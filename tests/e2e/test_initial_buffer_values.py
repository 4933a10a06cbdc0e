"""A mutated buffer that starts non-zero keeps its initial value in the ``.pte`` the lowering
path writes (``writeback_core.lowering.backend_config``): the runtimes zero-fill a mutable
buffer that carries no data, so without it the first call would start from zeros."""

from __future__ import annotations

import pytest
import torch
from executorch.runtime import Runtime as StockRuntime
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowering import lower
from writeback_pybind_runtime import Runtime

_START = (1.0, 2.0, 3.0, 4.0)


class RunningTotal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.total: torch.Tensor
        self.register_buffer("total", torch.tensor(_START))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total * 2


def _expected(call: int) -> torch.Tensor:
    """Twice the total after ``call + 1`` additions of ones, worked out by hand."""
    return torch.tensor([2 * (start + call + 1) for start in _START])


@pytest.mark.parametrize("backend", [None, "portable"])
def test_a_buffer_starting_non_zero_starts_there_in_both_runtimes(backend: str | None) -> None:
    registry = load_registry()
    spec = None if backend is None else registry.backends()[backend]
    pte = lower(export_model(RunningTotal(), (torch.ones(4),)), registry, spec).pte
    methods = {
        "writeback": Runtime.get().load_program(pte).load_method("forward"),
        "stock": StockRuntime.get().load_program(pte).load_method("forward"),
    }
    for runtime, method in methods.items():
        for call in range(3):
            (got,) = method.execute([torch.ones(4)])
            torch.testing.assert_close(got, _expected(call), msg=f"{runtime} runtime, call {call}")
