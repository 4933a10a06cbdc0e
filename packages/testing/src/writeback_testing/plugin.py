"""Entry-point plugin of writeback-testing: offers ``writeback fuzz`` (thin: imports click only;
the fuzzer, hypothesis and exir are imported when the command runs)."""

from __future__ import annotations

import click
from writeback_core import hookimpl

writeback_name = "writeback-testing"


@hookimpl
def writeback_cli_commands(group: click.Group) -> None:
    from writeback_testing.cli import fuzz_command

    group.add_command(fuzz_command)
