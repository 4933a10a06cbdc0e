"""The application's defaults, the entry point ``writeback``: a plugin on the same hooks as everyone else.

It is the application (built-in models, the CLI's commands), so the
registry never imports it; ``load_registry`` finds it among the entry points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from writeback_core.registry import hookimpl

if TYPE_CHECKING:
    from writeback_core.registry import Registry
    from writeback_core.types import ModelCase

writeback_name = "writeback"


@hookimpl
def writeback_models() -> dict[str, ModelCase]:
    from writeback.zoo import builtin_models

    return builtin_models()


@hookimpl(trylast=True)
def writeback_explain_notes(registry: Registry) -> list[str]:
    """The program passes a lowering for each installed backend (and for none) runs, by
    stage and in order, with the plugin and the reasons of each; after every plugin's notes."""
    from writeback.explain import pass_lines

    return pass_lines(registry)


@hookimpl
def writeback_cli_commands(group: click.Group) -> None:
    from writeback import cli

    group.add_command(cli.plugins_command)
    group.add_command(cli.explain_command)
    from writeback.export import export_command
    from writeback.generate import generate_command
    from writeback.run import run_command

    group.add_command(run_command)
    group.add_command(export_command)
    group.add_command(generate_command)
