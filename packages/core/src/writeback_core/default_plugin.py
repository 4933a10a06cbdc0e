"""Core's own defaults, registered as a plugin on the same hooks as everyone else."""

from __future__ import annotations

import click

from writeback_core.registry import hookimpl
from writeback_core.zoo import ModelCase, builtin_models

writeback_name = "writeback-core"


@hookimpl
def writeback_models() -> dict[str, ModelCase]:
    return builtin_models()


@hookimpl
def writeback_cli_commands(group: click.Group) -> None:
    from writeback_core import cli

    group.add_command(cli.plugins_command)
    group.add_command(cli.explain_command)
    from writeback_core.bench import bench_command
    from writeback_core.run import run_command

    group.add_command(run_command)
    group.add_command(bench_command)
    # ``fuzz`` imports hypothesis only when it runs (the ``testing`` extra).
    from writeback_core.testing.cli import fuzz_command

    group.add_command(fuzz_command)
