"""Run the binding tests under a memory checker, with their programs lowered beforehand.

Exporting under valgrind takes far too long, so this runs in two steps:

    python -m pybind_runtime.memcheck_tests prepare CACHE    # lower every program (fast)
    PYTHONMALLOC=malloc valgrind python -m pybind_runtime.memcheck_tests run CACHE

or, much faster, an AddressSanitizer build of ``_native.cpp`` (``-fsanitize=address``)
loaded in place of the extension, with ``LD_PRELOAD="$(gcc -print-file-name=libasan.so)
$(gcc -print-file-name=libstdc++.so)"`` and ``ASAN_OPTIONS=detect_leaks=0``.

``run`` calls every test function of ``test_set_output``, ``test_python_delegates``,
``test_input_mutations``, ``test_review_hazards`` and ``test_runtime_basics`` (stock
comparisons included) with a ``lower`` that
returns the prepared bytes, and prints how many passed. Run from ``tests/`` on
``PYTHONPATH``. Not collected by pytest.
"""

from __future__ import annotations

import inspect
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import Runtime

from tests.pybind_runtime import (
    conftest,
    test_input_mutations,
    test_python_delegates,
    test_review_hazards,
    test_runtime_basics,
    test_set_output,
)

MODULES = (test_set_output, test_python_delegates, test_input_mutations, test_review_hazards, test_runtime_basics)


def _key(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
    extra = {k: (type(v[0]).__name__ if k == "partitioners" and v else repr(v)) for k, v in kwargs.items()}
    return f"{type(module).__qualname__}|{shapes}|{sorted(extra.items())}"


def _calls(module: Any) -> list[tuple[str, Any, list[dict[str, Any]]]]:
    """Each test function with every parametrization of its arguments."""
    found = []
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if not name.startswith("test_"):
            continue
        cases: list[dict[str, Any]] = [{}]
        for mark in reversed(getattr(fn, "pytestmark", [])):
            if mark.name != "parametrize":
                continue
            names = [n.strip() for n in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])]
            values = mark.args[1]
            cases = [
                dict(c, **dict(zip(names, v if len(names) > 1 else (v,), strict=True))) for c in cases for v in values
            ]
        found.append((name, fn, cases))
    return found


def _fixtures(lower: Any, tmp: Path) -> dict[str, Any]:
    runtime = Runtime(load_registry(entry_points=False))
    values: dict[str, Any] = {"lower": lower, "runtime": runtime, "tmp_path": tmp}
    values["load"] = lambda pte, name="forward": runtime.load_program(pte).load_method(name)
    return values


def _run_all(lower: Any) -> tuple[int, list[str]]:
    passed, failed = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for module in MODULES:
            for name, fn, cases in _calls(module):
                for case in cases:
                    fixtures = _fixtures(lower, Path(tmp))
                    params = inspect.signature(fn).parameters
                    kwargs: dict[str, Any] = {}
                    for arg in params:
                        if arg in case:
                            kwargs[arg] = case[arg]
                        elif arg in fixtures:
                            kwargs[arg] = fixtures[arg]
                        else:  # a module-level fixture such as ``two`` or ``doubled_pte``
                            factory = getattr(module, arg).__wrapped__
                            sub = {a: fixtures[a] for a in inspect.signature(factory).parameters}
                            kwargs[arg] = factory(**sub)
                    try:
                        fn(**kwargs)
                        passed += 1
                    except pytest.skip.Exception:
                        passed += 1
                    except Exception as error:
                        failed.append(f"{module.__name__}.{name}{case}: {error!r}")
    return passed, failed


def main(argv: list[str]) -> int:
    mode, cache_path = argv[0], Path(argv[1])
    if mode == "prepare":
        cache: dict[str, bytes] = {}

        def recording(module: torch.nn.Module, args: tuple[Any, ...], **kwargs: Any) -> bytes:
            pte = conftest.to_pte(module, args, **kwargs)
            cache[_key(module, args, kwargs)] = pte
            return pte

        passed, failed = _run_all(recording)
        cache_path.write_bytes(pickle.dumps(cache))
    else:
        cache = pickle.loads(cache_path.read_bytes())

        def cached(module: torch.nn.Module, args: tuple[Any, ...], **kwargs: Any) -> bytes:
            return cache[_key(module, args, kwargs)]

        passed, failed = _run_all(cached)
    print(f"{mode}: {passed} passed, {len(failed)} failed")
    for line in failed:
        print("  FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
