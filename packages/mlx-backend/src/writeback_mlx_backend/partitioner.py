"""``MLXPartitioner``: which edge nodes the MLX delegate takes and which writes it does in place."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.fx
from executorch.exir.backend.partitioner import (
    DelegationSpec,
    Partitioner,
    PartitionResult,
)
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from writeback_mlx_backend._names import BACKEND_ID, BACKEND_NAME
from writeback_mlx_backend.ops import unsupported_reason
from writeback_mlx_backend.preprocess import WritebackMLXBackend

__all__ = ["MLXPartitioner"]

# Ops kept whole through to_edge so the delegate sees them (index_copy would
# otherwise decompose to index_put, which wraps negative indices).
_KEEP = (torch.ops.aten.index_copy.default,)


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        return node.op == "call_function" and unsupported_reason(node) is None


class MLXPartitioner(Partitioner):  # type: ignore[misc]  # executorch is untyped
    """Tag every node the MLX op table runs, grouped into delegate partitions.

    Buffers a partition mutates become delegate-owned when ``own_buffers`` (they
    then live in MLX across calls). The partitioner only tags: the in-place
    decision per mutation is core's: its lowering path wraps this partitioner in
    :func:`writeback_core.annotating`, which asks every plugin per mutation and
    records the decision. Used bare, no mutation is annotated (every write-back
    is kept).
    """

    def __init__(self, own_buffers: bool = True) -> None:
        super().__init__()
        self.own_buffers = own_buffers
        self.delegation_spec = DelegationSpec(WritebackMLXBackend.__name__, [])
        assert WritebackMLXBackend.__name__ == BACKEND_ID

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        """Keep ``index_copy`` whole where the delegate can run it; others decompose."""
        return list(_KEEP), lambda node: node.target not in _KEEP or (unsupported_reason(node) is None)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag supported nodes, owned buffers and constants."""
        gm = exported_program.graph_module
        partitions = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True).propose_partitions()
        tags: dict[str, DelegationSpec] = {}
        for partition in partitions:
            tag = f"{BACKEND_NAME}_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        if self.own_buffers:
            tag_mutated_buffer(exported_program)
            _keep_returned_buffers_outside(exported_program)
        tag_constant_data(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _keep_returned_buffers_outside(program: ExportedProgram) -> None:
    """Untag a mutated buffer whose new value the program also returns.

    exir cannot hand such a buffer to a delegate (its mutation output would also
    be a user output), so it stays a program buffer that the delegate reads and
    whose new value it returns.
    """
    sig = program.graph_signature
    names = Counter(s.arg.name for s in sig.output_specs if hasattr(s.arg, "name"))
    returned = {s.target for s in sig.output_specs if s.kind is OutputKind.BUFFER_MUTATION and names[s.arg.name] > 1}
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder" and sig.inputs_to_buffers.get(node.name) in returned:
            node.meta.pop("delegation_tag", None)
