"""``writeback explain``: the mutations of a model, where their write-backs sit, what they cost,
and the program passes a lowering for each backend runs."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument
from writeback_core.mutations import Mutation, find_mutations
from writeback_core.pass_order import PassOrderError
from writeback_core.program_passes import decomposed, unbacked_symbols_settled, write_back_positions
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry
from writeback_core.types import NO_BACKEND, ProgramPass, Stage
from writeback_core.units import format_bytes

if TYPE_CHECKING:
    from executorch.exir import ExecutorchProgramManager

from writeback_core.lowering import lower

from writeback.pass_reasons import listed, why_it_runs

__all__ = ["ExplainRow", "explain_notes", "explain_rows", "pass_lines"]


@dataclass
class ExplainRow:
    """One row of the explain table: a mutation and its columns, in display order."""

    mutation: Mutation
    columns: dict[str, str] = field(default_factory=dict)


def stock_positions(program: ExportedProgram) -> dict[str, tuple[int, int, int]]:
    """Where stock ``to_edge(...).to_executorch()`` places each write-back, keyed by target.

    Read from the write-back copies the final graph keeps, not from its signature: a state an
    op writes in place (ExecuTorch's ``llama::update_cache``) keeps its ``BUFFER_MUTATION``
    entry there while the graph no longer returns it, and has no write-back to place.
    """
    from executorch.exir import to_edge

    with known_warnings_ignored(), unbacked_symbols_settled(program):
        et = to_edge(program).to_executorch()
    ep = et.exported_program()
    targets = {
        spec.arg.name: spec.target or spec.arg.name
        for spec in ep.graph_signature.input_specs
        if isinstance(spec.arg, TensorArgument)
    }
    return {targets.get(name, name): where for name, where in write_back_positions(ep.graph_module.graph).items()}


def explain_rows(program: ExportedProgram) -> list[ExplainRow]:
    """The core columns of the explain table for ``program`` (an exported aten program); the
    mutations are found in :func:`~writeback_core.program_passes.decomposed` ``(program)``, the
    decomposition plugins read for their columns."""
    rows = []
    stock = stock_positions(program)
    for mutation in find_mutations(decomposed(program)):
        where = stock.get(mutation.target)
        placed = f"node {where[0]}/{where[2]} (value ready at {where[1]})" if where else "none"
        rows.append(
            ExplainRow(
                mutation,
                {
                    "state": mutation.target,
                    "kind": mutation.kind.value,
                    "write": mutation.write.describe(),
                    "shape": "x".join(str(s) for s in mutation.shape) or "scalar",
                    "stock write-back": placed,
                    "stock copies/call": format_bytes(mutation.nbytes if where else 0),
                },
            )
        )
    return rows


def pass_lines(registry: Registry) -> list[str]:
    """The program passes a lowering runs, for each installed backend and for none, in lines
    of at most 100 characters (a longer reason wraps, indented).

    Backends whose lowerings run the same passes share one list. Per stage, in the order
    they run, each pass with the plugin that offers it and why it is there: the backends it
    is for (``every backend`` when it names none) and the passes it runs after and before.
    Relations that cannot be ordered give the reason instead.
    """
    backends: list[str | None] = [*sorted(registry.backends()), None]
    shared: dict[tuple[tuple[str, str, str], ...], list[str | None]] = {}
    found: dict[tuple[tuple[str, str, str], ...], list[tuple[Stage, str, ProgramPass]]] = {}
    try:
        for backend in backends:
            offers = [
                (stage, plugin, program_pass)
                for stage in get_args(Stage)
                for plugin, program_pass in registry.program_pass_offers(stage, backend)
            ]
            key = tuple((stage, plugin, p.name) for stage, plugin, p in offers)
            shared.setdefault(key, []).append(backend)
            found[key] = offers
    except PassOrderError as error:
        return _wrapped(f"program passes: {error}", "  ")
    lines = ["program passes in the order they run, with the plugin that offers each and why it runs there:"]
    for key, group in shared.items():
        lines += _pass_list(group, found[key])
    return lines


# Notes are printed as they are: the pass lines wrap to fit a 100-column terminal.
_WIDTH = 100


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _pass_list(backends: Sequence[str | None], offers: Sequence[tuple[Stage, str, ProgramPass]]) -> list[str]:
    """``for backends mlx and none (no backend):``, then each stage's passes."""
    names = [b if b is not None else f"{NO_BACKEND} (no backend)" for b in backends]
    head = f"for backend{'s' if len(names) > 1 else ''} {listed(names)}:"
    if not offers:
        return _wrapped(f"{head} none", "    ")
    lines = _wrapped(head, "    ")
    width = max(len(p.name) for _, _, p in offers)
    for stage in get_args(Stage):
        here = [(plugin, p) for at, plugin, p in offers if at == stage]
        if here:
            lines.append(f"  {stage}:")
        for plugin, program_pass in here:
            line = f"    {program_pass.name:<{width}}  {'; '.join(why_it_runs(plugin, program_pass))}"
            lines += _wrapped(line, " " * (width + 6))
    return lines


def explain_notes(program: ExportedProgram, registry: Registry) -> list[str]:
    """Every plugin's ``writeback_explain_notes`` about ``program``, in the registry's order; the
    hook's ``lower`` lowers ``program`` for a backend as ``writeback run`` lowers it."""

    def lower_for(backend_name: str) -> ExecutorchProgramManager:
        backend = registry.backends().get(backend_name)
        if backend is None:
            raise KeyError(f"no backend {backend_name!r} is installed; installed: {sorted(registry.backends())}")
        return lower(program, registry, backend).program

    return [
        line
        for lines in registry.hook.writeback_explain_notes(program=program, registry=registry, lower=lower_for)
        for line in lines or ()
    ]
