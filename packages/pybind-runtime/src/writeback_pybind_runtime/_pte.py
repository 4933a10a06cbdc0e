"""Read which values a method takes and returns straight from a ``.pte`` flatbuffer.

The runtime's ``Method`` can only tell "output i is input j" through
``get_input``, which marks the input as set and so disables ExecuTorch's own
"input not set" check. The answer is in the program itself: each execution
plan lists the value indices of its inputs and outputs, and an output that is
an input names the same value. This module reads those two lists with a small
bounds-checked flatbuffer reader (no generated code ships with the wheel), so
a corrupted file raises :class:`ValueError` instead of reading out of range.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["PlanIO", "plan_io", "program_prefix_size", "validate_plan", "written_inputs"]

# Field numbers in executorch's schema/program.fbs (Program and ExecutionPlan tables).
_PROGRAM_EXECUTION_PLAN = 1
_PLAN_NAME = 0
_PLAN_INPUTS = 3
_PLAN_OUTPUTS = 4
_PLAN_VALUES = 2
_PLAN_CHAINS = 5
_PLAN_OPERATORS = 6
_PLAN_DELEGATES = 7
_CHAIN_INSTRUCTIONS = 2
# A union field takes two slots: its type (u8), then its value.
_UNION_TYPE, _UNION_VALUE = 0, 1
_EXTENDED_HEADER_MAGIC = b"eh00"


@dataclass(frozen=True)
class PlanIO:
    """The value indices of one method's inputs and outputs, in call order."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def output_is_input(self) -> tuple[int | None, ...]:
        """For each output, the index of the input that is the same value, or ``None``."""
        first: dict[int, int] = {}
        for j, value in enumerate(self.inputs):
            first.setdefault(value, j)
        return tuple(first.get(value) for value in self.outputs)

    def output_repeats(self) -> tuple[tuple[int, ...], ...]:
        """For each output, the other output indices that return the same value."""
        return tuple(
            tuple(k for k, other in enumerate(self.outputs) if other == value and k != i)
            for i, value in enumerate(self.outputs)
        )


# The little-endian scalars a program's flatbuffer holds, compiled once.
_SCALARS = {fmt: struct.Struct(fmt) for fmt in ("<b", "<B", "<H", "<i", "<I", "<q", "<Q")}
_I32, _U16 = _SCALARS["<i"], _SCALARS["<H"]


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.size = len(self.data)

    def _outside(self, pos: int) -> ValueError:
        return ValueError(f"not a valid .pte: offset {pos} is outside the {self.size}-byte program")

    def _unpack(self, fmt: str, pos: int) -> int:
        scalar = _SCALARS[fmt]
        if pos < 0 or pos + scalar.size > self.size:
            raise self._outside(pos)
        value: int = scalar.unpack_from(self.data, pos)[0]
        return value

    def u32(self, pos: int) -> int:
        return self._unpack("<I", pos)

    def scalar(self, table: int, number: int, fmt: str = "<i") -> int:
        """A scalar field's value; 0 (flatbuffers' default) when absent."""
        pos = self.field(table, number)
        return 0 if pos is None else self._unpack(fmt, pos)

    def tables(self, table: int, number: int) -> list[int]:
        start, length = self.vector(table, number)
        offsets = struct.unpack_from(f"<{length}I", self.data, start)
        return [start + 4 * k + offset for k, offset in enumerate(offsets)]

    def field(self, table: int, number: int) -> int | None:
        """Absolute position of a table field's data, or ``None`` when it is absent."""
        # The hottest read of the checks: the three scalars unpacked inline.
        data, size = self.data, self.size
        if table < 0 or table + 4 > size:
            raise self._outside(table)
        vtable = table - _I32.unpack_from(data, table)[0]
        if vtable < 0 or vtable + 2 > size:
            raise self._outside(vtable)
        slot = 4 + 2 * number
        if slot + 2 > _U16.unpack_from(data, vtable)[0]:
            return None
        if vtable + slot + 2 > size:
            raise self._outside(vtable + slot)
        offset: int = _U16.unpack_from(data, vtable + slot)[0]
        return table + offset if offset else None

    def indirect(self, pos: int) -> int:
        return pos + self.u32(pos)

    def vector(self, table: int, number: int, itemsize: int = 4) -> tuple[int, int]:
        """``(start of elements, length)`` of a vector field of ``itemsize``-byte entries;
        length 0 when absent."""
        pos = self.field(table, number)
        if pos is None:
            return 0, 0
        vec = self.indirect(pos)
        length = self.u32(vec)
        if vec + 4 + itemsize * length > self.size:
            raise ValueError(f"not a valid .pte: a vector of {length} {itemsize}-byte entries overruns the program")
        return vec + 4, length

    def string(self, table: int, number: int) -> str:
        pos = self.field(table, number)
        if pos is None:
            return ""
        start = self.indirect(pos)
        length = self.u32(start)
        if start + 4 + length > self.size:
            raise ValueError("not a valid .pte: a string overruns the program")
        return bytes(self.data[start + 4 : start + 4 + length]).decode("utf-8", "replace")

    def ints(self, table: int, number: int) -> tuple[int, ...]:
        start, length = self.vector(table, number)
        values: tuple[int, ...] = struct.unpack_from(f"<{length}i", self.data, start)
        return values

    def longs(self, table: int, number: int) -> tuple[int, ...]:
        start, length = self.vector(table, number, 8)
        values: tuple[int, ...] = struct.unpack_from(f"<{length}q", self.data, start)
        return values


def program_prefix_size(header: bytes) -> int | None:
    """How many leading bytes hold the program flatbuffer, from the extended header.

    :param header: at least the first 24 bytes of the file.
    :return: the flatbuffer's size, or ``None`` when the file has no extended
        header (then the whole file is the flatbuffer).
    """
    if len(header) < 24 or header[8:12] != _EXTENDED_HEADER_MAGIC:
        return None
    size: int = struct.unpack_from("<Q", header, 16)[0]
    return size


def _find_plan(reader: _Reader, method: str) -> int:
    root = reader.indirect(0)
    names = []
    for plan in reader.tables(root, _PROGRAM_EXECUTION_PLAN):
        name = reader.string(plan, _PLAN_NAME)
        if name == method:
            return plan
        names.append(name)
    raise ValueError(f"the program has no method {method!r}; it has {names}")


def plan_io(data: bytes | memoryview, method: str) -> PlanIO:
    """The input and output value indices of ``method`` in the program ``data``.

    :param data: the program flatbuffer (the whole file, or at least its prefix
        of :func:`program_prefix_size` bytes).
    :param method: the method's name.
    :raises ValueError: the data is not a program, or it has no such method.
    """
    reader = _Reader(data)
    plan = _find_plan(reader, method)
    return PlanIO(reader.ints(plan, _PLAN_INPUTS), reader.ints(plan, _PLAN_OUTPUTS))


# --- plan validation ----------------------------------------------------------------------
# ExecuTorch 1.5.1 verifies a program's flatbuffer structure, not what its
# instructions point at: an operator index out of range is logged and then
# crashes at execute, and a kernel argument of the wrong kind aborts inside the
# kernel (``EValue is not a Tensor``). validate_plan refuses those programs.

# Tensor table fields.
_TENSOR_SIZES, _TENSOR_DATA_BUFFER, _TENSOR_ALLOCATION, _TENSOR_EXTRA_INFO = 2, 5, 6, 9
# KernelTypes union codes (schema/program.fbs), 1-based; 0 is "none".
_NULL, _INT, _BOOL, _DOUBLE, _TENSOR, _STRING = 1, 2, 3, 4, 5, 6
_INT_LIST, _DOUBLE_LIST, _BOOL_LIST, _TENSOR_LIST, _OPTIONAL_TENSOR_LIST = 7, 8, 9, 10, 11
_LISTS_OF_TENSORS = frozenset({_TENSOR_LIST, _OPTIONAL_TENSOR_LIST})
# The value indices a TensorList or OptionalTensorList table lists.
_LIST_ITEMS = 0
# InstructionArguments union codes.
_KERNEL_CALL, _DELEGATE_CALL, _MOVE_CALL, _JUMP_FALSE_CALL, _FREE_CALL = 1, 2, 3, 4, 5

# What value kinds a schema argument type accepts, keyed by the type as torch prints it.
_ACCEPTS: dict[str, frozenset[int]] = {
    "Tensor": frozenset({_TENSOR}),
    "number": frozenset({_INT, _DOUBLE, _BOOL}),
    "int": frozenset({_INT}),
    "SymInt": frozenset({_INT}),
    "float": frozenset({_DOUBLE}),
    "bool": frozenset({_BOOL}),
    "str": frozenset({_STRING}),
    "ScalarType": frozenset({_INT}),
    "Layout": frozenset({_INT}),
    "MemoryFormat": frozenset({_INT}),
    "List[int]": frozenset({_INT_LIST}),
    "List[SymInt]": frozenset({_INT_LIST}),
    "List[float]": frozenset({_DOUBLE_LIST}),
    "List[bool]": frozenset({_BOOL_LIST}),
    "List[Tensor]": frozenset({_TENSOR_LIST}),
    "List[Optional[Tensor]]": frozenset({_OPTIONAL_TENSOR_LIST}),
}


def _accepted(type_name: str) -> frozenset[int] | None:
    """Value kinds a schema type accepts, or ``None`` for a type not checked."""
    if type_name.startswith("Optional[") and type_name.endswith("]"):
        inner = _accepted(type_name[len("Optional[") : -1])
        return None if inner is None else inner | {_NULL}
    return _ACCEPTS.get(type_name)


@cache
def _schema(name: str, overload: str) -> Any:
    """torch's ``FunctionSchema`` of operator ``name.overload``, or ``None`` when torch
    does not know it."""
    import torch

    # Looked up by name in torch's operator registry: the names come from the file,
    # so they never reach attribute access (a getattr chain on ``torch.ops`` can walk
    # to ``torch.ops.import_module`` and beyond).
    try:
        return torch._C._get_schema(name, "" if overload in ("", "default") else overload)
    except RuntimeError:
        return None


def _trailing(schema: Any) -> tuple[str, ...]:
    """The types of what ExecuTorch's emitter appends to a kernel call after the schema's
    arguments: for an out variant, its out arguments again (the one out argument, or
    several as one list; ``split_with_sizes_copy.out`` returns nothing yet gets its out
    list appended); otherwise its returns (several as one list: ``max.dim_max``)."""
    out = [a for a in schema.arguments if a.is_out]
    if out:
        return (str(out[0].type),) if len(out) == 1 else ("List[Tensor]",)
    returns = tuple(str(r.type) for r in schema.returns)
    return ("List[Tensor]",) if len(returns) > 1 else returns


# Operators of ExecuTorch's own that torch has no schema for, with the kinds of their
# kernel-call arguments: a view's kernel reads its size as an IntList (an Int there
# aborts the process in toIntList()).
_PRIM_SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    ("executorch_prim::et_view", "default"): ("Tensor", "List[int]", "Tensor"),
}


@cache
def _signature(name: str, overload: str) -> tuple[str, ...] | None:
    """The types of a kernel call's arguments to operator ``name.overload``: the schema's
    arguments, then :func:`_trailing`; ``None`` when neither torch nor
    :data:`_PRIM_SIGNATURES` knows the operator (then only index ranges are checked)."""
    if (name, overload) in _PRIM_SIGNATURES:
        return _PRIM_SIGNATURES[name, overload]
    schema = _schema(name, overload)
    if schema is None:
        return None
    return tuple(str(a.type) for a in schema.arguments) + _trailing(schema)


@cache
def _written_positions(name: str, overload: str) -> frozenset[int] | None:
    """Which kernel-call arguments operator ``name.overload`` writes: those its schema
    marks written (``Tensor(a!)``, ``Tensor(a!)[]``) and what :func:`_trailing` appends
    (for an out variant the out arguments again; otherwise the returns, except one that
    aliases an argument without writing it). ``None`` when torch does not know the
    operator."""
    schema = _schema(name, overload)
    if schema is None:
        return None
    n = len(schema.arguments)
    written = {k for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    if any(a.is_out for a in schema.arguments) or len(schema.returns) > 1:
        written.add(n)  # the out arguments again, or one list of the returns (the out arguments)
        return frozenset(written)
    for r, returned in enumerate(schema.returns):
        if returned.alias_info is None or returned.alias_info.is_write:
            written.add(n + r)
    return frozenset(written)


def validate_plan(data: bytes | memoryview, method: str) -> None:
    """Check that every instruction of ``method`` points at things that exist.

    1. Every operator, delegate and value index an instruction names is in range.
    2. A jump's destination is an instruction of its chain (or its end).
    3. A kernel call has one argument per schema argument of its operator, then
       what the emitter appends (:func:`_trailing`), when torch knows the operator;
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
    reader = _Reader(data)
    plan = _find_plan(reader, method)
    values = reader.tables(plan, _PLAN_VALUES)
    kinds = [reader.scalar(v, _UNION_TYPE, "<B") for v in values]
    operators = [(reader.string(op, 0), reader.string(op, 1)) for op in reader.tables(plan, _PLAN_OPERATORS)]
    _, n_delegates = reader.vector(plan, _PLAN_DELEGATES)
    for k, (name, _overload) in enumerate(operators):
        if not name:
            # ExecuTorch logs "Missing operator name", loads, then crashes at execute.
            raise ValueError(f"method {method!r}: operator {k} has no name")

    def check_value(index: int, where: str) -> None:
        if not 0 <= index < len(values):
            raise ValueError(f"method {method!r}: {where} names value {index}, but it has {len(values)}")

    for index, value in enumerate(values):
        _check_list_items(reader, value, kinds, f"method {method!r}: value {index}")
        facts = _tensor_facts(reader, value) if kinds[index] == _TENSOR else None
        if facts is not None and facts[0] not in _TENSOR_DTYPES:
            raise ValueError(
                f"method {method!r}: value {index} is a tensor of dtype code {facts[0]}, which the "
                f"runtime's kernels do not take (codes {sorted(_TENSOR_DTYPES)})"
            )
    inputs, outputs = reader.ints(plan, _PLAN_INPUTS), reader.ints(plan, _PLAN_OUTPUTS)
    for j, index in enumerate(inputs):
        check_value(index, f"input {j}")
    for i, index in enumerate(outputs):
        check_value(index, f"output {i}")
    # Inputs and outputs get storage from the caller; a view gets its pointer
    # from the view kernel that makes it.
    exempt = set(inputs) | set(outputs) | _view_results(reader, plan, operators)
    for index, value in enumerate(values):
        if kinds[index] == _TENSOR and index not in exempt and _lacks_storage(reader, value):
            raise ValueError(
                f"method {method!r}: value {index} is a tensor with no storage (not "
                "constant, not memory planned, not an input or output)"
            )
    for c, chain in enumerate(reader.tables(plan, _PLAN_CHAINS)):
        instructions = reader.tables(chain, _CHAIN_INSTRUCTIONS)
        for n, instruction in enumerate(instructions):
            where = f"chain {c} instruction {n}"
            kind = reader.scalar(instruction, _UNION_TYPE, "<B")
            pos = reader.field(instruction, _UNION_VALUE)
            if kind not in _CHECKS or pos is None:
                raise ValueError(f"method {method!r}: {where} has unknown kind {kind}")
            context = _Context(method, where, check_value, kinds, values, operators, n_delegates, len(instructions))
            _CHECKS[kind](reader, reader.indirect(pos), context)


# What the items of each list kind name: ExecuTorch reads an IntList's items as the
# indices of Int values (toInt() aborts the process on any other kind), a
# TensorList's as Tensor values, an OptionalTensorList's as Tensor values or -1
# (exir's emitter writes a None of an optional list as -1; ExecuTorch reads any other
# item as a Tensor, so an item naming a Null value aborts it too).
_LIST_ITEM_KINDS = {_INT_LIST: frozenset({_INT}), _TENSOR_LIST: frozenset({_TENSOR})}
_LIST_ITEM_KINDS[_OPTIONAL_TENSOR_LIST] = frozenset({_TENSOR})


def _check_list_items(reader: _Reader, value: int, kinds: list[int], where: str) -> None:
    """Every item of a list value names an existing value of the kind the list holds."""
    kind = reader.scalar(value, _UNION_TYPE, "<B")
    wanted = _LIST_ITEM_KINDS.get(kind)
    pos = reader.field(value, _UNION_VALUE)
    if wanted is None or pos is None:
        return
    table = reader.indirect(pos)
    items = reader.longs(table, _LIST_ITEMS) if kind == _INT_LIST else reader.ints(table, _LIST_ITEMS)
    for k, item in enumerate(items):
        if kind == _OPTIONAL_TENSOR_LIST and item == -1:
            continue
        if not 0 <= item < len(kinds):
            raise ValueError(f"{where}: list item {k} names value {item}, but the method has {len(kinds)}")
        if kinds[item] not in wanted:
            raise ValueError(
                f"{where}: list item {k} names value {item} of kind {kinds[item]}; a list of kind {kind} "
                f"holds only values of kinds {sorted(wanted)}"
            )


_VIEW_OPERATORS = frozenset({"executorch_prim::et_view"})


def written_inputs(data: bytes | memoryview, method: str) -> tuple[bool, ...]:
    """For each input of ``method``, whether the method may write its memory.

    1. A value a view operator (``et_view``) makes from an input's memory is
       that input's memory too (transitively).
    2. A kernel call writes the arguments :func:`_written_positions` names; a
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
    reader = _Reader(data)
    plan = _find_plan(reader, method)
    inputs, outputs = reader.ints(plan, _PLAN_INPUTS), reader.ints(plan, _PLAN_OUTPUTS)
    operators = [(reader.string(op, 0), reader.string(op, 1)) for op in reader.tables(plan, _PLAN_OPERATORS)]
    calls: list[tuple[int, int]] = []
    for chain in reader.tables(plan, _PLAN_CHAINS):
        for instruction in reader.tables(chain, _CHAIN_INSTRUCTIONS):
            pos = reader.field(instruction, _UNION_VALUE)
            if pos is not None:
                calls.append((reader.scalar(instruction, _UNION_TYPE, "<B"), reader.indirect(pos)))

    def operator_of(call: int) -> tuple[str, str]:
        op = reader.scalar(call, 0)
        return operators[op] if 0 <= op < len(operators) else ("", "")

    memory_of: dict[int, set[int]] = {}
    for j, value in enumerate(inputs):
        memory_of.setdefault(value, set()).add(j)
    views: list[tuple[int, int]] = []
    for kind, call in calls:
        args = reader.ints(call, 1) if kind == _KERNEL_CALL else ()
        if len(args) >= 2 and operator_of(call)[0] in _VIEW_OPERATORS:
            views.append((args[0], args[-1]))
    changed = True
    while changed:
        changed = False
        for source, view in views:
            new = memory_of.get(source, set()) - memory_of.get(view, set())
            if new:
                memory_of.setdefault(view, set()).update(new)
                changed = True

    values = reader.tables(plan, _PLAN_VALUES)

    def memory_of_arg(value: int) -> set[int]:
        """The inputs whose memory an argument is: a tensor's, or those of a list's tensors
        (a kernel writing an out list writes the listed tensors)."""
        touched = set(memory_of.get(value, set()))
        if 0 <= value < len(values) and reader.scalar(values[value], _UNION_TYPE, "<B") in _LISTS_OF_TENSORS:
            pos = reader.field(values[value], _UNION_VALUE)
            if pos is not None:
                for item in reader.ints(reader.indirect(pos), _LIST_ITEMS):
                    touched |= memory_of.get(item, set())
        return touched

    returned = {j for j, value in enumerate(inputs) if value in set(outputs)}
    written: set[int] = set()
    for kind, call in calls:
        if kind == _MOVE_CALL:
            written |= memory_of.get(reader.scalar(call, 1), set())
            continue
        if kind not in (_KERNEL_CALL, _DELEGATE_CALL):
            continue
        positions: frozenset[int] | None = None
        if kind == _KERNEL_CALL:
            name, overload = operator_of(call)
            if name in _VIEW_OPERATORS:
                continue
            positions = _written_positions(name, overload)
        for k, value in enumerate(reader.ints(call, 1)):
            touched = memory_of_arg(value)
            if positions is None:
                written |= touched & returned
            elif k in positions:
                written |= touched
    return tuple(j in written for j in range(len(inputs)))


def _view_results(reader: _Reader, plan: int, operators: list[tuple[str, str]]) -> set[int]:
    """Values written by a view operator (its last argument): they alias memory, unplanned."""
    found: set[int] = set()
    for chain in reader.tables(plan, _PLAN_CHAINS):
        for instruction in reader.tables(chain, _CHAIN_INSTRUCTIONS):
            pos = reader.field(instruction, _UNION_VALUE)
            if reader.scalar(instruction, _UNION_TYPE, "<B") != _KERNEL_CALL or pos is None:
                continue
            call = reader.indirect(pos)
            op_index = reader.scalar(call, 0)
            args = reader.ints(call, 1)
            if 0 <= op_index < len(operators) and operators[op_index][0] in _VIEW_OPERATORS and args:
                found.add(args[-1])
    return found


def _lacks_storage(reader: _Reader, value: int) -> bool:
    """Whether a Tensor value has data from nowhere: the runtime would run a kernel on a
    null pointer (crash), since only inputs and outputs get storage from the caller."""
    pos = reader.field(value, _UNION_VALUE)
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


def _planned_region(reader: _Reader, value: int) -> tuple[int, int, int] | None:
    """``(memory id, first byte, end)`` of a memory-planned tensor value, else ``None``."""
    pos = reader.field(value, _UNION_VALUE)
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


def _check_overlaps(reader: _Reader, args: tuple[int, ...], ctx: _Context) -> None:
    """No two tensors a kernel call takes may share planned memory in part: all are live
    during the call, so exir plans them apart, and a kernel copying between partly
    overlapping ones (``index_put``'s memcpy) reads and writes the same bytes."""
    regions: dict[int, tuple[int, int, int]] = {}
    for a in dict.fromkeys(args):
        if ctx.kinds[a] == _TENSOR:
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


def _tensor_facts(reader: _Reader, value: int) -> tuple[int, int | None] | None:
    """``(dtype code, element count or None when a size is negative)`` of a Tensor value."""
    pos = reader.field(value, _UNION_VALUE)
    if pos is None:
        return None
    tensor = reader.indirect(pos)
    sizes = reader.ints(tensor, _TENSOR_SIZES)
    numel = None if any(size < 0 for size in sizes) else math.prod(sizes)
    return reader.scalar(tensor, _TENSOR_SCALAR_TYPE, "<b"), numel


def _check_view(reader: _Reader, args: tuple[int, ...], ctx: _Context) -> None:
    """``et_view(self, size, out)`` points ``out`` at ``self``'s memory: both must be
    tensors of one dtype and element count, or later kernels read past ``self``'s bytes
    (the process died with SIGSEGV on a view of another value)."""
    if len(args) != 3 or ctx.kinds[args[0]] != _TENSOR or ctx.kinds[args[2]] != _TENSOR:
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


def _check_kernel_call(reader: _Reader, call: int, ctx: _Context) -> None:
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
    signature = _signature(name, overload)
    if signature is None:
        return
    if name in _VIEW_OPERATORS:
        _check_view(reader, args, ctx)
    if len(args) != len(signature):
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} passes {len(args)} arguments to "
            f"{name}.{overload}, whose schema takes {len(signature)}"
        )
    for k, (a, type_name) in enumerate(zip(args, signature, strict=True)):
        accepted = _accepted(type_name)
        if accepted is not None and ctx.kinds[a] not in accepted:
            raise ValueError(
                f"method {ctx.method!r}: {ctx.where} passes value {a} of kind "
                f"{ctx.kinds[a]} as argument {k} ({type_name}) of {name}.{overload}"
            )


def _check_delegate_call(reader: _Reader, call: int, ctx: _Context) -> None:
    index = reader.scalar(call, 0)
    if not 0 <= index < ctx.n_delegates:
        raise ValueError(f"method {ctx.method!r}: {ctx.where} calls delegate {index}, but it has {ctx.n_delegates}")
    for a in reader.ints(call, 1):
        ctx.check_value(a, ctx.where)


def _check_move_call(reader: _Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)
    ctx.check_value(reader.scalar(call, 1), ctx.where)


def _check_jump_false_call(reader: _Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)
    destination = reader.scalar(call, 1)
    if not 0 <= destination <= ctx.n_instructions:
        raise ValueError(
            f"method {ctx.method!r}: {ctx.where} jumps to instruction {destination} of {ctx.n_instructions}"
        )


def _check_free_call(reader: _Reader, call: int, ctx: _Context) -> None:
    ctx.check_value(reader.scalar(call, 0), ctx.where)


# Dispatch table keyed by instruction kind.
_CHECKS: dict[int, Callable[[_Reader, int, _Context], None]] = {
    _KERNEL_CALL: _check_kernel_call,
    _DELEGATE_CALL: _check_delegate_call,
    _MOVE_CALL: _check_move_call,
    _JUMP_FALSE_CALL: _check_jump_false_call,
    _FREE_CALL: _check_free_call,
}
