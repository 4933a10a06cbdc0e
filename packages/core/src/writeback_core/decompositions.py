"""Two of exir's decomposition retraces that change nothing, skipped while a program is
partitioned (:func:`decompositions_once`).

``to_edge_transform_and_lower`` retraces the whole program three times before it builds the
edge program when a partitioner filters the ops it keeps (XNNPACK's does):

1. ``run_decompositions({})``: functionalization alone;
2. ``run_decompositions(table)``, the default table less the ops the partitioner keeps:
   functionalization again, and every decomposition;
3. once the kept ops the partitioner takes are renamed into exir's ``EDGE_DO_NOT_DECOMP``
   namespace, ``run_decompositions`` of the whole default table, for the kept ops the
   partitioner turned down.

Step 2 functionalizes what step 1 would have, so step 1 is only needed when step 2 may not
run (a partitioner without a filter: exir then skips step 2 when nothing in the graph is in
its table). Step 3 has nothing to do when the partitioner took every kept op: no node's op is
in the table any more but ``aten.sym_size.int``, which a trace writes for every dynamic size
it reads and which no decomposition removes. Each retrace of a 0.5B decoder costs seconds to
tens of seconds of fake-tensor dispatch (torchao's quantize primitives run inside each); the
``.pte`` is the same byte for byte without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.export import ExportedProgram

__all__ = ["decompositions_once"]

# The namespace exir renames a kept op into between steps 2 and 3 (exir's edge_no_decomp_namespace).
_KEPT_NAMESPACE = "EDGE_DO_NOT_DECOMP"


def _kept_ops_marked(program: ExportedProgram) -> bool:
    """Whether ``program`` is at step 3: some node's op is in exir's kept namespace."""
    return any(
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == _KEPT_NAMESPACE
        for node in program.graph.nodes
    )


def _nothing_to_decompose(program: ExportedProgram, table: Any) -> bool:
    """Whether no node of ``program`` (or of a control-flow subgraph) calls an op of ``table``
    but ``aten.sym_size.int``."""
    from executorch.exir.graph_module import contains_any_call_fn_target_op

    targets = [op for op in table.keys() if op is not torch.ops.aten.sym_size.int]
    return not contains_any_call_fn_target_op(program.graph_module, targets)


def _filters_kept_ops(partitioner: Any, program: ExportedProgram) -> bool:
    """Whether exir takes the three-step path for ``partitioner``: it filters the ops it keeps."""
    _, check = partitioner.ops_to_not_decompose(program)
    return check is not None


@contextmanager
def decompositions_once(program: ExportedProgram, partitioners: Sequence[Any]) -> Iterator[None]:
    """While the block runs, ``to_edge_transform_and_lower(program, partitioner=partitioners)``
    skips the retraces that change nothing (see the module docstring): the functionalization
    alone of step 1 when every partitioner filters its kept ops (so step 2 always runs), and
    step 3 when no node is left for it to decompose. Every other ``run_decompositions`` call
    runs as it does. Process-wide while the block runs, as
    :func:`~writeback_core.lowering.preprocess_shares_constants` is."""
    original: Callable[..., ExportedProgram] = ExportedProgram.run_decompositions
    deferrable = [bool(partitioners) and all(_filters_kept_ops(p, program) for p in partitioners)]

    def run_decompositions(self: ExportedProgram, decomp_table: Any = None, *args: Any, **kwargs: Any) -> Any:
        if decomp_table is not None and not args and not kwargs:
            if deferrable[0] and len(decomp_table) == 0:
                deferrable[0] = False  # step 1, once: step 2 functionalizes
                return self
            if _kept_ops_marked(self) and _nothing_to_decompose(self, decomp_table):
                return self  # step 3 with nothing left to decompose
        return original(self, decomp_table, *args, **kwargs)

    setattr(ExportedProgram, "run_decompositions", run_decompositions)  # noqa: B010  # mypy refuses assigning a method
    try:
        yield
    finally:
        setattr(ExportedProgram, "run_decompositions", original)  # noqa: B010
