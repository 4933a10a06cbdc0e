"""The graph rewrite of the state-write pass: planned writes become ``index_put_``.

This module holds what :mod:`writeback_passes.reinplace_state_writes` does to the graph once a
state's writes are planned: :func:`rewrite_in_place` inserts each write's index (``arange``, or
the existing index wrapped as eager wraps a negative one) and its values' reshape or
broadcast, replaces the functional write by ``index_put_`` into the previous one and erases
what only the write read; :func:`guard_index_copies` makes each decomposed ``index_copy`` left
functional reject a negative index, as eager's does. Inserted nodes are edge ops whose ``val``
is computed on the graph's fake tensors (:func:`fake_mode`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx
from writeback_core.ops import packet_name

from writeback_passes.graph import arg_value, tensor_value
from writeback_passes.state_write_plans import Write, from_index_copy

__all__ = ["fake_mode", "guard_index_copies", "rewrite_in_place"]


def _edge(name: str) -> Any:
    from executorch.exir.dialects._ops import ops as exir_ops

    packet, overload = name.split(".")
    return getattr(getattr(exir_ops.edge.aten, packet), overload)


def fake_mode(graph: torch.fx.Graph) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])


def _call(
    graph: torch.fx.Graph, target: str, args: tuple[Any, ...], kwargs: dict[str, Any], fake: Any
) -> torch.fx.Node:
    """Insert a call of edge op ``target``, with its ``val`` computed on fake tensors."""
    node = graph.call_function(_edge(target), args, kwargs)

    def unwrap(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(unwrap(x) for x in a)
        return a

    op = _edge(target)._op
    with fake:
        node.meta["val"] = op(*unwrap(args), **unwrap(kwargs))
    return node


def rewrite_in_place(
    graph: torch.fx.Graph, writes: Sequence[Write], placeholder: torch.fx.Node, fake: Any
) -> torch.fx.Node:
    """Replace each functional write by ``index_put_``; return the last in-place node."""
    dest = placeholder
    for write in writes:
        with graph.inserting_before(write.node):
            index = write.index.node
            if index is None:
                args = (write.index.start, write.index.end, write.index.step)
                index = _call(graph, "arange.start_step", args, {"dtype": torch.int64}, fake)
            elif write.index.wrap is not None:
                index = _wrapped(graph, index, write.index.wrap, fake)
            values = write.values
            if write.fix == "view":
                values = _call(graph, "view_copy.default", (values, list(write.shape)), {}, fake)
            elif write.fix == "expand":
                values = _call(graph, "expand_copy.default", (values, list(write.shape)), {}, fake)
            indices = [None] * write.dim + [index]
            in_place = graph.call_function(_edge("index_put_.default"), (dest, indices, values, False))
        in_place.meta.update({k: v for k, v in write.node.meta.items() if k in ("val", "custom", "stack_trace")})
        write.node.replace_all_uses_with(in_place)
        inputs = write.node.all_input_nodes
        graph.erase_node(write.node)
        _erase_dead(inputs)
        dest = in_place
    return dest


def _wrapped(graph: torch.fx.Graph, index: torch.fx.Node, size: int, fake: Any) -> torch.fx.Node:
    """``where(index < 0, index + size, index)``: eager's reading of a negative index, with
    kernels every stock runtime links. An index outside ``[-size, size)`` stays outside
    ``[0, size)``, so the in-place kernel still rejects it before writing, as eager does."""
    negative = _call(graph, "lt.Scalar", (index, 0), {}, fake)
    shifted = _call(graph, "add.Scalar", (index, size), {}, fake)
    return _call(graph, "where.self", (negative, shifted, index), {}, fake)


def _erase_dead(nodes: Iterable[torch.fx.Node]) -> None:
    """Erase the pure calls among ``nodes`` that nothing reads any more, and theirs in turn
    (what only the functional write read: ``select_scatter``'s full-size mask and expand)."""
    frontier = list(nodes)
    erased: set[torch.fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in erased or node.users or node.op != "call_function" or node.is_impure():
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        frontier.extend(inputs)


def guard_index_copies(graph: torch.fx.Graph) -> list[str]:
    """Make each functional ``index_put`` that is a decomposed ``index_copy`` reject a negative
    index, as eager's ``index_copy`` does: the ``index_put.out`` kernel wraps one, so a copy kept
    (or an ``index_copy`` of no state) would write position ``size - 1`` where eager raises.
    ``where(i < 0, i - size, i)`` leaves every index eager accepts as it is and moves a negative
    one below ``-size``, which the kernel rejects before the write-back touches the state.
    Returns the guarded nodes' names."""
    fake = None
    guarded = []
    for node in list(graph.nodes):
        if node.op != "call_function" or packet_name(node.target) != "index_put" or not from_index_copy(node):
            continue
        indices = list(arg_value(node, 1, "indices", []))
        present = [k for k, i in enumerate(indices) if i is not None]
        state, index = tensor_value(node.args[0]), indices[present[0]] if len(present) == 1 else None
        if not isinstance(index, torch.fx.Node) or state is None or present[0] >= state.dim():
            continue
        size = state.shape[present[0]]
        if not isinstance(size, int):
            continue
        fake = fake if fake is not None else fake_mode(graph)
        with graph.inserting_before(node):
            negative = _call(graph, "lt.Scalar", (index, 0), {}, fake)
            below = _call(graph, "add.Scalar", (index, -size), {}, fake)
            moved = _call(graph, "where.self", (negative, below, index), {}, fake)
        indices[present[0]] = moved
        node.args = (node.args[0], indices, *node.args[2:])
        guarded.append(node.name)
    return guarded
