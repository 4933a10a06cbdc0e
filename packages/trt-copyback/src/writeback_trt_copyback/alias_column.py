"""The column ``writeback explain`` gets from this package: aliased or copy-back, and its cost."""

from __future__ import annotations

import weakref

from torch.export import ExportedProgram
from writeback_core.mutations import Mutation, MutationKind
from writeback_core.program_passes import decomposed, graphs_copy
from writeback_core.types import AliasingEngine
from writeback_core.units import format_bytes

from writeback_trt_copyback.lift import BufferClass, lift_decomposed

__all__ = ["COLUMN", "explain_columns"]

COLUMN = "trt engine"

# explain asks once per mutation row; the program is lifted once per engine kind (only the
# classes are kept: the lifted program would keep its weights alive).
_CLASSES: weakref.WeakKeyDictionary[ExportedProgram, dict[type, list[BufferClass]]] = weakref.WeakKeyDictionary()


def _buffer_classes(program: ExportedProgram, engine: AliasingEngine) -> list[BufferClass]:
    per_engine = _CLASSES.setdefault(program, {})
    if type(engine) not in per_engine:
        # The decomposition explain's rows were found in, copied: the lift changes its graph.
        lifted = lift_decomposed(graphs_copy(decomposed(program)), engine)
        per_engine[type(engine)] = list(lifted.buffers)
    return per_engine[type(engine)]


def explain_columns(program: ExportedProgram, mutation: Mutation, engine: AliasingEngine) -> dict[str, str]:
    """Whether ``engine`` would write ``mutation`` in place, and what copying it back costs.

    One column, kept short because every plugin adds to one table:
    ``aliased, 0 B/call`` or ``copy-back, <cost>/call``. A copy-back buffer pays,
    every call, its whole new value materialized as a graph output plus
    ExecuTorch's write-back copy of it: twice the buffer. An aliased one pays
    nothing beyond the slots it writes. (Why a buffer is copied back is
    ``BufferClass.reason`` from :func:`~writeback_trt_copyback.lift.lift_mutated_buffers`.)
    """
    if mutation.kind is not MutationKind.BUFFER:
        return {COLUMN: "n/a (input)"}
    cls = next((b for b in _buffer_classes(program, engine) if b.target == mutation.target), None)
    if cls is None:
        return {COLUMN: "?"}
    if cls.aliased:
        return {COLUMN: "aliased, 0 B/call"}
    cost = "?" if cls.nbytes is None else format_bytes(2 * cls.nbytes)
    return {COLUMN: f"copy-back, {cost}/call"}
