"""What the memory plan of a program after ``to_executorch`` costs, and how long written-back values live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx
from torch.export.graph_signature import InputKind
from writeback_core.program_passes import write_back_positions
from writeback_core.units import format_bytes

if TYPE_CHECKING:
    from executorch.exir import ExecutorchProgramManager
    from torch.export import ExportedProgram

__all__ = ["MemoryPlanReport", "MethodPlan", "WriteBackLifetime", "memory_plan_report"]


@dataclass(frozen=True)
class WriteBackLifetime:
    """One write-back of a planned program and the value it copies.

    ``copy_index`` and ``value_index`` count the graph's ``call_function``
    nodes (as ``writeback explain`` does). ``lifetime`` is the memory planner's
    ``[first, last]`` step of the value (``None`` when the value is not planned,
    for example a placeholder); ``nbytes`` its planned size.
    """

    state: str
    target: str
    value: str
    copy_index: int
    value_index: int
    lifetime: tuple[int, int] | None
    nbytes: int

    @property
    def live_steps(self) -> int | None:
        """How many planner steps the value occupies memory, or ``None`` if unplanned."""
        if self.lifetime is None:
            return None
        return self.lifetime[1] - self.lifetime[0] + 1


@dataclass(frozen=True)
class MethodPlan:
    """The plan of one method: bytes per memory id (id 0, reserved by exir, left out)."""

    method: str
    planned_bytes: dict[int, int]
    write_backs: tuple[WriteBackLifetime, ...]

    @property
    def total_bytes(self) -> int:
        """All planned (non-constant) bytes of the method."""
        return sum(self.planned_bytes.values())


@dataclass(frozen=True)
class MemoryPlanReport:
    """:func:`memory_plan_report`'s answer, one :class:`MethodPlan` per method."""

    methods: dict[str, MethodPlan]

    @property
    def total_bytes(self) -> int:
        """Planned bytes summed over methods and memory ids."""
        return sum(m.total_bytes for m in self.methods.values())

    def format(self) -> str:
        """A plain-text summary, one block per method."""
        lines: list[str] = []
        for plan in self.methods.values():
            ids = ", ".join(f"id {k}: {v} B" for k, v in sorted(plan.planned_bytes.items()))
            lines.append(f"{plan.method}: {plan.total_bytes} B planned ({ids or 'nothing'})")
            for wb in plan.write_backs:
                life = "unplanned" if wb.lifetime is None else f"steps {wb.lifetime[0]}..{wb.lifetime[1]}"
                lines.append(
                    f"  {wb.target}: copy at node {wb.copy_index}, value {wb.value} "
                    f"(node {wb.value_index}, {format_bytes(wb.nbytes)}) live {life}"
                )
        return "\n".join(lines)


def _state_targets(program: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> buffer FQN or user input name."""
    found: dict[str, str] = {}
    for spec in program.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind is InputKind.BUFFER and spec.target is not None:
            found[name] = str(spec.target)
        elif spec.kind is InputKind.USER_INPUT:
            found[name] = name
    return found


def _lifetime(spec: Any) -> tuple[int, int] | None:
    lifetime = getattr(spec, "lifetime", None)
    if not lifetime or None in lifetime or getattr(spec, "mem_id", None) is None:
        return None
    return int(lifetime[0]), int(lifetime[1])


def _write_backs(program: ExportedProgram) -> tuple[WriteBackLifetime, ...]:
    graph = program.graph_module.graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    targets = _state_targets(program)
    found = []
    for state, (copy_index, value_index, _count) in write_back_positions(graph).items():
        value = calls[copy_index].args[1]
        spec = value.meta.get("spec") if isinstance(value, torch.fx.Node) else None
        lifetime = _lifetime(spec)
        found.append(
            WriteBackLifetime(
                state=state,
                target=targets.get(state, state),
                value=value.name if isinstance(value, torch.fx.Node) else str(value),
                copy_index=copy_index,
                value_index=value_index,
                lifetime=lifetime,
                nbytes=int(getattr(spec, "allocated_memory", 0) or 0) if lifetime else 0,
            )
        )
    return tuple(sorted(found, key=lambda wb: wb.copy_index))


def memory_plan_report(program: ExecutorchProgramManager) -> MemoryPlanReport:
    """Planned bytes per memory id and the lifetime of each written-back value.

    :param program: the result of ``to_executorch`` (stock or
        :func:`writeback_passes.to_executorch`); its memory plan is read from
        the serialized program, lifetimes from the planner's tensor specs.
    :raises TypeError: ``program`` is not an ``ExecutorchProgramManager``.
    :raises ValueError: a method of ``program`` has no execution plan.
    """
    if not hasattr(program, "executorch_program"):
        raise TypeError(
            f"memory_plan_report needs the result of to_executorch (an "
            f"ExecutorchProgramManager), got {type(program).__name__}; call "
            "writeback_passes.to_executorch(edge_manager) first"
        )
    plans = {plan.name: plan for plan in program.executorch_program.execution_plan}
    methods: dict[str, MethodPlan] = {}
    for method in sorted(program.methods):
        plan = plans.get(method)
        if plan is None:
            raise ValueError(
                f"method {method!r} has no execution plan in the program; was it produced by to_executorch?"
            )
        sizes = {i: int(s) for i, s in enumerate(plan.non_const_buffer_sizes) if i > 0}
        methods[method] = MethodPlan(method, sizes, _write_backs(program.exported_program(method)))
    return MemoryPlanReport(methods)
