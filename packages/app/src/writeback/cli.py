"""The ``writeback`` command line. Subcommands come from plugins through a hook; core's own
(``plugins``, ``explain``) come from its built-in plugin the same way.

What every command shares, whoever contributes it:

- a user's mistake (an unknown name, an absurd size, a path that cannot be
  written, an error raised by the code in a model file) is one paragraph and
  exit status 2, found before anything is exported or lowered where it can be;
- Ctrl-C prints one line (``writeback: interrupted``) and exits 130.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from writeback_core import NAME
from writeback_core.memory import available_memory
from writeback_core.quiet import quiet_upstream_noise
from writeback_core.registry import Registry, load_registry
from writeback_core.types import ModelCase

from writeback._files import unwritable_reason

__all__ = [
    "EXIT_INTERRUPTED",
    "CacheMiB",
    "UserCodeError",
    "accept_weights_option",
    "cache_mib_problem",
    "main",
    "progress_bar",
    "quantize_option",
    "quantized_case",
    "resolve_model_option",
    "writable_file",
]

# Up to this many mutations, explain prints one column per state instead of one row.
_TRANSPOSE_AT_MOST = 4
# explain's table width while it prints a column per state.
_EXPLAIN_WIDTH = 130

# The shell's status for a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130

# No command takes a K+V cache larger than this, whatever the machine (64 GiB).
MAX_CACHE_MIB = 64 * 1024

MIB = 1 << 20


class UserCodeError(click.ClickException):
    """Code the user wrote (a model file) raised: one paragraph naming the file and line, exit 2."""

    exit_code = 2


def _user_code_failure(error: BaseException, message: str) -> UserCodeError:
    from writeback.loading import TRACEBACK_ENV

    if os.environ.get(TRACEBACK_ENV):
        traceback.print_exception(error, file=sys.stderr)
    return UserCodeError(message)


def resolve_model_option(registry: Registry, model: str, accept_weights: bool = False) -> ModelCase:
    """The model case ``model`` names (see :func:`writeback.loading.resolve_model`).

    :raises click.UsageError: no such model, file or factory (exit 2, with the choices).
    :raises UserCodeError: the model file raised on import or in its factory (exit 2).
    """
    from writeback.loading import ModelCodeError, resolve_model

    models = registry.models()
    if model not in models and ":" not in model and os.path.exists(model):
        return _model_from_path(registry, model, accept_weights)
    try:
        return resolve_model(model, models)
    except ModelCodeError as error:
        raise _user_code_failure(error.__cause__ or error, str(error)) from error
    except ValueError as error:
        raise click.UsageError(str(error)) from error


ACCEPT_WEIGHTS_HELP = (
    "Load a model folder's weights even where they do not give the model's numbers: tensors missing (left random), "
    "unexpected, of a dtype that does not convert exactly (integers), or holding NaN/inf. Refused without it; "
    "the model's description says what was accepted."
)


def accept_weights_option() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--accept-weights`` flag of every command that reads a model folder."""
    return click.option("--accept-weights", is_flag=True, default=False, help=ACCEPT_WEIGHTS_HELP)


def quantized_case(case: ModelCase, scheme: str | None) -> ModelCase:
    """``case`` with its weights quantized by ``scheme`` (``--quantize``), or as it is for ``None``.

    :raises click.UsageError: the case quantizes nothing, or not by that scheme (exit 2, with
        the schemes it takes).
    """
    if scheme is None:
        return case
    if case.quantized is None or scheme not in case.quantizations:
        offered = ", ".join(case.quantizations) if case.quantized is not None else "none"
        raise click.UsageError(
            f"--quantize {scheme}: model {case.name!r} does not offer it (schemes it takes: {offered}); "
            f"the Hugging Face models and model folders take {', '.join(QUANTIZATION_NAMES)}"
        )
    try:
        return case.quantized(scheme)
    except ValueError as error:  # the scheme finds nothing to quantize in this model
        raise click.UsageError(f"--quantize {scheme}: model {case.name!r}: {error}") from error


# The schemes the models' plugins offer (writeback-decoders' QUANTIZATIONS; a test keeps the two equal):
# the app imports no plugin package, and click needs the choices before any model is read.
QUANTIZATION_NAMES = ("8da4w", "8da4w-e8", "8da8w")

QUANTIZE_HELP = (
    "Quantize the model's weights before export, as ExecuTorch's Llama export does (XNNPACK runs the linear "
    "layers, ExecuTorch's quantized kernels the embedding lookup): 8da4w = linear layers, the LM head too, with "
    "8-bit dynamic activations and 4-bit weights in groups of 32, the embedding fp32; 8da4w-e8 = 8da4w with an "
    "8-bit embedding (one scale per row) and an LM head tied to it 8-bit per output channel; 8da8w = linear "
    "layers with 8-bit weights (one scale per output channel) and an 8-bit embedding. With an 8-bit embedding, "
    "a tied LM head reads the embedding's own int8 table and scales, stored once (in a single .pte as with "
    "--separate-weights). Steps are then compared with eager PyTorch running the same quantized model, at the "
    "scheme's tolerance."
)


def quantize_option(help: str = QUANTIZE_HELP) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--quantize`` option of every command that exports a model (``run``, ``export``, the benches)."""
    return click.option("--quantize", type=click.Choice(list(QUANTIZATION_NAMES)), default=None, help=help)


def _model_from_path(registry: Registry, path: str, accept_weights: bool = False) -> ModelCase:
    """The model a plugin reads from ``path`` (``writeback_model_from_path``); exit 2 when none
    does or the plugin finds the path unreadable."""
    try:
        case: ModelCase | None = registry.model_from_path(path, accept_weights)
    except ValueError as error:  # the plugin's refusal: its message names the file, field or tensor
        raise click.UsageError(f"model path {path!r}: {error}") from error
    except (OSError, ImportError) as error:
        raise click.UsageError(f"model path {path!r}: {type(error).__name__}: {error}") from error
    if case is None:
        raise click.UsageError(
            f"no installed plugin reads a model from {path!r}: a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer.json) is read by writeback-decoders with its [hf] extra; a model file is "
            "given as path/to/file.py:factory"
        )
    return case


def writable_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A click callback: refuse (exit 2) a path the CLI could not write, before any work starts."""
    if value is not None:
        reason = unwritable_reason(value)
        if reason is not None:
            raise click.BadParameter(f"cannot write {value}: {reason}", ctx=ctx, param=param)
    return value


@contextmanager
def progress_bar(progress: Progress) -> Iterator[Progress]:
    """``progress`` shown for the block; on Ctrl-C it goes without a trace (not even the
    blank line rich prints when output is not a terminal), so the CLI's one line is all."""
    with progress:
        try:
            yield progress
        except KeyboardInterrupt:
            progress.live.transient = True
            progress.live.stop()
            progress.disable = True
            raise


def _memory() -> tuple[int, str] | None:
    """Bytes of memory this machine can give a new process, and how they were found."""
    return available_memory()


def cache_mib_problem(mib: float, copies: int, what: str) -> str | None:
    """Why a K+V cache of ``mib`` MiB is refused, or ``None`` when it is fine.

    The limit is :data:`MAX_CACHE_MIB`, and less where the memory this machine has
    available cannot hold ``copies`` copies of the cache (what ``what`` holds at once).
    """
    if not math.isfinite(mib) or mib <= 0:
        return f"{mib:g} is not a size: give a positive number of MiB, like 16"
    limit, why = float(MAX_CACHE_MIB), f"{MAX_CACHE_MIB} MiB is the largest cache any command takes"
    memory = _memory()
    if memory is not None and memory[0] / copies / MIB < limit:
        bytes_, kind = memory
        limit = math.floor(bytes_ / copies / MIB)
        why = (
            f"{what} holds about {copies} copies of the cache and this machine has "
            f"{bytes_ / (1 << 30):.1f} GiB of memory {kind}, so at most {limit:g} MiB"
        )
    if mib > limit:
        return f"{mib:g} MiB is too large: {why}"
    return None


class CacheMiB(click.ParamType[float, "str | float"]):
    """A K+V cache size in MiB: a positive number no larger than :func:`cache_mib_problem` allows."""

    name = "mib"

    def __init__(self, copies: int, what: str) -> None:
        self.copies, self.what = copies, what

    def convert(self, value: str | float, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            mib = value
        else:
            try:
                mib = float(value)
            except ValueError:
                self.fail(f"{value!r} is not a number of MiB", param, ctx)
        problem = cache_mib_problem(mib, self.copies, self.what)
        if problem is not None:
            self.fail(problem, param, ctx)
        return mib


def _registry(ctx: click.Context) -> Registry:
    registry = ctx.find_object(Registry)
    if registry is None:
        registry = load_registry()
        ctx.obj = registry
    return registry


class _StateLost(click.ClickException):
    """The exported program drops state the eager model carries, or computes an op no ExecuTorch
    program holds: the model's to fix, exit 2."""

    exit_code = 2


def _state_lost(error: BaseException) -> BaseException | None:
    """The ``StateLostError`` or ``OpsOutsideCoreAtenError`` behind ``error`` (a command may
    have wrapped it), or ``None``."""
    from writeback_core.carried_state import StateLostError
    from writeback_core.core_aten import OpsOutsideCoreAtenError

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (StateLostError, OpsOutsideCoreAtenError)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class _PluginGroup(click.Group):
    """A group whose subcommands are added by the ``writeback_cli_commands`` hook."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # click.Group's own arguments, passed on
        self._registry: Registry | None = None

    def registry(self) -> Registry:
        if self._registry is None:
            # Before plugins import torchao and exir: their known import-time log lines
            # (writeback_core.quiet.NOISE) say nothing a user can act on.
            quiet_upstream_noise()
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
        from writeback.loading import TRACEBACK_ENV, user_code_error
        from writeback.model_build import ModelBuildError

        try:
            ctx.obj = self.registry()
            return super().invoke(ctx)
        except KeyboardInterrupt:
            # Whatever was running has cleaned up on its way out (temporary files,
            # worker processes); the traceback would say nothing the user needs.
            click.echo(f"{NAME}: interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort) as error:
            lost = _state_lost(error)
            if lost is not None:
                raise _StateLost(str(lost)) from error
            raise
        except ModelBuildError as error:
            # The model could not even be built (its class or a library's raised in
            # __init__): the user's to fix, as a model file's error is, exit 2.
            where = user_code_error(error.__cause__) if error.__cause__ is not None else None
            message = (
                f"model {error.model!r}: building the model raised {where}. Fix it there"
                if where is not None
                else str(error)
            )
            message += f" ({TRACEBACK_ENV}=1 shows the traceback)."
            raise _user_code_failure(error.__cause__ or error, message) from error
        except Exception as error:
            lost = _state_lost(error)
            if lost is not None:
                raise _StateLost(str(lost)) from error
            # An error raised later by a model file's code (its forward, while
            # exporting or running eagerly) is the user's too.
            where = user_code_error(error)
            if where is None:
                raise
            message = f"the model's code raised {where}. Fix it there ({TRACEBACK_ENV}=1 shows the traceback)."
            raise _user_code_failure(error, message) from error


@click.group(cls=_PluginGroup)
def main() -> None:
    """writeback: state that a model mutates, written once, in place, where the caller sees it.

    Commands come from the installed plugins (`writeback plugins` lists them): `bench`, `bench-generate`
    and `bench-scale` with writeback-bench, `fuzz` and `fuzz-blobs` with writeback-testing.
    """


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
@accept_weights_option()
@click.pass_context
def explain_command(ctx: click.Context, model: str, accept_weights: bool) -> None:
    """Export MODEL (a built-in name or path/to/file.py:factory) and explain its mutations."""
    from writeback_core.program_passes import unbacked_symbols_settled
    from writeback_core.quiet import known_warnings_ignored
    from writeback_core.types import LoweringError

    from writeback.explain import explain_notes, explain_rows
    from writeback.model_build import export_case

    registry = _registry(ctx)
    case = resolve_model_option(registry, model, accept_weights)
    try:
        program = export_case(case)
    except LoweringError as error:  # state lifted as constants: the message says what to do
        raise click.ClickException(str(error)) from error
    # Columns lower the program their own ways (stock exir, memory plans, an engine's path):
    # the upstream warnings every lowering raises are named in writeback_core.quiet.
    # Each step leaves the program traceable by the next (unbacked_symbols_settled).
    with known_warnings_ignored():
        rows = explain_rows(program)
        for row in rows:
            with unbacked_symbols_settled(program):
                columns = registry.hook.writeback_explain_columns(program=program, mutation=row.mutation)
            for extra in columns:
                row.columns.update(extra or {})
        with unbacked_symbols_settled(program):
            notes = explain_notes(program, registry)
    console = Console(width=_EXPLAIN_WIDTH)
    if not rows:
        console.print(f"{case.name}: no mutated state")
        _print_notes(console, notes)
        return
    titles: list[str] = []
    for row in rows:
        titles.extend(t for t in row.columns if t not in titles)
    table = Table(title=f"{case.name}: {case.description}", show_lines=True)
    names = [row.columns.get("state", row.mutation.target) for row in rows]
    # A column per state only while every name fits its column whole (label column, then
    # the states, three characters of border and padding each).
    label = max((len(t) for t in titles), default=0) + 3
    per_state = (_EXPLAIN_WIDTH - label) // len(rows) - 3
    if len(rows) <= _TRANSPOSE_AT_MOST and max(len(n) for n in names) <= per_state:
        # Few states, many plugin columns: one column per state reads best.
        table.add_column("", style="bold")
        for row in rows:
            table.add_column(row.columns.get("state", row.mutation.target))
        for title in titles:
            if title != "state":
                table.add_row(title, *(row.columns.get(title, "") for row in rows))
    else:
        # Many states (a decoder has two per layer), or names too long for a column each
        # (ExecuTorch's Llama: layers.0.attention.kv_cache.k_cache): one row per state, its full name never
        # cut, the short facts in columns and every longer column as a "title: value" line,
        # so the table reads in a terminal of 100 columns.
        console = Console(width=max(80, min(console.width, Console().width)))
        longer = [t for t in titles if t not in ("state", "kind", "write", "shape")]
        table.add_column("state", no_wrap=True, min_width=max(len(n) for n in names))
        table.add_column("shape", no_wrap=True)
        table.add_column("write, and where its write-back goes")
        for name, row in zip(names, rows, strict=True):
            first = " ".join(row.columns[t] for t in ("kind", "write") if row.columns.get(t))
            details = [first, *(f"{t}: {row.columns[t]}" for t in longer if row.columns.get(t))]
            table.add_row(name, row.columns.get("shape", ""), "\n".join(d for d in details if d))
    console.print(table)
    _print_notes(console, notes)


def _print_notes(console: Console, notes: Sequence[str]) -> None:
    """The plugins' lines about the whole program, under the table."""
    for line in notes:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
