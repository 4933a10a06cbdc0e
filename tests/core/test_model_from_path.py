"""writeback_model_from_path: a path becomes a model only through a plugin that reads it, two
plugins reading one path is an error naming both, and the CLI says what to do when none does."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback.cli import main
from writeback.zoo import builtin_models
from writeback_core import hookimpl, load_registry
from writeback_core.registry import DuplicateNameError
from writeback_core.types import ModelCase


class ReadsMarked:
    """Reads a folder holding a file named ``marked`` as the built-in decoder."""

    writeback_name = "reads-marked"

    @hookimpl
    def writeback_model_from_path(self, path: str) -> ModelCase | None:
        return builtin_models()["decoder"] if (Path(path) / "marked").is_file() else None


class AlsoReadsMarked(ReadsMarked):
    writeback_name = "also-reads-marked"


def test_a_path_a_plugin_reads_is_its_model_and_any_other_none(tmp_path: Path) -> None:
    registry = load_registry(entry_points=False, plugins=[ReadsMarked()])
    assert registry.model_from_path(str(tmp_path)) is None
    (tmp_path / "marked").write_text("")
    case = registry.model_from_path(str(tmp_path))
    assert case is not None and case.name == "decoder"


def test_two_plugins_reading_one_path_is_an_error_naming_both(tmp_path: Path) -> None:
    (tmp_path / "marked").write_text("")
    registry = load_registry(entry_points=False, plugins=[ReadsMarked(), AlsoReadsMarked()])
    with pytest.raises(DuplicateNameError, match="both plugin 'also-reads-marked' and plugin 'reads-marked'"):
        registry.model_from_path(str(tmp_path))


def test_the_cli_refuses_a_path_no_plugin_reads_with_exit_2_saying_what_reads_one(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["explain", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "no installed plugin reads a model from" in result.output
    assert "path/to/file.py:factory" in result.output
