"""The ``writeback explain`` column of early write-back: where the copy goes, what it saves."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from writeback_core.quiet import known_warnings_ignored

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from writeback_core import Mutation

    from writeback_passes.memory_report import MemoryPlanReport

__all__ = ["COLUMN", "early_write_back_columns"]

COLUMN = "early write-back"

# explain asks once per mutation row; both lowerings are made once per program.
_PLANS: weakref.WeakKeyDictionary[ExportedProgram, tuple[MemoryPlanReport, MemoryPlanReport]] = (
    weakref.WeakKeyDictionary()
)


def _plans(program: ExportedProgram) -> tuple[MemoryPlanReport, MemoryPlanReport]:
    """(stock, early) memory plans of ``program``, lowered with stock exir otherwise."""
    cached = _PLANS.get(program)
    if cached is not None:
        return cached
    from executorch.exir import ExecutorchBackendConfig, to_edge

    from writeback_passes.memory_report import memory_plan_report
    from writeback_passes.pipeline import as_exir_pass, early_write_back_pass

    with known_warnings_ignored():
        stock = memory_plan_report(to_edge(program).to_executorch())
        config = ExecutorchBackendConfig(passes=[as_exir_pass(early_write_back_pass())])
        early = memory_plan_report(to_edge(program).to_executorch(config))
    _PLANS[program] = (stock, early)
    return stock, early


def early_write_back_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str]:
    """``{"early write-back": ...}`` for one explain row.

    Says at which ``call_function`` node the early pass puts the write-back
    (out of how many, and where its value is ready), and how many memory
    planner steps the value's lifetime shrank compared with stock placement.
    ``"none"`` when the program has no write-back for this mutation (its
    value is written in place).
    """
    stock, early = _plans(program)
    before = {wb.target: wb for plan in stock.methods.values() for wb in plan.write_backs}
    after = {wb.target: wb for plan in early.methods.values() for wb in plan.write_backs}
    placed = after.get(mutation.target)
    if placed is None:
        return {COLUMN: "none"}
    where = f"node {placed.copy_index} (value ready at {placed.value_index})"
    old = before.get(mutation.target)
    if old is None or old.live_steps is None or placed.live_steps is None:
        return {COLUMN: f"{where}; value unplanned"}
    saved = old.live_steps - placed.live_steps
    return {COLUMN: f"{where}; value lives {placed.live_steps} steps, {saved} fewer than stock"}
