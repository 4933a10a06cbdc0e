"""The checks a method's execution plan passes before it loads.

ExecuTorch 1.5.1 verifies a program's flatbuffer structure, not what its instructions point
at: an operator index out of range is logged and then crashes at execute, and a kernel
argument of the wrong kind aborts inside the kernel (``EValue is not a Tensor``). This module
holds :func:`validate_plan`, which refuses those programs, and its checks: of every value (list
items, dtypes, storage) and of every instruction, one check per instruction kind (indices in
range, kernel arguments of the kinds the operator's schema takes, no partly overlapping planned
memory, views of their source's dtype and size).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from writeback_pybind_runtime._pte_format import (
    CHAIN_INSTRUCTIONS,
    DELEGATE_CALL,
    FREE_CALL,
    INT,
    INT_LIST,
    JUMP_FALSE_CALL,
    KERNEL_CALL,
    LIST_ITEMS,
    MOVE_CALL,
    OPTIONAL_TENSOR_LIST,
    PLAN_CHAINS,
    PLAN_DELEGATES,
    PLAN_INPUTS,
    PLAN_OPERATORS,
    PLAN_OUTPUTS,
    PLAN_VALUES,
    TENSOR,
    TENSOR_LIST,
    UNION_TYPE,
    UNION_VALUE,
    Reader,
    find_plan,
)
from writeback_pybind_runtime._pte_operators import VIEW_OPERATORS, accepted_kinds, kernel_signature

__all__ = ["validate_plan"]

# Tensor table fields.
_TENSOR_SIZES, _TENSOR_DATA_BUFFER, _TENSOR_ALLOCATION, _TENSOR_EXTRA_INFO = 2, 5, 6, 9


def validate_plan(data: bytes | memoryview, method: str) -> None:
    """Check that every instruction of ``method`` points at things that exist.

    1. Every operator, delegate and value index an instruction names is in range.
    2. A jump's destination is an instruction of its chain (or its end).
    3. A kernel call has one argument per schema argument of its operator, then
       what the emitter appends
       (:func:`~writeback_pybind_runtime._pte_operators.kernel_signature`), when torch
       knows the operator;
       each of a kind that type accepts.
    4. The method's inputs and outputs name existing values.
    5. Each item of an int, tensor or optional tensor list names an existing value of
       the kind the list holds (ExecuTorch aborts the process reading an IntList item
       that names a value of another kind).
    6. No two tensors one kernel call takes share planned memory in part.
    7. Every tensor has a dtype the kernels take; an ``et_view`` views a tensor of
       its own dtype and element count.

    :raises ValueError: naming the method, chain, instruction and what is wrong.
    """
    reader = Reader(data)
    plan = find_plan(reader, method)
    values = reader.tables(plan, PLAN_VALUES)
    kinds = [reader.scalar(v, UNION_TYPE, "<B") for v in values]
    operators = [(reader.string(op, 0), reader.string(op, 1)) for op in reader.tables(plan, PLAN_OPERATORS)]
    _, n_delegates = reader.vector(plan, PLAN_DELEGATES)
    for k, (name, _overload) in enumerate(operators):
        if not name:
            # ExecuTorch logs "Missing operator name", loads, then crashes at execute.
            raise ValueError(f"method {method!r}: operator {k} has no name")

    def check_value(index: int, where: str) -> None:
        if not 0 <= index < len(values):
            raise ValueError(f"method {method!r}: {where} names value {index}, but it has {len(values)}")

    for index, value in enumerate(values):
        _check_list_items(reader, value, kinds, f"method {method!r}: value {index}")
        facts = _tensor_facts(reader, value) if kinds[index] == TENSOR else None
        if facts is not None and facts[0] not in _TENSOR_DTYPES:
            raise ValueError(
                f"method {method!r}: value {index} is a tensor of dtype code {facts[0]}, which the "
                f"runtime's kernels do not take (codes {sorted(_TENSOR_DTYPES)})"
            )
    inputs, outputs = reader.ints(plan, PLAN_INPUTS), reader.ints(plan, PLAN_OUTPUTS)
    for j, index in enumerate(inputs):
        check_value(index, f"input {j}")
    for i, index in enumerate(outputs):
        check_value(index, f"output {i}")
    # Inputs and outputs get storage from the caller; a view gets its pointer
    # from the view kernel that makes it.
    exempt = set(inputs) | set(outputs) | _view_results(reader, plan, operators)
    for index, value in enumerate(values):
        if kinds[index] == TENSOR and index not in exempt and _lacks_storage(reader, value):
            raise ValueError(
                f"method {method!r}: value {index} is a tensor with no storage (not "
                "constant, not memory planned, not an input or output)"
            )
    for c, chain in enumerate(reader.tables(plan, PLAN_CHAINS)):
        instructions = reader.tables(chain, CHAIN_INSTRUCTIONS)
        for n, instruction in enumerate(instructions):
            where = f"chain {c} instruction {n}"
            kind = reader.scalar(instruction, UNION_TYPE, "<B")
            pos = reader.field(instruction, UNION_VALUE)
            if kind not in _CHECKS or pos is None:
                raise ValueError(f"method {method!r}: {where} has unknown kind {kind}")
            context = _Context(method, where, check_value, kinds, values, operators, n_delegates, len(instructions))
            _CHECKS[kind](reader, reader.indirect(pos), context)


# What the items of each list kind name: ExecuTorch reads an IntList's items as the
# indices of Int values (toInt() aborts the process on any other kind), a
# TensorList's as Tensor values, an OptionalTensorList's as Tensor values or -1
# (exir's emitter writes a None of an optional list as -1; ExecuTorch reads any other
# item as a Tensor, so an item naming a Null value aborts it too).
_LIST_ITEM_KINDS = {INT_LIST: frozenset({INT}), TENSOR_LIST: frozenset({TENSOR})}
_LIST_ITEM_KINDS[OPTIONAL_TENSOR_LIST] = frozenset({TENSOR})


def _check_list_items(reader: Reader, value: int, kinds: list[int], where: str) -> None:
    """Every item of a list value names an existing value of the kind the list holds."""
    kind = reader.scalar(value, UNION_TYPE, "<B")
    wanted = _LIST_ITEM_KINDS.get(kind)
    pos = reader.field(value, UNION_VALUE)
    if wanted is None or pos is None:
        return
    table = reader.indirect(pos)
    items = reader.longs(table, LIST_ITEMS) if kind == INT_LIST else reader.ints(table, LIST_ITEMS)
    for k, item in enumerate(items):
        if kind == OPTIONAL_TENSOR_LIST and item == -1:
            continue
        if not 0 <= item < len(kinds):
            raise ValueError(f"{where}: list item {k} names value {item}, but the method has {len(kinds)}")
        if kinds[item] not in wanted:
            raise ValueError(
                f"{where}: list item {k} names value {item} of kind {kinds[item]}; a list of kind {kind} "
                f"holds only values of kinds {sorted(wanted)}"
            )


def _view_results(reader: Reader, plan: int, operators: list[tuple[str, str]]) -> set[int]:
    """Values written by a view operator (its last argument): they alias memory, unplanned."""
    found: set[int] = set()
    for chain in reader.tables(plan, PLAN_CHAINS):
        for instruction in reader.tables(chain, CHAIN_INSTRUCTIONS):
            pos = reader.field(instruction, UNION_VALUE)
            if reader.scalar(instruction, UNION_TYPE, "<B") != KERNEL_CALL or pos is None:
                continue
            call = reader.indirect(pos)
            op_index = reader.scalar(call, 0)
            args = reader.ints(call, 1)
            if 0 <= op_index < len(operators) and operators[op_index][0] in VIEW_OPERATORS and args:
                found.add(args[-1])
    return found


def _lacks_storage(reader: Reader, value: int) -> bool:
    """Whether a Tensor value has data from nowhere: the runtime would run a kernel on a
    null pointer (crash), since only inputs and outputs get storage from the caller."""
    pos = reader.field(value, UNION_VALUE)
    if pos is None:
        return True
    tensor = reader.indirect(pos)
    if reader.scalar(tensor, _TENSOR_DATA_BUFFER, "<I") != 0:
        return False
    if reader.field(tensor, _TENSOR_ALLOCATION) is not None:
        return False
    if reader.field(tensor, _TENSOR_EXTRA_INFO) is not None:
        return False  # external or named data, resolved by the runtime
    numel = 1
    for size in reader.ints(tensor, _TENSOR_SIZES):
        numel *= size
    return numel > 0


@dataclass(frozen=True)
class _Context:
    method: str
    where: str
    check_value: Callable[[int, str], None]
    kinds: list[int]
    values: list[int]
    operators: list[tuple[str, str]]
    n_delegates: int
    n_instructions: int


# Bytes per element of ExecuTorch's ScalarType codes (schema/scalar_type.fbs) for the
# dtypes a planned tensor commonly has; a tensor of another dtype is not checked.
_ELEMENT_BYTES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 11: 1, 15: 2}
_TENSOR_SCALAR_TYPE = 0
_ALLOCATION_MEMORY_ID, _ALLOCATION_LOW, _ALLOCATION_HIGH = 0, 1, 2


def _planned_region(reader: Reader, value: int) -> tuple[int, int, int] | None:
    """``(memory id, first byte, end)`` of a memory-planned tensor value, else ``None``."""
    pos = reader.field(value, UNION_VALUE)
    if pos is None:
        return None
    tensor = reader.indirect(pos)
    allocation = reader.field(tensor, _TENSOR_ALLOCATION)
    itemsize = _ELEMENT_BYTES.get(reader.scalar(tensor, _TENSOR_SCALAR_TYPE, "<b"))
    if allocation is None or itemsize is None:
        return None
    details = reader.indirect(allocation)
    start = reader.scalar(details, _ALLOCATION_LOW, "<I") | reader.scalar(details, _ALLOCATION_HIGH, "<I") << 32
    numel = math.prod(reader.ints(tensor, _TENSOR_SIZES))
    if numel <= 0:
        return None
    return reader.scalar(details, _ALLOCATION_MEMORY_ID, "<I"), start, start + numel * itemsize


def _check_overlaps(reader: Reader, args: tuple[int, ...], ctx: _Context) -> None:
    """No two tensors a kernel call takes may share planned memory in part: all are live
    during the call, so exir plans them apart, and a kernel copying between partly
    overlapping ones (``index_put``'s memcpy) reads and writes the same bytes."""
    regions: dict[int, tuple[int, int, int]] = {}
    for a in dict.fromkeys(args):
        if ctx.kinds[a] == TENSOR:
            region = _planned_region(reader, ctx.values[a])
            if region is not None:
                regions[a] = region
    ordered = sorted(regions.items(), key=lambda item: item[1])
    for (a, (memory, start, end)), (b, (other_memory, other_start, other_end)) in itertools.pairwise(ordered):
        if memory == other_memory and other_start < end and (start, end) != (other_start, other_end):
            raise ValueError(
                f"method {ctx.method!r}: {ctx.where} passes values {a} and {b}, whose planned memory "
                f"(buffer {memory}, bytes [{start}, {end}) and [{other_start}, {other_end})) partly overlaps"
            )


# The dtypes (ScalarType codes) a tensor of a plan may have: those the kernels this
# runtime links take. A quantized one (QInt8 = 12 ...) aborted the process in
# promoteTypes(); complex, bit-packed and float8 ones are no dtype writeback lowers.
_TENSOR_DTYPES = frozenset({0, 1, 2, 3, 4, 5, 6, 7, 11, 15})


def _tensor_facts(reader: Reader, value: int) -> tuple[int, int | None] | None:
    """``(dtype code, element count or None when a size is negative)`` of a Tensor value."""
    pos = reader.field(value, UNION_VALUE)
    if pos is None:
        return None
    tensor = reader.indirect(pos)
    sizes = reader.ints(tensor, _TENSOR_SIZES)
    numel = None if any(size < 0 for size in sizes) else math.prod(sizes)
    return reader.scalar(tensor, _TENSOR_SCALAR_TYPE, "<b"), numel


def _check_view(reader: Reader, args: tuple[int, ...], ctx: _Context) -> None:
    """``et_view(self, size, out)`` points ``out`` at ``self``'s memory: both must be
    tensors of one dtype and element count, or later kernels read past ``self``'s bytes
    (the process died with SIGSEGV on a view of another value)."""
    if len(args) != 3 or ctx.kinds[args[0]] != TENSOR or ctx.kinds[args[2]] != TENSOR:
        return  # the kinds are checked against the signature
    if args[0] == args[2]:
        # A view's value has no memory until the view gives it its source's: of itself,
        # a null pointer (SIGSEGV in the next kernel).
        raise ValueError(f"method {ctx.method!r}: {ctx.where} views value {args[0]} as itself")
    source, view = _tensor_facts(reader, ctx.values[args[0]]), _tensor_facts(reader, ctx.values[args[2]])
    if source is None or view is None or source != view or source[1] is None:
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} views value {args[0]} (dtype, elements {source}) as value "
            f"{args[2]} (dtype, elements {view}); a view has its source's dtype and element count"
        )


def _check_kernel_call(reader: Reader, call: int, ctx: _Context) -> None:
    op_index = reader.scalar(call, 0)
    if not 0 <= op_index < len(ctx.operators):
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} calls operator {op_index}, but it has {len(ctx.operators)}"
        )
    args = reader.ints(call, 1)
    for a in args:
        ctx.check_value(a, ctx.where)
    _check_overlaps(reader, args, ctx)
    name, overload = ctx.operators[op_index]
    signature = kernel_signature(name, overload)
    if signature is None:
        return
    if name in VIEW_OPERATORS:
        _check_view(reader, args, ctx)
    if len(args) != len(signature):
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} passes {len(args)} arguments to "
            f"{name}.{overload}, whose schema takes {len(signature)}"
        )
    for k, (a, type_name) in enumerate(zip(args, signature, strict=True)):
        accepted = accepted_kinds(type_name)
        if accepted is not None and ctx.kinds[a] not in accepted:
            raise ValueError(
                f"method {ctx.method!r}: {ctx.where} passes value {a} of kind "
                f"{ctx.kinds[a]} as argument {k} ({type_name}) of {name}.{overload}"
            )


def _check_delegate_call(reader: Reader, call: int, ctx: _Context) -> None:
    index = reader.scalar(call, 0)
    if not 0 <= index < ctx.n_delegates:
        raise ValueError(f"method {ctx.method!r}: {ctx.where} calls delegate {index}, but it has {ctx.n_delegates}")
    for a in reader.ints(call, 1):
        ctx.check_value(a, ctx.where)


def _check_move_call(reader: Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)
    ctx.check_value(reader.scalar(call, 1), ctx.where)


def _check_jump_false_call(reader: Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)
    destination = reader.scalar(call, 1)
    if not 0 <= destination <= ctx.n_instructions:
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} jumps to instruction {destination} of {ctx.n_instructions}"
        )


def _check_free_call(reader: Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)


# Dispatch table keyed by instruction kind.
_CHECKS: dict[int, Callable[[Reader, int, _Context], None]] = {
    KERNEL_CALL: _check_kernel_call,
    DELEGATE_CALL: _check_delegate_call,
    MOVE_CALL: _check_move_call,
    JUMP_FALSE_CALL: _check_jump_false_call,
    FREE_CALL: _check_free_call,
}
