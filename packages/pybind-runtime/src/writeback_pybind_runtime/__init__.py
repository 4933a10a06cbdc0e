"""writeback-pybind-runtime: a Python runtime over the ExecuTorch runtime library.

``Runtime.get().load_program(path_or_bytes).load_method("forward")`` gives a
:class:`Method` whose mutated inputs land in the caller's tensors, whose
unplanned outputs can be bound to caller storage (``set_output``), and which
runs Python delegates that plugins offer through ``writeback_runtime_delegates``.
"""

from __future__ import annotations

from writeback_pybind_runtime._errors import DelegateError, ProgramError
from writeback_pybind_runtime._runtime import (
    Method,
    MethodMetadata,
    Program,
    Runtime,
    ValueMetadata,
    Verification,
)

__all__ = [
    "DelegateError",
    "Method",
    "MethodMetadata",
    "Program",
    "ProgramError",
    "Runtime",
    "ValueMetadata",
    "Verification",
]
