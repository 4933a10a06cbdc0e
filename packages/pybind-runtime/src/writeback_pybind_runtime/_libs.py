"""Load the compiled extension after the installed executorch runtime library.

The extension links ``libexecutorch.so`` by name. Loading the installed
executorch package's copy first (``RTLD_GLOBAL``) makes the dynamic loader
reuse it, whatever the extension's run path says, so this runtime and
``executorch.runtime`` share one kernel registry and one backend registry.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache
from types import ModuleType

__all__ = ["executorch_lib_dir", "native"]

_LIBRARIES = ("libexecutorch.so", "libexecutorch_kernels_optimized.so")


def executorch_lib_dir() -> str:
    """The ``lib`` folder of the installed executorch package (found without importing it)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("writeback_pybind_runtime needs the executorch package (executorch==1.5.1)")
    return os.path.join(next(iter(spec.submodule_search_locations)), "lib")


@cache
def native() -> ModuleType:
    """The compiled ``_native`` module, imported once its libraries are loaded."""
    lib_dir = executorch_lib_dir()
    for name in _LIBRARIES:
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    import writeback_pybind_runtime._native as _native
    from writeback_pybind_runtime import _errors

    _native.set_error_types(_errors.DelegateError, _errors.ProgramError)
    return _native
