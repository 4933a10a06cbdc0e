"""``writeback explain``: the mutations of a model, where their write-backs sit, what they cost."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram

from writeback_core._ops import packet_name
from writeback_core.mutations import Mutation, find_mutations
from writeback_core.quiet import known_warnings_ignored
from writeback_core.zoo import ModelCase

__all__ = ["ExplainRow", "explain_rows", "export_case", "write_back_positions"]


@dataclass
class ExplainRow:
    """One row of the explain table: a mutation and its columns, in display order."""

    mutation: Mutation
    columns: dict[str, str] = field(default_factory=dict)


def export_case(case: ModelCase) -> ExportedProgram:
    """``torch.export`` the case's model on its step-0 inputs (non-strict)."""
    module = case.build().eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, case.example_args(0), strict=False)


def write_back_positions(graph: torch.fx.Graph) -> dict[str, tuple[int, int, int]]:
    """For each write-back ``copy_(placeholder, value)``: ``(copy index, value index, count)``.

    Indices count the graph's ``call_function`` nodes; keys are placeholder names.
    """
    calls = [n for n in graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(calls)}
    found: dict[str, tuple[int, int, int]] = {}
    for node in calls:
        if packet_name(node.target) != "copy_" or len(node.args) < 2:
            continue
        dest, value = node.args[0], node.args[1]
        if isinstance(dest, torch.fx.Node) and dest.op == "placeholder":
            value_index = index.get(value, -1) if isinstance(value, torch.fx.Node) else -1
            found[dest.name] = (index[node], value_index, len(calls))
    return found


def stock_positions(program: ExportedProgram) -> dict[str, tuple[int, int, int]]:
    """Where stock ``to_edge(...).to_executorch()`` places each write-back, keyed by target."""
    from executorch.exir import to_edge

    with known_warnings_ignored():
        et = to_edge(program).to_executorch()
    ep = et.exported_program()
    by_placeholder = write_back_positions(ep.graph_module.graph)
    return {m.target: by_placeholder[m.placeholder] for m in find_mutations(ep) if m.placeholder in by_placeholder}


def format_bytes(n: int | None) -> str:
    """``2.0 KiB``-style sizes; ``?`` when unknown."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def explain_rows(program: ExportedProgram) -> list[ExplainRow]:
    """The core columns of the explain table for ``program`` (an exported aten program)."""
    decomposed = program.run_decompositions()
    rows = []
    stock = stock_positions(program)
    for mutation in find_mutations(decomposed):
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
