"""Read which values a method takes and returns straight from a ``.pte`` flatbuffer.

The runtime's ``Method`` can only tell "output i is input j" through
``get_input``, which marks the input as set and so disables ExecuTorch's own
"input not set" check. The answer is in the program itself: each execution
plan lists the value indices of its inputs and outputs, and an output that is
an input names the same value. This module reads those two lists with a small
bounds-checked flatbuffer reader (no generated code ships with the wheel), so
a corrupted file raises :class:`ValueError` instead of reading out of range.

This module is the reader's face: :class:`PlanIO`, :func:`plan_io` and
:func:`program_prefix_size` live here, and it offers :func:`validate_plan` (the checks a plan
passes before it loads, in ``_pte_checks``) and :func:`written_inputs` (in ``_pte_written``);
the flatbuffer layout and reader are in ``_pte_format``, what operators take and write in
``_pte_operators``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from writeback_pybind_runtime._pte_checks import validate_plan
from writeback_pybind_runtime._pte_format import PLAN_INPUTS, PLAN_OUTPUTS, Reader, find_plan
from writeback_pybind_runtime._pte_written import written_inputs

__all__ = ["PlanIO", "plan_io", "program_prefix_size", "validate_plan", "written_inputs"]

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
    reader = Reader(data)
    plan = find_plan(reader, method)
    return PlanIO(reader.ints(plan, PLAN_INPUTS), reader.ints(plan, PLAN_OUTPUTS))
