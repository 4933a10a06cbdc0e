"""What importing the contract and loading the plugins imports, seen in a fresh interpreter,
and what each package's source imports, read from its files.

- writeback-core (the contract) never imports the application (the ``writeback``
  distribution) nor a plugin.
- A package imports only itself, writeback-core and the workspace packages its
  pyproject declares; only the packages of ``_ON_THE_APPLICATION`` build on the application.
- Loading every installed plugin imports no heavy library: exir, torchao, MLX and
  the compiled runtime wait until a hook needs them.
- ``python -m writeback`` is the ``writeback`` console script.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]

_APPLICATION = (
    "writeback",
    "writeback.bench",
    "writeback.cli",
    "writeback.default_plugin",
    "writeback.explain",
    "writeback.model_build",
    "writeback.process_memory",
    "writeback.session",
    "writeback.run",
    "writeback.zoo",
    "writeback_bench",
    "writeback_testing",
)

# What a plugin author imports: the contract, the whole of writeback-core.
_CONTRACT = tuple(
    sorted(
        f"writeback_core.{path.stem}" if path.stem != "__init__" else "writeback_core"
        for path in (_ROOT / "packages" / "core" / "src" / "writeback_core").glob("*.py")
    )
)

# Packages that build on the application, and why; every other package imports writeback-core only.
_ON_THE_APPLICATION = {
    "writeback-testing": "its oracle certifies the bytes the application's one lowering path writes",
    "writeback-bench": "a harness measures the backends it names through the application's lowering",
}

_HEAVY = (
    "executorch.exir",
    "executorch.examples",
    "torchao",
    "mlx",
    "transformers",
    "writeback_pybind_runtime._native",
)


def _modules_after(code: str) -> set[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_the_contract_imports_no_application_module() -> None:
    """Every contract module at once, in one fresh interpreter: if any of them imported an
    application module, it would be loaded here."""
    loaded = _modules_after("\n".join(f"import {module}" for module in _CONTRACT))
    assert set(_CONTRACT) <= loaded
    assert sorted(loaded & set(_APPLICATION)) == []


def test_loading_every_installed_plugin_imports_no_heavy_library() -> None:
    loaded = _modules_after(
        "from writeback_core import load_registry\n"
        "names = load_registry().plugin_names()\n"
        "assert 'passes' in names and 'mlx-backend' in names and 'pybind-runtime' in names, names"
    )
    assert "torch" in loaded  # torch itself is fine
    assert sorted(loaded & set(_HEAVY)) == []


def test_python_dash_m_writeback_is_the_console_script() -> None:
    script = Path(sys.executable).with_name("writeback")
    console = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300)
    module = subprocess.run([sys.executable, "-m", "writeback", "--help"], capture_output=True, text=True, timeout=300)
    assert console.returncode == module.returncode == 0, (console.stderr, module.stderr)
    assert "Usage: writeback" in console.stdout
    assert module.stdout == console.stdout
    assert module.stderr == console.stderr == ""


def _packages() -> dict[str, tuple[Path, list[str], set[str]]]:
    """Every workspace package: distribution -> (folder, import packages, declared writeback dependencies)."""
    found = {}
    for folder in sorted([*(_ROOT / "packages").iterdir(), *(_ROOT / "examples").iterdir()]):
        if not (folder / "pyproject.toml").exists():
            continue
        with open(folder / "pyproject.toml", "rb") as handle:
            project = tomllib.load(handle)["project"]
        modules = [p.name for p in (folder / "src").iterdir() if (p / "__init__.py").exists()]
        declared = {
            requirement.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
            for requirement in project.get("dependencies", [])
        }
        found[project["name"]] = (
            folder,
            modules,
            {d for d in declared if d == "writeback" or d.startswith("writeback-")},
        )
    return found


def _imports_of(folder: Path) -> dict[str, set[str]]:
    """Top-level module -> the files of ``folder/src`` importing it (absolute imports, lazy ones included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((folder / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(_ROOT)))
    return found


def _crossings() -> list[str]:
    packages = _packages()
    owner = {module: name for name, (_, modules, _) in packages.items() for module in modules}
    problems = []
    for name, (folder, _, declared) in packages.items():
        for module, files in _imports_of(folder).items():
            other = owner.get(module)
            if other is None or other == name or other == "writeback-core":
                continue
            if other not in declared:
                problems.append(f"{name} imports {other} ({module}) without declaring it: {sorted(files)}")
            elif other == "writeback" and name not in _ON_THE_APPLICATION:
                problems.append(f"{name} imports the application ({module}): {sorted(files)}")
            elif other != "writeback" and name != "writeback-bench":
                problems.append(f"{name} imports its sibling {other} ({module}): {sorted(files)}")
    return problems


def test_no_package_imports_the_application_or_a_sibling() -> None:
    packages = _packages()
    assert {"writeback-core", "writeback", "writeback-mlx-backend", "writeback-testing"} <= set(packages)
    assert _crossings() == []
    # writeback-core declares no other workspace package at all.
    assert packages["writeback-core"][2] == set()


def test_the_walk_sees_an_application_import_from_a_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk itself can fail: a plugin's file that imports the application is named."""
    (tmp_path / "packages").mkdir()
    (tmp_path / "examples").mkdir()
    for name, module, source, dependencies in (
        ("writeback-core", "writeback_core", "", []),
        ("writeback", "writeback", "import writeback_core\n", ["writeback-core"]),
        (
            "writeback-plugin",
            "writeback_plugin",
            "def f():\n    from writeback.session import lower_case\n",
            ["writeback-core", "writeback"],
        ),
        ("writeback-other", "writeback_other", "import writeback_plugin.x\n", ["writeback-core"]),
    ):
        folder = tmp_path / "packages" / name
        (folder / "src" / module).mkdir(parents=True)
        (folder / "src" / module / "__init__.py").write_text(source)
        quoted = ", ".join(f'"{d}"' for d in dependencies)
        (folder / "pyproject.toml").write_text(f'[project]\nname = "{name}"\ndependencies = [{quoted}]\n')
    monkeypatch.setattr(sys.modules[__name__], "_ROOT", tmp_path)
    problems = _crossings()
    assert len(problems) == 2, problems
    assert problems[0].startswith("writeback-other imports writeback-plugin (writeback_plugin) without declaring it")
    assert problems[1].startswith("writeback-plugin imports the application (writeback)")


def _module_paths_outside_core() -> set[str]:
    """Every importable module path of the workspace's other packages (``writeback.zoo``,
    ``writeback_mlx_backend.runtime``, ...), their top-level packages but the project's
    name itself (``writeback``, also the entry-point group) included."""
    paths = set()
    for name, (folder, modules, _) in _packages().items():
        if name == "writeback-core":
            continue
        for module in modules:
            for path in (folder / "src" / module).rglob("*.py"):
                parts = path.relative_to(folder / "src").with_suffix("").parts
                dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                if dotted != "writeback":
                    paths.add(dotted)
    return paths


def test_the_contract_names_no_application_or_plugin_module_even_to_import_it_lazily() -> None:
    """A lazy import (``importlib.import_module("writeback.zoo")``) escapes the import walk; a
    string in core's source that is exactly another package's module path is one."""
    outside = _module_paths_outside_core()
    assert {"writeback.zoo", "writeback_mlx_backend.runtime"} <= outside
    found = []
    for path in sorted((_ROOT / "packages" / "core" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in outside:
                found.append(f"{path.relative_to(_ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []
