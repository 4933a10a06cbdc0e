"""Entry-point plugin of writeback-passes (thin: imports core and torch only).

The passes themselves live in sibling modules imported inside the hookimpls,
so loading the plugin costs nothing until a pipeline asks for a pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from writeback_core import ProgramPass, Stage, hookimpl

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from writeback_core import Mutation

writeback_name = "passes"


@hookimpl
def writeback_program_passes(stage: Stage) -> Sequence[ProgramPass]:
    """At ``"before_memory_planning"``: dropping write-backs a delegate takes in place (order
    50), then early write-back (order 100: after graph-editing passes)."""
    if stage != "before_memory_planning":
        return ()
    from writeback_passes.pipeline import early_write_back_pass
    from writeback_passes.reinplace_delegate import reinplace_delegate_pass

    return (reinplace_delegate_pass(), early_write_back_pass())


@hookimpl
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    """The "early write-back" column: where this pass puts the copy, and the lifetime it saves."""
    from writeback_passes.explain_columns import early_write_back_columns

    return early_write_back_columns(program, mutation)
