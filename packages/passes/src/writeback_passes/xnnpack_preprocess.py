"""XNNPACK's ``preprocess`` without the passes that find nothing to change in a partition.

XNNPACK's backend runs all seventeen of its passes on every partition it lowers, and each
pass ends by tracing the partition again. A decoder has nothing for most of them (no
convolution, batch norm, PReLU, ReLU, padding, pooling, upsampling or attention pattern), yet on a 0.5B
decoder (123 partitions) those traces were a third of ``writeback export``'s time.

:func:`xnnpack_passes_pruned`, entered by the ``xnnpack`` backend's ``lowering_context``:

1. Before each pass, look up what it needs in the partition (:data:`_NEEDS`, keyed by the
   pass's class name): an op it rewrites (the ops read from the pass or exir where they
   keep the list), or every op of one of the subgraph patterns it matches (a pattern can
   match only a graph that has each of its ops; an op every pattern holds is looked for
   first, so that the patterns are built only for a graph that has it), or, for
   ``PropagateCustomMetaPass``, a quantize/dequantize node whose ``custom`` metadata
   differs from its input's (:data:`_CHANGES`).
2. A pass whose need the partition's graph (as the passes before it left it) does not
   meet is skipped; every other pass runs as XNNPACK runs it, in XNNPACK's order.
3. A run of skipped passes that would have traced the graph again is replaced by one trace
   (exir's ``ExportPass``), before the next pass that runs: a pass that edits the graph may
   leave its new nodes' metadata to the next pass's trace (``FuseBatchNormPass`` does).
   The trace is left out when the pass that ran last ended by tracing the graph itself
   (:data:`_ENDS_WITH_TRACE`), or when the next pass is itself such a trace of the graph
   it is given (:data:`_TRACES_AS_GIVEN`): tracing a traced graph again gives the same graph.
4. A pass not in the table always runs: a pass a new ExecuTorch adds is never skipped.

A skipped pass would have changed nothing but traced the graph again, and the graph it
would have traced is traced once, so the delegate's blob and the ``.pte`` are the same
byte for byte (tests/passes/test_xnnpack_preprocess.py compares them). Refused: skipping
a pass that looks at every op (``ChannelsLastTaggedReshapePass``, ``ConstPropPass``, ...):
what it would change cannot be read off the graph before it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["xnnpack_passes_pruned"]


def _ops(*names: str) -> Callable[[], list[frozenset[str]]]:
    """Needs any one of the ops called ``names`` (``aten.convolution.default``)."""
    return lambda: [frozenset({name}) for name in names]


def _ops_of(module: str, attribute: str) -> Callable[[], list[frozenset[str]]]:
    """Needs any one of the ops ``module.attribute`` lists (a dotted attribute path; a
    mapping's keys), read from ExecuTorch, so that the list follows its release."""

    def needs() -> list[frozenset[str]]:
        import importlib

        value: Any = importlib.import_module(module)
        for name in attribute.split("."):
            value = getattr(value, name)
        return [frozenset({_op_name(op)}) for op in value]

    return needs


def _patterns(module: str, function: str) -> Callable[[], list[frozenset[str]]]:
    """Needs every op of one of the patterns ``module.function()`` returns (XNNPACK's own,
    cached by it)."""

    def needs() -> list[frozenset[str]]:
        import importlib

        graphs = getattr(importlib.import_module(module), function)()
        return [_op_names(graph.graph) for graph in graphs]

    return needs


_GRAPHS = "executorch.backends.xnnpack.partition.graphs"
_BATCH_NORM = ("aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default")

# Pass class name -> what a partition must hold for the pass to change anything.
_NEEDS: dict[str, Callable[[], list[frozenset[str]]]] = {
    "ConvertToUpsampleBilinear2d": _patterns(f"{_GRAPHS}.bilinear_2d", "get_graphs"),
    "ConvertToSDPAPass": _patterns(f"{_GRAPHS}.sdpa", "get_graphs"),
    "FuseBatchNormPass": _ops(*_BATCH_NORM),
    "DecomposeBatchNorm": _ops(*_BATCH_NORM),
    "Conv1dUnsqueezePass": _ops("aten.convolution.default"),
    "PReLUReshapePass": _ops("aten._prelu_kernel.default", "aten.prelu.default"),
    "InsertPadQDQPass": _ops("aten.constant_pad_nd.default"),
    "FuseActivationPass": _ops("aten.relu.default", "aten.hardtanh.default"),
    "DecomposeConcatenate": _ops("aten.cat.default"),
    "RemoveGetItemPass": _ops("aten.max_pool2d_with_indices.default", "aten.max.dim"),
    "DimOrderOpsRevertPass": _ops_of("executorch.exir.passes.dim_order_ops_registry", "MemoryFormatOpsMap"),
    "ConvertToLinearPass": _ops_of(
        "executorch.backends.xnnpack._passes.convert_to_linear", "ConvertToLinearPass.targets"
    ),
    "RemoveRedundantCopyPass": _ops("aten._to_copy.default"),
}
# Pattern passes -> an op every one of their patterns holds (tests check it against
# XNNPACK's patterns): a graph without it needs no pattern built.
_EVERY_PATTERN_HOLDS: dict[str, str] = {
    "ConvertToUpsampleBilinear2d": "aten.upsample_bilinear2d.vec",
    "ConvertToSDPAPass": "aten._softmax.default",
}
# The passes of the table that do not end by tracing the graph again.
_NO_TRACE = frozenset({"InsertPadQDQPass"})
# The passes XNNPACK runs that always end by tracing the graph again (exir's ``ExportPass``
# trace): after one of them ran, the graph is freshly traced (step 3).
_ENDS_WITH_TRACE = frozenset(
    {
        "ExportPass",
        "DimOrderOpsRevertPass",
        "ConvertToLinearPass",
        "PropagateCustomMetaPass",
        "ConstPropPass",
        "ChannelsLastTaggedReshapePass",
        "RemoveRedundantCopyPass",
        "DecomposeConcatenate",
    }
)
# The passes that are exir's ``ExportPass`` trace and nothing else (they rewrite ops as they
# trace): a trace just before one of them changes nothing it makes (step 3).
_TRACES_AS_GIVEN = frozenset({"ExportPass", "DimOrderOpsRevertPass", "ConstPropPass"})


def _op_name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


def _op_names(graph: torch.fx.Graph) -> frozenset[str]:
    return frozenset(_op_name(node.target) for node in graph.nodes if node.op == "call_function")


def _custom_meta_to_propagate(graph: torch.fx.Graph) -> bool:
    """Whether ``PropagateCustomMetaPass`` would change a node of ``graph``: a quantize or
    dequantize node whose first argument is a node carrying ``custom`` metadata the
    quantize/dequantize node does not carry already."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant

    for node in graph.nodes:
        if not node.all_input_nodes or not (is_quant(node) or is_dequant(node)):
            continue
        parent = node.args[0]
        if isinstance(parent, torch.fx.Node) and "custom" in parent.meta:
            if node.meta.get("custom") is not parent.meta["custom"]:
                return True
    return False


# Pass class name -> whether it would change the graph, for passes whose need is not an op.
_CHANGES: dict[str, Callable[[torch.fx.Graph], bool]] = {
    "PropagateCustomMetaPass": _custom_meta_to_propagate,
}


def _finds_nothing(pass_name: str, graph: torch.fx.Graph, needs: dict[str, list[frozenset[str]]]) -> bool:
    """Whether the pass called ``pass_name`` cannot change ``graph`` (steps 1 and 4)."""
    changes = _CHANGES.get(pass_name)
    if changes is not None:
        return not changes(graph)
    need = _NEEDS.get(pass_name)
    if need is None:
        return False
    present = _op_names(graph)
    held = _EVERY_PATTERN_HOLDS.get(pass_name)
    if held is not None and held not in present:
        return True
    if pass_name not in needs:
        needs[pass_name] = need()
    return not any(ops <= present for ops in needs[pass_name])


def _pruned(manager: Any) -> Any:
    """A subclass of XNNPACK's pass manager that runs its passes one by one, a run of passes
    :func:`_finds_nothing` rules out replaced by one trace (step 2)."""
    needs: dict[str, list[frozenset[str]]] = {}

    class PrunedPassManager(manager):  # type: ignore[misc]  # executorch is untyped: its classes are Any
        def transform(self) -> Any:
            from executorch.exir.pass_base import ExportPass

            program = self.exported_program
            trace = False
            traced = False  # the graph is as the last trace left it (step 3)
            for each in self.passes:
                if _finds_nothing(each.__name__, program.graph_module.graph, needs):
                    trace = trace or (each.__name__ not in _NO_TRACE and not traced)
                    continue
                if trace and each.__name__ not in _TRACES_AS_GIVEN:
                    program = manager(program, passes=[ExportPass]).transform()
                trace = False
                program = manager(program, passes=[each]).transform()
                traced = each.__name__ in _ENDS_WITH_TRACE
            if trace:
                program = manager(program, passes=[ExportPass]).transform()
            return program

    return PrunedPassManager


@contextmanager
def xnnpack_passes_pruned() -> Iterator[None]:
    """While the block runs, XNNPACK's ``preprocess`` skips the passes that find nothing to
    change in the partition (see the module docstring). Process-wide while the block runs."""
    from executorch.backends.xnnpack import xnnpack_preprocess

    original = xnnpack_preprocess.XNNPACKPassManager
    xnnpack_preprocess.XNNPACKPassManager = _pruned(original)
    try:
        yield
    finally:
        xnnpack_preprocess.XNNPACKPassManager = original
