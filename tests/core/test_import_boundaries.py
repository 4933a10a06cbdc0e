"""What importing the contract and loading the plugins imports, seen in a fresh interpreter,
and what each package's source imports, read from its files.

- writeback-core (the contract) never imports the application (the ``writeback``
  distribution) nor a plugin.
- A package imports only itself, writeback-core and the workspace packages its
  pyproject declares; only the packages of ``_ON_THE_APPLICATION`` build on the application.
  "Package" means every folder with a pyproject under ``packages/``, ``examples/`` and
  ``integrations/`` (the optimum recipe lives outside the workspace, but is ours).
- No private name crosses a module: no ``from m import _name``, no ``m._name``, and no
  package imports another package's private module (``writeback_core._name``). A helper
  another module needs is public in its module (``__all__``) or moved where both import it.
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
    "writeback_bench.bench_command",
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

# Packages that assemble their declared siblings, and why; a plugin never does (it meets the
# others in core's hooks).
_ASSEMBLING = {
    "writeback-bench": "a harness measures the backends and passes it names side by side",
    "writeback-optimum-executorch": "a recipe hands optimum core's partition arguments and the passes' to_executorch",
}

# The folders whose sub-folders are packages of ours: the workspace's, the third-party example's
# and the integrations' (which install apart, but import the same packages).
_GROUPS = ("packages", "examples", "integrations")

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
    folders = [folder for group in _GROUPS if (_ROOT / group).is_dir() for folder in (_ROOT / group).iterdir()]
    for folder in sorted(folders):
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
            elif other != "writeback" and name not in _ASSEMBLING:
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
        folder = tmp_path / ("integrations" if name == "writeback-other" else "packages") / name
        (folder / "src" / module).mkdir(parents=True)
        (folder / "src" / module / "__init__.py").write_text(source)
        quoted = ", ".join(f'"{d}"' for d in dependencies)
        (folder / "pyproject.toml").write_text(f'[project]\nname = "{name}"\ndependencies = [{quoted}]\n')
    monkeypatch.setattr(sys.modules[__name__], "_ROOT", tmp_path)
    problems = _crossings()
    assert len(problems) == 2, problems
    # writeback-other lives in integrations/: the walk reads it too.
    assert problems[0].startswith("writeback-other imports writeback-plugin (writeback_plugin) without declaring it")
    assert problems[1].startswith("writeback-plugin imports the application (writeback)")


def _module_paths_outside_core() -> set[str]:
    """Every importable module path of the workspace's other packages (``writeback.zoo``,
    ``writeback_mlx_backend.mlx_delegate``, ...), their top-level packages but the project's
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
    assert {"writeback.zoo", "writeback_mlx_backend.mlx_delegate"} <= outside
    found = []
    for path in sorted((_ROOT / "packages" / "core" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in outside:
                found.append(f"{path.relative_to(_ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> dict[str, tuple[str, Path]]:
    """Every module of every package: dotted path -> (distribution, file)."""
    found = {}
    for name, (folder, modules, _) in _packages().items():
        for module in modules:
            for path in (folder / "src" / module).rglob("*.py"):
                parts = path.relative_to(folder / "src").with_suffix("").parts
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (name, path)
    return found


def _absolute(node: ast.ImportFrom, dotted: str, is_package: bool) -> str:
    """The module an import names, a relative one (``from .x import y``) resolved against ``dotted``."""
    if node.level == 0:
        return node.module or ""
    base = dotted.split(".") if is_package else dotted.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _private_crossings() -> list[str]:
    """Every place a private name crosses a module: ``from m import _name`` (``_name`` not a
    module of the importer's own package), ``m._name`` on an imported module of ours, and
    any import of another package's private module (a part of its path starting with ``_``)."""
    modules = _modules()
    problems = []
    for dotted, (owner, path) in sorted(modules.items()):
        where = str(path.relative_to(_ROOT))
        bound: dict[str, str] = {}  # a local name -> the module of ours it is
        imported: list[tuple[int, str]] = []  # (line, module path) of every import of ours
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        imported.append((node.lineno, alias.name))
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, dotted, path.name == "__init__.py")
                if source not in modules:
                    continue
                imported.append((node.lineno, source))
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:
                        imported.append((node.lineno, full))
                        bound[alias.asname or alias.name] = full
                    elif _is_private(alias.name):
                        problems.append(f"{where}:{node.lineno}: imports {alias.name} from {source}, private to it")
        for line, module in imported:
            if modules[module][0] != owner and any(_is_private(part) for part in module.split(".")):
                problems.append(f"{where}:{line}: imports {module}, a private module of {modules[module][0]}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = ".".join([bound[value.id], *reversed(chain)])
                problems.append(f"{where}:{node.lineno}: reads {node.attr} of {module}, private to it")
    return sorted(set(problems))


def test_no_private_name_crosses_a_module() -> None:
    """Each line names the importing file and the private name: make the name public in its
    module (and its ``__all__``), or move the helper where both modules import it."""
    assert {"writeback_core._name", "writeback_optimum"} <= set(_modules())
    assert _private_crossings() == []


def test_the_walk_sees_private_names_crossing_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The private-name walk itself can fail: each way a private name crosses is named once, and
    a package's own private module (imported whole, or its public names) is not a crossing."""
    sources = {
        "writeback-core": {"__init__.py": "", "_name.py": "NAME = 'w'\n", "ops.py": "def _helper(): ...\n"},
        "writeback-plugin": {
            "__init__.py": "from writeback_plugin import _own\nfrom writeback_plugin._own import VALUE\n",
            "_own.py": "VALUE = 1\n",
            "a.py": "from writeback_core._name import NAME\nfrom writeback_core.ops import _helper\n",
            "b.py": "import writeback_core.ops as ops\n\ndef f():\n    return ops._helper\n",
            "c.py": "from . import a\nfrom .a import _x\n",
        },
    }
    for name, files in sources.items():
        folder = tmp_path / ("integrations" if name == "writeback-plugin" else "packages") / name
        package = folder / "src" / name.replace("-", "_")
        package.mkdir(parents=True)
        for file, text in files.items():
            (package / file).write_text(text)
        (folder / "pyproject.toml").write_text(f'[project]\nname = "{name}"\ndependencies = []\n')
    monkeypatch.setattr(sys.modules[__name__], "_ROOT", tmp_path)
    plugin = "integrations/writeback-plugin/src/writeback_plugin"
    assert _private_crossings() == [
        f"{plugin}/a.py:1: imports writeback_core._name, a private module of writeback-core",
        f"{plugin}/a.py:2: imports _helper from writeback_core.ops, private to it",
        f"{plugin}/b.py:4: reads _helper of writeback_core.ops, private to it",
        f"{plugin}/c.py:2: imports _x from writeback_plugin.a, private to it",
    ]
