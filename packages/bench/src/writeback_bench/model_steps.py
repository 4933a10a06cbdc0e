"""The model bench of ``writeback bench``: every contender on one model, side by side.

``writeback bench --model NAME`` (:func:`run_model_bench`) times one model
instead of the cache sizes (:mod:`writeback_bench.cache_sizes`), resolved as
``writeback run`` resolves it (a built-in or plugin name, or ``file.py:factory``;
``--cache-mib`` for the built-in decoders) and exported once through
:func:`writeback.model_build.export_case`. Its contenders, one row each,
interleaved the same way as the cache sizes' from step ``--start``: eager; stock;
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
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from writeback.eager_weights import same_weights
from writeback.process_memory import return_freed_memory
from writeback.session import Eager, Session, StepResult, assemble, compare, flatten_step_inputs, lower_case
from writeback_core.lowered import InputSignature
from writeback_core.quiet import NativeLog, known_warnings_ignored, native_stderr_captured
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
    write_stock_pte,
)

__all__ = [
    "BASELINE",
    "UPSTREAM",
    "WRITEBACK_PREFIX",
    "XNNPACK_REINPLACE",
    "ModelBenchResult",
    "ModelRow",
    "model_contenders",
    "model_table",
    "reinplace_ops",
    "run_model_bench",
]

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
    from writeback_core.program_passes import write_back_bytes

    copies = write_back_bytes(program.exported_program())
    return len(copies), sum(copies.values())


def _stock_model_call(
    case: ModelCase, exported: Any, partitioner: str | None, reinplace: bool, path: Path
) -> tuple[Call, int, int]:
    """Lower ``exported`` the stock way (``partitioner``: ``"xnnpack"`` or none), write it to
    ``path`` and load that file in stock ``executorch.runtime``, as ExecuTorch users save and
    load a program (the runtime maps the file: no joined copy of the weights in memory).
    Caller-owned state is fed in every call and its new value, which that runtime returns as
    an output instead of writing it, copied back (timed: a stock user pays it)."""
    from executorch.exir import ExecutorchBackendConfig

    with known_warnings_ignored():
        from executorch.runtime import Runtime

        config = (
            ExecutorchBackendConfig(run_reinplace_pass=True, reinplace_extra_ops=reinplace_ops())
            if reinplace
            else ExecutorchBackendConfig()
        )
        program = write_stock_pte(exported, path, partitioner == "xnnpack", config)
        # A stock Method reads freed memory once its Program is collected: keep both.
        loaded = Runtime.get().load_program(path)
        method = loaded.load_method("forward")
    final = program.exported_program()
    from torch.export.graph_signature import OutputKind

    mutated = sum(1 for s in final.graph_signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION)
    state = case.make_state()
    count, nbytes = _program_copies(program)
    del program, final  # the lowering's copies of the weights: the loaded file is what runs

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


def _upstream_row(name: str, case: ModelCase, exported: Callable[[], Any], folder: Path) -> ModelRow:
    row = ModelRow(name)
    try:
        if name == EAGER:
            row.call, row.copies, row.copied_bytes = _model_eager_call(case), 0, 0
            row.note = "PyTorch writes its state in place"
            return row
        partitioner = None if name == STOCK else "xnnpack"
        row.call, row.copies, row.copied_bytes = _stock_model_call(
            case, exported(), partitioner, reinplace=name == XNNPACK_REINPLACE, path=_pte_path(folder, name)
        )
    except Exception as error:  # reported in its cell; the other contenders go on
        row.error = f"failed to lower or load: {short_error(error)}"
    return row


def _pte_path(folder: Path, name: str) -> Path:
    return folder / (re.sub(r"[^A-Za-z0-9.-]+", "_", name) + ".pte")


def _writeback_row(
    name: str, case: ModelCase, registry: Registry, backend: str, folder: Path
) -> tuple[ModelRow, Session | None]:
    """Lowered as ``writeback run`` lowers: written to a file in ``folder``, the lowering's
    copies of the weights released, then that file loaded."""
    row = ModelRow(name)
    try:
        pipeline = assemble(registry, backend)
        lowered = lower_case(case, pipeline, between_steps=return_freed_memory)
        path = _pte_path(folder, name)
        lowered.write_pte(path)
        lowered.release()
        return_freed_memory()
        session = Session.open(pipeline, lowered, path=path)
    except Exception as error:
        row.error = f"failed to lower or load: {short_error(error)}"
        return row, None
    row.copies, row.copied_bytes = len(lowered.write_back_bytes), lowered.copied_per_call

    def call(step: int) -> tuple[float, list[Any]]:
        result = session.step(step)  # times the runtime's execute alone
        return result.seconds, result.outputs

    row.call = call
    return row, session


def _contender_row(name: str, case: ModelCase, make: Callable[[], Any], folder: Path) -> ModelRow:
    """A case's own upstream contender: its program lowered with XNNPACK, stock runtime."""
    row = ModelRow(name, note="the model's own export, lowered with XNNPACK, stock runtime")
    try:
        row.call, row.copies, row.copied_bytes = _stock_model_call(
            case, make(), "xnnpack", reinplace=False, path=_pte_path(folder, name)
        )
    except Exception as error:
        row.error = f"failed to lower or load: {short_error(error)}"
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
        if start == 0 and case.observe is not None:
            # From step 0 this is the run greedy decoding makes: the case takes its next
            # inputs from it instead of building an eager copy of its own (a model's weights).
            case.observe(step, outputs)
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
    text = f"failed at run time: {short_error(error)}"
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
    # Every row and the eager reference hold the weights of the first build; a factory whose builds
    # differ (unseeded random weights) is refused naming the first tensor that differs.
    case = same_weights(case)
    exported_once: list[Any] = []

    def exported() -> Any:
        # One export shared by the stock rows (exir consumes none of it: to_edge copies).
        from writeback.model_build import export_case

        if not exported_once:
            exported_once.append(export_case(case))
        return exported_once[0]

    reference = _model_reference(case, start)
    found: dict[str, ModelRow] = {}
    task = progress.add_task("lower", total=len(chosen)) if progress is not None else None
    # Memory (a real-size model's weights are held by each loaded program, by the shared export
    # and by the eager row): the shared export is dropped after its last user, and the eager
    # row, which keeps a model for the whole bench, is built after every lowering.
    order = sorted(chosen, key=lambda name: name == EAGER)
    last_export_user = max((i for i, name in enumerate(order) if name in UPSTREAM and name != EAGER), default=-1)
    # The runtimes' C++ log goes through a file: a failing kernel's reason goes into its row's
    # cell, the stock runtime's start-up lines are dropped, any other line is printed at the end.
    with native_stderr_captured() as log, tempfile.TemporaryDirectory(prefix="writeback-bench-") as folder:
        for index, name in enumerate(order):
            session = None
            if name in UPSTREAM:
                row = _upstream_row(name, case, exported, Path(folder))
            elif name.startswith(WRITEBACK_PREFIX) and name not in case.contenders:
                row, session = _writeback_row(name, case, registry, name.removeprefix(WRITEBACK_PREFIX), Path(folder))
            else:
                row = _contender_row(name, case, case.contenders[name], Path(folder))
            if index == last_export_user:
                exported_once.clear()
            return_freed_memory()
            if row.error is None:
                _warm_up_row(row, session, reference, start, log)
            found[name] = row
            session = None  # the row's call holds it
            if progress is not None and task is not None:
                progress.advance(task)
        rows = [found[name] for name in chosen]
        # From step 0, the rows' own outputs give a greedy case its next tokens (as run does).
        observe = case.observe if start == 0 else None
        _time_model_rounds(rows, steps, start + WARMUP, log, observe)
        for row in rows:
            row.call = None
        gc.collect()
    return ModelBenchResult(case, rows, steps, start)


def _time_model_rounds(
    rows: Sequence[ModelRow],
    steps: int,
    first: int,
    log: NativeLog | None = None,
    observe: Callable[[int, Sequence[Any]], None] | None = None,
) -> None:
    """One call of each live row per round, the order rotated each round; a row that
    raises keeps its error and leaves the rounds. ``observe(step, outputs)`` gets the
    outputs of each round's first row that answered (untimed), before the next round."""
    live = [r for r in rows if r.error is None and r.call is not None]
    gc.collect()
    gc.disable()
    try:
        for round_ in range(steps):
            observed = False
            shift = round_ % max(1, len(live))
            for row in live[shift:] + live[:shift]:
                assert row.call is not None
                mark = log.mark() if log is not None else 0
                try:
                    seconds, outputs = row.call(first + round_)
                except Exception as error:
                    row.error = _run_failure(error, log, mark)
                    continue
                row.times.append(seconds)
                if observe is not None and not observed:
                    observe(first + round_, outputs)
                    observed = True
            live = [r for r in live if r.error is None]
    finally:
        gc.enable()


def _copies_cell(row: ModelRow) -> str:
    if row.copies is None:
        return "-"
    from writeback_core.units import format_bytes

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
            step = format_ms(median)
        copies_ratio = "-"
        if row.copies is not None and base_copies is not None:
            copies_ratio = f"{row.copies} vs {base_copies}"
        table.add_row(row.name, step, format_ratio(base_median, median), _copies_cell(row), copies_ratio)
    return table
