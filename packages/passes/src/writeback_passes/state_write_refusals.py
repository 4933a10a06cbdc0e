"""Whether a state write may be made in place: the one rule of the state-write pass.

This module holds :func:`in_place_kernel_refusal`, which ``writeback_accepts_in_place`` and
``writeback explain`` ask at partition time, and :func:`plan_state_write`, which
:mod:`writeback_passes.reinplace_state_writes` asks again of the final graph. Both peel
functional copies (:func:`peel_copy`), plan the writes that build the new value
(:func:`~writeback_passes.state_write_plans.write_chain`) and then refuse what would change a
result: a node that reads the old value through any alias after a write (a node a delegation
partition takes counts as read where its delegate call runs; a node that reads only metadata,
such as ``_assert_tensor_metadata``, reads no value), values or an index that may
share the state's storage, a state consumed into a delegate as constant data.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx
from writeback_core.ops import packet_name
from writeback_core.partition import DELEGATION_TAG as _TAG

from writeback_passes.graph import StorageAliases, reads_no_value
from writeback_passes.state_write_plans import Write, write_chain

__all__ = ["in_place_kernel_refusal", "peel_copy", "plan_state_write"]


def _hazard(
    writes: Sequence[Write],
    placeholder: torch.fx.Node,
    storage: StorageAliases,
    after: Callable[[torch.fx.Node, torch.fx.Node], bool],
    ignored: frozenset[torch.fx.Node],
) -> str | None:
    """Why writing ``writes`` in place would change a result, or ``None``.

    The alias analysis lets a delegate call's results alias its arguments; here they
    do not: a delegate writes its results into outputs the runtime allocated (one
    it writes in place has no reader left: ``reinplace_delegate_input_mutations``).
    """
    state = {n for n in storage.members(placeholder) if not _delegate_result(n)}
    for write in writes:
        state |= {n for n in storage.members(write.node) if not _delegate_result(n)}
    for write in writes:
        inputs = [write.values, *(n for n in write.node.all_input_nodes if n is not write.dest)]
        shared = list(dict.fromkeys(n.name for n in inputs if n in state))
        if shared:
            return (
                f"{write.node.name!r} writes {placeholder.name!r} from {', '.join(shared)}, which may "
                "share its storage: an in-place write would overlap what it reads"
            )
        for old in storage.members(write.dest):
            if _delegate_result(old):
                continue
            for reader in old.users:
                if reader is write.node or reader in ignored or reader.op == "output" or reads_no_value(reader):
                    continue
                if after(reader, write.node):
                    return (
                        f"{reader.name!r} reads the old value of {placeholder.name!r} (through "
                        f"{old.name!r}) after {write.node.name!r} writes it; writing in place "
                        "would change what it reads"
                    )
    return None


def _delegate_result(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``getitem(executorch_call_delegate(...), j)``."""
    from executorch.exir.delegate import executorch_call_delegate

    source = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(source, torch.fx.Node) and source.target is executorch_call_delegate


def _order(graph: torch.fx.Graph) -> Callable[[torch.fx.Node, torch.fx.Node], bool]:
    """``after(reader, write)``: whether ``reader`` runs after ``write``.

    Graph order, except for a node a delegation partition takes (before
    lowering): the partition runs as one delegate call, which exir places at
    the partition's first node unless one of its nodes depends on ``write``;
    so the node runs after ``write`` when any node of its partition depends on
    ``write``, or when it comes after ``write`` itself.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    members: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        tag = node.meta.get(_TAG)
        if node.op == "call_function" and isinstance(tag, str):
            members.setdefault(tag, []).append(node)
    downstream: dict[torch.fx.Node, set[torch.fx.Node]] = {}

    def depends(write: torch.fx.Node) -> set[torch.fx.Node]:
        found = downstream.get(write)
        if found is None:
            found, frontier = set(), [write]
            while frontier:
                for user in frontier.pop().users:
                    if user not in found:
                        found.add(user)
                        frontier.append(user)
            downstream[write] = found
        return found

    def after(reader: torch.fx.Node, write: torch.fx.Node) -> bool:
        if order[reader] > order[write]:
            return True
        tag = reader.meta.get(_TAG)
        if reader.op != "call_function" or not isinstance(tag, str) or tag not in members:
            return False
        return any(n in depends(write) for n in members[tag])

    return after


def plan_state_write(
    graph: torch.fx.Graph,
    placeholder: torch.fx.Node,
    value: object,
    ignored: Iterable[torch.fx.Node] = (),
    storage: StorageAliases | None = None,
) -> list[Write] | str:
    value, peeled = peel_copy(value, placeholder)
    writes = write_chain(value, placeholder)
    if isinstance(writes, str):
        return writes
    if isinstance(placeholder.meta.get(_TAG), str):
        return f"{placeholder.name!r} is consumed into a delegate as constant data"
    storage = storage if storage is not None else StorageAliases(graph)
    reason = _hazard(writes, placeholder, storage, _order(graph), frozenset([*ignored, *peeled]))
    return reason if reason is not None else writes


def in_place_kernel_refusal(graph: torch.fx.Graph, placeholder: str, value: str) -> str | None:
    """Why the state write that makes node ``value`` from placeholder ``placeholder`` of
    ``graph`` cannot be made in place with the stock runtime's kernels, or ``None`` when it can.

    The one rule of this pass: ``writeback_accepts_in_place`` answers the
    ``portable`` and ``xnnpack`` backends with it at partition time, ``writeback
    explain`` states it, and
    :func:`~writeback_passes.reinplace_state_writes.reinplace_state_writes` applies it again to the
    final graph. Works on an edge or aten program (after ``run_decompositions()``),
    partitioned or not: a node a delegation partition takes counts as read at the
    partition's last node.
    """
    nodes = {n.name: n for n in graph.nodes}
    if placeholder not in nodes or value not in nodes:
        return f"the graph has no node {placeholder!r} or {value!r}"
    planned = plan_state_write(graph, nodes[placeholder], nodes[value])
    return planned if isinstance(planned, str) else None


def peel_copy(value: object, placeholder: torch.fx.Node) -> tuple[object, list[torch.fx.Node]]:
    """Follow functional ``aten.copy(placeholder, x)`` nodes down to the value written."""
    chain: list[torch.fx.Node] = []
    while (
        isinstance(value, torch.fx.Node)
        and packet_name(value.target) == "copy"
        and value.args
        and value.args[0] is placeholder
    ):
        chain.append(value)
        value = value.args[1]
    return value, chain
