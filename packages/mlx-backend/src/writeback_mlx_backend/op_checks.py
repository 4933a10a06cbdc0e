"""The support checks of the MLX delegate's op table: each reads only node metadata
(``node.meta["val"]``, literal arguments) and says why a node cannot run in MLX, or
``None`` when it can. The partitioner leaves a node outside the delegate when its op's
check (``OpHandler.check``) answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from writeback_core.ops import node_value

from writeback_mlx_backend.op_handler import MX_DTYPES

__all__ = [
    "float_check",
    "gelu_check",
    "index_put_check",
    "layer_norm_check",
    "literal_ints_check",
    "literal_reason",
    "one_index_check",
    "sdpa_check",
    "tensor_check",
]

_INDEX_DTYPES = (torch.int64, torch.int32)


def _vals(node: torch.fx.Node) -> list[Any]:
    """The traced values of ``node`` and of every node it reads."""
    return [node_value(node), *(node_value(arg) for arg in node.all_input_nodes)]


def tensor_check(node: torch.fx.Node) -> str | None:
    """Every tensor the node reads or makes has a known static shape and an MLX dtype."""
    for val in _vals(node):
        if isinstance(val, (list, tuple)):
            items: Sequence[Any] = val
        else:
            items = [val]
        for item in items:
            if isinstance(item, torch.Tensor):
                if item.dtype not in MX_DTYPES:
                    return f"dtype {item.dtype} has no MLX counterpart here"
                if any(not isinstance(s, int) for s in item.shape):
                    return "dynamic shape"
            elif item is not None and not isinstance(item, (int, float, bool)):
                return f"value of type {type(item).__name__}"
    return None


def float_check(node: torch.fx.Node) -> str | None:
    """:func:`tensor_check`, and every tensor floating point (MLX multiplies matrices of no other kind)."""
    reason = tensor_check(node)
    if reason:
        return reason
    for val in _vals(node):
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return f"MLX multiplies only floating-point matrices, not {val.dtype}"
    return None


def sdpa_check(node: torch.fx.Node) -> str | None:
    """``scaled_dot_product_attention``: floating-point query, key and value, no dropout, and
    query heads that share the key heads evenly."""
    reason = tensor_check(node)
    if reason:
        return reason
    for position, name in enumerate(("query", "key", "value")):
        val = node_value(node.args[position])
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return f"{name} of dtype {val.dtype} (MLX attends over floating point only)"
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if dropout != 0.0:
        return f"dropout_p {dropout!r} (the delegate runs inference only)"
    q, k = (node_value(a) for a in node.args[:2])
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
        if q.dim() < 3 or k.dim() < 3:
            return "query and key need a head dimension"
        if q.shape[-3] != k.shape[-3] and (k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]):
            return f"{q.shape[-3]} query heads do not share {k.shape[-3]} key heads evenly"
    return None


def _rank(node: Any) -> int | None:
    val = node_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else None


def one_index_check(first: str) -> Callable[[torch.fx.Node], str | None]:
    """Checks for ``op(x, dim, index, ...)`` with one 1-D integer index; ``first`` names ``x``."""

    def check(node: torch.fx.Node) -> str | None:
        reason = tensor_check(node)
        if reason:
            return reason
        if _rank(node.args[0]) == 0:
            return f"0-d {first} (left to portable kernels)"
        index = node.args[2]
        if not isinstance(index, torch.fx.Node) or _rank(index) != 1:
            return "index is not a 1-D tensor (a 0-d index is left to portable kernels)"
        if index.meta["val"].dtype not in _INDEX_DTYPES:
            return "index dtype is not int64/int32"
        if not isinstance(node.args[1], int):
            return "dim is not a literal int"
        return None

    return check


def index_put_check(node: torch.fx.Node) -> str | None:
    """``op(x, [indices], ...)`` (``index_put``, ``index.Tensor``): adjacent int64/int32
    index tensors, none 0-d, into a destination that is not 0-d."""
    reason = tensor_check(node)
    if reason:
        return reason
    if _rank(node.args[0]) == 0:
        return "0-d destination"
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)) or not any(i is not None for i in indices):
        return "no index tensors"
    for index in indices:
        if index is None:
            continue
        if not isinstance(index, torch.fx.Node):
            return "index is not a tensor"
        if index.meta["val"].dtype not in _INDEX_DTYPES:
            return "index is not int64/int32 (boolean masks stay on portable kernels)"
        if _rank(index) == 0:
            return "0-d index"
    present = [k for k, i in enumerate(indices) if i is not None]
    if present != list(range(present[0], present[-1] + 1)):
        return "index tensors are not adjacent"
    return None


def literal_ints_check(*positions: int) -> Callable[[torch.fx.Node], str | None]:
    """Checks for an op whose arguments at ``positions`` (dims, bounds) are literal ints or ``None``."""

    def check(node: torch.fx.Node) -> str | None:
        reason = tensor_check(node)
        if reason:
            return reason
        for position in positions:
            if position < len(node.args):
                value = node.args[position]
                if value is not None and not isinstance(value, int):
                    return f"argument {position} is not a literal int"
        return None

    return check


def layer_norm_check(node: torch.fx.Node) -> str | None:
    """``layer_norm(x, normalized_shape, weight, bias, eps)``: literal sizes that are ``x``'s
    last dimensions, a literal eps, floating point throughout."""
    reason = float_check(node)
    if reason:
        return reason
    shape = node.args[1]
    x = node_value(node.args[0])
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
        return "normalized_shape is not a list of literal ints"
    if not isinstance(x, torch.Tensor) or not shape or tuple(x.shape[x.dim() - len(shape) :]) != tuple(shape):
        return f"normalized_shape {list(shape)} is not the input's last dimensions"
    eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    if not isinstance(eps, (int, float)):
        return "eps is not a literal number"
    return None


def gelu_check(node: torch.fx.Node) -> str | None:
    """``gelu``: an ``approximate`` the handler computes (``"none"`` or ``"tanh"``)."""
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return None if approximate in ("none", "tanh") else f"gelu approximate={approximate!r}"


# Literal argument types a delegate blob can carry (see ``writeback_mlx_backend.preprocess``).
_LITERALS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def literal_reason(value: Any) -> str | None:
    """Why argument ``value`` cannot be written into a blob, or ``None``."""
    if value is None or isinstance(value, (torch.fx.Node, *_LITERALS)):
        return None
    if isinstance(value, (list, tuple)):
        return next((r for r in map(literal_reason, value) if r is not None), None)
    return f"argument of type {type(value).__name__}"
