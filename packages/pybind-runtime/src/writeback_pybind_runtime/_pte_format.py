"""The layout of a ``.pte`` program's flatbuffer and a bounds-checked reader of it.

This module holds the field numbers and union codes of executorch's ``schema/program.fbs``
that the ``.pte`` reader reads (the Program, ExecutionPlan and Chain tables, the KernelTypes
kinds of a value and the InstructionArguments kinds of an instruction), :class:`Reader`, which
reads tables, vectors, strings and scalars and raises :class:`ValueError` for any offset,
vector or string that leaves the program instead of reading out of range (no generated code
ships with the wheel), and :func:`find_plan`, which finds a method's execution plan by name.
"""

from __future__ import annotations

import struct

__all__ = [
    "BOOL",
    "BOOL_LIST",
    "CHAIN_INSTRUCTIONS",
    "DELEGATE_CALL",
    "DOUBLE",
    "DOUBLE_LIST",
    "FREE_CALL",
    "INT",
    "INT_LIST",
    "JUMP_FALSE_CALL",
    "KERNEL_CALL",
    "LISTS_OF_TENSORS",
    "LIST_ITEMS",
    "MOVE_CALL",
    "NULL",
    "OPTIONAL_TENSOR_LIST",
    "PLAN_CHAINS",
    "PLAN_DELEGATES",
    "PLAN_INPUTS",
    "PLAN_OPERATORS",
    "PLAN_OUTPUTS",
    "PLAN_VALUES",
    "STRING",
    "TENSOR",
    "TENSOR_LIST",
    "UNION_TYPE",
    "UNION_VALUE",
    "Reader",
    "find_plan",
]

# Field numbers in executorch's schema/program.fbs (Program and ExecutionPlan tables).
_PROGRAM_EXECUTION_PLAN = 1
_PLAN_NAME = 0
PLAN_INPUTS = 3
PLAN_OUTPUTS = 4
PLAN_VALUES = 2
PLAN_CHAINS = 5
PLAN_OPERATORS = 6
PLAN_DELEGATES = 7
CHAIN_INSTRUCTIONS = 2
# A union field takes two slots: its type (u8), then its value.
UNION_TYPE, UNION_VALUE = 0, 1
# KernelTypes union codes (schema/program.fbs), 1-based; 0 is "none".
NULL, INT, BOOL, DOUBLE, TENSOR, STRING = 1, 2, 3, 4, 5, 6
INT_LIST, DOUBLE_LIST, BOOL_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST = 7, 8, 9, 10, 11
LISTS_OF_TENSORS = frozenset({TENSOR_LIST, OPTIONAL_TENSOR_LIST})
# The value indices a TensorList or OptionalTensorList table lists.
LIST_ITEMS = 0
# InstructionArguments union codes.
KERNEL_CALL, DELEGATE_CALL, MOVE_CALL, JUMP_FALSE_CALL, FREE_CALL = 1, 2, 3, 4, 5


# The little-endian scalars a program's flatbuffer holds, compiled once.
_SCALARS = {fmt: struct.Struct(fmt) for fmt in ("<b", "<B", "<H", "<i", "<I", "<q", "<Q")}
_I32, _U16 = _SCALARS["<i"], _SCALARS["<H"]


class Reader:
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


def find_plan(reader: Reader, method: str) -> int:
    root = reader.indirect(0)
    names = []
    for plan in reader.tables(root, _PROGRAM_EXECUTION_PLAN):
        name = reader.string(plan, _PLAN_NAME)
        if name == method:
            return plan
        names.append(name)
    raise ValueError(f"the program has no method {method!r}; it has {names}")
