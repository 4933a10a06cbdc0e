"""``writeback fuzz``: differential fuzzing from the command line.

Added to the CLI by writeback-testing's plugin through ``writeback_cli_commands``.
This module imports neither hypothesis nor exir at import time, so every
``writeback`` start stays cheap until ``fuzz`` runs.
"""

from __future__ import annotations

import os
import sys

import click

__all__ = ["fuzz_blobs_command", "fuzz_command"]

# More worker processes than this (four per core) only multiply memory: each imports torch and exir.
_MAX_JOBS = 4 * (os.cpu_count() or 1)


@click.command("fuzz")
@click.option(
    "--programs",
    "n_programs",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="How many generated programs to check.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Hypothesis seed (job j uses seed + j).")
@click.option(
    "--jobs",
    type=click.IntRange(min=1, max=_MAX_JOBS),
    default=None,
    help=f"Worker processes (default: one per core, at most 2; at most {_MAX_JOBS}, four per core).",
)
@click.option(
    "--runtime",
    default=None,
    help="A runtime a plugin offers (writeback_runtimes; default: the first "
    "offered); '' for stock executorch.runtime only.",
)
@click.option(
    "--runtime-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run the runtime targets on every n-th program only.",
)
@click.option(
    "--calls",
    type=click.IntRange(min=3),
    default=3,
    show_default=True,
    help="Calls per program (state must be carried at least twice).",
)
@click.option(
    "--backend",
    "backends",
    multiple=True,
    help="Also lower every program with this backend (repeatable) and check it "
    "against eager and its in-place answers (the contract suite).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    help="Run every program through this aliasing engine's copy-back path "
    "(writeback_engines; repeatable; default: every engine offered).",
)
@click.option("--no-engines", is_flag=True, help="Run no engine's copy-back path.")
@click.option(
    "--engine-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run the engine targets on every n-th program only.",
)
@click.option("--no-shrink", is_flag=True, help="Report the first failing program as drawn.")
def fuzz_command(
    n_programs: int,
    seed: int,
    jobs: int | None,
    runtime: str | None,
    runtime_every: int,
    calls: int,
    backends: tuple[str, ...],
    engines: tuple[str, ...],
    no_engines: bool,
    engine_every: int,
    no_shrink: bool,
) -> None:
    """Check N generated stateful programs: eager PyTorch against every lowered form.

    Each program runs eagerly and through the pipeline the installed plugins
    assemble (early write-back among its passes), in stock executorch.runtime
    and in the caller-writing runtime (planned, unplanned, bound outputs),
    and through the copy-back path of every aliasing engine offered (in the
    caller-writing runtime and stock executorch.runtime), comparing every
    output and every state after each call. A program a path cannot take is
    reported as skipped, with its reason. A failure prints a minimal
    reproducing module. Exit status 1 on any failure.
    """
    if no_engines and engines:
        raise click.UsageError("--engine and --no-engines exclude each other")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from writeback.cli import progress_bar

    from writeback_testing.fuzz import FuzzConfig, check_config, default_jobs, run_fuzz, summary

    config = FuzzConfig(
        programs=n_programs,
        seed=seed,
        jobs=jobs or default_jobs(),
        runtime=runtime,
        runtime_every=runtime_every,
        calls=calls,
        shrink=not no_shrink,
        backends=backends,
        engines=() if no_engines else (engines or None),
        engine_every=engine_every,
    )
    try:
        check_config(config)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    console = Console(stderr=True)
    bar = Progress("fuzz", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False)
    with progress_bar(bar):
        task = bar.add_task("fuzz", total=n_programs)
        report = run_fuzz(config, progress=lambda n: bar.advance(task, n))
    for line in summary(report):
        click.echo(line)
    if report.failures:
        sys.exit(1)


@click.command("fuzz-blobs")
@click.option("--mutants", "n_mutants", type=int, default=1000, show_default=True, help="Mutants per target.")
@click.option("--seed", type=int, default=0, show_default=True, help="Mutant i of a target is drawn from (seed, i).")
@click.option(
    "--target",
    "targets",
    multiple=True,
    help="pte, backend:NAME or engine:NAME (repeatable; default: every one the installed plugins offer).",
)
def fuzz_blobs_command(n_mutants: int, seed: int, targets: tuple[str, ...]) -> None:
    """Change one field of real delegate blobs and .pte execution plans per mutant and run each.

    Every mutant must be refused with a clean error or give eager PyTorch's
    answer; a crash, a hang, a wrong answer or an internal exception escaping is
    printed with the command that reproduces it. Exit status 1 on any.
    """
    from writeback_testing.blobfuzz import run_blob_fuzz
    from writeback_testing.blobseeds import installed_plugins

    if n_mutants < 1:
        raise click.UsageError("--mutants must be at least 1")
    report = run_blob_fuzz(list(targets) or None, n_mutants, seed, plugins=installed_plugins())
    click.echo(report.summary())
    if report.findings:
        sys.exit(1)
