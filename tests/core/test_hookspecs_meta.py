"""Meta-tests: every hookspec is documented, typed, prefixed, and exercised by a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from writeback_core import hookspecs

TESTS = Path(__file__).resolve().parents[1]
SPECS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "writeback_spec"))


def test_there_are_hookspecs() -> None:
    assert "writeback_accepts_in_place" in SPECS
    assert len(SPECS) >= 7


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_is_documented_and_typed(name: str) -> None:
    fn = getattr(hookspecs, name)
    assert name.startswith("writeback_")
    doc = inspect.getdoc(fn) or ""
    assert doc.startswith("Called"), f"{name}: the docstring must say when it is called"
    assert ":return:" in doc, f"{name}: the docstring must say what the return means"
    signature = inspect.signature(fn)
    for param in signature.parameters.values():
        assert f":param {param.name}:" in doc, f"{name}: :param {param.name}: is undocumented"
        assert param.annotation is not inspect.Parameter.empty, f"{name}: {param.name} is untyped"
        assert param.default is inspect.Parameter.empty
    assert signature.return_annotation is not inspect.Signature.empty
    if fn.writeback_spec.get("firstresult"):
        assert "Stops at the first non-None result" in doc
    if "None" in str(signature.return_annotation):
        assert "None" in doc.split(":return:")[1], f"{name}: say what None means"


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_has_a_test(name: str) -> None:
    mentioned = [
        path for path in TESTS.rglob("test_*.py") if path.name != Path(__file__).name and name in path.read_text()
    ]
    assert mentioned, f"no test mentions hook {name}"
