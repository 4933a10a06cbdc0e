"""XNNPACK's ``preprocess`` without the passes that find nothing to change in a partition.

XNNPACK's backend runs all seventeen of its passes on every partition it lowers, and each
pass ends by tracing the partition again. A decoder has nothing for most of them (no
convolution, batch norm, PReLU, ReLU, padding, pooling, upsampling or attention pattern), yet on a 0.5B
decoder (123 partitions) those traces were a third of ``writeback export``'s time.

:func:`xnnpack_passes_pruned`, entered by the ``xnnpack`` backend's ``lowering_context``:

1. Before each pass, look up what it needs in the partition (:data:`_NEEDS`, keyed by the
   pass's class name): an op it rewrites, or every op of one of the subgraph patterns it
   matches (a pattern can match only a graph that has each of its ops).
2. A pass whose need the partition's graph (as the passes before it left it) does not
   meet is skipped; every other pass runs as XNNPACK runs it, in XNNPACK's order.
3. A run of skipped passes that would have traced the graph again is replaced by one trace
   (exir's ``ExportPass``), before the next pass that runs: a pass that edits the graph may
   leave its new nodes' metadata to the next pass's trace (``FuseBatchNormPass`` does).
4. A pass not in the table always runs: a pass a new ExecuTorch adds is never skipped.

A skipped pass would have changed nothing but traced the graph again, and the trace is
kept, so the delegate's blob and the ``.pte`` are the same byte for byte
(tests/passes/test_xnnpack_preprocess.py compares them). Refused: skipping a pass that
looks at every op (``ChannelsLastTaggedReshapePass``, ``ConstPropPass``,
``RemoveRedundantCopyPass``, ...): what it needs cannot be read off the op names.
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
}
# The passes of the table that do not end by tracing the graph again.
_NO_TRACE = frozenset({"InsertPadQDQPass"})


def _op_names(graph: torch.fx.Graph) -> frozenset[str]:
    return frozenset(
        str(getattr(node.target, "__name__", node.target)) for node in graph.nodes if node.op == "call_function"
    )


def _finds_nothing(pass_name: str, graph: torch.fx.Graph, needs: dict[str, list[frozenset[str]]]) -> bool:
    """Whether the pass called ``pass_name`` cannot change ``graph`` (steps 1 and 4)."""
    need = _NEEDS.get(pass_name)
    if need is None:
        return False
    if pass_name not in needs:
        needs[pass_name] = need()
    present = _op_names(graph)
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
            for each in self.passes:
                if _finds_nothing(each.__name__, program.graph_module.graph, needs):
                    trace = trace or each.__name__ not in _NO_TRACE
                    continue
                if trace:
                    program = manager(program, passes=[ExportPass]).transform()
                    trace = False
                program = manager(program, passes=[each]).transform()
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
