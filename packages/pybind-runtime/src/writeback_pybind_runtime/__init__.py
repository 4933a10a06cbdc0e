"""writeback-pybind-runtime: a Python runtime over the ExecuTorch runtime library.

``Runtime.get().load_program(path_or_bytes).load_method("forward")`` gives a
:class:`Method` whose mutated inputs land in the caller's tensors, whose
unplanned outputs can be bound to caller storage (``set_output``), and which
runs Python delegates that plugins offer through ``writeback_runtime_delegates``.
"""

from __future__ import annotations

from writeback_pybind_runtime._executorch_version import check_executorch

# Before anything can load the compiled extension: another executorch release's
# library fails late and obscurely, this names both versions.
check_executorch()

from writeback_pybind_runtime._errors import DelegateError, ProgramError  # noqa: E402 - after the version check
from writeback_pybind_runtime._runtime import (  # noqa: E402 - after the version check
    DecoderContract,
    Method,
    MethodMetadata,
    Program,
    Runtime,
    ValueMetadata,
    Verification,
    set_log_level,
)

__all__ = [
    "DecoderContract",
    "DelegateError",
    "Method",
    "MethodMetadata",
    "Program",
    "ProgramError",
    "Runtime",
    "ValueMetadata",
    "Verification",
    "set_log_level",
]
