"""``writeback export MODEL --output model.pte``: a ``.pte`` for ExecuTorch's own LLM runner.

Exports MODEL, checks it against the runner's contract
(:mod:`writeback_core.llm_runner`), lowers it through the one lowering path with the
model's runner metadata as constant methods, writes the ``.pte`` and, for a model
folder, copies its ``tokenizer.json`` beside it. It prints what it wrote: the
metadata, how the runner will prefill a prompt, which positions' logits a call returns, where
each state lives and which whole-state copies are left.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from writeback_core.llm_runner import RUNNER_METADATA, RunnerContractError, check_runner_contract, logits_rows
from writeback_core.lowered import Lowered, state_places
from writeback_core.lowering import lower, partition
from writeback_core.registry import Registry
from writeback_core.types import LoweringError
from writeback_core.units import format_bytes

from writeback._files import WriteFailed, replacing
from writeback.cli import (
    accept_weights_option,
    quantize_option,
    quantized_case,
    resolve_model_option,
    writable_file,
)
from writeback.lowered_lines import runner_loads, state_lines, where_it_loads
from writeback.model_build import export_case
from writeback.process_memory import free_delegated_weights, map_large_allocations, return_freed_memory
from writeback.session import PipelineError, assemble

__all__ = ["ExportReport", "export_command", "one_copy_line"]


@dataclass(frozen=True)
class ExportReport:
    """What ``writeback export`` wrote."""

    lowered: Lowered
    pte_path: Path
    tokenizer: Path | None
    #: Which positions' logits a call returns (:func:`writeback_core.llm_runner.logits_rows`).
    logits: str | None = None
    #: The weights' data file written beside the ``.pte`` (``--separate-weights``), else None.
    weights_path: Path | None = None


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
        *_weights_lines(report),
        *_stored_once_lines(lowered),
        "runner metadata: " + ", ".join(f"{name}={methods[name]!r}" for name in RUNNER_METADATA if name in methods),
        "prefill: "
        + (
            f"the whole prompt in one call (up to {methods.get('get_max_seq_len')} tokens)"
            if dynamic
            else "one token per call (the token dimension is static)"
        ),
        *_logits_lines(report.logits),
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


def _weights_lines(report: ExportReport) -> list[str]:
    """Where the weights went when they are in a file of their own."""
    if report.weights_path is None:
        return []
    size = format_bytes(report.weights_path.stat().st_size)
    return [
        f"wrote the weights to {report.weights_path} ({size}; each weight once, a tied embedding/LM head too): "
        f"load both, TextLLMRunner(PTE, TOKENIZER, {report.weights_path.name}); writeback generate finds it beside "
        "the .pte"
    ]


def _stored_once_lines(lowered: Lowered) -> list[str]:
    """The constants the program and a delegate both read from one place in the .pte (a tied
    embedding/LM head's table and scales)."""
    if not lowered.stored_once:
        return []
    tensors = ", ".join(f"{record.tensor} ({format_bytes(record.nbytes)})" for record in lowered.stored_once)
    backend = lowered.backend or "a delegate"
    return [
        f"stored once: {tensors}, bytes the program and {backend} both read (as a tied embedding/LM head's table "
        "and scales), held once in the .pte"
    ]


# What export prints for each answer of logits_rows.
_LOGITS_LINES = {
    "last": "logits: the last position's only (what the runner reads; the LM head runs on one row); --all-logits "
    "returns every position's",
    "every": "logits: every position's, [1, n, vocab] for a call of n tokens (--all-logits)",
    "one": "logits: the one position of a call (one token per call)",
}


def _logits_lines(rows: str | None) -> list[str]:
    """The line saying which positions' logits a call returns (none for a program whose output is
    not logits)."""
    return [_LOGITS_LINES[rows]] if rows in _LOGITS_LINES else []


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
@click.option(
    "--all-logits",
    is_flag=True,
    help="Return every position's logits, [1, n, vocab] for a call of n tokens, for a tool that scores every "
    "position. Default: the last position's only, which is all ExecuTorch's LLM runner reads (the LM head then runs "
    "on one row and the program plans no [1, max_seq_len, vocab] buffer).",
)
@click.option(
    "--separate-weights",
    is_flag=True,
    help="Write the weights to a data file of their own beside the .pte (OUTPUT with the suffix .ptd, ExecuTorch's "
    "program-data separation), each stored once, a tied embedding/LM head too (as in a single .pte: in fp32, or as "
    "the int8 table and scales that --quantize 8da4w-e8 and 8da8w give the lookup and the head alike). The runner "
    "loads both: TextLLMRunner(PTE, TOKENIZER, PTD).",
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
    all_logits: bool,
    separate_weights: bool,
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
    runner prefills a prompt in one call. A call returns the last position's logits, all
    the runner reads; --all-logits returns every position's."""
    map_large_allocations()  # freed temporaries go back to the system, not to glibc's heap
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    console = Console(width=120)
    if separate_weights and output.suffix == ".ptd":
        raise click.UsageError(
            f"--separate-weights writes the weights to OUTPUT with the suffix .ptd, which is {output} itself: "
            "give the program a .pte path"
        )
    try:
        pipeline = assemble(registry, backend or _default_backend(registry))
    except PipelineError as error:
        raise click.UsageError(str(error)) from error
    case = quantized_case(resolve_model_option(registry, model, accept_weights), quantize)
    if all_logits:
        if case.all_logits is None:
            raise click.UsageError(
                f"--all-logits: model {case.name!r} does not offer it: its program returns the logits its module "
                "returns; write the module to return every position's logits instead"
            )
        case = case.all_logits()
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
        rows = logits_rows(exported)
        start = time.perf_counter()
        parts = partition(
            exported, pipeline.registry, pipeline.backend, case.constant_methods, weights_apart=separate_weights
        )
        # Nothing reads the exported weights again: those the delegates took go before serialization.
        free_delegated_weights(exported, [parts.edge.exported_program(method) for method in parts.edge.methods])
        lowered = lower(
            exported,
            pipeline.registry,
            pipeline.backend,
            "state",
            case,
            partitioned=parts,
            between_steps=return_freed_memory,
            weights_apart=separate_weights,
        )
        lowered.seconds = time.perf_counter() - start  # partitioning included
        weights = output.with_suffix(".ptd") if separate_weights else None
        if weights is not None:
            with replacing(weights) as temporary:
                lowered.write_weights(temporary)
        elif output.suffix != ".ptd":
            # A weights file from an earlier export would be loaded with this program (generate finds it).
            output.with_suffix(".ptd").unlink(missing_ok=True)
        with replacing(output) as temporary:
            lowered.write_pte(temporary)
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
    for line in _lines(ExportReport(lowered, output, tokenizer, rows, weights)):
        console.print(line, markup=False, highlight=False)
