"""No two source files import each other, directly or around a longer loop, and one lowering path.

The graph: one node per module file under ``packages/*/src``, ``integrations/*/src`` and
``examples/*/src`` (``pkg/__init__.py`` is ``pkg``); an edge from a file to every module of
the tree it imports when it runs. What counts as an import, read with ``ast``:

- every ``import a.b`` and ``from a.b import c`` anywhere in the file, at module level or
  inside a function or class body (a deferred import runs too, only later);
- ``from a import b`` is an edge to ``a.b`` when that is a module of the tree, else to ``a``;
  relative imports are resolved against the importing file's package;
- imports under ``if TYPE_CHECKING:`` do not count: they never run;
- ``importlib.import_module`` by a string (a package's lazy ``__getattr__``) is not read.

Also here: exactly one public ``lower`` and one public ``to_executorch`` are defined in those
files, both in ``writeback_core/lowering.py`` (issue 53: "the one lowering path").
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_TOPS = ("packages", "integrations", "examples")


def _source_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``<top>/*/src``."""
    modules: dict[str, Path] = {}
    for top in _TOPS:
        for src in sorted((root / top).glob("*/src")):
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if parts:
                    modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import node that can run: all of them but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports at run time (see the module docstring)."""
    modules = _source_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop (``[a, b, ..., a]``) per strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative: the tree is deep enough to matter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_loop_in(group, graph) for group in groups]


def _loop_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest loop through the first module of ``group`` (by name), for the message."""
    first = min(group)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == first:
                    return [*paths[node], first]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no loop through {first} in {sorted(group)}")


def test_no_two_source_files_import_each_other_nor_around_a_loop() -> None:
    found = cycles(import_graph(_ROOT))
    assert not found, "import cycles between files (break each by moving what both need to one of them):\n" + (
        "\n".join(" -> ".join(loop) for loop in found)
    )


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_walk_names_a_loop_made_of_deferred_relative_and_from_imports(tmp_path: Path) -> None:
    """The check can fail: a -> b (a deferred import), b -> c (relative), c -> a (``from pkg
    import a``) is named; an import under ``TYPE_CHECKING`` closes no loop."""
    _write(tmp_path, "packages/one/src/pkg/__init__.py", "")
    _write(tmp_path, "packages/one/src/pkg/a.py", "def f():\n    import pkg.b\n")
    _write(tmp_path, "packages/one/src/pkg/b.py", "from . import c\n")
    _write(tmp_path, "packages/one/src/pkg/c.py", "from pkg import a\n")
    _write(
        tmp_path,
        "packages/one/src/pkg/d.py",
        "from typing import TYPE_CHECKING\nimport pkg.a\nif TYPE_CHECKING:\n    import pkg.d2\n",
    )
    _write(tmp_path, "packages/one/src/pkg/d2.py", "import pkg.d\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.d2"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def _public_definitions(root: Path, names: set[str]) -> dict[str, list[str]]:
    """Name -> ``module`` of every module-level ``def``/``class`` of that name (not ``_private``)."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for module, path in _source_files(root).items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
                found[node.name].append(module)
    return found


def test_one_public_lower_and_one_to_executorch_both_in_the_lowering_module() -> None:
    found = _public_definitions(_ROOT, {"lower", "to_executorch"})
    assert found == {"lower": ["writeback_core.lowering"], "to_executorch": ["writeback_core.lowering"]}, found
