"""``writeback export MODEL --output model.pte``: a ``.pte`` for ExecuTorch's own LLM runner.

Exports MODEL, checks it against the runner's contract
(:mod:`writeback_core.llm_runner`), lowers it through the one lowering path with the
model's runner metadata as constant methods, writes the ``.pte`` and, for a model
folder, copies its ``tokenizer.json`` beside it. It prints what it wrote: the
metadata, how the runner will prefill a prompt, where each state lives and which
whole-state copies are left.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from writeback_core.llm_runner import RUNNER_METADATA, RunnerContractError, check_runner_contract
from writeback_core.program import LoweringError
from writeback_core.registry import Registry
from writeback_core.units import format_bytes

from writeback._files import WriteFailed
from writeback.cli import (
    accept_weights_option,
    quantize_option,
    quantized_case,
    resolve_model_option,
    writable_file,
)
from writeback.lowering import Lowered, export_case, lower, state_places
from writeback.pipeline import PipelineError, assemble
from writeback.run import state_lines

__all__ = ["ExportReport", "export_command", "one_copy_line", "runner_loads", "where_it_loads"]

# Backends whose delegates the stock ExecuTorch runtime (and so its LLM runner) has linked in.
_STOCK_BACKENDS = frozenset({"portable", "xnnpack"})


@dataclass(frozen=True)
class ExportReport:
    """What ``writeback export`` wrote."""

    lowered: Lowered
    pte_path: Path
    tokenizer: Path | None


def runner_loads(backend: str | None) -> bool:
    """Whether ExecuTorch's stock runtime, and so ``TextLLMRunner``, can load a program
    lowered for ``backend`` (``None``: no delegate)."""
    return backend is None or backend in _STOCK_BACKENDS


def where_it_loads(backend: str | None, pte_path: Path) -> str:
    """One line saying which runtime loads a program lowered for ``backend``, and how."""
    if runner_loads(backend):
        return (
            f"loads in ExecuTorch's stock runtime (executorch.runtime.Runtime.get().load_program('{pte_path}')) "
            "and its LLM runner"
        )
    return (
        f"needs writeback's runtime: writeback_pybind_runtime.Runtime.get().load_program('{pte_path}') with the "
        f"{backend} backend's package installed (writeback-pybind-runtime registers its delegate); ExecuTorch's "
        "stock runtime and TextLLMRunner fail to load it (backend not registered)"
    )


def _default_backend(registry: Registry) -> str:
    """xnnpack where a plugin offers it (the runner links XNNPACK), else no delegate."""
    return "xnnpack" if "xnnpack" in registry.backends() else "none"


def _lines(report: ExportReport) -> list[str]:
    lowered = report.lowered
    case = lowered.case
    assert case is not None, "export always lowers a case"
    methods = case.constant_methods
    backend = lowered.backend or "none"
    places = state_places(lowered)
    copies = [p for p in places if p.copy_bytes]
    dynamic = bool(methods.get("enable_dynamic_shape", False))
    lines = [
        f"model {case.name}: {case.description}",
        f"wrote {report.pte_path} ({format_bytes(lowered.pte_nbytes)}, backend {backend}, "
        f"lowered in {lowered.seconds:.1f} s)",
        "runner metadata: " + ", ".join(f"{name}={methods[name]!r}" for name in RUNNER_METADATA if name in methods),
        "prefill: "
        + (
            f"the whole prompt in one call (up to {methods.get('get_max_seq_len')} tokens)"
            if dynamic
            else "one token per call (the token dimension is static)"
        ),
        f"{len(lowered.mutations)} mutated states; whole-state copies left per call: "
        + (f"{len(copies)} ({format_bytes(sum(p.copy_bytes for p in copies))}/call)" if copies else "none"),
        *state_lines(places),
    ]
    if report.tokenizer is not None:
        lines.append(f"tokenizer: {report.tokenizer}")
    if runner_loads(lowered.backend):
        tokenizer = "" if report.tokenizer is not None else " --tokenizer PATH"
        lines.append(
            f"loads in ExecuTorch's stock runtime and its LLM runner: writeback generate {report.pte_path}{tokenizer} "
            "--prompt TEXT"
        )
        lines.append(one_copy_line(lowered.backend))
    else:
        lines.append(where_it_loads(lowered.backend, report.pte_path))
    return lines


def one_copy_line(backend: str | None) -> str:
    """How to load a program the stock runtime runs so that each weight is resident once."""
    packed = " and unmaps the file's pages of the weights XNNPACK packed for itself" if backend == "xnnpack" else ""
    return (
        "one resident copy of each weight: load the file by its path (TextLLMRunner(PATH, TOKENIZER), "
        "executorch.runtime.Runtime.get().load_program(PATH)): the runtime maps it"
        f"{packed}; loading it from bytes (load_program(data)) keeps those bytes as a second copy"
    )


def _tokenizer_of(model: str) -> Path | None:
    folder = Path(model)
    found = folder / "tokenizer.json"
    return found if folder.is_dir() and found.is_file() else None


@click.command("export")
@click.argument("model")
@click.option(
    "--backend",
    default=None,
    help="A backend plugins offer, or 'none'. Default: xnnpack when installed (ExecuTorch's runner links it).",
)
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable_file,
    help="Where to write the .pte (replaced whole); a model folder's tokenizer.json is copied beside it.",
)
@click.option(
    "--token-by-token",
    is_flag=True,
    help="Export one token per call (the runner then prefills a prompt token by token) even where the model and "
    "backend take a dynamic token dimension.",
)
@quantize_option()
@accept_weights_option()
@click.pass_context
def export_command(
    ctx: click.Context,
    model: str,
    backend: str | None,
    output: Path,
    token_by_token: bool,
    quantize: str | None,
    accept_weights: bool,
) -> None:
    """Write MODEL as a .pte for ExecuTorch's LLM runner (TextLLMRunner, llama_main).

    MODEL: a decoder the plugins offer (et-llama, hf-llama, ...) or a local Hugging Face
    model folder (config.json, *.safetensors, tokenizer.json; nothing is downloaded and
    nothing in it runs). The program is checked against the runner's contract (two
    inputs: tokens [1, n] and positions; one output: the logits; metadata as constant
    methods) before anything is written. Where the backend takes dynamic shapes
    (xnnpack, portable) and the model offers it, the token dimension is dynamic: the
    runner prefills a prompt in one call."""
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    console = Console(width=120)
    try:
        pipeline = assemble(registry, backend or _default_backend(registry))
    except PipelineError as error:
        raise click.UsageError(str(error)) from error
    case = quantized_case(resolve_model_option(registry, model, accept_weights), quantize)
    dynamic = pipeline.backend is None or pipeline.backend.dynamic_shapes
    if dynamic and not token_by_token and case.dynamic_prefill is not None:
        case = case.dynamic_prefill()
    if not case.constant_methods:
        raise click.UsageError(
            f"model {case.name!r} carries no runner metadata (ModelCase.constant_methods): export writes "
            "programs for ExecuTorch's LLM runner; use `writeback run --output` for any other program"
        )
    try:
        exported = export_case(case)
        check_runner_contract(exported, case.constant_methods)
        lowered = lower(exported, pipeline.registry, pipeline.backend, "state", case)
        lowered.write_pte(output)
    except RunnerContractError as error:
        raise click.UsageError(f"model {case.name!r}: {error}") from error
    except (LoweringError, WriteFailed) as error:
        raise click.ClickException(str(error)) from error
    source = _tokenizer_of(model)
    tokenizer = None
    if source is not None:
        tokenizer = output.parent / "tokenizer.json"
        if tokenizer.resolve() != source.resolve():
            shutil.copyfile(source, tokenizer)
    for line in _lines(ExportReport(lowered, output, tokenizer)):
        console.print(line, markup=False, highlight=False)
