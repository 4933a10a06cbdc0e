"""The one lowering module (``writeback_core.lowering``): the function users' scripts import
from writeback-passes is its own, and a lowering does no process housekeeping unless the
caller hands it some (``between_steps``), called once, between partitioning and serializing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import writeback_passes
from executorch.runtime import Runtime
from writeback_core import ProgramPass, Stage, hookimpl, load_registry
from writeback_core.exporting import export_model
from writeback_core.lowering import lower, to_executorch


class _Total(torch.nn.Module):
    """Keeps a running total of its inputs and returns the total plus the input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total + x


def test_writeback_passes_to_executorch_is_the_lowering_modules_own_function() -> None:
    assert writeback_passes.to_executorch is to_executorch


class _Steps:
    """Records when its passes run: ``"exported"`` inside the partition step, ``"edge"`` at the
    start of ``to_executorch``."""

    writeback_name = "steps"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _note(self, what: str) -> Any:
        def run(program: Any) -> None:
            self.seen.append(what)

        return run

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
        if stage in ("exported", "edge"):
            return [ProgramPass(f"note_{stage}", stage, self._note(stage), reason="records the step")]
        return ()


def test_lower_runs_the_callers_housekeeping_once_between_partitioning_and_serializing() -> None:
    steps = _Steps()
    registry = load_registry(entry_points=False, plugins=[steps])
    exported = export_model(_Total(), (torch.ones(3),))
    lowered = lower(exported, registry, None, between_steps=lambda: steps.seen.append("housekeeping"))
    assert steps.seen == ["exported", "housekeeping", "edge"]
    # Without a caller's housekeeping, nothing runs between the steps.
    steps.seen.clear()
    lower(exported, registry, None)
    assert steps.seen == ["exported", "edge"]
    # The program is the model's: after ones then twos the total is 3, plus the input 2: 5 (by hand).
    method = Runtime.get().load_program(lowered.pte).load_method("forward")
    method.execute([torch.ones(3)])
    (out,) = method.execute([torch.full((3,), 2.0)])
    assert out.tolist() == [5.0, 5.0, 5.0]
