"""Graph-op helpers for plugins: see through exir's edge dialect to the aten op beneath.

An edge-dialect node's ``target`` wraps the aten ``OpOverload`` it stands for;
a pass or partitioner that matches ops should match through these helpers, so
that one rule holds on the aten program and on the edge program alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["aten_op", "is_aten", "op_name", "packet_name", "schema_of", "write_back_copies"]


def aten_op(target: Any) -> Any:
    """The ``torch._ops.OpOverload`` behind ``target`` (edge ops wrap one), else ``target``."""
    inner = getattr(target, "_op", None)
    if isinstance(inner, torch._ops.OpOverload):
        return inner
    return target


def op_name(target: Any) -> str:
    """A stable printable name such as ``aten.index_put.default``."""
    op = aten_op(target)
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return getattr(target, "__name__", repr(target))


def schema_of(target: Any) -> torch.FunctionSchema | None:
    """The function schema of an op target, or ``None`` when it has none."""
    op = aten_op(target)
    schema = getattr(op, "_schema", None)
    if isinstance(schema, torch.FunctionSchema):
        return schema
    schema = getattr(target, "_schema", None)
    return schema if isinstance(schema, torch.FunctionSchema) else None


def is_aten(target: Any) -> bool:
    """True when the op's schema is in the ``aten::`` namespace (the only one we trust)."""
    schema = schema_of(target)
    return schema is not None and schema.name.startswith("aten::")


def packet_name(target: Any) -> str | None:
    """``"index_put"`` for ``aten.index_put.default`` and its edge wrapper; ``None`` otherwise."""
    op = aten_op(target)
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
        return str(op._opname)
    return None


def write_back_copies(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Every write-back: a ``copy_(placeholder, value)`` node (aten or edge), in graph order.

    exir writes a mutated buffer or input back this way; the one helper every pass,
    report and check uses to find them.
    """
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and packet_name(node.target) == "copy_"
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    ]
