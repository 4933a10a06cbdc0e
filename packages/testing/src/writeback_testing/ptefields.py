"""Where each field of a ``.pte``'s execution plans lives: the blob fuzzer's map of a program.

The fuzzer mutates a ``.pte`` in place, one scalar at a time, so every mutant is
the real program with one field changed (no re-serialization, which would need
``flatc`` per mutant). :func:`plan_fields` walks a valid program's flatbuffer
(ExecuTorch's ``schema/program.fbs``, field numbers below) and lists every
scalar it finds with its byte offset, width and path:

- each value (``values[i]``): its union kind (type confusion), an ``Int``'s
  value, a ``Bool``'s, a tensor's scalar type, storage offset, sizes, dim order,
  data buffer index, allocation (memory id and offsets), shape dynamism, and the
  items of int and tensor lists (references to other values);
- each instruction of each chain: its kind, operator or delegate index, every
  argument (a value index), move, jump and free operands;
- the method's input and output value indices, the planned buffer sizes;
- each delegate's data location and index;
- the length of every vector above (a length that overruns the program).

Only fields present in the file are listed: an absent field has no bytes to change.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["PlanField", "plan_fields"]

# (field number, name, struct format) per table of schema/program.fbs.
_UNION_TYPE, _UNION_VALUE = 0, 1
_KINDS = {1: "Null", 2: "Int", 3: "Bool", 4: "Double", 5: "Tensor", 6: "String", 7: "IntList"}
_KINDS.update({8: "DoubleList", 9: "BoolList", 10: "TensorList", 11: "OptionalTensorList"})
_INSTRUCTIONS = {1: "KernelCall", 2: "DelegateCall", 3: "MoveCall", 4: "JumpFalseCall", 5: "FreeCall"}
# Scalars of each table, and its vectors of scalars (field number, name, element format).
_SCALARS: dict[str, tuple[tuple[int, str, str], ...]] = {
    "Int": ((0, "int_val", "<q"),),
    "Bool": ((0, "bool_val", "<B"),),
    "Tensor": (
        (0, "scalar_type", "<b"),
        (1, "storage_offset", "<i"),
        (4, "requires_grad", "<B"),
        (5, "data_buffer_idx", "<I"),
        (7, "layout", "<b"),
        (8, "shape_dynamism", "<b"),
    ),
    "AllocationDetails": ((0, "memory_id", "<I"), (1, "memory_offset_low", "<I"), (2, "memory_offset_high", "<I")),
    "KernelCall": ((0, "op_index", "<i"),),
    "DelegateCall": ((0, "delegate_index", "<i"),),
    "MoveCall": ((0, "move_from", "<i"), (1, "move_to", "<i")),
    "JumpFalseCall": ((0, "cond_value_index", "<i"), (1, "destination_instruction", "<i")),
    "FreeCall": ((0, "value_index", "<i"),),
    "BackendDelegateDataReference": ((0, "location", "<B"), (1, "index", "<I")),
}
_VECTORS: dict[str, tuple[tuple[int, str, str], ...]] = {
    "Tensor": ((2, "sizes", "<i"), (3, "dim_order", "<B")),
    "IntList": ((0, "items", "<q"),),
    "BoolList": ((0, "items", "<B"),),
    "TensorList": ((0, "items", "<i"),),
    "OptionalTensorList": ((0, "items", "<i"),),
    "KernelCall": ((1, "args", "<i"),),
    "DelegateCall": ((1, "args", "<i"),),
    "ExecutionPlan": ((3, "inputs", "<i"), (4, "outputs", "<i"), (8, "non_const_buffer_sizes", "<q")),
}


@dataclass(frozen=True)
class PlanField:
    """One scalar of the program: ``path`` names it (``plan[0].values[3].Tensor.sizes[1]``),
    ``offset`` is where its ``fmt`` (a ``struct`` format) bytes start."""

    path: str
    offset: int
    fmt: str

    def read(self, data: bytes | bytearray) -> int:
        value: int = struct.unpack_from(self.fmt, data, self.offset)[0]
        return value


class _Walker:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.found: list[PlanField] = []

    def _unpack(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise ValueError(f"offset {pos} is outside the {len(self.data)}-byte program")
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    def field(self, table: int, number: int) -> int | None:
        vtable = table - self._unpack("<i", table)
        slot = 4 + 2 * number
        if slot + 2 > self._unpack("<H", vtable):
            return None
        offset = self._unpack("<H", vtable + slot)
        return table + offset if offset else None

    def indirect(self, pos: int) -> int:
        return pos + self._unpack("<I", pos)

    def vector(self, table: int, number: int, path: str) -> tuple[int, int] | None:
        pos = self.field(table, number)
        if pos is None:
            return None
        start = self.indirect(pos)
        self.found.append(PlanField(f"{path}.length", start, "<I"))
        return start + 4, self._unpack("<I", start)

    def scalars(self, table: int, kind: str, path: str) -> None:
        for number, name, fmt in _SCALARS.get(kind, ()):
            pos = self.field(table, number)
            if pos is not None:
                self.found.append(PlanField(f"{path}.{name}", pos, fmt))
        for number, name, fmt in _VECTORS.get(kind, ()):
            span = self.vector(table, number, f"{path}.{name}")
            if span is not None:
                size = struct.calcsize(fmt)
                self.found.extend(PlanField(f"{path}.{name}[{k}]", span[0] + size * k, fmt) for k in range(span[1]))

    def tables(self, table: int, number: int, path: str) -> list[tuple[str, int]]:
        span = self.vector(table, number, path)
        if span is None:
            return []
        return [(f"{path}[{k}]", self.indirect(span[0] + 4 * k)) for k in range(span[1])]

    def union(self, table: int, names: dict[int, str], path: str) -> None:
        kind_pos, value_pos = self.field(table, _UNION_TYPE), self.field(table, _UNION_VALUE)
        if kind_pos is None or value_pos is None:
            return
        self.found.append(PlanField(f"{path}.kind", kind_pos, "<B"))
        kind = names.get(self._unpack("<B", kind_pos), "")
        inner = self.indirect(value_pos)
        self.scalars(inner, kind, f"{path}.{kind}")
        if kind == "Tensor":
            allocation = self.field(inner, 6)
            if allocation is not None:
                self.scalars(self.indirect(allocation), "AllocationDetails", f"{path}.Tensor.allocation_info")

    def plan(self, plan: int, path: str) -> None:
        self.scalars(plan, "ExecutionPlan", path)
        for where, value in self.tables(plan, 2, f"{path}.values"):
            self.union(value, _KINDS, where)
        for chain_path, chain in self.tables(plan, 5, f"{path}.chains"):
            for where, instruction in self.tables(chain, 2, f"{chain_path}.instructions"):
                self.union(instruction, _INSTRUCTIONS, where)
        for where, delegate in self.tables(plan, 7, f"{path}.delegates"):
            processed = self.field(delegate, 1)
            if processed is not None:
                self.scalars(self.indirect(processed), "BackendDelegateDataReference", f"{where}.processed")


def plan_fields(data: bytes) -> list[PlanField]:
    """Every scalar field of every execution plan of the program ``data`` (a valid ``.pte``).

    :raises ValueError: ``data`` is not a program this walker can read.
    """
    walker = _Walker(data)
    root = walker.indirect(0)
    for path, plan in walker.tables(root, 1, "plan"):
        walker.plan(plan, path)
    return walker.found
