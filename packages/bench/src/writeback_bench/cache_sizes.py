"""The cache-size bench of ``writeback bench``: one decode step through stock ExecuTorch
and through writeback, at each cache size.

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
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import Progress
from rich.table import Table
from torch import nn
from writeback.session import Eager, Pipeline, PipelineError, Session, StepResult, assemble, compare, lower_case
from writeback.zoo import DecoderConfig, decoder_case
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry
from writeback_core.types import ModelCase

from writeback_bench.contenders import (
    EAGER,
    STOCK,
    WARMUP,
    XNNPACK,
    Call,
    format_ms,
    format_ratio,
    short_error,
    stock_program,
)

__all__ = [
    "MIB",
    "PIPELINES",
    "REINPLACE",
    "SLICE_COPY",
    "UPDATE_CALLS_PER_ROUND",
    "WINDOW",
    "WRITEBACK",
    "BenchResult",
    "CacheUpdate",
    "Contender",
    "SizeResult",
    "failures",
    "run_bench",
    "tables",
]

REINPLACE = "stock+reinplace"
WRITEBACK = "writeback"
SLICE_COPY = "slice copy_"
PIPELINES = (STOCK, REINPLACE, XNNPACK, WRITEBACK)
# Positions each decode step attends over (see the module docstring).
WINDOW = 64
UPDATE_CALLS_PER_ROUND = 5
MIB = 1 << 20


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
    from executorch.exir import ExecutorchBackendConfig
    from writeback.model_build import export_case

    with known_warnings_ignored():
        from executorch.runtime import Runtime

        program = stock_program(export_case(case), xnnpack, ExecutorchBackendConfig(run_reinplace_pass=reinplace))
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
    session = Session.open(pipeline, lower_case(case, pipeline))

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


def _warm_up(contender: Contender, session: Session | None, reference: list[Any]) -> None:
    """Run the warm-up calls, each checked against eager; mark the contender on any failure."""

    assert contender.call is not None
    for step, (expected, state) in enumerate(reference):
        try:
            _, outputs = contender.call(step)
        except Exception as error:  # a pipeline that fails at run time is reported, not dropped
            contender.error = f"failed at run time: {short_error(error)}"
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
        contender.error = f"failed to lower or load: {short_error(error)}"
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
            contender.error = f"failed at run time: {short_error(error)}"
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


def _cell(size: SizeResult, pipeline: str, kind: str) -> str:
    error = size.error(pipeline, kind) or (size.error(pipeline, "idle") if kind == "update" else None)
    if error is not None:
        return "[red]failed[/red]" if error.startswith("failed") else "[red]wrong[/red]"
    value = size.median(pipeline, kind) if kind == "step" else size.update(pipeline)
    return format_ms(value)


def tables(result: BenchResult) -> list[Table]:
    """The decode-step table and the state-update table, a row per size: medians, floors, ratios."""
    writeback = f"{WRITEBACK} ({result.backend})" if result.backend else WRITEBACK
    size_and_pipelines = ("K+V cache", STOCK, REINPLACE, XNNPACK, writeback)
    step = Table(title=f"decode step, median of {result.repeats} interleaved calls")
    for title in (
        *size_and_pipelines,
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
        *size_and_pipelines,
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
            format_ms(size.median(EAGER, "step")),
            format_ratio(size.median(STOCK, "step"), wb),
            format_ratio(size.median(XNNPACK, "step"), wb),
            format_ratio(wb, size.median(EAGER, "step")),
        )
        update.add_row(
            label,
            *(_cell(size, p, "update") for p in PIPELINES),
            format_ms(size.update(SLICE_COPY)),
            format_ratio(size.update(STOCK), size.update(WRITEBACK)),
            format_ratio(size.update(XNNPACK), size.update(WRITEBACK)),
            format_ratio(size.update(WRITEBACK), size.update(SLICE_COPY)),
            f"{format_ms(size.median(WRITEBACK, 'update'))}, {format_ms(size.median(WRITEBACK, 'idle'))}",
        )
    return [step, update]


def failures(result: BenchResult) -> list[str]:
    """A line per contender that failed to lower, load, run or match eager, with the reason."""
    lines = []
    for size in result.sizes:
        for (pipeline, kind), contender in size.contenders.items():
            if contender.error is not None:
                lines.append(f"{size.mib:g} MiB, {pipeline}, {kind} program: {contender.error}")
    return lines
