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

import struct
from dataclasses import dataclass

__all__ = ["PlanIO", "plan_io", "program_prefix_size"]

# Field numbers in executorch's schema/program.fbs (Program and ExecutionPlan tables).
_PROGRAM_EXECUTION_PLAN = 1
_PLAN_NAME = 0
_PLAN_INPUTS = 3
_PLAN_OUTPUTS = 4
_EXTENDED_HEADER_MAGIC = b"eh00"


@dataclass(frozen=True)
class PlanIO:
    """The value indices of one method's inputs and outputs, in call order."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def output_is_input(self) -> tuple[int | None, ...]:
        """For each output, the index of the input that is the same value, or ``None``."""
        first = {}
        for j, value in enumerate(self.inputs):
            first.setdefault(value, j)
        return tuple(first.get(value) for value in self.outputs)

    def output_repeats(self) -> tuple[tuple[int, ...], ...]:
        """For each output, the other output indices that return the same value."""
        return tuple(
            tuple(k for k, other in enumerate(self.outputs) if other == value and k != i)
            for i, value in enumerate(self.outputs)
        )


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)

    def _unpack(self, fmt: str, pos: int) -> int:
        size = struct.calcsize(fmt)
        if pos < 0 or pos + size > len(self.data):
            raise ValueError(f"not a valid .pte: offset {pos} is outside the {len(self.data)}-byte program")
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    def u32(self, pos: int) -> int:
        return self._unpack("<I", pos)

    def field(self, table: int, number: int) -> int | None:
        """Absolute position of a table field's data, or ``None`` when it is absent."""
        vtable = table - self._unpack("<i", table)
        vtable_size = self._unpack("<H", vtable)
        slot = 4 + 2 * number
        if slot + 2 > vtable_size:
            return None
        offset = self._unpack("<H", vtable + slot)
        return table + offset if offset else None

    def indirect(self, pos: int) -> int:
        return pos + self.u32(pos)

    def vector(self, table: int, number: int) -> tuple[int, int]:
        """``(start of elements, length)`` of a vector field; length 0 when absent."""
        pos = self.field(table, number)
        if pos is None:
            return 0, 0
        vec = self.indirect(pos)
        length = self.u32(vec)
        if vec + 4 + 4 * length > len(self.data):
            raise ValueError(f"not a valid .pte: a vector of {length} entries overruns the program")
        return vec + 4, length

    def string(self, table: int, number: int) -> str:
        pos = self.field(table, number)
        if pos is None:
            return ""
        start = self.indirect(pos)
        length = self.u32(start)
        if start + 4 + length > len(self.data):
            raise ValueError("not a valid .pte: a string overruns the program")
        return bytes(self.data[start + 4 : start + 4 + length]).decode("utf-8", "replace")

    def ints(self, table: int, number: int) -> tuple[int, ...]:
        start, length = self.vector(table, number)
        return tuple(self._unpack("<i", start + 4 * k) for k in range(length))


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


def plan_io(data: bytes | memoryview, method: str) -> PlanIO:
    """The input and output value indices of ``method`` in the program ``data``.

    :param data: the program flatbuffer (the whole file, or at least its prefix
        of :func:`program_prefix_size` bytes).
    :param method: the method's name.
    :raises ValueError: the data is not a program, or it has no such method.
    """
    reader = _Reader(data)
    root = reader.indirect(0)
    start, count = reader.vector(root, _PROGRAM_EXECUTION_PLAN)
    names = []
    for k in range(count):
        plan = reader.indirect(start + 4 * k)
        name = reader.string(plan, _PLAN_NAME)
        if name == method:
            return PlanIO(reader.ints(plan, _PLAN_INPUTS), reader.ints(plan, _PLAN_OUTPUTS))
        names.append(name)
    raise ValueError(f"the program has no method {method!r}; it has {names}")
