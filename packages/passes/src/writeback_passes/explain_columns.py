"""The ``writeback explain`` column of early write-back: where the copy goes, what it saves."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from writeback_core.quiet import known_warnings_ignored

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from writeback_core import Mutation

    from writeback_passes.memory_report import MemoryPlanReport

__all__ = ["COLUMN", "KERNEL_COLUMN", "early_write_back_columns", "stock_kernel_columns"]

COLUMN = "early write-back"
KERNEL_COLUMN = "stock kernels"

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
    from writeback_core.program_passes import as_exir_pass, graphs_copy

    from writeback_passes.early_write_back import early_write_back_pass
    from writeback_passes.memory_report import memory_plan_report

    with known_warnings_ignored():
        edge = to_edge(program)
        # to_executorch changes the edge program it lowers: the early lowering gets a copy
        # (the decomposition in to_edge is the costly step, a copy of the graphs is not).
        graphs_only = graphs_copy(edge)
        stock = memory_plan_report(edge.to_executorch())
        del edge
        config = ExecutorchBackendConfig(passes=[as_exir_pass(early_write_back_pass())])
        early = memory_plan_report(graphs_only.to_executorch(config))
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


def _size(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 1024:.1f} KiB"


def stock_kernel_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str]:
    """``{"stock kernels": ...}`` for one explain row: what ``--backend portable`` (and
    ``xnnpack``, for a write outside its delegate) does with this state.

    Decided by :func:`~writeback_passes.state_write_refusals.in_place_kernel_refusal`
    (the rule the backends answer ``writeback_accepts_in_place`` with) over the
    program's shared decomposition (:func:`writeback_core.program_passes.decomposed`); a buffer
    an op declared to write it writes (``Mutation.written_by_op``) is written in place. A
    caller-owned state written in place says where that holds: stock
    ``executorch.runtime`` does not write a mutated input back into the caller's tensor
    (it returns the new value as an output), writeback's runtime does.
    """
    from writeback_core import MutationKind
    from writeback_core.program_passes import decomposed

    from writeback_passes.state_write_plans import IN_PLACE_KERNEL
    from writeback_passes.state_write_refusals import in_place_kernel_refusal

    if mutation.written_by_op is not None:
        # exir runs an op declared to write its argument on that argument: nothing to copy.
        return {KERNEL_COLUMN: f"in place ({mutation.written_by_op}), any runtime"}
    graph = decomposed(program).graph_module.graph
    refusal = in_place_kernel_refusal(graph, mutation.placeholder, mutation.value)
    if refusal is None and mutation.kind is MutationKind.BUFFER and mutation.also_returned(graph):
        refusal = "its new value is also returned, which must live outside the buffer"
    if refusal is not None:
        return {KERNEL_COLUMN: f"copied back, {_size(mutation.nbytes)}/call: {refusal}"}
    if mutation.kind is MutationKind.BUFFER:
        return {KERNEL_COLUMN: f"in place ({IN_PLACE_KERNEL}), any runtime"}
    return {
        KERNEL_COLUMN: (
            f"in place ({IN_PLACE_KERNEL}) in writeback's runtime; stock executorch.runtime "
            "leaves the caller's tensor unwritten (returns the new value)"
        )
    }
