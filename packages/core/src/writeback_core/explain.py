"""``writeback explain``: the mutations of a model, where their write-backs sit, what they cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.export import ExportedProgram

from writeback_core.lowering import export_case, write_back_positions
from writeback_core.mutations import Mutation, find_mutations
from writeback_core.quiet import known_warnings_ignored

__all__ = ["ExplainRow", "explain_rows", "export_case", "write_back_positions"]


@dataclass
class ExplainRow:
    """One row of the explain table: a mutation and its columns, in display order."""

    mutation: Mutation
    columns: dict[str, str] = field(default_factory=dict)


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
