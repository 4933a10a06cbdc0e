"""``writeback fuzz``, added to the CLI by core's plugin through ``writeback_cli_commands``."""

from __future__ import annotations

from click.testing import CliRunner
from writeback.cli import main


def test_fuzz_command_is_added_through_writeback_cli_commands_and_reports() -> None:
    result = CliRunner().invoke(main, ["fuzz", "--programs", "3", "--seed", "7", "--jobs", "1", "--runtime", ""])
    assert result.exit_code == 0, result.output
    assert "3 programs passed" in result.output
    assert "0 mismatches" in result.output


def test_fuzz_command_rejects_fewer_than_three_calls() -> None:
    result = CliRunner().invoke(main, ["fuzz", "--programs", "1", "--calls", "2"])
    assert result.exit_code == 2
    assert "--calls" in result.output
