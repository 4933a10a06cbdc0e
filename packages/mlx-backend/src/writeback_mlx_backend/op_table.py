"""The op table of the MLX delegate: one :class:`~writeback_mlx_backend.op_handler.OpHandler`
per aten op, keyed by :func:`op_key`, and which nodes the partitioner takes
(:func:`unsupported_reason`).

A handler has a ``check`` that reads only node metadata and says why the node cannot run
in MLX, or ``None`` when it can (``writeback_mlx_backend.op_checks``); the partitioner
leaves a node outside the delegate when its check answers. ``run`` computes the node's
value in MLX from its resolved arguments. The handlers live by what they do:
``op_math`` (arithmetic, reductions, matmuls, softmax, norms, attention), ``op_shapes``
(views, permutes, copies, casts, literal-sized values) and ``op_indexing`` (the writes
with their regions, gathers and slices, every index checked as ATen does).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx
from writeback_core.ops import node_value, normalize_dim, overload_name

from writeback_mlx_backend.op_checks import literal_reason, tensor_check
from writeback_mlx_backend.op_handler import OpHandler
from writeback_mlx_backend.op_indexing import INDEXING_OPS
from writeback_mlx_backend.op_math import MATH_OPS
from writeback_mlx_backend.op_shapes import SHAPE_OPS

__all__ = ["OPS", "SPLIT", "op_key", "split_parts", "unsupported_reason"]


def op_key(target: Any) -> str:
    """The :data:`OPS` key of ``target``: ``"aten.mm.default"`` for an op or its edge
    wrapper (core's ``overload_name``); ``""`` for anything else, which no entry names."""
    return overload_name(target) or ""


OPS: dict[str, OpHandler] = {**MATH_OPS, **SHAPE_OPS, **INDEXING_OPS}
# One handler per op: no part of the table names an op another part names.
assert len(OPS) == len(MATH_OPS) + len(SHAPE_OPS) + len(INDEXING_OPS)


# ``split_with_sizes_copy`` (what ``chunk``, ``split`` and ``unbind`` become in the edge
# dialect) returns a list, read through ``getitem``. The partitioner takes it when every
# reader takes one part by a literal index; the blob then holds each part as a
# ``slice_copy`` step (``writeback_mlx_backend.preprocess``), never the split itself, so
# the runtime's table has no entry for it.
SPLIT = "aten.split_with_sizes_copy.default"


def split_parts(node: torch.fx.Node) -> tuple[int, list[tuple[int, int]]] | None:
    """``(dim, [(start, end), ...])``: the split's dim (an axis in [0, rank)) and each part's bounds along
    it, or ``None`` when the sizes are not literal ints that add up to the input's size
    there."""
    sizes = node.args[1]
    x = node_value(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        return None
    if not isinstance(x, torch.Tensor):
        return None
    try:
        axis = normalize_dim(dim, x.dim(), what="split dim")
    except (IndexError, TypeError):
        return None
    ends = list(itertools.accumulate(cast(Sequence[int], sizes)))
    if not ends or ends[-1] != x.shape[axis]:
        return None
    return axis, list(zip([0, *ends[:-1]], ends, strict=True))


def _split_reason(node: torch.fx.Node) -> str | None:
    reason = tensor_check(node)
    if reason:
        return reason
    found = split_parts(node)
    if found is None:
        return "split sizes or dim are not literal ints covering the input"
    parts = found[1]
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return f"{user.name} reads the split's list whole (only getitem of one part is delegated)"
        if not 0 <= user.args[1] < len(parts):
            return f"{user.name} reads part {user.args[1]} of {len(parts)}"
    return None


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """Why ``node`` stays outside the delegate, or ``None`` when the table runs it.

    Conservative: a node is taken only when its op has a handler, every literal
    argument can be written into the blob, and the handler's check passes. A
    check that cannot read the node (an argument where it expects none) leaves
    it outside rather than failing the lowering.
    """
    if node.op != "call_function":
        return "not a call"
    if op_key(node.target) == SPLIT:
        return _split_reason(node)
    source = node.args[0] if node.target is operator.getitem and node.args else None
    if isinstance(source, torch.fx.Node) and op_key(source.target) == SPLIT:
        return _split_reason(source)  # a part goes where its split goes
    handler = OPS.get(op_key(node.target))
    if handler is None:
        return f"no MLX handler for {op_key(node.target) or node.target}"
    reason = literal_reason([node.args, list(node.kwargs.values())])
    if reason is not None:
        return reason
    try:
        return handler.check(node)
    except (IndexError, KeyError, AttributeError, TypeError) as error:
        return f"unexpected arguments ({type(error).__name__}: {error})"
