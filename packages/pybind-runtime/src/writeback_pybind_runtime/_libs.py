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

__all__ = ["NATIVE_PATH_ENV", "executorch_lib_dir", "native"]

# The XNNPACK backend registers itself when its library loads: the same library file
# executorch's own bindings link, so either side loading first registers it once.
_LIBRARIES = (
    "libexecutorch.so",
    "libexecutorch_kernels_optimized.so",
    "libexecutorch_threadpool.so",
    "libexecutorch_backend_xnnpack.so",
)


def executorch_lib_dir() -> str:
    """The ``lib`` folder of the installed executorch package (found without importing it)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("writeback_pybind_runtime needs the executorch package (executorch==1.5.1)")
    return os.path.join(next(iter(spec.submodule_search_locations)), "lib")


# Names a compiled extension file to load instead of the installed one: an
# instrumented build of _native.cpp (AddressSanitizer; see the README), never
# needed otherwise.
NATIVE_PATH_ENV = "WRITEBACK_PYBIND_NATIVE_PATH"


def _load_extension(path: str) -> ModuleType:
    """The extension module compiled at ``path``, imported as ``writeback_pybind_runtime._native``."""
    import importlib.machinery
    import sys

    name = "writeback_pybind_runtime._native"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"{NATIVE_PATH_ENV}={path!r} names no compiled extension file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


@cache
def native() -> ModuleType:
    """The compiled ``_native`` module, imported once its libraries are loaded."""
    lib_dir = executorch_lib_dir()
    for name in _LIBRARIES:
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    override = os.environ.get(NATIVE_PATH_ENV)
    if override:
        _native = _load_extension(override)
    else:
        import writeback_pybind_runtime._native as _native
    from writeback_pybind_runtime import _errors

    _native.set_error_types(_errors.DelegateError, _errors.ProgramError)
    return _native
