"""``writeback bench-generate``: whole generations through ExecuTorch's own LLM runner, every
contender in a process of its own, interleaved rounds, medians and ratios.

Contenders, each a ``.pte`` with the same runner metadata, run by ``TextLLMRunner`` on the
same prompt with greedy decoding:

- ``stock+xnnpack`` of every program the model offers: its own export and each of its
  ``ModelCase.contenders`` (for a Hugging Face folder: transformers' ``StaticCache``, and
  the same model on ExecuTorch's ``llama::update_cache``/``llama::custom_sdpa``), lowered
  as an ExecuTorch user does (``to_edge_transform_and_lower`` with ``XnnpackPartitioner``,
  ``to_executorch()``);
- ``writeback+xnnpack``: what ``writeback export MODEL`` writes.

Each generation runs in a new process (``writeback_bench.resident_memory.measure_in_child``) that loads
its contender's ``.pte`` by path, so one contender's weights are in memory at a time and each
is measured from its own baseline: the time from just before loading to the first token, the
resident memory loading and prefill added by then, the peak through the generation (both minus
what the process held before loading) and the file's size (with the weights' ``.ptd`` beside it,
when there is one). Rounds run the contenders one after the other, in an order rotated each round,
so a noisy machine slows them alike. XNNPACK's thread
pool runs one thread unless asked. The runner's own statistics give prefill (prompt tokens /
prefill time) and decode (generated tokens / decode time) speeds; ratios are against the first
stock row (or ``--baseline``).

Each row also says what its program moves to keep its state, counted from the lowered
program's final graph: the whole-state write-back copies left (exir's ``copy_`` into a mutated
buffer, the copies ``writeback run`` names) and the bytes they move per call, beside the bytes
of all the states the program mutates. The runner decodes one token per call, and prefills the
recurrent and hybrid folders one token per call too, so the bytes per call are the state bytes
the copies move per token. A ``--pte`` file written elsewhere has no graph here: ``-``.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from writeback.cli import accept_weights_option, quantize_option, quantized_case, resolve_model_option
from writeback_core.core_aten import OpsOutsideCoreAtenError
from writeback_core.registry import Registry
from writeback_core.types import ModelCase

from writeback_bench.contenders import write_stock_pte

__all__ = [
    "STOCK_SAME",
    "WRITEBACK",
    "GenerationRow",
    "StateTraffic",
    "bench_generate_command",
    "bench_generation",
    "mutated_state_bytes",
    "state_traffic",
]

MIB = 1 << 20
WRITEBACK = "writeback+xnnpack"
STOCK_SAME = "stock+xnnpack (same export)"  # the program writeback lowers, lowered by ExecuTorch alone


@dataclass
class GenerationRow:
    """One contender: its speeds per round and the text it generated."""

    name: str
    program: str
    prefill: list[float] = field(default_factory=list)  # tokens/s
    decode: list[float] = field(default_factory=list)  # tokens/s
    first_token: list[float] = field(default_factory=list)  # s, from just before loading
    resident: list[int] = field(default_factory=list)  # bytes added by the first token
    peak: list[int] = field(default_factory=list)  # bytes, peak minus the process before loading
    file_bytes: int = 0
    text: str = ""
    prompt_tokens: int = 0
    error: str | None = None
    traffic: StateTraffic | None = None  # None: a file written elsewhere, no graph to count

    @property
    def prefill_median(self) -> float:
        return _median(self.prefill)

    @property
    def decode_median(self) -> float:
        return _median(self.decode)

    @property
    def first_token_median(self) -> float:
        return _median(self.first_token)

    @property
    def resident_median(self) -> float:
        return _median(self.resident)

    @property
    def peak_median(self) -> float:
        return _median(self.peak)


@dataclass(frozen=True)
class StateTraffic:
    """What a lowered program moves to keep its state: ``copies`` whole-state write-back copies
    left per call, ``copied_bytes`` the bytes they move per call, ``state_bytes`` the bytes of
    every state the exported program mutates (its mutated buffers and user inputs)."""

    copies: int
    copied_bytes: int
    state_bytes: int


def state_traffic(final: Any) -> StateTraffic:
    """The :class:`StateTraffic` of ``final``, the final ``ExportedProgram`` of a stock lowering
    (after ``to_executorch``, where every mutated state is still a placeholder its signature
    names: stock partitioners take no mutable buffer)."""
    from writeback_core.program_passes import write_back_bytes

    copies = write_back_bytes(final)
    return StateTraffic(len(copies), sum(copies.values()), mutated_state_bytes(final))


def mutated_state_bytes(exported: Any) -> int:
    """The bytes of every state ``exported`` (a functional ``ExportedProgram``: edge or later)
    mutates: its mutated buffers and mutated user inputs, as its signature names them."""
    signature = exported.graph_signature
    mutated = set(signature.buffers_to_mutate.values()) | set(signature.user_inputs_to_mutate.values())
    buffers = signature.inputs_to_buffers
    state = 0
    for node in exported.graph.nodes:
        if node.op == "placeholder" and (buffers.get(node.name) in mutated or node.name in mutated):
            value = node.meta["val"]
            state += value.numel() * value.element_size()
    return state


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# A contender's .pte: written to the path given (returned), or a file of its own (returned, the path
# ignored), with what its program moves to keep its state (None for a file written elsewhere).
WritePte = Callable[[Path], tuple[Path, StateTraffic | None]]


def _programs(registry: Registry, case: ModelCase) -> list[tuple[str, str, WritePte]]:
    """(row name, what the program is, how to write its ``.pte``) for every contender."""
    from writeback.model_build import export_case
    from writeback.process_memory import return_freed_memory
    from writeback.session import assemble
    from writeback_core.lowering import lower

    methods = dict(case.constant_methods)
    rows: list[tuple[str, str, WritePte]] = []

    def stock(make: Callable[[], Any]) -> WritePte:
        def write(path: Path) -> tuple[Path, StateTraffic | None]:
            program = write_stock_pte(make(), path, xnnpack=True, constant_methods=methods)
            return path, state_traffic(program.exported_program())

        return write

    for label, make in case.contenders.items():
        rows.append((f"stock+xnnpack ({label})", label, stock(make)))
    rows.append((STOCK_SAME, case.description, stock(lambda: export_case(case))))

    def ours(path: Path) -> tuple[Path, StateTraffic | None]:
        pipeline = assemble(registry, "xnnpack")
        lowered = lower(
            export_case(case), pipeline.registry, pipeline.backend, "state", case, between_steps=return_freed_memory
        )
        lowered.write_pte(path)
        # writeback's partitioner may move states into a delegate: its own record of the mutations counts them.
        state = 0
        for mutation in lowered.mutations:
            dims = [d for d in mutation.shape if isinstance(d, int)]
            if len(dims) != len(mutation.shape):
                raise ValueError(
                    f"state {mutation.target!r} has shape {mutation.shape}, not fixed: bench-generate counts the "
                    "bytes of fixed-size states only (a runner-ready program holds its states as buffers)"
                )
            state += math.prod(dims) * mutation.dtype.itemsize
        return path, StateTraffic(len(lowered.write_back_bytes), lowered.copied_per_call, state)

    rows.append((WRITEBACK, case.description, ours))
    return rows


def _given(path: Path) -> WritePte:
    return lambda _unused: (path, None)


def _prompt(tokenizer: Path, tokens: int) -> str:
    """Text that the tokenizer reads as (about) ``tokens`` tokens."""
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise click.ClickException(
            "bench-generate cuts its prompt with Hugging Face's tokenizers library, which is not installed "
            "(pip install tokenizers; transformers brings it)"
        ) from error
    reader = Tokenizer.from_file(str(tokenizer))
    base = "the quick brown fox jumps over the lazy dog and the state it mutates is written once in place "
    text = base * (tokens // 4 + 8)
    ids = reader.encode(text).ids[:tokens]
    decoded: str = reader.decode(ids)
    return decoded


def bench_generation(
    registry: Registry,
    case: ModelCase,
    tokenizer: Path,
    prompt_tokens: int = 64,
    new_tokens: int = 64,
    rounds: int = 3,
    threads: int = 1,
    on_progress: Callable[[str], None] | None = None,
    files: Sequence[tuple[str, Path]] = (),
    only_files: bool = False,
) -> list[GenerationRow]:
    """Every contender's generations through ``TextLLMRunner``, interleaved (see the module docstring).

    ``files`` adds contenders written elsewhere (``(row name, .pte path)``; for instance by
    ``optimum-cli export executorch`` in an environment of its own), run beside the others;
    with ``only_files``, they alone run.

    :raises OpsOutsideCoreAtenError: the model computes an op no ExecuTorch program holds.
    """
    from executorch.extension.llm.runner import TextLLMRunner
    from writeback.process_memory import return_freed_memory
    from writeback_core.llm_runner import data_file_beside, load_runner_kernels

    load_runner_kernels()
    say = on_progress or (lambda _line: None)
    prompt = _prompt(tokenizer, prompt_tokens)
    rows: list[GenerationRow] = []
    paths: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="writeback-bench-generate-") as folder:
        given = [(name, f"file {path.name}", _given(path)) for name, path in files]
        own = [] if only_files else _programs(registry, case)
        for name, what, write in [*own, *given]:
            row = GenerationRow(name, what)
            rows.append(row)
            say(f"lowering {name}")
            try:
                path, row.traffic = write(Path(folder) / f"{len(rows)}.pte")
                # The lowering's copies of the weights are garbage now (some held by the
                # toolchain's caches): gone before the next contender lowers.
                return_freed_memory()
                # Made once here (it reads the .pte's metadata) so that a .pte the runner refuses
                # is reported before any round; each generation runs in a process of its own.
                data = data_file_beside(path)
                TextLLMRunner(str(path), str(tokenizer), None if data is None else str(data))
                paths[name] = path
                row.file_bytes = path.stat().st_size + (0 if data is None else data.stat().st_size)
            except OpsOutsideCoreAtenError:
                raise  # the model's refusal, not a contender's: no program of it could run
            except Exception as error:  # a contender that cannot lower or load is reported, not fatal
                row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        live = [r for r in rows if r.error is None]
        for round_ in range(rounds):
            say(f"round {round_ + 1} of {rounds}")
            for row in live[round_ % len(live) :] + live[: round_ % len(live)] if live else []:
                say(f"generating {row.name}")
                _generate(row, paths[row.name], tokenizer, prompt, new_tokens, threads)
            live = [r for r in live if r.error is None]
    return rows


def _generate(row: GenerationRow, path: Path, tokenizer: Path, prompt: str, new_tokens: int, threads: int) -> None:
    """One generation of ``row``'s ``.pte`` at ``path`` in a new process, recorded on ``row``:
    one contender's weights (the mapped file, XNNPACK's packed weights) are in memory at a
    time, each measured from its own process's baseline."""
    from writeback_bench.resident_memory import measure_in_child

    try:
        figures = measure_in_child(path, tokenizer, prompt, new_tokens, threads)
    except RuntimeError as error:
        row.error = f"generation failed: {error}"
        return
    row.prefill.append(figures.prefill_tps)
    row.decode.append(figures.decode_tps)
    row.first_token.append(figures.first_token_s)
    row.resident.append(figures.resident_added)
    row.peak.append(figures.peak_added)
    row.prompt_tokens = figures.prompt_tokens
    row.text = figures.text


def _table(rows: list[GenerationRow], baseline: str | None = None) -> list[str]:
    if baseline is not None:
        base = next((r for r in rows if r.error is None and r.name == baseline), None)
    else:
        base = next((r for r in rows if r.error is None and r.name.startswith("stock")), None)
        base = base or next((r for r in rows if r.error is None), None)
    ours = next((r for r in rows if r.name == WRITEBACK and r.error is None), None)
    # The text every row is checked against: writeback's, or the baseline's when writeback's row did not run.
    reference, label = (ours, "writeback") if ours is not None else (base, "the baseline")
    lines = [
        f"{'contender':<52} {'file MiB':>8} {'load s':>6} {'resident MiB':>12} {'peak MiB':>8} {'prefill tok/s':>13} "
        f"{'decode tok/s':>12} {'load x':>6} {'resident x':>10} {'peak x':>6} {'prefill x':>9} {'decode x':>8} "
        f"{'copies/call':>11} {'copied/call':>11} {'state':>9}  tokens"
    ]
    for row in rows:
        if row.error is not None:
            lines.append(f"{row.name:<52} failed: {row.error}")
            continue
        same = f"same as {label}" if reference is not None and row.text == reference.text else f"DIFFER from {label}"
        if row is reference:
            same = "-"
        ratios = [
            _ratio(getattr(row, name), getattr(base, name) if base else float("nan"))
            for name in ("first_token_median", "resident_median", "peak_median", "prefill_median", "decode_median")
        ]
        lines.append(
            f"{row.name:<52} {row.file_bytes / MIB:>8.1f} {row.first_token_median:>6.2f} "
            f"{row.resident_median / MIB:>12.1f} {row.peak_median / MIB:>8.1f} {row.prefill_median:>13.1f} "
            f"{row.decode_median:>12.1f} {ratios[0]:>6.2f} {ratios[1]:>10.2f} {ratios[2]:>6.2f} {ratios[3]:>9.2f} "
            f"{ratios[4]:>8.2f} {_traffic_cells(row.traffic)}  {same}"
        )
    return lines


def _traffic_cells(traffic: StateTraffic | None) -> str:
    from writeback_core.units import format_bytes

    if traffic is None:
        return f"{'-':>11} {'-':>11} {'-':>9}"
    copied = format_bytes(traffic.copied_bytes) if traffic.copies else "0"
    return f"{traffic.copies:>11} {copied:>11} {format_bytes(traffic.state_bytes):>9}"


def _ratio(value: float, base: float) -> float:
    return value / base if base and base == base else float("nan")


@click.command("bench-generate")
@click.argument("model")
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="tokenizer.json; default: the one in the MODEL folder.",
)
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--threads", default=1, show_default=True, type=click.IntRange(min=1), help="XNNPACK and PyTorch threads."
)
@click.option(
    "--pte",
    "files",
    multiple=True,
    metavar="NAME=PATH",
    help="Also run this .pte (written elsewhere, e.g. by optimum-cli) as contender NAME. Repeatable.",
)
@click.option("--only-pte", is_flag=True, help="Run the --pte files alone, not MODEL's own contenders.")
@click.option(
    "--baseline", default=None, metavar="NAME", help="The row ratios are against (default: the first stock row)."
)
@quantize_option(
    "Quantize the model's weights by this scheme (8da4w, 8da4w-e8, 8da8w: see `writeback export --help`) "
    "before export, for every contender of MODEL alike (not the --pte files)."
)
@accept_weights_option()
@click.pass_context
def bench_generate_command(
    ctx: click.Context,
    model: str,
    tokenizer: Path | None,
    prompt_tokens: int,
    new_tokens: int,
    rounds: int,
    threads: int,
    files: tuple[str, ...],
    only_pte: bool,
    baseline: str | None,
    quantize: str | None,
    accept_weights: bool,
) -> None:
    """Time whole generations of MODEL in ExecuTorch's LLM runner for every contender, interleaved.

    MODEL: what `writeback export` takes. Prints each contender's median prefill and
    decode tokens/s, the ratios to the first stock row, and whether its text equals
    writeback's."""
    registry = ctx.find_object(Registry)
    assert registry is not None, "the writeback group puts the registry on the context"
    case = quantized_case(resolve_model_option(registry, model, accept_weights), quantize)
    if case.dynamic_prefill is not None:
        case = case.dynamic_prefill()
    if not case.constant_methods:
        raise click.UsageError(f"model {case.name!r} carries no runner metadata: it cannot run in the LLM runner")
    if tokenizer is None:
        tokenizer = Path(model) / "tokenizer.json"
        if not tokenizer.is_file():
            raise click.UsageError(f"no tokenizer.json in {model!r}: pass --tokenizer PATH")
    given = _given_files(files)
    if only_pte and not given:
        raise click.UsageError("--only-pte needs at least one --pte NAME=PATH")
    console = Console(width=140, stderr=True)
    rows = bench_generation(
        registry,
        case,
        tokenizer,
        prompt_tokens,
        new_tokens,
        rounds,
        threads,
        on_progress=lambda line: console.print(line, markup=False, highlight=False),
        files=given,
        only_files=only_pte,
    )
    if baseline is not None and not any(r.name == baseline and r.error is None for r in rows):
        names = ", ".join(repr(r.name) for r in rows if r.error is None)
        raise click.UsageError(f"--baseline {baseline!r} is not a contender that ran (those that ran: {names})")
    prompt = next((r.prompt_tokens for r in rows if r.prompt_tokens), prompt_tokens)
    click.echo(f"model {case.name}: {case.description}")
    click.echo(
        f"prompt {prompt} tokens, {new_tokens} new tokens, greedy; {rounds} rounds interleaved, each generation in "
        f"a process of its own; {threads} thread(s); medians; x = ratio to "
        + (repr(baseline) if baseline else "the first stock row (else the first row)")
    )
    click.echo(
        "load s: from just before loading to the first token (prompt prefilled); resident: what loading and "
        "prefill added to the process by then; peak: its highest resident set through the generation, minus "
        "what it held before loading; copies/call, copied/call: whole-state write-back copies left in the "
        "program and the bytes they move per call (one call per decoded token: the state bytes moved per "
        "token); state: the bytes of every state the program mutates"
    )
    for line in _table(rows, baseline):
        click.echo(line)


def _given_files(files: Sequence[str]) -> list[tuple[str, Path]]:
    """``NAME=PATH`` options as (name, path), every path an existing file, every name once."""
    given: list[tuple[str, Path]] = []
    for item in files:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{item!r} is not NAME=PATH", param_hint="--pte")
        if not Path(path).is_file():
            raise click.BadParameter(f"{path!r} (contender {name!r}) is not a file", param_hint="--pte")
        if name in {n for n, _ in given} or name in (WRITEBACK, STOCK_SAME):
            raise click.BadParameter(f"contender name {name!r} is used twice", param_hint="--pte")
        given.append((name, Path(path)))
    return given
