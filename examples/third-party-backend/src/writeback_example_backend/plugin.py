"""Entry-point module of the example backend: thin, imports core and torch only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx
from writeback_core import (
    BackendSpec,
    Mutation,
    MutationKind,
    PartitionView,
    Registry,
    RuntimeDelegate,
    WriteKind,
    hookimpl,
)
from writeback_core.ops import packet_name

from writeback_example_backend import BACKEND_ID, BACKEND_NAME

writeback_name = "example-backend"


def _partitioner(registry: Registry, **options: Any) -> Any:
    # exir is imported here, not at the top: loading this plugin stays cheap.
    from writeback_example_backend.backend import ExamplePartitioner

    # Our partitioner only tags nodes; core wraps it and records the per-mutation decisions.
    return ExamplePartitioner(**options)


def _overwrites(node: torch.fx.Node, state: torch.fx.Node) -> bool:
    """``aten.copy(state, src)``: the functional write-back lands in ``state``, reading none of its values."""
    return packet_name(node.target) == "copy" and bool(node.args) and node.args[0] is state


def _reader_not_ordered_before(state: torch.fx.Node, write: torch.fx.Node) -> torch.fx.Node | None:
    """A node that reads ``state``'s old value and may run after ``write``, or ``None``.

    Writing ``state`` in place is safe only when every reader of its old value
    runs before the write. Node order does not promise that (exir places each
    fused delegate call where it likes: a functional ``s0.index_copy(...)``
    delegated beside the in-place one ran after it); only a data dependency
    does. So every node reached from ``state``, other than through ``write``
    or a functional write-back into ``state`` (:func:`_overwrites`), must be an
    ancestor of ``write``. The walk goes on through those ancestors
    too: one may be a view of ``state`` (exir turns ``view_copy`` into a view),
    whose later readers see the new value.
    """
    ancestors: set[torch.fx.Node] = set()
    frontier = list(write.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node not in ancestors:
            ancestors.add(node)
            frontier.extend(node.all_input_nodes)
    position = {n: i for i, n in enumerate(write.graph.nodes)}
    seen = {state}
    frontier = [state]
    while frontier:
        for user in frontier.pop().users:
            if user is write or user in seen or _overwrites(user, state):
                continue
            if user not in ancestors and not _kept_before(user, write, position):
                return user
            seen.add(user)
            if user in ancestors or packet_name(user.target) == "view_copy":
                frontier.append(user)  # its readers read the state too (a view, once exir makes one)
    return None


def _kept_before(node: torch.fx.Node, write: torch.fx.Node, position: dict[torch.fx.Node, int]) -> bool:
    """Whether ``node`` runs before ``write`` without a data dependency: it stays outside every
    partition (only one-index writes are delegated, each alone) and comes first in the graph,
    whose order exir keeps for the nodes it does not fuse; an aten op that computes a new
    value, not a clone, which the passes treat as a possible alias of the state."""
    from writeback_example_backend.backend import single_index_dim  # exir: only while lowering

    if node.op != "call_function" or packet_name(node.target) in (None, "clone"):
        return False  # a copy (exir's clone) may share the state's memory later: not a plain read
    return single_index_dim(node) is None and position[node] < position[write]


@hookimpl
def writeback_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            backend_id=BACKEND_ID,
            partitioner=_partitioner,
            description="example third-party backend: in-place one-slot cache writes",
        )
    ]


@hookimpl
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    if backend != BACKEND_NAME:
        return None
    write = mutation.write
    if write.kind is not WriteKind.INDEX_COPY or write.node is None:
        return False
    if mutation.kind is MutationKind.BUFFER and mutation.also_returned(partition.graph):
        # A buffer is planned memory; the value the caller gets back must live
        # elsewhere, so a copy is needed either way: keep exir's write-back.
        return False
    if not partition.contains(write.node):
        return False
    # The partition takes only the write: another reader of the old value stays outside it.
    nodes = {n.name: n for n in partition.graph.nodes}
    state, node = nodes.get(mutation.placeholder), nodes.get(write.node)
    if state is None or node is None:
        return False
    return _reader_not_ordered_before(state, node) is None


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_example_backend.backend import ExampleRuntimeDelegate

    return [ExampleRuntimeDelegate()]
