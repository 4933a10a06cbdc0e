"""The ``writeback`` command line. Subcommands come from plugins through a hook; core's own
(``plugins``, ``explain``) come from its built-in plugin the same way."""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.table import Table

from writeback_core.registry import Registry, load_registry

__all__ = ["main"]

# Up to this many mutations, explain prints one column per state instead of one row.
_TRANSPOSE_AT_MOST = 4


def _registry(ctx: click.Context) -> Registry:
    registry = ctx.find_object(Registry)
    if registry is None:
        registry = load_registry()
        ctx.obj = registry
    return registry


class _PluginGroup(click.Group):
    """A group whose subcommands are added by the ``writeback_cli_commands`` hook."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._registry: Registry | None = None

    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = load_registry()
            self._registry.hook.writeback_cli_commands(group=self)
        return self._registry

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.registry()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self.registry()
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        ctx.obj = self.registry()
        return super().invoke(ctx)


@click.group(cls=_PluginGroup)
def main() -> None:
    """writeback: state that a model mutates, written once, in place, where the caller sees it."""


@click.command("plugins")
@click.pass_context
def plugins_command(ctx: click.Context) -> None:
    """List the registered plugins and the hooks each implements."""
    registry = _registry(ctx)
    table = Table(title="writeback plugins")
    table.add_column("plugin")
    table.add_column("hooks")
    for name in registry.plugin_names():
        table.add_row(name, ", ".join(registry.hooks_of(name)))
    Console(width=120).print(table)


@click.command("explain")
@click.argument("model", default="decoder")
@click.pass_context
def explain_command(ctx: click.Context, model: str) -> None:
    """Export MODEL (a built-in name or path/to/file.py:factory) and explain its mutations."""
    from writeback_core.explain import explain_rows, export_case
    from writeback_core.loading import resolve_model

    registry = _registry(ctx)
    try:
        case = resolve_model(model, registry.models())
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    program = export_case(case)
    rows = explain_rows(program)
    for row in rows:
        for extra in registry.hook.writeback_explain_columns(program=program, mutation=row.mutation):
            row.columns.update(extra or {})
    console = Console(width=130)
    if not rows:
        console.print(f"{case.name}: no mutated state")
        return
    titles: list[str] = []
    for row in rows:
        titles.extend(t for t in row.columns if t not in titles)
    table = Table(title=f"{case.name}: {case.description}", show_lines=True)
    if len(rows) <= _TRANSPOSE_AT_MOST:
        # Few states, many plugin columns: one column per state reads best.
        table.add_column("", style="bold")
        for row in rows:
            table.add_column(row.columns.get("state", row.mutation.target))
        for title in titles:
            if title != "state":
                table.add_row(title, *(row.columns.get(title, "") for row in rows))
    else:
        for title in titles:
            table.add_column(title)
        for row in rows:
            table.add_row(*(row.columns.get(t, "") for t in titles))
    console.print(table)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
