"""An AddressSanitizer build of the pybind-runtime extension, into a directory of the caller's.

``build(directory)`` compiles ``_native.cpp`` with ``-fsanitize=address`` against the
installed executorch (its headers and ``libexecutorch.so``, as ``CMakeLists.txt``
does) and returns the ``.so``; :func:`environment` is what a Python process needs
to run it: ``LD_PRELOAD`` of the compiler's ``libasan.so`` (the interpreter itself
is not instrumented, so the runtime must be loaded first) and of ``libstdc++`` and
``WRITEBACK_PYBIND_NATIVE_PATH`` naming the build, which ``writeback_pybind_runtime``
then imports instead of the installed extension.

Run locally: ``python -m pybind_runtime.asan DIR`` (from ``tests/`` on ``PYTHONPATH``)
builds into ``DIR`` and prints the environment to run anything under it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).parents[2] / "packages/pybind-runtime/src/writeback_pybind_runtime/_native.cpp"
# The definitions executorch's CMake package gives its consumers (see CMakeLists.txt).
_DEFINES = ("-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED", "-DET_USE_THREADPOOL")
_DEFINES += ("-D_GLIBCXX_USE_CXX11_ABI=1",)
_LIBRARIES = ("libexecutorch_threadpool.so", "libexecutorch_kernels_optimized.so", "libexecutorch.so")


class Unavailable(Exception):
    """What is missing to build or run the sanitized extension (the reason to skip)."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"the {name} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _pybind11_include() -> Path:
    """pybind11's headers: the pybind11 package's, else the copy torch ships."""
    if importlib.util.find_spec("pybind11") is not None:
        import pybind11

        return Path(pybind11.get_include())
    torch_include = _package_dir("torch") / "include"
    if (torch_include / "pybind11" / "pybind11.h").exists():
        return torch_include
    raise Unavailable("no pybind11 headers (neither the pybind11 package nor torch's copy)")


def libasan() -> Path:
    """The compiler's AddressSanitizer runtime library."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise Unavailable("no g++ on PATH")
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False)
    path = Path(found.stdout.strip())
    if found.returncode != 0 or not path.is_absolute() or not path.exists():
        raise Unavailable("g++ has no AddressSanitizer runtime (libasan.so)")
    return path.resolve()


def libstdcxx() -> Path:
    """The C++ runtime the sanitizer must find loaded: its ``__cxa_throw`` interceptor
    aborts the first C++ throw (torch throws at import) when libstdc++ comes later."""
    found = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, check=False)
    path = Path(found.stdout.strip())
    if found.returncode != 0 or not path.is_absolute() or not path.exists():
        raise Unavailable("g++ names no libstdc++.so.6")
    return path.resolve()


def build(directory: Path) -> Path:
    """Compile the sanitized extension into ``directory``; :class:`Unavailable` when it cannot."""
    compiler, asan = shutil.which("g++"), libasan()
    assert compiler is not None  # libasan() found it
    executorch = _package_dir("executorch")
    include, lib = executorch / "include", executorch / "lib"
    missing = [name for name in _LIBRARIES if not (lib / name).exists()]
    if missing or not include.is_dir():
        raise Unavailable(f"the executorch package lacks its headers or {missing}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = directory / f"_native{suffix}"
    command = [
        compiler,
        "-O1",
        "-g",
        "-fsanitize=address",
        "-fno-omit-frame-pointer",
        "-std=gnu++17",
        "-fPIC",
        "-shared",
        *_DEFINES,
        "-isystem",
        sysconfig.get_paths()["include"],
        "-isystem",
        str(_pybind11_include()),
        "-isystem",
        str(include),
        "-isystem",
        str(include / "executorch/runtime/core/portable_type/c10"),
        str(SOURCE),
        "-o",
        str(target),
        "-Wl,--no-as-needed",
        *(str(lib / name) for name in _LIBRARIES),
        f"-Wl,-rpath,{lib}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the sanitized build failed:\n{done.stderr[-4000:]}")
    del asan
    return target


def environment(extension: Path) -> dict[str, str]:
    """This process's environment plus what runs ``extension`` under AddressSanitizer."""
    return dict(
        os.environ,
        LD_PRELOAD=f"{libasan()} {libstdcxx()}",
        # Python and torch free memory at exit in ways LeakSanitizer reports as leaks;
        # the fuzzer wants memory errors, which abort the process.
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
        WRITEBACK_PYBIND_NATIVE_PATH=str(extension),
    )


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    built = build(out)
    env = environment(built)
    print(f"LD_PRELOAD={env['LD_PRELOAD']} ASAN_OPTIONS={env['ASAN_OPTIONS']} WRITEBACK_PYBIND_NATIVE_PATH={built}")
