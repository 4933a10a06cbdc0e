"""The ops of the MLX delegate that move, view, copy or make values and compute nothing:
reshapes, permutes, expands, squeezes, concatenation, copies, casts, and values made from
literal sizes (``full``, ``arange``). Each wraps its dims through core's ``normalize_dim``
when it runs, as ATen does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from writeback_core.ops import normalize_dim

from writeback_mlx_backend.op_checks import literal_ints_check, tensor_check
from writeback_mlx_backend.op_handler import OpHandler

__all__ = ["CASTS", "PERMUTES", "SHAPE_OPS", "VIEWS"]

# Op families, each named once: the attention window and the fusions match them by these.
VIEWS = ("aten.view_copy.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
PERMUTES = ("aten.permute_copy.default", "aten.permute.default")
CASTS = ("aten._to_copy.default", "dim_order_ops._to_dim_order_copy.default")
# Ops whose ``run`` returns their argument itself (MLX arrays are immutable).
_ALIASES = (
    "aten.clone.default",
    "aten.alias_copy.default",
    "aten.alias.default",
    "aten.detach_copy.default",
    "dim_order_ops._clone_dim_order.default",
)


def _reshape(x: Any, size: Sequence[int]) -> Any:
    """``reshape`` that stays a view when only unit dims are added or removed.

    MLX copies when reshaping an array that is not row-contiguous (a transposed
    cache); adding or dropping size-1 dims never needs that copy.
    """
    shape = list(size)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = x.size // known if known else 0
    if tuple(shape) == tuple(x.shape):
        return x
    if [d for d in x.shape if d != 1] == [d for d in shape if d != 1]:
        out = mx.squeeze(x) if 1 in x.shape else x
        for position, dim in enumerate(shape):
            if dim == 1:
                out = mx.expand_dims(out, position)
        return out
    return mx.reshape(x, shape)


def _transpose(x: Any, a: int, b: int) -> Any:
    return mx.swapaxes(
        x, normalize_dim(a, x.ndim, what="transpose dim0"), normalize_dim(b, x.ndim, what="transpose dim1")
    )


def _permute(x: Any, dims: Sequence[int]) -> Any:
    axes = [normalize_dim(d, x.ndim, what="permute dim") for d in dims]
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"permute: dims {list(dims)} are not a permutation of the {x.ndim} axes of the input")
    return mx.transpose(x, axes)


def _squeeze(x: Any, dims: Any = None) -> Any:
    if dims is None:
        return mx.squeeze(x)
    if isinstance(dims, int):
        dims = [dims]
    axes = [normalize_dim(d, x.ndim, what="squeeze dim") for d in dims]
    keep = [a for a in axes if x.shape[a] == 1]
    return mx.squeeze(x, axis=keep) if keep else x


def _expand(x: Any, size: Sequence[int], implicit: bool = False) -> Any:
    lead = len(size) - x.ndim
    if lead < 0:
        raise ValueError(f"expand: size {list(size)} has fewer dimensions than the input's {x.ndim}")
    shape = []
    for position, s in enumerate(size):
        if s == -1 and position >= lead:
            s = x.shape[position - lead]
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"expand: size {s!r} at dimension {position} of {list(size)} (-1 keeps an existing one)")
        shape.append(s)
    return mx.broadcast_to(x, shape)


def _full(size: Sequence[int], value: Any, **_: Any) -> Any:
    return mx.full(list(size), value)


def _full_like(x: Any, value: Any, **_: Any) -> Any:
    return mx.full(x.shape, value, dtype=x.dtype)


def _unsqueeze(x: Any, dim: int) -> Any:
    return mx.expand_dims(x, normalize_dim(dim, x.ndim + 1, what="unsqueeze dim"))


def _arange(start: Any, end: Any = None, step: Any = 1, **_: Any) -> Any:
    if end is None:
        start, end = 0, start
    return mx.arange(start, end, step)


def _cast(x: Any, dtype: Any = None, **_: Any) -> Any:
    return x if dtype is None else x.astype(dtype)


def _identity(x: Any, *_: Any, **__: Any) -> Any:
    return x


def _cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    parts = [t for t in tensors if t.size > 0 or t.ndim > 1]
    return mx.concatenate(parts, axis=normalize_dim(dim, parts[0].ndim, what="cat dim"))


def _copy(dest: Any, src: Any, non_blocking: bool = False) -> Any:
    """Functional ``aten.copy``: ``src``'s values in ``dest``'s shape and dtype."""
    out = src if src.shape == dest.shape else mx.broadcast_to(src, dest.shape)
    return out if out.dtype == dest.dtype else out.astype(dest.dtype)


SHAPE_OPS: dict[str, OpHandler] = {
    **{op: OpHandler(tensor_check, _reshape) for op in VIEWS},
    **{op: OpHandler(tensor_check, _permute) for op in PERMUTES},
    "aten.transpose_copy.int": OpHandler(literal_ints_check(1, 2), _transpose),
    "aten.transpose.int": OpHandler(literal_ints_check(1, 2), _transpose),
    "aten.t_copy.default": OpHandler(tensor_check, lambda x: x.T),
    "aten.expand_copy.default": OpHandler(tensor_check, _expand),
    "aten.expand.default": OpHandler(tensor_check, _expand),
    "aten.unsqueeze_copy.default": OpHandler(tensor_check, _unsqueeze),
    "aten.unsqueeze.default": OpHandler(tensor_check, _unsqueeze),
    "aten.squeeze_copy.dims": OpHandler(tensor_check, _squeeze),
    "aten.squeeze_copy.dim": OpHandler(tensor_check, _squeeze),
    "aten.cat.default": OpHandler(literal_ints_check(1), _cat),
    "aten.full.default": OpHandler(tensor_check, _full),
    "aten.full_like.default": OpHandler(tensor_check, _full_like),
    "aten.scalar_tensor.default": OpHandler(tensor_check, lambda value, **_: mx.array(value)),
    "aten.arange.start_step": OpHandler(tensor_check, _arange),
    "aten.arange.default": OpHandler(tensor_check, _arange),
    **{op: OpHandler(tensor_check, _identity, alias=True) for op in _ALIASES},
    "aten.copy.default": OpHandler(tensor_check, _copy),
    **{op: OpHandler(tensor_check, _cast) for op in CASTS},
}
