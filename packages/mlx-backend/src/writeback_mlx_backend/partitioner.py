"""``MLXPartitioner``: which edge nodes the MLX delegate takes and which writes it does in place."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.fx
from executorch.exir.backend.partitioner import (
    DelegationSpec,
    Partitioner,
    PartitionResult,
)
from executorch.exir.backend.utils import tag_constant_data
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from writeback_core.partition import wrapped

from writeback_mlx_backend._names import BACKEND_ID, BACKEND_NAME
from writeback_mlx_backend.op_table import unsupported_reason
from writeback_mlx_backend.preprocess import WritebackMLXBackend

__all__ = ["MLXPartitioner"]

# Ops kept whole through to_edge so the delegate sees them: index_copy would
# otherwise decompose to index_put, which wraps negative indices; layer_norm to
# native_layer_norm, whose three outputs (the mean and rstd unused) a delegate
# step cannot return.
_KEEP = (torch.ops.aten.index_copy.default, torch.ops.aten.layer_norm.default)


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        return node.op == "call_function" and unsupported_reason(node) is None


class MLXPartitioner(Partitioner):  # type: ignore[misc]  # executorch is untyped
    """Tag every node the MLX op table runs, grouped into delegate partitions.

    With ``own_buffers``, a mutated buffer becomes delegate-owned (it then lives
    in MLX across calls) when one partition does everything with it: every read
    of it and the op producing its new value carry that partition's tag (see
    :func:`owned_buffers`). Any other mutated buffer stays a program buffer
    that delegates read and whose new value one of them returns; an op MLX
    lacks is never tagged, so it runs outside the delegate. The partition of an
    owned buffer is exir's: the lowered module of that tag lists the buffer in
    its program's ``graph_signature.buffers_to_mutate``. The partitioner only tags: the in-place
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
        """Keep ``index_copy`` and ``layer_norm`` whole where the delegate can run them;
        others decompose."""
        return list(_KEEP), lambda node: node.target not in _KEEP or (unsupported_reason(node) is None)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag supported nodes, owned buffers and constants.

        Used bare (not wrapped by writeback, see :func:`writeback_core.partition.wrapped`), it
        warns, naming every state that then stays copied back whole.
        """
        gm = exported_program.graph_module
        tags: dict[str, DelegationSpec] = {}
        nodes = {n.name: n for n in gm.graph.nodes}
        for name, tag in propose_tags(gm).items():
            nodes[name].meta["delegation_tag"] = tag
            # A spec (and compile-spec list) of its own per partition: a pass that records
            # per-delegate compile specs (the in-place outputs) edits one partition's list.
            if tag not in tags:
                tags[tag] = DelegationSpec(self.delegation_spec.backend_id, list(self.delegation_spec.compile_specs))
        if self.own_buffers:
            placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
            for name, tag in owned_buffers(exported_program).items():
                placeholders[name].meta["delegation_tag"] = tag
        tag_constant_data(exported_program)
        _untag_shared_constants(gm)
        if not wrapped():
            _warn_used_alone(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _warn_used_alone(program: ExportedProgram) -> None:
    """Name each mutated state a bare partitioner leaves to exir's whole-state copy: every one
    but the buffers a partition owns (those live inside the delegate)."""
    from writeback_core.copies import CopyLeftWarning, caller_stacklevel, idiom
    from writeback_core.mutations import MutationKind, find_mutations

    owned = {n.name for n in program.graph_module.graph.nodes if n.op == "placeholder" and _meta_tag(n) is not None}
    copied = [m for m in find_mutations(program) if m.placeholder not in owned]
    if not copied:
        return
    lines = [
        f"{'input' if m.kind is MutationKind.USER_INPUT else 'buffer'} {m.target!r} ({m.nbytes} bytes)" for m in copied
    ]
    warnings.warn(
        "MLXPartitioner() used alone: writeback records no in-place decision for it, so each of these "
        "mutated states is copied back whole on every call: "
        + ", ".join(lines)
        + f". To write them in place: {idiom(BACKEND_NAME)}.",
        CopyLeftWarning,
        stacklevel=caller_stacklevel(),
    )


def _untag_shared_constants(gm: torch.fx.GraphModule) -> None:
    """Leave outside every partition a weight or buffer that something outside also uses.

    exir's ``tag_constant_data`` tags a constant with the one partition among its users
    and ignores users outside every partition (the graph output, when the program
    returns a buffer it also reads), which exir's lowering then refuses. Left untagged,
    the constant reaches the delegate as an input instead.
    """
    for node in gm.graph.nodes:
        tag = _meta_tag(node) if node.op == "placeholder" else None
        if tag is not None and any(_meta_tag(user) != tag for user in node.users):
            del node.meta["delegation_tag"]


def owned_buffers(
    program: ExportedProgram, tag_of: Callable[[torch.fx.Node], str | None] | None = None
) -> dict[str, str]:
    """The mutated buffers one partition can own: ``{placeholder name: delegation tag}``.

    ``tag_of`` gives a node's partition tag; by default the ``delegation_tag``
    the partitioner put in its meta (call after the operator nodes are tagged).
    A mutated buffer is owned by the partition tagged ``t`` when:

    1. the node producing its new value (the buffer-mutation output) is an
       operator tagged ``t`` (an op outside every delegate, such as one MLX
       lacks, leaves the buffer to the program);
    2. every reader of its placeholder is tagged ``t`` (a read in another
       partition, or outside, would need the value the delegate keeps);
    3. every reader of its new value is tagged ``t`` too (a reader outside, such
       as an op MLX lacks, needs the value in the program, where an owned buffer
       never is);
    4. the program does not also return its new value as a user output (exir
       cannot give a delegate a buffer whose mutation output is a user output
       too).

    Examples it must refuse: ``a = s + x`` in partition 1, an unsupported op,
    then ``s.copy_(f(b))`` in partition 2. Partition 1 reads ``s`` but
    partition 2 produces its new value, so ``s`` stays a program buffer. And
    ``s.copy_(cat([s[:, :, 1:], x], -1)); y = conv(s)`` with the convolution
    outside: the convolution reads the new value, so ``s`` stays a program buffer.
    """
    if tag_of is None:
        tag_of = _meta_tag
    sig = program.graph_signature
    graph = program.graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    returned = Counter(s.arg.name for s in sig.output_specs if hasattr(s.arg, "name"))
    new_value = {
        s.target: s.arg.name
        for s in sig.output_specs
        if s.kind is OutputKind.BUFFER_MUTATION and returned[s.arg.name] == 1
    }
    owned: dict[str, str] = {}
    for name, target in sig.inputs_to_buffers.items():
        value = nodes.get(new_value.get(target, ""))
        tag = tag_of(value) if value is not None and value.op == "call_function" else None
        if tag is None or any(tag_of(user) != tag for user in nodes[name].users):
            continue
        assert value is not None
        if all(tag_of(user) == tag for user in value.users if user.op != "output"):
            owned[name] = tag
    return owned


def _meta_tag(node: torch.fx.Node) -> str | None:
    tag = node.meta.get("delegation_tag")
    return tag if isinstance(tag, str) else None


def propose_tags(graph_module: torch.fx.GraphModule) -> dict[str, str]:
    """``{node name: delegation tag}`` of the partitions :class:`MLXPartitioner` would make, without tagging."""
    partitions = CapabilityBasedPartitioner(
        graph_module, _Support(), allows_single_node_partition=True
    ).propose_partitions()
    return {node.name: f"{BACKEND_NAME}_{partition.id}" for partition in partitions for node in partition.nodes}
