"""What importing the contract and loading the plugins imports, seen in a fresh interpreter.

- The registry (the contract side of core) never imports the application.
- Loading every installed plugin imports no heavy library: exir, torchao, MLX and
  the compiled runtime wait until a hook needs them.
- ``python -m writeback`` is the ``writeback`` console script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_APPLICATION = (
    "writeback_core.bench",
    "writeback_core.bench_cache",
    "writeback_core.bench_common",
    "writeback_core.bench_model",
    "writeback_core.bench_plot",
    "writeback_core.cli",
    "writeback_core.default_plugin",
    "writeback_core.explain",
    "writeback_core.lowering",
    "writeback_core.pipeline",
    "writeback_core.run",
    "writeback_core.testing",
    "writeback_core.zoo",
    "writeback_testing",
)

# What a plugin author imports: the contract.
_CONTRACT = (
    "writeback_core",
    "writeback_core.alias",
    "writeback_core.blob",
    "writeback_core.hookspecs",
    "writeback_core.meta",
    "writeback_core.mutations",
    "writeback_core.ops",
    "writeback_core.partition",
    "writeback_core.quiet",
    "writeback_core.registry",
    "writeback_core.types",
)

_HEAVY = ("executorch.exir", "torchao", "mlx", "writeback_pybind_runtime._native")


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
