"""Entry-point plugin of writeback-bench: offers ``writeback bench``, ``writeback bench-generate`` and
``writeback bench-scale`` (thin: imports click and core only; the harnesses, torch and exir are
imported when the CLI asks for its commands)."""

from __future__ import annotations

import click
from writeback_core import hookimpl

writeback_name = "writeback-bench"


@hookimpl
def writeback_cli_commands(group: click.Group) -> None:
    from writeback_bench.bench_command import bench_command
    from writeback_bench.llama_scale import bench_scale_command
    from writeback_bench.runner_generation import bench_generate_command

    group.add_command(bench_command)
    group.add_command(bench_generate_command)
    group.add_command(bench_scale_command)
