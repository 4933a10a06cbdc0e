"""The columns ``writeback explain`` gets from this package: aliased or copy-back, and its cost."""

from __future__ import annotations

from torch.export import ExportedProgram
from writeback_core.explain import format_bytes
from writeback_core.mutations import Mutation, MutationKind
from writeback_core.types import AliasingEngine

from writeback_trt_copyback.lift import lift_mutated_buffers

__all__ = ["ALIASED", "COPY_BACK", "COST", "explain_columns"]

ALIASED = "trt-style engine"
COPY_BACK = "why copy-back"
COST = "copy-back/call"


def explain_columns(program: ExportedProgram, mutation: Mutation, engine: AliasingEngine) -> dict[str, str]:
    """Whether ``engine`` would write ``mutation`` in place, and what copying it back costs.

    A copy-back buffer pays, every call, its whole new value materialized as a
    graph output plus ExecuTorch's write-back copy of it: twice the buffer. An
    aliased one pays nothing beyond the slots it writes.
    """
    if mutation.kind is not MutationKind.BUFFER:
        return {ALIASED: "n/a (caller-owned input)", COPY_BACK: "", COST: ""}
    lifted = lift_mutated_buffers(program, engine)
    cls = next((b for b in lifted.buffers if b.target == mutation.target), None)
    if cls is None:
        return {ALIASED: "?", COPY_BACK: "not found after decomposition", COST: "?"}
    if cls.aliased:
        return {ALIASED: f"aliased ({engine.name})", COPY_BACK: "", COST: "0 B"}
    size = cls.nbytes
    cost = "?" if size is None else f"{format_bytes(2 * size)} (2 x {format_bytes(size)})"
    return {ALIASED: "copy-back", COPY_BACK: cls.reason or "", COST: cost}
