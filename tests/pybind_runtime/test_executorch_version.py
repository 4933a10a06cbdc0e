"""Importing the runtime beside another executorch release fails at once, naming both versions."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
from writeback_pybind_runtime import _executorch_version
from writeback_pybind_runtime._executorch_version import check_executorch, wanted_executorch


def test_the_wanted_release_is_the_one_installed_and_pinned() -> None:
    assert wanted_executorch() == "1.5.1"
    assert metadata.version("executorch").split("+")[0] == wanted_executorch()
    check_executorch()


def test_another_release_is_an_import_error_naming_found_and_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version
    monkeypatch.setattr(
        _executorch_version.metadata, "version", lambda name: "1.6.0" if name == "executorch" else real(name)
    )
    with pytest.raises(ImportError, match=r"compiled against executorch 1\.5\.1, but executorch 1\.6\.0") as error:
        check_executorch()
    assert "pip install 'executorch==1.5.1'" in str(error.value)


def test_a_local_build_label_is_the_same_release(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version
    monkeypatch.setattr(
        _executorch_version.metadata, "version", lambda name: "1.5.1+cpu" if name == "executorch" else real(name)
    )
    check_executorch()


def test_the_package_import_itself_refuses_another_release() -> None:
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '1.4.0' if name == 'executorch' else real(name)\n"
        "import writeback_pybind_runtime\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ImportError: writeback_pybind_runtime is compiled against executorch 1.5.1" in result.stderr
    assert "executorch 1.4.0 is installed" in result.stderr
