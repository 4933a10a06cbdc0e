"""Meta-tests, as datasette has: every hook is on the "Writing a backend" page and has a test."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import writeback_core.hookspecs as hookspecs
import writeback_core.registry as registry_module

_ROOT = Path(__file__).resolve().parents[2]
_PAGE = _ROOT / "docs" / "writing-a-backend.md"
_TESTS = _ROOT / "tests"
_HOOKS = sorted(name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("writeback_"))


def _registry_methods_calling(hook: str) -> set[str]:
    """Names of the ``Registry`` methods whose body names ``hook`` (how the pipeline calls it)."""
    tree = ast.parse(inspect.getsource(registry_module))
    found = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Registry"):
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            if not method.name.startswith("_") and hook in ast.unparse(method):
                found.add(method.name)
    return found


def _test_sources() -> dict[Path, str]:
    this = Path(__file__).resolve()
    return {p: p.read_text() for p in _TESTS.rglob("test_*.py") if p.resolve() != this}


def test_the_hook_list_is_read_from_the_hookspecs() -> None:
    assert {"writeback_backends", "writeback_accepts_in_place", "writeback_runtime_delegates"} <= set(_HOOKS)


@pytest.mark.parametrize("hook", _HOOKS)
def test_every_hookspec_is_named_on_the_writing_a_backend_page(hook: str) -> None:
    assert re.search(rf"`{hook}`", _PAGE.read_text()), f"docs/writing-a-backend.md does not name `{hook}`: add it"


@pytest.mark.parametrize("hook", _HOOKS)
def test_every_hookspec_is_exercised_by_a_test(hook: str) -> None:
    """A test implements or calls the hook, or calls a registry method that calls it."""
    calls = [re.compile(rf"\.{m}\(") for m in sorted(_registry_methods_calling(hook))]
    users = [
        path.relative_to(_ROOT).as_posix()
        for path, text in _test_sources().items()
        if hook in text or any(c.search(text) for c in calls)
    ]
    assert users, f"no test under tests/ names {hook} or a Registry method that calls it: add one"


def test_the_root_readme_and_the_example_readme_link_the_page() -> None:
    assert "docs/writing-a-backend.md" in (_ROOT / "README.md").read_text()
    example = (_ROOT / "examples" / "third-party-backend" / "README.md").read_text()
    assert "docs/writing-a-backend.md" in example
