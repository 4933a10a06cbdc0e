"""Rebuilding an ``ExportedProgram`` after its outputs changed (shared by lift, declare, settle)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, OutputSpec
from torch.utils import _pytree as pytree


def user_out_spec(original: pytree.TreeSpec, extra: int) -> pytree.TreeSpec:
    """``original`` with ``extra`` trailing leaves: ``(original_structure, leaf, ...)``."""
    if extra == 0:
        return original
    skeleton = pytree.tree_unflatten([0] * original.num_leaves, original)
    return pytree.tree_structure((skeleton, *([0] * extra)))


def rebuild(
    program: ExportedProgram,
    module: torch.fx.GraphModule,
    outputs: Sequence[Any],
    specs: Sequence[OutputSpec],
    out_spec: pytree.TreeSpec | None = None,
    meta: dict[str, Any] | None = None,
) -> ExportedProgram:
    """A new program over ``module`` whose output node returns ``outputs`` described by ``specs``.

    ``out_spec`` (the user outputs' pytree) defaults to the program's own;
    ``meta`` entries are set on the new graph module.
    """
    graph = module.graph
    old = graph.output_node()
    with graph.inserting_before(old):
        new = graph.output(tuple(outputs))
    new.meta = dict(old.meta)
    graph.erase_node(old)
    module.recompile()
    module.meta.update(meta or {})
    signature = ExportGraphSignature(input_specs=list(program.graph_signature.input_specs), output_specs=list(specs))
    call_graph = copy.deepcopy(program._module_call_graph)
    if out_spec is not None and call_graph and call_graph[0].signature is not None:
        call_graph[0].signature.out_spec = out_spec
    return ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=signature,
        state_dict=program.state_dict,
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=program.verifiers,
    )


def output_values(module: torch.fx.GraphModule) -> list[Any]:
    """What the output node returns, flattened, one entry per output spec."""
    return list(pytree.tree_leaves(module.graph.output_node().args[0]))


def out_spec_of(program: ExportedProgram) -> pytree.TreeSpec:
    """The pytree of the program's user outputs."""
    spec: pytree.TreeSpec | None = program.call_spec.out_spec
    assert spec is not None
    return spec
