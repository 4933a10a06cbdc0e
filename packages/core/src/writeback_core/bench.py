"""``writeback bench``: one decode step through stock ExecuTorch and through writeback.

For each cache size (K + V, fp32, MiB) the built-in one-layer decoder is
lowered three ways and timed interleaved in one process, one call of each per
round, so a noisy machine slows every pipeline alike. The decoder attends over
the last :data:`WINDOW` positions (sliding-window attention, as Mistral-style
models do), so a step's arithmetic is the same at every cache size and what
grows with the cache is only what a pipeline does with the state:

- ``stock``: the decoder with its KV cache in registered buffers,
  ``to_edge(...).to_executorch()`` defaults, stock ``executorch.runtime``
  (the way ExecuTorch users write a KV cache today);
- ``stock+reinplace``: the same with ``ExecutorchBackendConfig(run_reinplace_pass=True)``;
- ``stock+xnnpack``: the same lowered with ExecuTorch's ``XnnpackPartitioner``
  (what ExecuTorch users deploy on CPU);
- ``writeback``: the same decoder with a caller-owned cache
  (``decoder-caller-cache``), lowered by the pipeline (default backend, the
  registered passes), run by the pipeline's runtime with the cache allocated
  by the backend's allocator and bound in place.

Floors, timed in the same rounds: ``eager`` (PyTorch running the same step on
its own cache) and ``slice copy_`` (the step's state update done by hand:
``k_cache[:, :, p:p+1].copy_(k)`` and the same for V).

How the state-update part is measured: each pipeline also lowers two small
programs over the same cache, ``update`` (only the two ``index_copy_`` writes
of one slot, returning ``k + v``) and ``idle`` (returning ``k + v``, writing
nothing). The state update of a pipeline is ``median(update) - median(idle)``:
the cost of the write with the pipeline's fixed per-call overhead (runtime
entry, delegate dispatch, input binding) taken out. Both medians are printed
too, so the subtraction can be checked. These programs are short, so each
round times :data:`UPDATE_CALLS_PER_ROUND` calls of each (the same slot written
again: the same work), after one untimed call that brings the program back into
the CPU caches the previous contender flushed (every contender, floors included).

Each call is timed alone, around the work itself (the runtime's ``execute``,
the eager forward, the two copies); inputs are made before the clock starts.
PyTorch runs with ``--torch-threads`` intra-op threads (default 1: on a loaded
2-core machine a second thread makes eager wait at barriers). Numbers from a
shared, loaded machine are noisy; the ratios, taken within one round-robin, hold
better than the absolute times.

Every pipeline's outputs (and the caller-owned cache, where there is one) are
compared with eager on the warm-up calls; a pipeline that fails to lower, to
load or to match is reported as such in its cells, never dropped.

``writeback bench --model NAME`` (:func:`run_model_bench`) times one model
instead, resolved as ``writeback run`` resolves it (a built-in or plugin name,
or ``file.py:factory``; ``--cache-mib`` for the built-in decoders) and exported
once through :func:`writeback_core.lowering.export_case`. Its contenders, one
row each, interleaved the same way from step ``--start``: eager; stock;
stock + XNNPACK (the baseline every row is compared with); stock + XNNPACK +
exir's reinplace pass with every op it can be opted into; writeback with each
backend the registry offers; and each of the model's own ``contenders``. Each
row also says how many whole-state write-back copies its lowered program still
makes per call, and how many bytes they move.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from torch import nn

from writeback_core._files import WriteFailed, replacing
from writeback_core.cli import CacheMiB, cache_mib_problem, progress_bar, writable_file
from writeback_core.pipeline import (
    Eager,
    InputSignature,
    Pipeline,
    PipelineError,
    Session,
    StepResult,
    assemble,
    choose_backend,
    compare,
    flatten_step_inputs,
    lower,
)
from writeback_core.quiet import NativeLog, known_warnings_ignored, native_stderr_captured, native_stderr_filtered
from writeback_core.registry import Registry
from writeback_core.zoo import DecoderConfig, ModelCase, decoder_case

__all__ = [
    "BenchResult",
    "ModelBenchResult",
    "ModelRow",
    "SizeResult",
    "bench_command",
    "model_contenders",
    "model_table",
    "plot_model",
    "reinplace_ops",
    "run_bench",
    "run_model_bench",
]

STOCK = "stock"
REINPLACE = "stock+reinplace"
XNNPACK = "stock+xnnpack"
WRITEBACK = "writeback"
EAGER = "eager"
SLICE_COPY = "slice copy_"
PIPELINES = (STOCK, REINPLACE, XNNPACK, WRITEBACK)
WARMUP = 2
# Positions each decode step attends over (see the module docstring).
WINDOW = 64
UPDATE_CALLS_PER_ROUND = 5
MIB = 1 << 20
# Copies of the K+V cache one size holds at once (measured: three programs per
# pipeline, their references, caller caches and floors), plus the process itself.
CACHE_COPIES = 32
# The same for ``--model``: one program per contender (about seven), eager's and the references.
MODEL_CACHE_COPIES = 16

# One timed call at a step: ``(seconds, outputs)``. Each call times only the work
# itself (the runtime's execute, the eager forward, the two copies); its inputs
# are made before the clock starts.
Call = Callable[[int], tuple[float, list[Any]]]


class CacheUpdate(nn.Module):
    """The decode step's state update alone: one slot of K and V written with ``index_copy_``.

    ``caller_cache``: the caches are ``forward``'s trailing inputs; else registered
    buffers. ``write=False`` is the idle twin (same inputs and output, no write).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: DecoderConfig, caller_cache: bool, write: bool = True) -> None:
        super().__init__()
        self.caller_cache, self.write = caller_cache, write
        if not caller_cache:
            self.register_buffer("k_cache", torch.zeros(cfg.cache_shape))
            self.register_buffer("v_cache", torch.zeros(cfg.cache_shape))

    def forward(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = caches if self.caller_cache else (self.k_cache, self.v_cache)
        if self.write:
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
        return k + v


def _update_case(cfg: DecoderConfig, caller_cache: bool, write: bool) -> ModelCase:
    def inputs(step: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(1000 + step)
        shape = (1, cfg.heads, 1, cfg.head_dim)
        return (
            torch.randn(shape, generator=gen),
            torch.randn(shape, generator=gen),
            torch.tensor([step % cfg.max_seq]),
        )

    return ModelCase(
        name=f"cache-{'update' if write else 'idle'}",
        description="one slot of K and V written" if write else "no write",
        build=lambda: CacheUpdate(cfg, caller_cache, write),
        step_inputs=inputs,
        make_state=(lambda: (torch.zeros(cfg.cache_shape), torch.zeros(cfg.cache_shape)))
        if caller_cache
        else (lambda: ()),
    )


def _cases(cfg: DecoderConfig, caller_cache: bool) -> dict[str, ModelCase]:
    return {
        "step": decoder_case(cfg, caller_cache=caller_cache),
        "update": _update_case(cfg, caller_cache, write=True),
        "idle": _update_case(cfg, caller_cache, write=False),
    }


@dataclass
class Contender:
    """One timed thing: a pipeline running one program kind (``step``/``update``/``idle``)."""

    pipeline: str
    kind: str
    call: Call | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and self.error is None else None


def _stock_call(case: ModelCase, reinplace: bool, xnnpack: bool = False) -> Call:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    from writeback_core.lowering import export_case

    with known_warnings_ignored():
        from executorch.runtime import Runtime

        partitioners: list[Any] = []
        if xnnpack:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            partitioners.append(XnnpackPartitioner())
        edge = to_edge_transform_and_lower(export_case(case), partitioner=partitioners)
        program = edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=reinplace))
        # The stock runtime reads the program from this buffer after loading: keep it alive.
        data = bytes(program.buffer)
        # ... and the Program: a stock Method whose Program was collected reads freed memory.
        loaded = Runtime.get().load_program(data)
        method = loaded.load_method("forward")

    def call(step: int) -> tuple[float, list[Any]]:
        assert data and loaded
        inputs = list(case.step_inputs(step))
        start = time.perf_counter()
        outputs = method.execute(inputs)
        return time.perf_counter() - start, list(outputs)

    return call


def _writeback_call(case: ModelCase, pipeline: Pipeline) -> tuple[Call, Session]:
    session = Session.open(pipeline, lower(case, pipeline))

    def call(step: int) -> tuple[float, list[Any]]:
        result = session.step(step)  # times the runtime's execute alone
        return result.seconds, result.outputs

    return call, session


def _eager_call(case: ModelCase) -> Call:
    eager = Eager(case)

    def call(step: int) -> tuple[float, list[Any]]:
        inputs = case.step_inputs(step)
        with torch.no_grad():
            start = time.perf_counter()
            outputs = eager.module(*inputs, *eager.state)
            return time.perf_counter() - start, [outputs]

    return call


def _slice_copy_call(cfg: DecoderConfig) -> Call:
    caches = (torch.zeros(cfg.cache_shape), torch.zeros(cfg.cache_shape))
    update = _update_case(cfg, True, True)

    def call(step: int) -> tuple[float, list[Any]]:
        k, v, pos = update.step_inputs(step)
        p = int(pos)
        start = time.perf_counter()
        caches[0][:, :, p : p + 1].copy_(k)
        caches[1][:, :, p : p + 1].copy_(v)
        return time.perf_counter() - start, []

    return call


def _reference(case: ModelCase, steps: int) -> list[tuple[list[Any], tuple[torch.Tensor, ...]]]:
    """Eager outputs and state after each of the first ``steps`` calls."""
    eager = Eager(case)
    found = []
    for step in range(steps):
        outputs = eager.step(step)
        found.append(([o.clone() for o in outputs], tuple(s.clone() for s in eager.state)))
    return found


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) < 160 else text[:157] + "..."


def _warm_up(contender: Contender, session: Session | None, reference: list[Any]) -> None:
    """Run the warm-up calls, each checked against eager; mark the contender on any failure."""

    assert contender.call is not None
    for step, (expected, state) in enumerate(reference):
        try:
            _, outputs = contender.call(step)
        except Exception as error:  # a pipeline that fails at run time is reported, not dropped
            contender.error = f"failed at run time: {_short(error)}"
            return
        mine = session.state if session is not None else ()
        check = compare(StepResult(step, 0.0, outputs, 0, 0), expected, mine, state[: len(mine)])
        if not check.ok:
            contender.error = f"wrong at warm-up step {step}: {'; '.join(check.problems)}"
            return


def _build(pipeline_name: str, kind: str, case: ModelCase, pipeline: Pipeline | None) -> tuple[Contender, Any]:
    contender = Contender(pipeline_name, kind)
    session = None
    try:
        if pipeline_name == WRITEBACK:
            if pipeline is None:
                raise PipelineError("no writeback pipeline could be assembled")
            contender.call, session = _writeback_call(case, pipeline)
        else:
            contender.call = _stock_call(case, reinplace=pipeline_name == REINPLACE, xnnpack=pipeline_name == XNNPACK)
    except Exception as error:  # reported in the table
        contender.error = f"failed to lower or load: {_short(error)}"
    return contender, session


@dataclass
class SizeResult:
    """Every contender at one cache size."""

    mib: float
    contenders: dict[tuple[str, str], Contender]

    def median(self, pipeline: str, kind: str) -> float | None:
        found = self.contenders.get((pipeline, kind))
        return found.median() if found is not None else None

    def update(self, pipeline: str) -> float | None:
        """The state-update part: ``median(update) - median(idle)`` (raw slice copy for the floor)."""
        if pipeline == SLICE_COPY:
            return self.median(SLICE_COPY, "update")
        update, idle = self.median(pipeline, "update"), self.median(pipeline, "idle")
        return None if update is None or idle is None else update - idle

    def error(self, pipeline: str, kind: str) -> str | None:
        found = self.contenders.get((pipeline, kind))
        return found.error if found is not None else None


def _contenders(mib: float, pipeline: Pipeline | None) -> dict[tuple[str, str], Contender]:
    cfg = DecoderConfig.for_cache_bytes(int(mib * MIB), window=WINDOW)
    references = {kind: _reference(case, WARMUP) for kind, case in _cases(cfg, True).items()}
    found: dict[tuple[str, str], Contender] = {}
    for name in PIPELINES:
        for kind, case in _cases(cfg, caller_cache=name == WRITEBACK).items():
            contender, session = _build(name, kind, case, pipeline)
            if contender.error is None:
                _warm_up(contender, session, references[kind])
            found[(name, kind)] = contender
    found[(EAGER, "step")] = Contender(EAGER, "step", _eager_call(decoder_case(cfg, caller_cache=True)))
    found[(SLICE_COPY, "update")] = Contender(SLICE_COPY, "update", _slice_copy_call(cfg))
    for floor in (found[(EAGER, "step")], found[(SLICE_COPY, "update")]):
        for step in range(WARMUP):
            assert floor.call is not None
            floor.call(step)
    return found


def _time_calls(contender: Contender, step: int) -> None:
    assert contender.call is not None
    # The update-part programs are short, so a scheduler hiccup moves one sample a
    # lot: take several calls per round (each timed alone) for a steadier median.
    # Their first call in a round runs untimed: right after another contender's
    # whole-cache copy (stock's, 128 MiB) the CPU caches hold none of this one's
    # code or data, and a short call measured then is 3-4x slower (raw slice
    # copy_ included) -- a cost of the previous contender, not of this one.
    short = contender.kind != "step"
    for call in range(1 + UPDATE_CALLS_PER_ROUND if short else 1):
        try:
            seconds, _ = contender.call(step)
        except Exception as error:
            contender.error = f"failed at run time: {_short(error)}"
            return
        if not short or call > 0:
            contender.times.append(seconds)


def _time_rounds(contenders: Sequence[Contender], repeats: int) -> None:
    """One call of each contender per round, the order rotated each round."""
    live = [c for c in contenders if c.error is None and c.call is not None]
    gc.collect()
    gc.disable()
    try:
        for round_ in range(repeats):
            step = WARMUP + round_
            shift = round_ % max(1, len(live))
            for contender in live[shift:] + live[:shift]:
                _time_calls(contender, step)
            live = [c for c in live if c.error is None]
    finally:
        gc.enable()


@dataclass
class BenchResult:
    """Every size, in the order measured."""

    sizes: list[SizeResult]
    repeats: int
    backend: str | None = None


def run_bench(
    registry: Registry,
    sizes: Sequence[float],
    repeats: int,
    backend: str | None = None,
    progress: Progress | None = None,
) -> BenchResult:
    """Measure every size (see the module docstring). Never raises for a failing pipeline."""
    try:
        pipeline: Pipeline | None = assemble(registry, backend)
    except PipelineError:
        pipeline = None
    chosen = (pipeline.backend.name if pipeline.backend is not None else "none") if pipeline is not None else backend
    results = []
    task = progress.add_task("bench", total=len(sizes)) if progress is not None else None
    for mib in sizes:
        contenders = _contenders(mib, pipeline)
        _time_rounds(list(contenders.values()), repeats)
        results.append(SizeResult(mib, contenders))
        # Drop this size's programs and caches before building the next one's.
        for contender in contenders.values():
            contender.call = None
        gc.collect()
        if progress is not None and task is not None:
            progress.advance(task)
    return BenchResult(results, repeats, chosen)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def _ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den <= 0:
        return "-"
    return f"{num / den:.1f}x"


def _cell(size: SizeResult, pipeline: str, kind: str) -> str:
    error = size.error(pipeline, kind) or (size.error(pipeline, "idle") if kind == "update" else None)
    if error is not None:
        return "[red]failed[/red]" if error.startswith("failed") else "[red]wrong[/red]"
    value = size.median(pipeline, kind) if kind == "step" else size.update(pipeline)
    return _ms(value)


def _tables(result: BenchResult) -> list[Table]:
    writeback = f"{WRITEBACK} ({result.backend})" if result.backend else WRITEBACK
    step = Table(title=f"decode step, median of {result.repeats} interleaved calls")
    for title in (
        "K+V cache",
        STOCK,
        REINPLACE,
        XNNPACK,
        writeback,
        "eager (floor)",
        "stock / writeback",
        f"{XNNPACK} / writeback",
        "writeback / eager",
    ):
        step.add_column(title, justify="right")
    update = Table(
        title=f"state update: median(update-only call) - median(idle call), "
        f"{UPDATE_CALLS_PER_ROUND * result.repeats} calls each"
    )
    for title in (
        "K+V cache",
        STOCK,
        REINPLACE,
        XNNPACK,
        writeback,
        "slice copy_ (floor)",
        "stock / writeback",
        f"{XNNPACK} / writeback",
        "writeback / slice copy_",
        "writeback update, idle calls",
    ):
        update.add_column(title, justify="right")
    for size in result.sizes:
        label = f"{size.mib:g} MiB"
        wb = size.median(WRITEBACK, "step")
        step.add_row(
            label,
            *(_cell(size, p, "step") for p in PIPELINES),
            _ms(size.median(EAGER, "step")),
            _ratio(size.median(STOCK, "step"), wb),
            _ratio(size.median(XNNPACK, "step"), wb),
            _ratio(wb, size.median(EAGER, "step")),
        )
        update.add_row(
            label,
            *(_cell(size, p, "update") for p in PIPELINES),
            _ms(size.update(SLICE_COPY)),
            _ratio(size.update(STOCK), size.update(WRITEBACK)),
            _ratio(size.update(XNNPACK), size.update(WRITEBACK)),
            _ratio(size.update(WRITEBACK), size.update(SLICE_COPY)),
            f"{_ms(size.median(WRITEBACK, 'update'))}, {_ms(size.median(WRITEBACK, 'idle'))}",
        )
    return [step, update]


def _failures(result: BenchResult) -> list[str]:
    lines = []
    for size in result.sizes:
        for (pipeline, kind), contender in size.contenders.items():
            if contender.error is not None:
                lines.append(f"{size.mib:g} MiB, {pipeline}, {kind} program: {contender.error}")
    return lines


def _goal(label: str, value: float | None, target: float, at_least: bool) -> str:
    if value is None:
        return f"{label}: not measured"
    met = value >= target if at_least else value <= target
    sign = ">=" if at_least else "<="
    return f"{label}: {value:.2f} ({'met' if met else 'MISSED'}, goal {sign} {target:g})"


def goals(result: BenchResult) -> list[str]:
    """The issue's goals at the largest size measured, each with its measured value."""
    if not result.sizes:
        return []
    big, small = result.sizes[-1], result.sizes[0]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    wb_big, wb_small = big.median(WRITEBACK, "step"), small.median(WRITEBACK, "step")
    return [
        f"goals at {big.mib:g} MiB:",
        _goal("  stock / writeback, whole step", ratio(big.median(STOCK, "step"), wb_big), 3, True),
        _goal("  stock / writeback, state update", ratio(big.update(STOCK), big.update(WRITEBACK)), 50, True),
        _goal(f"  {XNNPACK} / writeback, state update", ratio(big.update(XNNPACK), big.update(WRITEBACK)), 50, True),
        _goal("  writeback update / slice copy_", ratio(big.update(WRITEBACK), big.update(SLICE_COPY)), 10, False),
        _goal(f"  writeback step {big.mib:g} MiB / {small.mib:g} MiB", ratio(wb_big, wb_small), 1.5, False),
        f"  for reference, eager step {big.mib:g} MiB / {small.mib:g} MiB: "
        f"{_ratio(big.median(EAGER, 'step'), small.median(EAGER, 'step'))} "
        f"(attention over the last {WINDOW} positions at every size)",
    ]


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or a usage error saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise click.UsageError(
            "--plot needs matplotlib: pip install matplotlib==3.11.2 (the workspace's dev group has it)"
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_format(path: Path) -> str:
    """The image format ``--plot`` writes, from the file's suffix (``png`` without one)."""
    return path.suffix.lstrip(".").lower() or "png"


def _check_plot(path: Path) -> None:
    """Refuse (``click.UsageError``) a ``--plot`` path matplotlib cannot write, before any timing."""
    plt = _pyplot()
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if _plot_format(path) not in formats:
        raise click.BadParameter(
            f"cannot write {path}: matplotlib writes {', '.join(sorted(formats))}; end the name with one of them",
            param_hint="'--plot'",
        )


def plot(result: BenchResult, path: Path) -> None:
    """Step time and state-update time against cache size, one line per pipeline, log scales.

    The image (its format from ``path``'s suffix) replaces ``path`` whole or not at all."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [s.mib for s in result.sizes]
    styles = {STOCK: "o-", REINPLACE: "s-", XNNPACK: "D-", WRITEBACK: "^-", EAGER: "k--", SLICE_COPY: "k:"}

    def line(axis: Any, name: str, values: list[float | None]) -> None:
        points = [(x, v * 1e3) for x, v in zip(sizes, values, strict=True) if v is not None and v > 0]
        if points:
            axis.plot(*zip(*points, strict=True), styles[name], label=name)

    for name in (*PIPELINES, EAGER):
        line(left, name, [s.median(name, "step") for s in result.sizes])
    for name in (*PIPELINES, SLICE_COPY):
        line(right, name, [s.update(name) for s in result.sizes])
    for axis, title in ((left, "decode step"), (right, "state update (update - idle call)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("K+V cache (MiB)")
        axis.set_ylabel("ms (median)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (format from its suffix), replacing it whole or not at all."""
    fig.tight_layout()
    try:
        with replacing(path) as temporary:
            fig.savefig(temporary, dpi=120, format=_plot_format(path))
    finally:
        plt.close(fig)


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
@click.option("--backend", default=None, help="The writeback pipeline's backend. Default: mlx when installed.")
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
) -> None:
    """Time one decode step through stock ExecuTorch, stock + reinplace, stock + XNNPACK and writeback, interleaved,
    at each cache size; print medians, ratios and floors (eager, raw slice copy_). With --model,
    time one model through every contender instead, with the whole-state copies each leaves."""
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    if model is not None:
        _bench_model(registry, model, cache_mib, steps or 15, start, contender_names, plot_path, torch_threads)
        return
    given = [f"--{n}" for n, v in (("cache-mib", cache_mib), ("steps", steps), ("contenders", contender_names)) if v]
    if start:
        given.append("--start")
    if given:
        raise click.UsageError(f"{', '.join(given)} go with --model NAME (without it, bench times the cache sizes)")
    try:
        choose_backend(registry, backend)
    except PipelineError as error:
        raise click.BadParameter(str(error), param_hint="'--backend'") from error
    if plot_path is not None:
        _check_plot(plot_path)
    torch.set_num_threads(torch_threads)
    console = Console(width=200)
    with native_stderr_filtered(), progress_bar(Progress(console=console, transient=True)) as progress:
        result = run_bench(registry, sizes, repeats, backend, progress)
    for table in _tables(result):
        console.print(table)
    for line in [*_failures(result), *goals(result)]:
        console.print(line, markup=False)
    _write_plot(console, lambda path: plot(result, path), plot_path)


# ---------------------------------------------------------------------------
# ``writeback bench --model NAME``: every contender on one model, side by side.
# ---------------------------------------------------------------------------

XNNPACK_REINPLACE = "stock+xnnpack+reinplace"
# The baseline every row is compared with: what ExecuTorch users deploy on CPU.
BASELINE = XNNPACK
UPSTREAM = (EAGER, STOCK, XNNPACK, XNNPACK_REINPLACE)
WRITEBACK_PREFIX = "writeback+"

# Functional state writes exir's reinplace pass could be asked to make in place
# (``ExecutorchBackendConfig.reinplace_extra_ops``); those whose in-place form the
# pass derives are opted in, beside its default (``index_put``).
_REINPLACE_CANDIDATES = ("index_put.default", "index_copy.default", "copy.default", "scatter.src", "scatter.value")


def reinplace_ops() -> frozenset[Any]:
    """Every edge op exir's reinplace pass can be opted into among the functional state writes.

    Read from the installed exir: an op counts when the pass derives its in-place
    overload (``aten::index_copy`` -> ``aten::index_copy_``); ``slice_scatter`` and
    ``select_scatter`` have no in-place form, so they never count.
    """
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.passes import reinplace

    found = set(reinplace.DEFAULT_INPLACEABLE_OPS)
    for name in _REINPLACE_CANDIDATES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(exir_ops.edge.aten, packet, None), overload, None)
        if op is not None and reinplace._derive_edge_inplace_overload(op) is not None:
            found.add(op)
    return frozenset(found)


@dataclass
class ModelRow:
    """One contender on the model: its timed calls and the whole-state copies its program leaves.

    ``copies``/``copied_bytes``: write-back ``copy_`` nodes of state left in the
    final program and the bytes they move per call (``None``: no program, or it
    failed before one existed).
    """

    name: str
    call: Call | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)
    copies: int | None = None
    copied_bytes: int | None = None
    note: str = ""

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and self.error is None else None


@dataclass
class ModelBenchResult:
    """Every contender's row on ``case``, in the order they were asked for."""

    case: ModelCase
    rows: list[ModelRow]
    steps: int
    start: int

    def row(self, name: str) -> ModelRow | None:
        return next((r for r in self.rows if r.name == name), None)


def _program_copies(program: Any) -> tuple[int, int]:
    """``(count, bytes per call)`` of the write-back copies of state in ``program``'s final graph."""
    from writeback_core.lowering import write_back_bytes

    copies = write_back_bytes(program.exported_program())
    return len(copies), sum(copies.values())


def _stock_model_call(
    case: ModelCase, exported: Any, partitioner: str | None, reinplace: bool
) -> tuple[Call, int, int]:
    """Lower ``exported`` the stock way (``partitioner``: ``"xnnpack"`` or none) and load it in
    stock ``executorch.runtime``. Caller-owned state is fed in every call and its new value,
    which that runtime returns as an output instead of writing it, copied back (timed: a
    stock user pays it)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    with known_warnings_ignored():
        from executorch.runtime import Runtime

        partitioners: list[Any] = []
        if partitioner == "xnnpack":
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            partitioners.append(XnnpackPartitioner())
        edge = to_edge_transform_and_lower(exported, partitioner=partitioners)
        config = (
            ExecutorchBackendConfig(run_reinplace_pass=True, reinplace_extra_ops=reinplace_ops())
            if reinplace
            else ExecutorchBackendConfig()
        )
        program = edge.to_executorch(config)
        data = bytes(program.buffer)
        # A stock Method reads freed memory once its Program is collected: keep both.
        loaded = Runtime.get().load_program(data)
        method = loaded.load_method("forward")
    final = program.exported_program()
    from torch.export.graph_signature import OutputKind

    mutated = sum(1 for s in final.graph_signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION)
    state = case.make_state()
    count, nbytes = _program_copies(program)

    signature = InputSignature.of(exported)

    def call(step: int) -> tuple[float, list[Any]]:
        assert loaded is not None
        inputs = flatten_step_inputs(signature, case, step, state)
        start = time.perf_counter()
        outputs = list(method.execute(inputs))
        for tensor, new in zip(state, outputs[:mutated], strict=False):
            tensor.copy_(new)
        seconds = time.perf_counter() - start
        return seconds, outputs[mutated:]

    call.state = state  # type: ignore[attr-defined]  # read by the warm-up check
    return call, count, nbytes


def _eager_outputs(eager: Eager, step: int) -> list[Any]:
    case = eager.case
    with torch.no_grad():
        return _flat(eager.module(*case.step_inputs(step), *eager.state, **case.example_kwargs(step)))


def _model_eager_call(case: ModelCase) -> Call:
    eager = Eager(case)

    def call(step: int) -> tuple[float, list[Any]]:
        start = time.perf_counter()
        outputs = _eager_outputs(eager, step)
        return time.perf_counter() - start, outputs

    return call


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


def _upstream_row(name: str, case: ModelCase, exported: Callable[[], Any]) -> ModelRow:
    row = ModelRow(name)
    try:
        if name == EAGER:
            row.call, row.copies, row.copied_bytes = _model_eager_call(case), 0, 0
            row.note = "PyTorch writes its state in place"
            return row
        partitioner = None if name == STOCK else "xnnpack"
        row.call, row.copies, row.copied_bytes = _stock_model_call(
            case, exported(), partitioner, reinplace=name == XNNPACK_REINPLACE
        )
    except Exception as error:  # reported in its cell; the other contenders go on
        row.error = f"failed to lower or load: {_short(error)}"
    return row


def _writeback_row(name: str, case: ModelCase, registry: Registry, backend: str) -> tuple[ModelRow, Session | None]:
    row = ModelRow(name)
    try:
        pipeline = assemble(registry, backend)
        lowered = lower(case, pipeline)
        session = Session.open(pipeline, lowered)
    except Exception as error:
        row.error = f"failed to lower or load: {_short(error)}"
        return row, None
    row.copies, row.copied_bytes = len(lowered.write_back_bytes), lowered.copied_per_call

    def call(step: int) -> tuple[float, list[Any]]:
        result = session.step(step)  # times the runtime's execute alone
        return result.seconds, result.outputs

    row.call = call
    return row, session


def _contender_row(name: str, case: ModelCase, make: Callable[[], Any]) -> ModelRow:
    """A case's own upstream contender: its program lowered with XNNPACK, stock runtime."""
    row = ModelRow(name, note="the model's own export, lowered with XNNPACK, stock runtime")
    try:
        row.call, row.copies, row.copied_bytes = _stock_model_call(case, make(), "xnnpack", reinplace=False)
    except Exception as error:
        row.error = f"failed to lower or load: {_short(error)}"
    return row


def model_contenders(registry: Registry, case: ModelCase) -> list[str]:
    """Every contender ``bench --model`` offers for ``case``, in table order."""
    backends = [f"{WRITEBACK_PREFIX}{b}" for b in sorted(registry.backends())]
    return [*UPSTREAM, *backends, *case.contenders]


def _model_reference(case: ModelCase, start: int) -> list[tuple[list[Any], tuple[torch.Tensor, ...]]]:
    """Eager outputs and state after each warm-up call, steps ``start`` .. ``start + WARMUP - 1``."""
    eager = Eager(case)
    found = []
    for step in range(start, start + WARMUP):
        outputs = _eager_outputs(eager, step)
        found.append(
            (
                [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs],
                tuple(t.clone() for t in eager.state),
            )
        )
    return found


# A kernel's own reason, as the ExecuTorch runtime logs it: "[op_x.cpp:228] Check failed (cond): reason".
_CHECK_FAILED = re.compile(r"Check failed \(.*\): (\S.*)$")


def _run_failure(error: BaseException, log: NativeLog | None, mark: int) -> str:
    """A cell's text for a call that raised: the exception, and the reason the runtime logged
    since ``mark`` (the Python error of a stock Method says only its error code)."""
    text = f"failed at run time: {_short(error)}"
    lines = log.since(mark) if log is not None else []
    reasons = [m.group(1).strip() for m in map(_CHECK_FAILED.search, lines) if m is not None]
    failed = [line.split("] ", 1)[-1] for line in lines if " failed" in line]
    reason = reasons[0] if reasons else failed[-1] if failed else None
    return f"{text} ({reason})" if reason else text


def _warm_up_row(
    row: ModelRow, session: Session | None, reference: list[Any], start: int, log: NativeLog | None = None
) -> None:
    """The warm-up calls, each checked against eager (outputs, and caller-owned state after the last)."""
    assert row.call is not None
    for offset, (expected, _) in enumerate(reference):
        step = start + offset
        mark = log.mark() if log is not None else 0
        try:
            _, outputs = row.call(step)
        except Exception as error:  # a contender that fails at run time is reported, not dropped
            row.error = _run_failure(error, log, mark)
            return
        check = compare(StepResult(step, 0.0, outputs, 0, 0), expected, (), ())
        if not check.ok:
            row.error = f"wrong at warm-up step {step}: {'; '.join(check.problems)}"
            return
    state = session.state if session is not None else getattr(row.call, "state", ())
    eager_state = reference[-1][1] if reference else ()
    if state and len(state) == len(eager_state):
        check = compare(StepResult(start, 0.0, [], 0, 0), [], state, eager_state)
        if not check.ok:
            row.error = f"wrong state after warm-up: {'; '.join(check.problems)}"


def run_model_bench(
    registry: Registry,
    case: ModelCase,
    steps: int,
    start: int = 0,
    contenders: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> ModelBenchResult:
    """Time one decode call of ``case`` through each contender, interleaved round-robin in one
    process: ``WARMUP`` checked calls from step ``start``, then ``steps`` timed rounds.

    Contenders (:func:`model_contenders`): ``eager``; ``stock`` (``to_edge`` +
    ``to_executorch`` defaults, stock ``executorch.runtime``); ``stock+xnnpack``
    (``XnnpackPartitioner``); ``stock+xnnpack+reinplace`` (also exir's reinplace pass with
    every op it can be opted into, :func:`reinplace_ops`); ``writeback+<backend>`` for each
    backend the registry offers (writeback's pipeline); and each of ``case.contenders``
    (lowered with XNNPACK, stock runtime). One that fails to lower, load, run or match
    eager keeps its row with the reason. Never raises for a failing contender.

    :raises ValueError: ``contenders`` names one that is not offered (the message lists them).
    """
    offered = model_contenders(registry, case)
    chosen = list(offered if contenders is None else contenders)
    unknown = [c for c in chosen if c not in offered]
    if unknown:
        raise ValueError(f"no contender named {', '.join(map(repr, unknown))}; offered: {', '.join(offered)}")
    exported_once: list[Any] = []

    def exported() -> Any:
        # One export shared by the stock rows (exir consumes none of it: to_edge copies).
        from writeback_core.lowering import export_case

        if not exported_once:
            exported_once.append(export_case(case))
        return exported_once[0]

    reference = _model_reference(case, start)
    rows: list[ModelRow] = []
    task = progress.add_task("lower", total=len(chosen)) if progress is not None else None
    # The runtimes' C++ log goes through a file: a failing kernel's reason goes into its row's
    # cell, the stock runtime's start-up lines are dropped, any other line is printed at the end.
    with native_stderr_captured() as log:
        for name in chosen:
            session = None
            if name in UPSTREAM:
                row = _upstream_row(name, case, exported)
            elif name.startswith(WRITEBACK_PREFIX) and name not in case.contenders:
                row, session = _writeback_row(name, case, registry, name.removeprefix(WRITEBACK_PREFIX))
            else:
                row = _contender_row(name, case, case.contenders[name])
            if row.error is None:
                _warm_up_row(row, session, reference, start, log)
            rows.append(row)
            if progress is not None and task is not None:
                progress.advance(task)
        _time_model_rounds(rows, steps, start + WARMUP, log)
    for row in rows:
        row.call = None
    gc.collect()
    return ModelBenchResult(case, rows, steps, start)


def _time_model_rounds(rows: Sequence[ModelRow], steps: int, first: int, log: NativeLog | None = None) -> None:
    """One call of each live row per round, the order rotated each round; a row that
    raises keeps its error and leaves the rounds."""
    live = [r for r in rows if r.error is None and r.call is not None]
    gc.collect()
    gc.disable()
    try:
        for round_ in range(steps):
            shift = round_ % max(1, len(live))
            for row in live[shift:] + live[:shift]:
                assert row.call is not None
                mark = log.mark() if log is not None else 0
                try:
                    seconds, _ = row.call(first + round_)
                except Exception as error:
                    row.error = _run_failure(error, log, mark)
                    continue
                row.times.append(seconds)
            live = [r for r in live if r.error is None]
    finally:
        gc.enable()


def _copies_cell(row: ModelRow) -> str:
    if row.copies is None:
        return "-"
    from writeback_core.explain import format_bytes

    return f"{row.copies} ({format_bytes(row.copied_bytes or 0)})" if row.copies else "0"


def model_table(result: ModelBenchResult) -> Table:
    """One row per contender: step median, speed against the baseline, whole-state copies per call."""
    case = result.case
    table = Table(
        title=f"{case.name}: one call, median of {result.steps} interleaved calls from step "
        f"{result.start + WARMUP} (after {WARMUP} warm-up calls checked against eager)"
    )
    base = result.row(BASELINE)
    base_median = base.median() if base is not None else None
    base_copies = base.copies if base is not None and base.error is None else None
    for title in ("contender", "step", f"{BASELINE} / this", "whole-state copies/call", f"copies vs {BASELINE}"):
        table.add_column(title, justify="left" if title == "contender" else "right")
    for row in result.rows:
        median = row.median()
        if row.error is not None:
            word = "failed" if row.error.startswith("failed") else "wrong"
            step = f"[red]{word}[/red]{escape(row.error.removeprefix(word))}"
        else:
            step = _ms(median)
        copies_ratio = "-"
        if row.copies is not None and base_copies is not None:
            copies_ratio = f"{row.copies} vs {base_copies}"
        table.add_row(row.name, step, _ratio(base_median, median), _copies_cell(row), copies_ratio)
    return table


def plot_model(result: ModelBenchResult, path: Path) -> None:
    """A bar per contender (median step, ms), labelled with the copies it leaves per call.

    The image (its format from ``path``'s suffix) replaces ``path`` whole or not at all."""
    plt = _pyplot()
    measured = [(r.name, r.median(), r.copies) for r in result.rows]
    fig, axis = plt.subplots(figsize=(9, 0.5 * len(measured) + 1.5))
    names = [name for name, _, _ in measured]
    values = [(m or 0.0) * 1e3 for _, m, _ in measured]
    bars = axis.barh(names, values, color=["tab:blue" if m is not None else "lightgrey" for _, m, _ in measured])
    for bar, (_, median, copies) in zip(bars, measured, strict=True):
        label = "failed" if median is None else f"{median * 1e3:.2f} ms, {copies if copies is not None else '-'} copies"
        axis.annotate(
            label,
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    axis.invert_yaxis()
    axis.set_xlabel("ms (median)")
    axis.set_title(f"{result.case.name}: one call from step {result.start + WARMUP}")
    axis.grid(True, axis="x", alpha=0.3)
    _save(plt, fig, path)


def _bench_model(
    registry: Registry,
    model: str,
    cache_mib: float | None,
    steps: int,
    start: int,
    contender_names: str | None,
    plot_path: Path | None,
    torch_threads: int,
) -> None:
    """``bench --model``: resolve the model as ``writeback run`` does, check the contender names
    and the plot path before anything is lowered, then time and print."""
    from writeback_core.run import _case

    case = _case(registry, model, cache_mib)
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
        _check_plot(plot_path)
    torch.set_num_threads(torch_threads)
    console = Console(width=160)
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
