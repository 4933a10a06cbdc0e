"""``writeback bench-scale``: a Llama of a given shape through export, lowering, load and decode,
stock ExecuTorch + XNNPACK beside each writeback backend, every phase in a process of its own.

The model is a Hugging Face Llama config of the shape asked for, random fp32 weights (seed 0),
saved as a local folder and read back through the plugin that reads model folders (the
decoders plugin), as ``writeback export FOLDER`` reads it. Per contender, one child process
exports and lowers it and writes the ``.pte`` (export and lowering seconds, peak resident
memory), and another loads that file and runs the decode steps (load seconds, resident
memory after the method loaded, median decode-step milliseconds over the steps after the
first, peak resident memory). Stock: ``to_edge_transform_and_lower`` with ExecuTorch's
``XnnpackPartitioner`` and ``to_executorch()``, loaded by ``executorch.runtime``;
writeback: the one lowering path for the backend, loaded by the pipeline's runtime from the
file. Memory is given in GB and as a multiple of the weights' bytes; ratios are each row's
over stock's. A child's baseline (Python, torch and executorch imported, nothing built) is
measured and printed too: memory above it is what the phase itself costs.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from writeback.cli import quantize_option

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

__all__ = ["STOCK", "LlamaShape", "ScaleRow", "bench_scale_command", "llama_folder", "run_contender"]

STOCK = "stock+xnnpack"
NO_QUANTIZATION = "none"
WRITEBACK_PREFIX = "writeback+"


def _peak_gb() -> float:
    """This process's peak resident memory so far, in GB: the kernel's high-water mark of this
    program's own memory (``VmHWM``). Not ``getrusage``'s ``ru_maxrss``: Linux carries that across
    ``fork`` and ``exec``, so a child started by a large process (a test worker) reports the
    parent's resident size as its own peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _resident_gb() -> float:
    """This process's resident memory now, in GB (0.0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


@dataclass(frozen=True)
class LlamaShape:
    """The shape of the Llama ``bench-scale`` builds (``head_dim`` = hidden / heads)."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    vocab: int = 32000
    positions: int = 1024

    def refusal(self) -> str | None:
        """Why transformers cannot build this shape, or ``None``."""
        if self.hidden % self.heads or self.heads % self.kv_heads:
            return (
                f"--hidden {self.hidden} must divide by --heads {self.heads}, and --heads by --kv-heads {self.kv_heads}"
            )
        return None

    def words(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads ({self.kv_heads} KV), intermediate "
            f"{self.intermediate}, vocab {self.vocab}, {self.positions} positions"
        )


def llama_folder(path: Path, shape: LlamaShape) -> int:
    """Save a Llama of ``shape`` (random fp32 weights, seed 0) to ``path``; returns its
    weights' bytes. Needs transformers (the decoders plugin's dependency)."""
    import torch

    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:  # the decoders plugin brings it
        raise click.UsageError(f"bench-scale builds a Hugging Face Llama and needs transformers: {error}") from error
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.positions,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    nbytes = int(sum(p.numel() * p.element_size() for p in model.parameters()))
    model.save_pretrained(path)
    return nbytes


def _folder_case(registry: Any, folder: str, quantize: str) -> ModelCase:
    """The case the plugins read from ``folder``, quantized by ``quantize`` (``"none"``: as saved)."""
    case: ModelCase | None = registry.model_from_path(folder)
    if case is None:
        raise click.UsageError(f"no plugin reads the model folder {folder!r}")
    from writeback.cli import quantized_case

    return quantized_case(case, None if quantize == NO_QUANTIZATION else quantize)


def _lower(contender: str, folder: str, pte: str, quantize: str) -> dict[str, float]:
    import executorch.exir  # noqa: F401  (imported before the baseline: every contender imports it)
    from writeback.model_build import export_case
    from writeback_core.quiet import known_warnings_ignored
    from writeback_core.registry import load_registry

    registry = load_registry()
    base = _resident_gb()
    start = time.perf_counter()
    case = _folder_case(registry, folder, quantize)
    exported = export_case(case)
    exported_at = time.perf_counter()
    # Each .pte is streamed to its file from exir's serialized pieces (exir's write_to_file, as
    # ExecuTorch's export scripts save it), never joined into one bytes object first.
    if contender == STOCK:
        from writeback_bench.contenders import write_stock_pte

        with known_warnings_ignored():
            write_stock_pte(exported, pte, xnnpack=True, constant_methods=dict(case.constant_methods))
    else:
        from writeback.process_memory import return_freed_memory
        from writeback.session import assemble
        from writeback_core.lowering import lower

        pipeline = assemble(registry, contender.removeprefix(WRITEBACK_PREFIX))
        lowered = lower(exported, pipeline.registry, pipeline.backend, "state", case, between_steps=return_freed_memory)
        lowered.write_pte(Path(pte))
    lowered_at = time.perf_counter()
    return {
        "base_gb": base,
        "export_s": exported_at - start,
        "lower_s": lowered_at - exported_at,
        "lower_peak_gb": _peak_gb(),
        "pte_gb": os.path.getsize(pte) / 1e9,
    }


def _run(contender: str, folder: str, pte: str, steps: int, quantize: str) -> dict[str, float]:
    import torch.utils._pytree as pytree
    from writeback.session import assemble
    from writeback_core.llm_runner import load_runner_kernels
    from writeback_core.quiet import known_warnings_ignored
    from writeback_core.registry import load_registry

    registry = load_registry()
    load_runner_kernels()
    case = _folder_case(registry, folder, quantize)
    state = case.make_state()
    with known_warnings_ignored():
        from executorch.runtime import Runtime
    pipeline = None if contender == STOCK else assemble(registry, contender.removeprefix(WRITEBACK_PREFIX))
    base = _resident_gb()
    start = time.perf_counter()
    if pipeline is None:
        program = Runtime.get().load_program(pte)
        method = program.load_method("forward")
    else:
        program = pipeline.runtime.load_program(Path(pte), pipeline.delegates)
        method = program.load_method("forward")
    loaded = time.perf_counter()
    after_load = _resident_gb() - base
    times = []
    for step in range(steps):
        # Flattened as torch.export flattens them (no second export here to read its spec).
        inputs = pytree.tree_leaves(((*case.step_inputs(step), *state), case.example_kwargs(step)))
        begin = time.perf_counter()
        outputs = method.execute(inputs)
        times.append(time.perf_counter() - begin)
        if case.observe is not None:  # the next token from the program's logits: no eager model
            case.observe(step, outputs)
    return {
        "base_gb": base,
        "load_s": loaded - start,
        "after_load_gb": after_load,
        "decode_ms": statistics.median(times[1:] or times) * 1e3,
        "run_peak_gb": _peak_gb(),
    }


@dataclass
class ScaleRow:
    """One contender's figures (``None`` where its phase failed, ``error`` saying why)."""

    name: str
    figures: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _child(phase: str, contender: str, folder: Path, pte: Path, steps: int, quantize: str) -> dict[str, float]:
    """Run one phase of one contender in a fresh interpreter; its figures, or raise with its stderr."""
    module = "writeback_bench.llama_scale"
    command = [sys.executable, "-m", module, phase, contender, str(folder), str(pte), str(steps), quantize]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{phase} exited {done.returncode}: {tail}")
    figures: dict[str, float] = json.loads(lines[-1])
    return figures


def run_contender(name: str, folder: Path, scratch: Path, steps: int, quantize: str | None = None) -> ScaleRow:
    """Lower ``name`` in one child process, then load and decode it in another; ``quantize``:
    a scheme the folder's case offers (``ModelCase.quantized``), applied in both."""
    scheme = quantize or NO_QUANTIZATION
    row = ScaleRow(name)
    pte = scratch / f"{name.replace('+', '-')}.pte"
    try:
        row.figures.update(_child("lower", name, folder, pte, steps, scheme))
        lowered_base = row.figures.pop("base_gb")
        row.figures.update(_child("run", name, folder, pte, steps, scheme))
        row.figures["base_gb"] = min(lowered_base, row.figures["base_gb"])
    except RuntimeError as error:
        row.error = str(error)
    finally:
        pte.unlink(missing_ok=True)
    return row


_COLUMNS = (
    ("export s", "export_s", "{:.1f}"),
    ("lower s", "lower_s", "{:.1f}"),
    ("lower peak GB", "lower_peak_gb", "{:.2f}"),
    (".pte GB", "pte_gb", "{:.3f}"),
    ("load s", "load_s", "{:.2f}"),
    ("after load GB", "after_load_gb", "{:.2f}"),
    ("decode ms", "decode_ms", "{:.1f}"),
    ("run peak GB", "run_peak_gb", "{:.2f}"),
)


def _ratio(value: float, stock: float) -> float:
    return value / stock if stock else float("nan")


def table(rows: Sequence[ScaleRow], weights: int) -> list[str]:
    """The printed table: each figure, then its ratio to stock's on the line below."""
    names = [title for title, _, _ in _COLUMNS]
    width = max(len(r.name) for r in rows) + 2
    lines = [f"{'contender':<{width}}" + "".join(f"{n:>15}" for n in names)]
    stock = next((r for r in rows if r.name == STOCK and r.error is None), None)
    for row in rows:
        if row.error is not None:
            lines.append(f"{row.name:<{width}}failed: {row.error}")
            continue
        cells = [fmt.format(row.figures[key]) for _, key, fmt in _COLUMNS]
        lines.append(f"{row.name:<{width}}" + "".join(f"{c:>15}" for c in cells))
        if stock is not None and row is not stock:
            ratios = [_ratio(row.figures[key], stock.figures[key]) for _, key, _ in _COLUMNS]
            lines.append(f"{'  x stock':<{width}}" + "".join(f"{r:>14.2f}x" for r in ratios))
    gb = weights / 1e9
    for row in rows:
        if row.error is None:
            f = row.figures
            lines.append(
                f"{row.name}: peaks above a bare child's {f['base_gb']:.2f} GB, in weights ({gb:.3f} GB): "
                f"lowering {(f['lower_peak_gb'] - f['base_gb']) / gb:.1f}x, "
                f"run {(f['run_peak_gb'] - f['base_gb']) / gb:.1f}x; "
                f"after load {f['after_load_gb'] / f['pte_gb']:.2f}x the .pte"
            )
    return lines


_DEFAULT = LlamaShape()


@click.command("bench-scale")
@click.option("--layers", default=_DEFAULT.layers, show_default=True, type=click.IntRange(min=1))
@click.option("--hidden", default=_DEFAULT.hidden, show_default=True, type=click.IntRange(min=8))
@click.option("--heads", default=_DEFAULT.heads, show_default=True, type=click.IntRange(min=1))
@click.option("--kv-heads", default=_DEFAULT.kv_heads, show_default=True, type=click.IntRange(min=1))
@click.option("--intermediate", default=_DEFAULT.intermediate, show_default=True, type=click.IntRange(min=1))
@click.option("--vocab", default=_DEFAULT.vocab, show_default=True, type=click.IntRange(min=2))
@click.option(
    "--positions", default=_DEFAULT.positions, show_default=True, type=click.IntRange(min=2), help="Cache positions."
)
@click.option("--steps", default=8, show_default=True, type=click.IntRange(min=2), help="Decode steps timed.")
@click.option(
    "--backend",
    "backends",
    multiple=True,
    default=("xnnpack",),
    show_default=True,
    help="writeback backends to run beside stock (repeatable).",
)
@quantize_option(
    "Quantize the weights by this scheme (8da4w, 8da4w-e8, 8da8w: see `writeback export --help`) before "
    "export, for stock and writeback alike."
)
def bench_scale_command(steps: int, backends: tuple[str, ...], quantize: str | None, **sizes: int) -> None:
    """Export, lower, load and decode a Llama of the given shape (random fp32 weights), stock
    ExecuTorch + XNNPACK and writeback with each --backend, every phase in its own process;
    prints seconds, peak memory and ratios to stock."""
    shape = LlamaShape(**sizes)
    refusal = shape.refusal()
    if refusal is not None:
        raise click.UsageError(refusal)
    with tempfile.TemporaryDirectory(prefix="writeback-scale-") as scratch:
        folder = Path(scratch) / "model"
        weights = llama_folder(folder, shape)
        click.echo(
            f"Llama: {shape.words()}; {weights / 1e9:.3f} GB of fp32 weights"
            + (f", weights quantized {quantize} before export" if quantize else "")
            + f"; {steps} decode steps, median of the last {steps - 1}; 1 process per phase"
        )
        rows = [
            run_contender(name, folder, Path(scratch), steps, quantize)
            for name in (STOCK, *(WRITEBACK_PREFIX + b for b in backends))
        ]
    for line in table(rows, weights):
        click.echo(line)
    if any(r.error for r in rows):
        raise click.ClickException("a contender failed (above)")


def _main(argv: Sequence[str]) -> int:
    """A child's entry: ``PHASE CONTENDER FOLDER PTE STEPS QUANTIZE``; prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    phase, contender, folder, pte, steps, quantize = argv
    if phase == "lower":
        figures = _lower(contender, folder, pte, quantize)
    elif phase == "run":
        figures = _run(contender, folder, pte, int(steps), quantize)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
