"""Entry-point plugin of writeback-testing: offers ``writeback fuzz`` and ``writeback fuzz-blobs``
(thin: imports click only; the fuzzers, hypothesis and exir are imported when a command runs)."""

from __future__ import annotations

import click
from writeback_core import hookimpl

writeback_name = "writeback-testing"


@hookimpl
def writeback_cli_commands(group: click.Group) -> None:
    from writeback_testing.cli import fuzz_blobs_command, fuzz_command

    group.add_command(fuzz_command)
    group.add_command(fuzz_blobs_command)
