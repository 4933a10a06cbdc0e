"""Ops no ExecuTorch program can hold, found on the exported program before any lowering.

ExecuTorch's edge dialect holds Core ATen ops (and the few exir allows besides). ``to_edge``
decomposes the rest into Core ATen where a decomposition exists and refuses what is left, deep
inside the lowering, with a message that names neither the model nor the code that made the op.
:func:`ops_outside_core_aten` finds those ops on the program ``torch.export`` made:

1. Take each call of an ATen operator overload.
2. Pass it when ``to_edge`` will turn it into Core ATen ops: it has a decomposition in the
   table ``to_edge`` uses (``torch.export.default_decompositions()`` and exir's additions) or
   a ``CompositeImplicitAutograd`` kernel (made of other ops), or it mutates
   (functionalization makes it its functional form), or it returns nothing (an assertion on
   metadata, dropped).
3. Ask exir's own edge verifier about what is left (``check_valid_op``): an op it refuses is
   outside Core ATen.

Each op found is named once, with where the model computes it (the innermost module's path and
class, and the model's source line, from the node's ``nn_module_stack`` and ``stack_trace``).
Refused, for example: a mixture-of-experts router counting tokens per expert with
``torch.histc`` (``aten.histc`` has no decomposition and is not Core ATen).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch
import torch.fx
from torch.export import ExportedProgram

from writeback_core.ops import source_of
from writeback_core.types import LoweringError

__all__ = ["OpOutsideCoreAten", "OpsOutsideCoreAtenError", "check_core_aten", "ops_outside_core_aten"]


@dataclass(frozen=True)
class OpOutsideCoreAten:
    """An op of the program that ``to_edge`` would refuse: its name (``aten.histc.default``) and
    where the model computes it (``router (Router) at model.py:30``: the innermost module's path
    and class, the source line; :func:`~writeback_core.ops.source_of`)."""

    op: str
    source: str


class OpsOutsideCoreAtenError(LoweringError):
    """The program computes ops outside Core ATen that ``to_edge`` cannot decompose: no ExecuTorch
    program can hold it. ``ops`` lists each op once; the message names the model, each op and
    where it is made, and what would fix it."""

    def __init__(self, what: str, ops: list[OpOutsideCoreAten]) -> None:
        listed = "; ".join(f"{o.op} in {o.source}" for o in ops)
        super().__init__(
            f"{what} computes {'an op' if len(ops) == 1 else 'ops'} outside Core ATen with no decomposition into "
            f"it, which no ExecuTorch program can hold (to_edge refuses it): {listed}. It would export once that "
            "code computes the same with Core ATen ops (a model with a switch for it, such as transformers' "
            "experts implementation, set to one that does), or once ExecuTorch's edge dialect accepts the op and "
            "the backend has a kernel for it",
            upstream=True,
        )
        self.ops = ops


def _becomes_core_aten(op: torch._ops.OpOverload, decompositions: Container[object]) -> bool:
    if op in decompositions or op._schema.is_mutable or not op._schema.returns:
        return True
    name = op.name()  # type: ignore[no-untyped-call]  # torch leaves OpOverload.name unannotated
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))


def ops_outside_core_aten(program: ExportedProgram) -> list[OpOutsideCoreAten]:
    """Each op of ``program`` that ``to_edge`` would refuse as outside Core ATen, once, in graph
    order (see the module docstring)."""
    # exir's own table, the one to_edge decomposes with (torch's defaults and exir's additions,
    # linalg_vector_norm among them); exir gives it no public name.
    from executorch.exir.tracer import _default_decomposition_table
    from executorch.exir.verification.verifier import EXIRATenDialectVerifier

    verifier = EXIRATenDialectVerifier()
    decompositions = _default_decomposition_table()
    found: dict[str, OpOutsideCoreAten] = {}
    for node in program.graph_module.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or str(op) in found:
            continue
        if _becomes_core_aten(op, decompositions):
            continue
        try:
            verifier.check_valid_op(op)
        except Exception:  # exir's SpecViolationError: the op is refused
            found[str(op)] = OpOutsideCoreAten(str(op), source_of(node, with_class=True))
    return list(found.values())


def check_core_aten(program: ExportedProgram, what: str) -> None:
    """Refuse ``program`` when it computes an op :func:`ops_outside_core_aten` finds.

    :param what: what the error names (``model 'name'``).
    :raises OpsOutsideCoreAtenError: naming each op, where the model makes it, and the fix.
    """
    ops = ops_outside_core_aten(program)
    if ops:
        raise OpsOutsideCoreAtenError(what, ops)
