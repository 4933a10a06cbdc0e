"""A model whose state the export drops is refused by every command that exports it, exit 2, one
paragraph naming the state; the same model with its state as a registered buffer goes through.
Real CLI, real torch.export and ExecuTorch (tests/core/lazy_state_model.py holds the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback.cli import main

MODEL = Path(__file__).parents[1] / "core" / "lazy_state_model.py"
NAMED = "cache.state [1, 1, 8] float32 (created by call 1, written in place by call 2; not a buffer)"


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--backend", "portable", "--steps", "3"],
        ["export", "--backend", "portable"],
        ["explain"],
    ],
    ids=["run", "export", "explain"],
)
def test_a_dropped_state_exits_2_naming_it_in_one_paragraph_clear_error(tmp_path: Path, command: list[str]) -> None:
    output = tmp_path / "model.pte"
    arguments = [command[0], f"{MODEL}:case", *command[1:]]
    if command[0] == "export":
        arguments += ["--output", str(output)]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.output.startswith("Error: model "), result.output
    assert "the exported program drops state the eager model carries" in result.output
    assert NAMED in result.output
    assert "register_buffer" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output  # one paragraph
    assert not output.exists()  # nothing written


def test_the_same_model_with_its_state_registered_runs_and_exports_no_false_refusal(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", f"{MODEL}:kept_case", "--backend", "portable", "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "all 3 steps match eager" in result.output
    output = tmp_path / "model.pte"
    result = CliRunner().invoke(
        main, ["export", f"{MODEL}:kept_case", "--backend", "portable", "--output", str(output)]
    )
    assert result.exit_code == 0, result.output
    assert output.stat().st_size > 0
