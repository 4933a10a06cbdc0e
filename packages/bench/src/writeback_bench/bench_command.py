"""``writeback bench``: the command, and what it alone needs.

Without ``--model`` it runs the cache-size bench (:mod:`writeback_bench.cache_sizes`: one
decode step through stock ExecuTorch and through writeback, at each cache size); with
``--model NAME``, the model bench (:mod:`writeback_bench.model_steps`: every contender on
one model). Both are described in their modules. Here the options are checked before
anything is lowered, the tables printed and ``--plot`` written (:mod:`writeback_bench.plots`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import Progress
from writeback import WriteFailed
from writeback.cli import CacheMiB, accept_weights_option, cache_mib_problem, progress_bar, writable_file
from writeback.session import PipelineError, choose_backend
from writeback_core.quiet import native_stderr_filtered
from writeback_core.registry import Registry

from writeback_bench.cache_sizes import failures, run_bench, tables
from writeback_bench.model_steps import BASELINE, model_contenders, model_table, run_model_bench
from writeback_bench.plots import check_plot, plot, plot_model

__all__ = ["bench_command"]

# The backend the cache-size bench times writeback on unless told: what a user deploys on CPU.
DEPLOYABLE = "xnnpack"
# Copies of the K+V cache one size holds at once (measured: three programs per
# pipeline, their references, caller caches and floors), plus the process itself.
CACHE_COPIES = 32
# The same for ``--model``: one program per contender (about seven), eager's and the references.
MODEL_CACHE_COPIES = 16


def _write_plot(console: Console, draw: Callable[[Path], None], path: Path | None) -> None:
    """``draw(path)`` when a plot was asked for, then say where it went."""
    if path is None:
        return
    try:
        draw(path)
    except WriteFailed as error:  # checked writable up front: the disk filled or a quota hit since
        raise click.ClickException(str(error)) from error
    console.print(f"plot written to {path}")


def _sizes(ctx: click.Context, param: click.Parameter, text: str) -> list[float]:
    """``--sizes``: positive MiB, comma-separated, each small enough for memory (see ``cache_mib_problem``)."""
    try:
        sizes = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError as error:
        raise click.BadParameter(
            f"{text!r}: give cache sizes in MiB separated by commas, like 1,8,128", ctx=ctx, param=param
        ) from error
    if not sizes:
        raise click.BadParameter(f"{text!r}: give at least one positive size in MiB", ctx=ctx, param=param)
    for mib in sizes:
        problem = cache_mib_problem(mib, CACHE_COPIES, "writeback bench, at each size,")
        if problem is not None:
            raise click.BadParameter(problem, ctx=ctx, param=param)
    return sizes


@click.command("bench")
@click.option(
    "--sizes",
    default="1,2,4,8,16,32,64,128",
    show_default=True,
    callback=_sizes,
    help=f"K+V cache sizes in MiB, comma-separated (each at most what memory can hold {CACHE_COPIES} times).",
)
@click.option(
    "--repeats",
    default=15,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed calls of each pipeline per size (interleaved).",
)
@click.option(
    "--backend",
    default=None,
    help="The writeback pipeline's backend. Default: xnnpack (writeback's deployable path) when installed, "
    "else the preferred backend.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=writable_file,
    help="Write a plot here, PNG or another format matplotlib knows by the suffix (needs matplotlib).",
)
@click.option(
    "--torch-threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="PyTorch intra-op threads (the eager floor). On a loaded 2-core machine a second thread "
    "makes eager wait at barriers for a descheduled thread: 1 gives a steadier floor.",
)
@click.option(
    "--model",
    default=None,
    help="Bench this model instead of the cache sizes: a built-in name, one a plugin offers, or "
    "path/to/file.py:factory. Every contender (upstream, each writeback backend, the model's own) "
    "runs it interleaved; see --contenders.",
)
@click.option(
    "--cache-mib",
    type=CacheMiB(MODEL_CACHE_COPIES, "writeback bench --model"),
    default=None,
    help="With --model, for models sized by their K+V cache (the built-in decoders, et-llama, hf-*): the size in MiB.",
)
@click.option(
    "--steps",
    default=None,
    type=click.IntRange(min=1),
    help="With --model: timed calls of each contender (interleaved). Default 15.",
)
@click.option(
    "--start",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="With --model: the decode step (position) to start from: 0 is short context, "
    "the cache's length minus the calls is full context.",
)
@click.option(
    "--contenders",
    "contender_names",
    default=None,
    help="With --model: only these contenders, comma-separated (the table lists every name).",
)
@accept_weights_option()
@click.pass_context
def bench_command(
    ctx: click.Context,
    sizes: list[float],
    repeats: int,
    backend: str | None,
    plot_path: Path | None,
    torch_threads: int,
    model: str | None,
    cache_mib: float | None,
    steps: int | None,
    start: int,
    contender_names: str | None,
    accept_weights: bool,
) -> None:
    """Time one decode step through stock ExecuTorch, stock + reinplace, stock + XNNPACK and writeback (on
    xnnpack unless --backend says otherwise), interleaved, at each cache size; print medians, ratios and
    floors (eager, raw slice copy_). With --model,
    time one model through every contender instead, with the whole-state copies each leaves."""
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    if model is not None:
        _bench_model(
            registry, model, cache_mib, steps or 15, start, contender_names, plot_path, torch_threads, accept_weights
        )
        return
    given = [f"--{n}" for n, v in (("cache-mib", cache_mib), ("steps", steps), ("contenders", contender_names)) if v]
    if start:
        given.append("--start")
    if accept_weights:
        given.append("--accept-weights")
    if given:
        raise click.UsageError(f"{', '.join(given)} go with --model NAME (without it, bench times the cache sizes)")
    if backend is None and DEPLOYABLE in registry.backends():
        backend = DEPLOYABLE
    try:
        choose_backend(registry, backend)
    except PipelineError as error:
        raise click.BadParameter(str(error), param_hint="'--backend'") from error
    if plot_path is not None:
        check_plot(plot_path)
    torch.set_num_threads(torch_threads)
    console = Console(width=200)
    with native_stderr_filtered(), progress_bar(Progress(console=console, transient=True)) as progress:
        result = run_bench(registry, sizes, repeats, backend, progress)
    for table in tables(result):
        console.print(table)
    for line in failures(result):
        console.print(line, markup=False)
    _write_plot(console, lambda path: plot(result, path), plot_path)


def _bench_model(
    registry: Registry,
    model: str,
    cache_mib: float | None,
    steps: int,
    start: int,
    contender_names: str | None,
    plot_path: Path | None,
    torch_threads: int,
    accept_weights: bool,
) -> None:
    """``bench --model``: resolve the model as ``writeback run`` does, check the contender names
    and the plot path before anything is lowered, then time and print (with ``--accept-weights``,
    the model's description first: it says what the option let through)."""
    from writeback.run import resolve_case

    case = resolve_case(registry, model, cache_mib, accept_weights)
    offered = model_contenders(registry, case)
    chosen = None
    if contender_names is not None:
        chosen = [c.strip() for c in contender_names.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in offered]
        if unknown or not chosen:
            raise click.BadParameter(
                f"no contender named {', '.join(map(repr, unknown)) or repr(contender_names)}; "
                f"offered for {case.name!r}: {', '.join(offered)}",
                param_hint="'--contenders'",
            )
    if plot_path is not None:
        check_plot(plot_path)
    torch.set_num_threads(torch_threads)
    console = Console(width=160)
    if accept_weights:
        console.print(f"model {case.name}: {case.description}", markup=False)
    with progress_bar(Progress(console=console, transient=True)) as progress:
        result = run_model_bench(registry, case, steps, start, chosen, progress)
    console.print(model_table(result))
    console.print(
        "whole-state copies/call: write-back copy_ nodes of state left in the lowered program, and the "
        f"bytes they move per call\n{BASELINE} / this: how many times faster than the baseline",
        markup=False,
    )
    for row in result.rows:
        if row.error is not None:
            console.print(f"{row.name}: {row.error}", markup=False)
    _write_plot(console, lambda path: plot_model(result, path), plot_path)
