"""``memory_plan_report``: planned bytes from the serialized plan, lifetimes from the planner."""

from __future__ import annotations

import pytest
import torch
import writeback_passes
from writeback_passes import memory_plan_report

from .hazard_models import EarlyReady, seeded
from .lowering import edge_of, lower

_N = 64
_STATE_BYTES = _N * _N * 4  # one [64, 64] fp32 state


def _copy_node_index(program) -> int:  # type: ignore[no-untyped-def]
    nodes = list(program.exported_program().graph.nodes)
    return next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.copy_.default)


@pytest.mark.parametrize("early", [False, True], ids=["stock", "early"])
def test_report_reads_serialized_plan_and_value_lives_until_its_copy(early: bool) -> None:
    program = lower(EarlyReady(_N), (seeded(5, _N, _N),), early=early)
    report = memory_plan_report(program)
    (plan,) = report.methods.values()
    serialized = program.executorch_program.execution_plan[0].non_const_buffer_sizes
    assert plan.method == "forward"
    assert plan.planned_bytes == {i: s for i, s in enumerate(serialized) if i > 0}
    assert report.total_bytes == sum(serialized)
    (wb,) = plan.write_backs
    assert (wb.target, wb.state, wb.nbytes) == ("state", "b_state", _STATE_BYTES)
    assert wb.lifetime is not None
    # The copy is the value's last use, so the planner frees it right there.
    assert wb.lifetime[1] == _copy_node_index(program)
    assert "state: copy at node" in report.format()


def test_early_ready_model_plans_at_least_one_state_less() -> None:
    stock = memory_plan_report(lower(EarlyReady(_N), (seeded(5, _N, _N),), early=False))
    early = memory_plan_report(lower(EarlyReady(_N), (seeded(5, _N, _N),)))
    assert stock.total_bytes - early.total_bytes >= _STATE_BYTES
    (before,) = stock.methods["forward"].write_backs
    (after,) = early.methods["forward"].write_backs
    assert after.live_steps is not None and before.live_steps is not None
    assert after.live_steps < before.live_steps


def test_report_of_an_edge_program_is_refused_naming_the_fix() -> None:
    edge = edge_of(EarlyReady(_N), (seeded(5, _N, _N),))
    with pytest.raises(
        TypeError, match=r"needs the result of to_executorch.*got EdgeProgramManager.*writeback_passes\.to_executorch"
    ):
        writeback_passes.memory_plan_report(edge)  # type: ignore[arg-type]
