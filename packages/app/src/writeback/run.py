"""``writeback run [MODEL]``: the whole pipeline on one model, every step checked against eager.

Exports MODEL, finds its mutations, lowers it with the chosen backend, runs the
registered passes, writes the ``.pte``, then runs ``--steps`` calls through the
runtime with caller-owned state bound in place, comparing each call's outputs
and state with eager PyTorch. A step beyond the fixed tolerance is judged against
the same weights run in float64 (:mod:`writeback.reference`): it matches when the
program is within a few times eager fp32's own rounding error of float64. Exits
non-zero, naming the step, the value and both errors, when any step differs.
``--no-check`` builds no eager model and compares nothing.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.export import ExportedProgram
from writeback_core.lowered import Lowered, state_places
from writeback_core.lowering import Partitioned
from writeback_core.registry import Registry
from writeback_core.types import ModelCase
from writeback_core.units import format_bytes

from writeback._files import WriteFailed, replacing
from writeback.cli import (
    CacheMiB,
    UserCodeError,
    accept_weights_option,
    progress_bar,
    quantize_option,
    quantized_case,
    resolve_model_option,
    writable_file,
)
from writeback.eager_weights import EAGER_WEIGHTS_HELP, EagerWeights, ExportedWeights, WeightsDiffer
from writeback.lowered_lines import state_lines, where_it_loads
from writeback.pass_reasons import passes_run_lines
from writeback.process_memory import free_delegated_weights, map_large_allocations, return_freed_memory
from writeback.reference import FP32_FACTOR, Float64Reference
from writeback.session import (
    Eager,
    Pipeline,
    PipelineError,
    Session,
    StepCheck,
    StepInputError,
    StepResult,
    assemble,
    compare,
    lower_case,
    state_nbytes,
)

__all__ = ["RunReport", "StepRefused", "resolve_case", "run_command", "run_model"]

DEFAULT_MODEL = "decoder-caller-cache"

# Copies of the K+V cache a run holds at once (measured: the exported program's,
# the runtime's, eager's, the .pte's for program-owned caches, and lowering's).
CACHE_COPIES = 8


@dataclass(frozen=True)
class RunReport:
    """What ``writeback run`` did: the lowering and every step with its check."""

    pipeline: Pipeline
    case: ModelCase
    lowered: Lowered
    pte_path: Path
    steps: list[tuple[StepResult, StepCheck | None]]
    pte_kept: bool = True  # the .pte stays at pte_path (run --output); else a temporary file

    @property
    def checked(self) -> bool:
        """Whether the steps were compared with eager (``run_model(check=True)``)."""
        return all(c is not None for _, c in self.steps)

    @property
    def failures(self) -> list[tuple[StepResult, StepCheck]]:
        return [(r, c) for r, c in self.steps if c is not None and not c.ok]


def resolve_case(registry: Registry, model: str, cache_mib: float | None, accept_weights: bool = False) -> ModelCase:
    """``--model`` and ``--cache-mib`` of ``run`` and ``bench`` as a case (sized when asked).

    :raises click.UsageError: ``--cache-mib`` for a model without a cache size, naming those with one.
    """
    case = resolve_model_option(registry, model, accept_weights)
    if cache_mib is None:
        return case
    if case.sized is None:
        sized = sorted(name for name, offered in registry.models().items() if offered.sized is not None)
        raise click.UsageError(
            f"--cache-mib: model {model!r} has no cache size to set; models sized by their K+V cache: "
            f"{', '.join(sized) or 'none'}"
        )
    return case.sized(cache_mib)


def run_model(
    pipeline: Pipeline,
    case: ModelCase,
    steps: int,
    output: Path,
    console: Console | None = None,
    check: bool = True,
    eager_weights: EagerWeights = "auto",
    float64_reference: bool = True,
) -> RunReport:
    """Lower ``case`` through ``pipeline``, write the ``.pte`` to ``output`` and run ``steps``
    decode steps, each compared with eager. Never raises for a mismatch: see ``failures``.

    ``check=False`` builds no eager model (a second copy of the weights) and compares
    nothing: each step's check is ``None``, and a step the runtime refuses raises
    :class:`StepRefused` without asking eager why.

    Eager runs the very weights exported, kept as ``eager_weights`` says
    (:class:`~writeback.eager_weights.ExportedWeights`). :raises WeightsDiffer: built again
    for eager (``"rebuild"``), the model has other weights than those exported.

    A step beyond the case's ``rtol``/``atol`` is judged against eager's weights run in float64
    (:class:`~writeback.reference.Float64Reference`, built at the first such step, freed after
    the last step) unless ``float64_reference`` is false (a quantized run: its scheme's
    tolerance alone decides). Eager's own weights are freed with the delegated ones before the
    program loads, so the reference is a new build, refused unless its weights equal those
    exported (checksums taken at partitioning).

    ``output`` is replaced whole or not at all (a new file renamed into place), so a
    process that has the old file mapped keeps it and a failure leaves it as it was."""
    weights = ExportedWeights(case, eager_weights) if check else None
    reference: _Reference | None = None

    def partitioned(exported: ExportedProgram, parts: Partitioned) -> None:
        # Eager's steps are computed while the weights are whole, then the weights the
        # delegates took are freed: serialization, the runtime and eager never hold them at once.
        nonlocal reference
        if weights is not None:
            weights.record(exported, checksums=float64_reference)
            if weights.chosen == "copy":
                reference = _Reference.compute(case, weights.eager_module(), steps)
        edge = parts.edge
        free_delegated_weights(exported, [edge.exported_program(method) for method in edge.methods])

    lowered = lower_case(
        weights.case if weights is not None else case,
        pipeline,
        between_steps=return_freed_memory,
        partitioned=partitioned,
    )
    with replacing(output) as temporary:
        lowered.write_pte(temporary)
    # The steps need the runtime's copy of the weights alone: the exported program, the
    # program manager and the .pte bytes go before the runtime and eager take theirs.
    lowered.release()
    return_freed_memory()
    if weights is not None and reference is None:  # built again for eager: its steps before the runtime loads
        reference = _Reference.compute(case, weights.eager_module(), steps)
        return_freed_memory()
    session = Session.open(pipeline, lowered, path=output)
    # Built only at a step the fixed tolerance refuses, from a new build checked against the
    # weights exported (eager's own were freed with the delegated weights).
    float64 = Float64Reference(case, weights.checked_rebuild) if weights is not None and float64_reference else None
    done: list[tuple[StepResult, StepCheck | None]] = []
    progress = Progress(
        TextColumn("[bold]decode"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=console is None,
    )
    with progress_bar(progress):
        task = progress.add_task("decode", total=steps)
        for step in range(steps):
            try:
                result = session.step(step)
            except RuntimeError as error:
                if reference is None:
                    raise StepRefused(
                        f"step {step}: the runtime refused the call ({error}); run without --no-check "
                        "to ask eager PyTorch whether the inputs or the program are at fault",
                        eager_refuses=False,
                        state_kept=False,
                    ) from error
                raise _refusal(step, error, session, reference) from error
            if reference is None:
                done.append((result, None))
                if case.observe is not None:  # the next inputs from these outputs (greedy tokens)
                    case.observe(step, result.outputs)
            else:  # eager's outputs were observed when its steps were computed
                expected = reference.expected(step)
                reference.advance(step)
                step_check = compare(result, expected, session.state, reference.state, case.rtol, case.atol)
                if not step_check.ok and float64 is not None and len(result.outputs) == len(expected):
                    judged = float64.judge(step, result.outputs, session.state, expected, reference.state, case.atol)
                    step_check = dataclasses.replace(step_check, float64=judged)
                done.append((result, step_check))
            progress.advance(task)
    if float64 is not None:
        float64.release()
    return RunReport(pipeline, case, lowered, output, done)


class StepRefused(RuntimeError):
    """The runtime refused a step's call. ``eager_refuses``: eager PyTorch refuses the same
    inputs (the model's inputs are wrong, not the program); ``state_kept``: every caller-owned
    state is as it was before the call (nothing written)."""

    def __init__(self, message: str, eager_refuses: bool, state_kept: bool) -> None:
        super().__init__(message)
        self.eager_refuses = eager_refuses
        self.state_kept = state_kept


def _changes(before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What a step changed in one state tensor: ``(flat indices, values)``, or ``(None, the
    whole tensor)`` where that is smaller (a state rewritten whole)."""
    flat = after.reshape(-1)
    differ = flat.ne(before.reshape(-1))
    count = int(differ.sum())
    if count * 8 >= flat.numel() * flat.element_size():  # the indices alone would outweigh the state
        return None, after.clone(memory_format=torch.contiguous_format)
    indices = differ.nonzero().squeeze(1)
    return indices, flat[indices].clone()


def _apply(state: torch.Tensor, change: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    indices, values = change
    if indices is None:
        state.copy_(values)
    elif indices.numel():
        state.view(-1)[indices] = values


@dataclass
class _Reference:
    """Eager PyTorch's answer to every step, computed before the runtime loads the program so
    that eager's model and the runtime never hold the weights at once.

    ``outputs``: each step's outputs (copies). ``state``: eager's state before the step being
    compared, replayed from the state before step 0 by what each step changed (``changes``), so
    the steps cost one state copy and the bytes they wrote. ``error``: the step eager raised at
    (no later step ran) and what it raised."""

    outputs: list[list[Any]]
    state: tuple[torch.Tensor, ...]
    changes: list[list[tuple[torch.Tensor | None, torch.Tensor]]]
    error: tuple[int, Exception] | None = None

    @classmethod
    def compute(cls, case: ModelCase, module: torch.nn.Module, steps: int) -> _Reference:
        """Run eager ``steps`` times on ``module``, handing each step's outputs to ``case.observe``."""
        eager = Eager(case, module)
        initial = tuple(t.clone(memory_format=torch.contiguous_format) for t in eager.state)
        running = tuple(t.clone(memory_format=torch.contiguous_format) for t in eager.state)
        outputs: list[list[Any]] = []
        changes: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = []
        for step in range(steps):
            try:
                answered = eager.step(step)
            except Exception as error:  # the model's own refusal, whatever its type: raised at that step
                return cls(outputs, initial, changes, (step, error))
            changed = [_changes(mine, now) for mine, now in zip(running, eager.state, strict=True)]
            for mine, change in zip(running, changed, strict=True):
                _apply(mine, change)
            outputs.append([o.clone() if isinstance(o, torch.Tensor) else o for o in answered])
            changes.append(changed)
            if case.observe is not None:  # the next inputs from these outputs (greedy tokens)
                case.observe(step, answered)
        return cls(outputs, initial, changes)

    def refuses(self, step: int) -> Exception | None:
        """What eager raised at ``step``, or ``None`` when it answered."""
        return self.error[1] if self.error is not None and self.error[0] == step else None

    def expected(self, step: int) -> list[Any]:
        """Eager's outputs of ``step``; raises what eager raised there."""
        refused = self.refuses(step)
        if refused is not None:
            raise refused
        return self.outputs[step]

    def advance(self, step: int) -> None:
        """Move :attr:`state` past ``step`` (to eager's state after it)."""
        for mine, change in zip(self.state, self.changes[step], strict=True):
            _apply(mine, change)


def _refusal(step: int, error: RuntimeError, session: Session, reference: _Reference) -> StepRefused:
    """Why step ``step`` failed in the runtime: what eager PyTorch answered to the same call (its
    own error names the state, the index and the size) and the caller's state checked unchanged."""
    eager_error = reference.refuses(step)
    if eager_error is not None:
        state = reference.state
        kept = all(torch.equal(ours, theirs) for ours, theirs in zip(session.state, state, strict=True))
        indexed = [
            f"{m.target} ({m.write.kind.value} along dim {m.write.dim} of size {m.shape[m.write.dim]})"
            for m in session.lowered.mutations
            if m.write.dim is not None and m.write.index is not None and m.write.dim < len(m.shape)
        ]
        message = (
            f"step {step}: the program refused the call ({error}), as eager PyTorch refuses these inputs: "
            f"{type(eager_error).__name__}: {eager_error}. "
            + (f"States written at a run-time index: {', '.join(indexed)}. " if indexed else "")
            + ("Nothing was written: every caller-owned state is as before the call. " if kept and state else "")
            + "Fix the model's step inputs (an index out of range, say)"
        )
        return StepRefused(message, eager_refuses=True, state_kept=kept)
    return StepRefused(
        f"step {step}: the runtime failed ({error}) where eager PyTorch answers the same inputs: this is a "
        "failure of the lowered program, please report it with the model",
        eager_refuses=False,
        state_kept=False,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _summary(report: RunReport) -> str:
    lowered = report.lowered
    caller, owned = state_nbytes(lowered.mutations)
    backend = report.pipeline.backend.name if report.pipeline.backend else "none"
    places = state_places(lowered)
    copies = [p for p in places if p.copy_bytes]
    lines = [
        f"model {report.case.name}: {report.case.description}",
        f"backend {backend}, runtime {report.pipeline.runtime.name}, "
        f"lowered in {lowered.seconds:.1f} s, {format_bytes(lowered.pte_nbytes)} .pte at {report.pte_path}"
        + ("" if report.pte_kept else " (temporary: pass --output to keep it)"),
        f"{len(lowered.mutations)} mutated states: {format_bytes(caller)} caller-owned, "
        f"{format_bytes(owned)} in the program; whole-state copies left per call: "
        + (f"{len(copies)} ({format_bytes(sum(p.copy_bytes for p in copies))}/call)" if copies else "none"),
        *state_lines(places),
    ]
    if report.case.same_inputs_every_step and lowered.mutations:
        lines.append(
            "note: every step gets the same inputs (the factory returned (module, args)); "
            "return a ModelCase with step_inputs to give each step its own"
        )
    lines += passes_run_lines(report.pipeline.registry, lowered.backend, lowered.passes)
    if report.pte_kept:
        lines.append(where_it_loads(lowered.backend, report.pte_path))
    return "\n".join(lines)


def _table(report: RunReport) -> Table:
    against = "vs eager" if report.checked else "not compared with eager (--no-check)"
    table = Table(title=f"writeback run {report.case.name}: {len(report.steps)} steps {against}")
    titles = (
        "step",
        "latency ms",
        "state write-back",
        "copied into delegate",
        "max abs err (out)",
        "max abs err (state)",
        "match",
    )
    for title in titles:
        table.add_column(title, justify="right")
    for result, check in report.steps:
        if check is None:
            errors = ("not checked", "not checked", "not checked")
        else:
            state = "n/a" if check.state_error is None else f"{check.state_error:.2e}"
            match = "[red]NO[/red]" if not check.ok else "yes (f64)" if check.float64 is not None else "yes"
            errors = (f"{check.output_error:.2e}", state, match)
        table.add_row(
            str(result.step),
            _ms(result.seconds),
            format_bytes(result.copied_bytes - result.delegate_copied_bytes),
            format_bytes(result.delegate_copied_bytes),
            *errors,
        )
    return table


def _execution_paths(pipeline: Pipeline) -> list[str]:
    """``delegate NAME: how it ran each partition`` for each runtime delegate that says
    (the optional ``execution_paths`` attribute, see :class:`RuntimeSpec`)."""
    lines = []
    for backend_id, delegate in pipeline.delegates.items():
        paths = getattr(delegate, "execution_paths", None)
        if paths:
            counts = Counter(str(p) for p in paths)
            text = "; ".join(f"{path} ({count})" if len(paths) > 1 else path for path, count in counts.items())
            lines.append(f"delegate {backend_id}, per partition: {text}")
    return lines


@click.command("run")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--steps", default=16, show_default=True, type=click.IntRange(min=1), help="Decode steps to run.")
@click.option(
    "--backend",
    default=None,
    help="A backend plugins offer (see `writeback plugins`), or 'none'. Default: mlx when installed.",
)
@click.option("--runtime", "runtime_name", default=None, help="A runtime plugins offer. Default: pybind.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=writable_file,
    help="Where to write the .pte (replaced whole, never rewritten in place). Default: a temporary directory.",
)
@click.option(
    "--cache-mib",
    type=CacheMiB(CACHE_COPIES, "writeback run"),
    default=None,
    help="For models sized by their K+V cache (the built-in decoders, et-llama, hf-*): size it to this many MiB "
    f"(at most what memory can hold {CACHE_COPIES} times).",
)
@click.option(
    "--no-check",
    is_flag=True,
    help="Build no eager model beside the program (a second copy of the weights) and compare nothing: "
    "for models whose two copies do not fit in memory.",
)
@click.option(
    "--eager-weights",
    type=click.Choice(["auto", "copy", "rebuild"]),
    default="auto",
    show_default=True,
    help=EAGER_WEIGHTS_HELP,
)
@quantize_option()
@accept_weights_option()
@click.pass_context
def run_command(
    ctx: click.Context,
    model: str,
    steps: int,
    backend: str | None,
    runtime_name: str | None,
    output: Path | None,
    cache_mib: float | None,
    no_check: bool,
    eager_weights: EagerWeights,
    quantize: str | None,
    accept_weights: bool,
) -> None:
    """Lower MODEL through the installed backend and passes, run it STEPS times with its state
    bound in place, and check every step against eager PyTorch.

    A step matches eager fp32 within the model's rtol/atol (1e-4 unless the model sets its own).
    A step beyond it is judged against the same weights run in float64 eager (built at that step,
    run from step 0, freed after the last step): it matches when, for each output and state,
    |program - float64| <= 8 x |eager fp32 - float64| + atol (largest element errors): the program is
    within a few times fp32's own rounding error, which grows past any fixed tolerance in a deep
    model. The last line gives both errors. --quantize runs keep their scheme's tolerance alone.

    MODEL: a built-in name (default: decoder-caller-cache) or path/to/file.py:factory, where
    factory() returns a writeback_core.types.ModelCase (how each step gets its own inputs and
    keyword arguments, strict export, or an ExportedProgram of your own) or a tuple
    (module, args) / (module, args, kwargs) that every step reuses."""
    map_large_allocations()  # freed temporaries go back to the system, not to glibc's heap
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    console = Console(width=120)
    try:
        pipeline = assemble(registry, backend, runtime_name)
    except PipelineError as error:
        raise click.UsageError(str(error)) from error
    case = quantized_case(resolve_case(registry, model, cache_mib, accept_weights), quantize)
    with tempfile.TemporaryDirectory(prefix="writeback-run-") as scratch:
        path = output if output is not None else Path(scratch) / "model.pte"
        try:
            ran = run_model(
                pipeline,
                case,
                steps,
                path,
                console,
                check=not no_check,
                eager_weights=eager_weights,
                float64_reference=quantize is None,
            )
            report = dataclasses.replace(ran, pte_kept=output is not None)
        except PipelineError as error:
            raise click.ClickException(str(error)) from error
        except (StepInputError, WeightsDiffer) as error:  # the case's inputs or its weights: the model's mistake
            raise UserCodeError(str(error)) from error
        except StepRefused as error:  # eager refuses the inputs too: the model's mistake, exit 2
            raise (UserCodeError if error.eager_refuses else click.ClickException)(str(error)) from error
        except WriteFailed as error:  # checked writable up front: the disk filled or a quota hit since
            raise click.ClickException(str(error)) from error
        console.print(_summary(report))
    console.print(_table(report))
    console.print(
        "state write-back: bytes of whole-state copies the program makes per call; copied into delegate: "
        "bytes a delegate reported copying to bind its inputs (state and per-step inputs alike)"
    )
    for line in _execution_paths(pipeline):
        console.print(line, markup=False)
    if report.failures:
        raise click.ClickException(_failure(report))
    if not report.checked:
        console.print(
            f"{len(report.steps)} steps ran; not compared with eager PyTorch (--no-check): "
            "outputs and state are unchecked"
        )
        return
    console.print(_verdict(report))


def _tolerance(case: ModelCase) -> str:
    return f"rtol={case.rtol:g}, atol={case.atol:g}"


def _failure(report: RunReport) -> str:
    """The error of a run with a step that differs: how many, the first one, and why (against
    float64 eager, with the program's error and eager fp32's own, when it was judged there)."""
    result, check = report.failures[0]
    message = (
        f"{len(report.failures)} of {len(report.steps)} steps differ from eager PyTorch ({_tolerance(report.case)}); "
        f"first at step {result.step}: {'; '.join(check.problems)}"
    )
    judged = check.float64
    if judged is None:
        return message
    if judged.unavailable is not None:
        return (
            f"{message}. No float64 reference could judge whether that is fp32's own rounding: eager's model "
            f"in float64 failed ({judged.unavailable})"
        )
    return f"{message}. Beyond fp32's own rounding error, judged against float64 eager: {'; '.join(judged.problems)}"


def _verdict(report: RunReport) -> str:
    """The line of a run whose every step matches: within the fixed tolerance, or, for the steps
    beyond it, within fp32's own rounding error of float64 eager (both errors given)."""
    judged = [c.float64 for _, c in report.steps if c is not None and c.float64 is not None]
    steps, tolerance = len(report.steps), _tolerance(report.case)
    if not judged:
        return f"all {steps} steps match eager PyTorch ({tolerance})"
    program = max(j.program_error for j in judged)
    fp32 = max(j.fp32_error for j in judged)
    return (
        f"all {steps} steps match eager PyTorch: {steps - len(judged)} within {tolerance}, {len(judged)} within "
        f"fp32's own rounding error (f64 in the table): against float64 eager the program is at most "
        f"{program:.2e} away, eager fp32 itself {fp32:.2e} (bound {FP32_FACTOR:g} x eager fp32's + atol)"
    )
