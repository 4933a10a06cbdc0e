"""Which inputs a method of a ``.pte`` may write, read from its execution plan.

This module holds :func:`written_inputs`, which follows the views a plan makes of its inputs'
memory and the arguments each kernel, move and delegate call writes, so that the runtime knows
which of the caller's tensors a call may change without asking ``Method`` (whose
``get_input`` would mark the input as set).
"""

from __future__ import annotations

from writeback_pybind_runtime._pte_format import (
    CHAIN_INSTRUCTIONS,
    DELEGATE_CALL,
    KERNEL_CALL,
    LIST_ITEMS,
    LISTS_OF_TENSORS,
    MOVE_CALL,
    PLAN_CHAINS,
    PLAN_INPUTS,
    PLAN_OPERATORS,
    PLAN_OUTPUTS,
    PLAN_VALUES,
    UNION_TYPE,
    UNION_VALUE,
    Reader,
    find_plan,
)
from writeback_pybind_runtime._pte_operators import VIEW_OPERATORS, written_positions

__all__ = ["written_inputs"]


def written_inputs(data: bytes | memoryview, method: str) -> tuple[bool, ...]:
    """For each input of ``method``, whether the method may write its memory.

    1. A value a view operator (``et_view``) makes from an input's memory is
       that input's memory too (transitively).
    2. A kernel call writes the arguments
       :func:`~writeback_pybind_runtime._pte_operators.written_positions` names; a
       move writes its destination.
    3. A delegate call, or a kernel of an operator torch does not know, may write
       any argument; that counts for an input the method also returns (a mutated
       input is returned: that is how exir and writeback's in-place delegates
       express the mutation), not for one it only reads.

    An input only read, or returned as is and never written, is not written
    (``forward(x): return x, x + 1`` writes nothing; ``cache.add_(x)`` writes
    ``cache`` through ``aten::copy_``).

    :raises ValueError: the data is not a program, or it has no such method.
    """
    reader = Reader(data)
    plan = find_plan(reader, method)
    inputs, outputs = reader.ints(plan, PLAN_INPUTS), reader.ints(plan, PLAN_OUTPUTS)
    operators = [(reader.string(op, 0), reader.string(op, 1)) for op in reader.tables(plan, PLAN_OPERATORS)]
    calls: list[tuple[int, int]] = []
    for chain in reader.tables(plan, PLAN_CHAINS):
        for instruction in reader.tables(chain, CHAIN_INSTRUCTIONS):
            pos = reader.field(instruction, UNION_VALUE)
            if pos is not None:
                calls.append((reader.scalar(instruction, UNION_TYPE, "<B"), reader.indirect(pos)))

    def operator_of(call: int) -> tuple[str, str]:
        op = reader.scalar(call, 0)
        return operators[op] if 0 <= op < len(operators) else ("", "")

    memory_of: dict[int, set[int]] = {}
    for j, value in enumerate(inputs):
        memory_of.setdefault(value, set()).add(j)
    views: list[tuple[int, int]] = []
    for kind, call in calls:
        args = reader.ints(call, 1) if kind == KERNEL_CALL else ()
        if len(args) >= 2 and operator_of(call)[0] in VIEW_OPERATORS:
            views.append((args[0], args[-1]))
    changed = True
    while changed:
        changed = False
        for source, view in views:
            new = memory_of.get(source, set()) - memory_of.get(view, set())
            if new:
                memory_of.setdefault(view, set()).update(new)
                changed = True

    values = reader.tables(plan, PLAN_VALUES)

    def memory_of_arg(value: int) -> set[int]:
        """The inputs whose memory an argument is: a tensor's, or those of a list's tensors
        (a kernel writing an out list writes the listed tensors)."""
        touched = set(memory_of.get(value, set()))
        if 0 <= value < len(values) and reader.scalar(values[value], UNION_TYPE, "<B") in LISTS_OF_TENSORS:
            pos = reader.field(values[value], UNION_VALUE)
            if pos is not None:
                for item in reader.ints(reader.indirect(pos), LIST_ITEMS):
                    touched |= memory_of.get(item, set())
        return touched

    returned = {j for j, value in enumerate(inputs) if value in set(outputs)}
    written: set[int] = set()
    for kind, call in calls:
        if kind == MOVE_CALL:
            written |= memory_of.get(reader.scalar(call, 1), set())
            continue
        if kind not in (KERNEL_CALL, DELEGATE_CALL):
            continue
        positions: frozenset[int] | None = None
        if kind == KERNEL_CALL:
            name, overload = operator_of(call)
            if name in VIEW_OPERATORS:
                continue
            positions = written_positions(name, overload)
        for k, value in enumerate(reader.ints(call, 1)):
            touched = memory_of_arg(value)
            if positions is None:
                written |= touched & returned
            elif k in positions:
                written |= touched
    return tuple(j in written for j in range(len(inputs)))
