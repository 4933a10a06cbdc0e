"""The op table of the MLX delegate: one :class:`OpHandler` per aten op, keyed by op name.

A handler has a ``check`` that reads only node metadata (``node.meta["val"]``,
literal arguments) and says why the node cannot run in MLX, or ``None`` when it
can; the partitioner leaves a node outside the delegate when its check answers.
``run`` computes the node's value in MLX from its resolved arguments.

Write ops (``index_copy``, ``index_put``, ``slice_scatter``) also have a
``region``: where in the destination the write lands and what is written, as a
numpy index, so the delegate can write only that region into memory it shares
with the caller instead of building a new array.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
import torch
import torch.fx
from writeback_core.ops import aten_op, normalize_dim

__all__ = [
    "MX_DTYPES",
    "OPS",
    "SPLIT",
    "UNKNOWN",
    "OpHandler",
    "Region",
    "op_key",
    "split_parts",
    "unsupported_reason",
]

# torch dtypes the delegate computes in, with their MLX and numpy counterparts.
MX_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.int64: mx.int64,
    torch.int32: mx.int32,
    torch.int16: mx.int16,
    torch.int8: mx.int8,
    torch.uint8: mx.uint8,
    torch.bool: mx.bool_,
}

_INDEX_DTYPES = (torch.int64, torch.int32)

# An argument whose value is not known yet (passed to ``OpHandler.validate``).
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()


@dataclass(frozen=True)
class Region:
    """A write into part of a destination: ``dest[key] = values`` (``+=`` when ``accumulate``)."""

    key: tuple[Any, ...]
    values: np.ndarray
    accumulate: bool = False


@dataclass(frozen=True)
class OpHandler:
    """How the delegate runs one op.

    ``check(node)`` returns the reason the node cannot be delegated, or ``None``;
    ``run(*args, **kwargs)`` computes its MLX value; ``region(*args, **kwargs)``,
    for write ops only, describes the written part of ``args[0]`` (after
    validating indices, so a bad index raises before anything is written);
    ``validate`` checks the indices alone, so a call can check every write first.
    """

    check: Callable[[torch.fx.Node], str | None]
    run: Callable[..., Any]
    region: Callable[..., Region] | None = None
    # For ops that index: ``validate(*args)`` raises on an index ATen rejects; it reads
    # only the indexed tensor's shape and the indices, and skips what is ``UNKNOWN``.
    validate: Callable[..., None] | None = None
    # ``run`` returns its first argument itself (clone and alias ops on immutable
    # MLX arrays): the runtime may name that argument instead of running a step.
    alias: bool = False
    # For ops that index: the positions of ``args`` holding the indices ``validate`` reads.
    index_args: tuple[int, ...] = ()
    # ``run`` without host reads, for a traced (``mx.compile``) step: the indices were
    # validated on the call's inputs before the graph was built. ``None``: ``run`` is
    # already pure MLX.
    trace: Callable[..., Any] | None = None
    # ``bounds(*args, **kwargs)``: each index argument with the range ``[lo, hi)`` its
    # values must lie in, for a quick check on the host; ``validate`` says why not.
    bounds: Callable[..., list[tuple[Any, int, int]]] | None = None


def op_key(target: Any) -> str:
    """``"aten.mm.default"`` for an aten op or its edge wrapper; ``""`` for anything else."""
    op = aten_op(target)
    return str(op) if isinstance(op, torch._ops.OpOverload) else ""


# -- metadata checks ------------------------------------------------------------


def _vals(node: torch.fx.Node) -> list[Any]:
    vals = [node.meta.get("val")]
    for arg in node.all_input_nodes:
        vals.append(arg.meta.get("val"))
    return vals


def _tensor_check(node: torch.fx.Node) -> str | None:
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


def _ok(node: torch.fx.Node) -> str | None:
    return _tensor_check(node)


def _float_check(node: torch.fx.Node) -> str | None:
    """:func:`_tensor_check`, and every tensor floating point (MLX multiplies matrices of no other kind)."""
    reason = _tensor_check(node)
    if reason:
        return reason
    for val in _vals(node):
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return f"MLX multiplies only floating-point matrices, not {val.dtype}"
    return None


def _sdpa_check(node: torch.fx.Node) -> str | None:
    reason = _tensor_check(node)
    if reason:
        return reason
    for position, name in enumerate(("query", "key", "value")):
        val = _val(node.args[position])
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return f"{name} of dtype {val.dtype} (MLX attends over floating point only)"
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if dropout != 0.0:
        return f"dropout_p {dropout!r} (the delegate runs inference only)"
    q, k = (_val(a) for a in node.args[:2])
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
        if q.dim() < 3 or k.dim() < 3:
            return "query and key need a head dimension"
        if q.shape[-3] != k.shape[-3] and (k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]):
            return f"{q.shape[-3]} query heads do not share {k.shape[-3]} key heads evenly"
    return None


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _rank(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _one_index_check(first: str) -> Callable[[torch.fx.Node], str | None]:
    """Checks for ``op(x, dim, index, ...)`` with one 1-D integer index; ``first`` names ``x``."""

    def check(node: torch.fx.Node) -> str | None:
        reason = _tensor_check(node)
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


def _index_put_check(node: torch.fx.Node) -> str | None:
    reason = _tensor_check(node)
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


def _literal_ints_check(*positions: int) -> Callable[[torch.fx.Node], str | None]:
    def check(node: torch.fx.Node) -> str | None:
        reason = _tensor_check(node)
        if reason:
            return reason
        for position in positions:
            if position < len(node.args):
                value = node.args[position]
                if value is not None and not isinstance(value, int):
                    return f"argument {position} is not a literal int"
        return None

    return check


# -- helpers ------------------------------------------------------------------------


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def run(a: Any, b: Any, alpha: Any = 1) -> Any:
        if alpha != 1:
            b = b * alpha
        return fn(a, b)

    return run


def _to_np_index(index: Any) -> np.ndarray:
    return np.asarray(index).astype(np.int64, copy=False)


def _prefix(dim: int) -> tuple[slice, ...]:
    return (slice(None),) * dim


# -- write ops ----------------------------------------------------------------------


def _in_range(index: Any, op: str, dim: int, size: int, advice: str) -> np.ndarray:
    """``index`` flattened as int64 numpy; ``IndexError`` naming the first index outside ``[0, size)``."""
    idx = _to_np_index(index).reshape(-1)
    bad = np.flatnonzero((idx < 0) | (idx >= size))
    if bad.size:
        first = int(bad[0])
        raise IndexError(
            f"{op}: index {int(idx[first])} at position {first} is out of range for "
            f"dimension {dim} of size {size}; {advice}"
        )
    return idx


def _index_copy_key(dest: Any, dim: int, index: Any) -> tuple[Any, ...]:
    """The numpy key of ``index_copy(dest, dim, index)``; raises on an index ATen rejects."""
    dim = normalize_dim(dim, dest.ndim, what="index_copy dim")
    size = dest.shape[dim]
    if getattr(index, "size", None) == 1:
        # A decode step's one slot: a scalar check and a one-wide slice (numpy and MLX
        # assign through a slice faster than through an index array).
        slot = int(index.item())
        if 0 <= slot < size:
            return (*_prefix(dim), slice(slot, slot + 1))
    idx = _in_range(
        index,
        "index_copy",
        dim,
        size,
        "negative indices are rejected, not wrapped (as ATen does). Pass indices in [0, size).",
    )
    return (*_prefix(dim), idx)


def _index_copy_run(dest: Any, dim: int, index: Any, source: Any) -> Any:
    key = _index_copy_key(dest, dim, index)
    out = mx.array(dest)
    last = key[-1] if isinstance(key[-1], slice) else mx.array(key[-1])
    out[(*key[:-1], last)] = source
    return out


def _slot_update(dest: Any, dim: int, index: Any, source: Any) -> Any:
    """``dest`` with ``source`` written at the one position ``index`` holds along ``dim``,
    without reading ``index`` on the host (a traced step)."""
    start = index.reshape(1).astype(mx.int32)
    return mx.slice_update(dest, source.astype(dest.dtype), start, [dim])


def _index_copy_trace(dest: Any, dim: int, index: Any, source: Any) -> Any:
    dim = normalize_dim(dim, dest.ndim, what="index_copy dim")
    if index.size == 1 and source.ndim == dest.ndim and source.shape[dim] == 1:
        return _slot_update(dest, dim, index, source)
    out = mx.array(dest)
    out[(*_prefix(dim), index.reshape(-1))] = source
    return out


def _index_put_trace(dest: Any, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Any:
    given = [(position, index) for position, index in enumerate(indices) if index is not None]
    if not accumulate and len(given) == 1 and given[0][1].size == 1 and given[0][1].ndim == 1:
        # The decode step's form (``cache[:, :, pos] = values``): one slot of one dim.
        position, index = given[0]
        size = dest.shape[position]
        slot = mx.where(index < 0, index + size, index)
        shape = list(dest.shape)
        shape[position] = 1
        return _slot_update(dest, position, slot, mx.broadcast_to(values, shape))
    key = _wrapped_key(dest, indices)
    if accumulate:
        return dest.at[key].add(values)
    out = mx.array(dest)
    out[key] = values
    return out


def _take_trace(x: Any, dim: int, index: Any) -> Any:
    return mx.take(x, index, axis=normalize_dim(dim, x.ndim, what="index_select dim"))


def _embedding_trace(weight: Any, indices: Any, *_: Any) -> Any:
    return mx.take(weight, indices, axis=0)


def _along_dim_bounds(x: Any, dim: int, index: Any, *_: Any) -> list[tuple[Any, int, int]]:
    return [(index, 0, x.shape[normalize_dim(dim, x.ndim, what="dim")])]


def _embedding_bounds(weight: Any, indices: Any, *_: Any) -> list[tuple[Any, int, int]]:
    return [(indices, 0, weight.shape[0])]


def _index_put_bounds(dest: Any, indices: Sequence[Any], *_: Any, **__: Any) -> list[tuple[Any, int, int]]:
    # index_put wraps negative indices, as ATen does.
    return [(index, -dest.shape[p], dest.shape[p]) for p, index in enumerate(indices) if index is not None]


def _wrapped_key(x: Any, indices: Sequence[Any]) -> tuple[Any, ...]:
    """``indices`` as an MLX key into ``x``, negative indices wrapped, no host reads."""
    return tuple(
        slice(None) if index is None else mx.where(index < 0, index + x.shape[position], index)
        for position, index in enumerate(indices)
    )


def _index_tensor_run(x: Any, indices: Sequence[Any]) -> Any:
    # MLX gathers out of range silently; ATen raises: check on the host first.
    key = _index_put_key(x, indices, "index")
    return x[tuple(mx.array(k) if isinstance(k, np.ndarray) else k for k in key)]


def _index_tensor_trace(x: Any, indices: Sequence[Any]) -> Any:
    return x[_wrapped_key(x, indices)]


def _index_tensor_validate(x: Any, indices: Sequence[Any]) -> None:
    if x is not UNKNOWN and indices is not UNKNOWN and UNKNOWN not in indices:
        _index_put_key(x, indices, "index")


def _index_copy_validate(dest: Any, dim: int, index: Any, *_: Any) -> None:
    if not any(v is UNKNOWN for v in (dest, dim, index)):
        _index_copy_key(dest, dim, index)


def _index_put_validate(dest: Any, indices: Sequence[Any], *_: Any, **__: Any) -> None:
    if dest is not UNKNOWN and indices is not UNKNOWN and UNKNOWN not in indices:
        _index_put_key(dest, indices)


def _index_copy_region(dest: Any, dim: int, index: Any, source: Any) -> Region:
    return Region(_index_copy_key(dest, dim, index), np.asarray(source))


def _index_put_key(dest: Any, indices: Sequence[Any], op: str = "index_put") -> tuple[Any, ...]:
    key: list[Any] = []
    for position, index in enumerate(indices):
        if index is None:
            key.append(slice(None))
            continue
        size = dest.shape[position]
        idx = _to_np_index(index)
        bad = np.flatnonzero(((idx < -size) | (idx >= size)).reshape(-1))
        if bad.size:
            value = int(idx.reshape(-1)[int(bad[0])])
            raise IndexError(f"{op}: index {value} is out of range for dimension {position} of size {size}")
        key.append(np.where(idx < 0, idx + size, idx))
    return tuple(key)


def _index_put_run(dest: Any, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Any:
    key = _index_put_key(dest, indices)
    mx_key = tuple(mx.array(k) if isinstance(k, np.ndarray) else k for k in key)
    if accumulate:
        return dest.at[mx_key].add(values)
    out = mx.array(dest)
    out[mx_key] = values
    return out


def _index_put_region(dest: Any, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Region:
    key = _index_put_key(dest, indices)
    return Region(key, np.asarray(values), accumulate)


_INT32 = 2**31 - 1


def _clamp(bound: Any) -> Any:
    """Bounds such as ``sys.maxsize`` (an open end) clamped to what MLX indexes with."""
    return max(min(bound, _INT32), -_INT32) if isinstance(bound, int) else bound


def _slice_key(rank: int, size: int, dim: int, start: Any, end: Any, step: Any) -> tuple[Any, ...]:
    step = 1 if step is None else step
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        # ATen refuses a step below 1; MLX crashes the process on a zero step.
        raise ValueError(f"slice: step {step!r} must be a positive integer (as ATen requires)")
    for name, bound in (("start", start), ("end", end)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool)):
            raise TypeError(f"slice: {name} {bound!r} must be an integer or None")
    dim = normalize_dim(dim, rank, what="slice dim")
    return (*_prefix(dim), slice(_clamp(start), _clamp(end), step))


def _slice_scatter_run(dest: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None, step: Any = 1) -> Any:
    out = mx.array(dest)
    out[_slice_key(dest.ndim, 0, dim, start, end, step)] = src
    return out


def _slice_scatter_region(
    dest: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None, step: Any = 1
) -> Region:
    return Region(_slice_key(dest.ndim, 0, dim, start, end, step), np.asarray(src))


# -- compute ops --------------------------------------------------------------------


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


def _axes(x: Any, dims: Any, op: str) -> list[int] | None:
    """``dims`` (a list of dims, or ``None`` / ``[]`` for every axis) as MLX axes of ``x``."""
    if dims is None or dims == []:
        return None
    if isinstance(dims, int):
        dims = [dims]
    axes = [normalize_dim(d, x.ndim, what=f"{op} dim") for d in dims]
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: dim {list(dims)} names an axis twice (ATen refuses a repeated dim)")
    return axes


def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    axes = _axes(x, dim, "mean")
    return mx.mean(x, axis=axes, keepdims=keepdim)


def _sum(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    axes = _axes(x, dim, "sum")
    return mx.sum(x, axis=axes, keepdims=keepdim)


def _layer_norm_check(node: torch.fx.Node) -> str | None:
    """``layer_norm(x, normalized_shape, weight, bias, eps)``: literal sizes that are ``x``'s
    last dimensions, a literal eps, floating point throughout."""
    reason = _float_check(node)
    if reason:
        return reason
    shape = node.args[1]
    x = _val(node.args[0])
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
        return "normalized_shape is not a list of literal ints"
    if not isinstance(x, torch.Tensor) or not shape or tuple(x.shape[x.dim() - len(shape) :]) != tuple(shape):
        return f"normalized_shape {list(shape)} is not the input's last dimensions"
    eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    if not isinstance(eps, (int, float)):
        return "eps is not a literal number"
    return None


def _layer_norm(
    x: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None, eps: float = 1e-5, *_: Any
) -> Any:
    """ATen's layer norm: mean and biased variance over the normalized (last) dimensions.
    One normalized dimension with matching weight and bias runs as ``mx.fast.layer_norm``."""
    count = len(normalized_shape)
    shape = tuple(normalized_shape)
    if not 0 < count <= x.ndim or tuple(x.shape[x.ndim - count :]) != shape:
        raise ValueError(f"layer_norm: normalized_shape {list(shape)} is not the last dimensions of input {x.shape}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"layer_norm: {name} of shape {t.shape}, expected normalized_shape {list(shape)}")
    if count == 1:
        return mx.fast.layer_norm(x, weight, bias, float(eps))
    axes = list(range(x.ndim - count, x.ndim))
    mean = mx.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    out = centered * mx.rsqrt(mx.mean(centered * centered, axis=axes, keepdims=True) + eps)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _softmax(x: Any, dim: int, half_to_float: bool = False) -> Any:
    return mx.softmax(x, axis=normalize_dim(dim, x.ndim, what="softmax dim"), precise=True)


def _addmm(bias: Any, a: Any, b: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    prod = a @ b
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias * beta if beta != 1 else bias)


def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    out = x @ weight.T
    return out if bias is None else out + bias


def _slice(x: Any, dim: int = 0, start: Any = None, end: Any = None, step: Any = 1) -> Any:
    return x[_slice_key(x.ndim, 0, dim, start, end, step)]


def _index_select_validate(x: Any, dim: Any, index: Any) -> None:
    if not any(v is UNKNOWN for v in (x, dim, index)):
        dim = normalize_dim(dim, x.ndim, what="index_select dim")
        _in_range(index, "index_select", dim, x.shape[dim], "pass indices in [0, size).")


def _index_select(x: Any, dim: int, index: Any) -> Any:
    # MLX's take reads out of range silently; ATen raises. Evaluating the index
    # here costs one small evaluation, and a bad index never yields a value.
    dim = normalize_dim(dim, x.ndim, what="index_select dim")
    size = x.shape[dim]
    idx = _in_range(index, "index_select", dim, size, "pass indices in [0, size).")
    return mx.take(x, mx.array(idx), axis=dim)


def _select(x: Any, dim: int, index: int) -> Any:
    # MLX reads past the end for an out-of-range integer index (and crashes on a
    # negative one): check it as ATen does.
    dim = normalize_dim(dim, x.ndim, what="select dim")
    size = x.shape[dim]
    if isinstance(index, bool) or not isinstance(index, int) or not -size <= index < size:
        raise IndexError(f"select: index {index!r} is out of range for dimension {dim} of size {size}")
    return x[(*_prefix(dim), index % size)]


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


def _clamp_values(x: Any, lo: Any = None, hi: Any = None) -> Any:
    if lo is not None:
        x = mx.maximum(x, lo)
    return x if hi is None else mx.minimum(x, hi)


def _full_like(x: Any, value: Any, **_: Any) -> Any:
    return mx.full(x.shape, value, dtype=x.dtype)


def _unsqueeze(x: Any, dim: int) -> Any:
    return mx.expand_dims(x, normalize_dim(dim, x.ndim + 1, what="unsqueeze dim"))


def _arange(start: Any, end: Any = None, step: Any = 1, **_: Any) -> Any:
    if end is None:
        start, end = 0, start
    return mx.arange(start, end, step)


def _where(cond: Any, a: Any, b: Any) -> Any:
    return mx.where(cond, a, b)


def _cast(x: Any, dtype: Any = None, **_: Any) -> Any:
    return x if dtype is None else x.astype(dtype)


def _identity(x: Any, *_: Any, **__: Any) -> Any:
    return x


def _embedding_validate(weight: Any, indices: Any, *_: Any) -> None:
    if weight is not UNKNOWN and indices is not UNKNOWN:
        _in_range(indices, "embedding", 0, weight.shape[0], "token ids must be in [0, number of embeddings).")


def _embedding(weight: Any, indices: Any, *_: Any) -> Any:
    # MLX's take reads out of range silently (garbage, or a crash); ATen raises.
    _embedding_validate(weight, indices)
    return mx.take(weight, indices, axis=0)


def _cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    parts = [t for t in tensors if t.size > 0 or t.ndim > 1]
    return mx.concatenate(parts, axis=normalize_dim(dim, parts[0].ndim, what="cat dim"))


def _pow(x: Any, exponent: Any) -> Any:
    if exponent == 2:
        return x * x
    return mx.power(x, exponent)


def _div(a: Any, b: Any, rounding_mode: Any = None) -> Any:
    if rounding_mode == "floor":
        return mx.floor_divide(a, b)
    out = mx.divide(a, b)
    return mx.trunc(out) if rounding_mode == "trunc" else out


def _sdpa(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        # Grouped-query attention: each key/value head serves a group of query heads.
        groups = q.shape[-3] // k.shape[-3]
        k, v = mx.repeat(k, groups, axis=-3), mx.repeat(v, groups, axis=-3)
    scores = (q @ mx.swapaxes(k, -1, -2)) * scale
    if is_causal:
        rows, cols = scores.shape[-2], scores.shape[-1]
        scores = mx.where(mx.tril(mx.ones((rows, cols), dtype=mx.bool_)), scores, -math.inf)
    if attn_mask is not None:
        scores = mx.where(attn_mask, scores, -math.inf) if attn_mask.dtype == mx.bool_ else scores + attn_mask
    return mx.softmax(scores, axis=-1, precise=True) @ v


def _copy(dest: Any, src: Any, non_blocking: bool = False) -> Any:
    """Functional ``aten.copy``: ``src``'s values in ``dest``'s shape and dtype."""
    out = src if src.shape == dest.shape else mx.broadcast_to(src, dest.shape)
    return out if out.dtype == dest.dtype else out.astype(dest.dtype)


def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _gelu_check(node: torch.fx.Node) -> str | None:
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return None if approximate in ("none", "tanh") else f"gelu approximate={approximate!r}"


def _unary(fn: Callable[[Any], Any]) -> OpHandler:
    return OpHandler(_ok, fn)


def _binary_handler(fn: Callable[[Any, Any], Any]) -> OpHandler:
    return OpHandler(_ok, _binary(fn))


_COMPARE = {
    "lt": mx.less,
    "le": mx.less_equal,
    "gt": mx.greater,
    "ge": mx.greater_equal,
    "eq": mx.equal,
    "ne": mx.not_equal,
}

OPS: dict[str, OpHandler] = {
    "aten.embedding.default": OpHandler(
        _literal_ints_check(2),
        _embedding,
        validate=_embedding_validate,
        index_args=(1,),
        trace=_embedding_trace,
        bounds=_embedding_bounds,
    ),
    "aten.mm.default": OpHandler(_float_check, _binary(mx.matmul)),
    "aten.bmm.default": OpHandler(_float_check, _binary(mx.matmul)),
    "aten.matmul.default": OpHandler(_float_check, _binary(mx.matmul)),
    "aten.addmm.default": OpHandler(_float_check, _addmm),
    "aten.linear.default": OpHandler(_float_check, _linear),
    "aten.add.Tensor": _binary_handler(mx.add),
    "aten.add.Scalar": _binary_handler(mx.add),
    "aten.sub.Tensor": _binary_handler(mx.subtract),
    "aten.sub.Scalar": _binary_handler(mx.subtract),
    "aten.rsub.Scalar": OpHandler(_ok, lambda a, b, alpha=1: b - a * alpha),
    "aten.mul.Tensor": _binary_handler(mx.multiply),
    "aten.mul.Scalar": _binary_handler(mx.multiply),
    "aten.div.Tensor": OpHandler(_ok, _div),
    "aten.div.Tensor_mode": OpHandler(_ok, _div),
    "aten.div.Scalar": OpHandler(_ok, _div),
    "aten.pow.Tensor_Scalar": OpHandler(_ok, _pow),
    "aten.pow.Tensor_Tensor": _binary_handler(mx.power),
    "aten.maximum.default": _binary_handler(mx.maximum),
    "aten.minimum.default": _binary_handler(mx.minimum),
    "aten.mean.dim": OpHandler(_ok, _mean),
    "aten.sum.dim_IntList": OpHandler(_ok, _sum),
    "aten.amax.default": OpHandler(
        _ok, lambda x, dim=(), keepdim=False: mx.max(x, axis=_axes(x, list(dim), "amax"), keepdims=keepdim)
    ),
    "aten.any.dim": OpHandler(
        _literal_ints_check(1), lambda x, dim, keepdim=False: mx.any(x, axis=_axes(x, [dim], "any"), keepdims=keepdim)
    ),
    "aten.any.dims": OpHandler(
        _ok,
        lambda x, dim=None, keepdim=False: mx.any(x, axis=_axes(x, dim, "any"), keepdims=keepdim),
    ),
    "aten.clamp.default": OpHandler(_ok, _clamp_values),
    "aten.clamp_min.default": OpHandler(_ok, lambda x, lo: mx.maximum(x, lo)),
    "aten.clamp_max.default": OpHandler(_ok, lambda x, hi: mx.minimum(x, hi)),
    "aten.rsqrt.default": _unary(mx.rsqrt),
    "aten.sqrt.default": _unary(mx.sqrt),
    "aten.exp.default": _unary(mx.exp),
    "aten.cos.default": _unary(mx.cos),
    "aten.gelu.default": OpHandler(_gelu_check, _gelu),
    "aten.sin.default": _unary(mx.sin),
    "aten.log.default": _unary(mx.log),
    "aten.neg.default": _unary(mx.negative),
    "aten.abs.default": _unary(mx.abs),
    "aten.reciprocal.default": _unary(mx.reciprocal),
    "aten.tanh.default": _unary(mx.tanh),
    "aten.sigmoid.default": _unary(mx.sigmoid),
    "aten.silu.default": _unary(lambda x: x * mx.sigmoid(x)),
    "aten.relu.default": _unary(lambda x: mx.maximum(x, 0)),
    "aten.logical_not.default": _unary(mx.logical_not),
    "aten.logical_and.default": _binary_handler(mx.logical_and),
    "aten.logical_or.default": _binary_handler(mx.logical_or),
    "aten.bitwise_and.Tensor": _binary_handler(mx.bitwise_and),
    "aten.bitwise_or.Tensor": _binary_handler(mx.bitwise_or),
    "aten.bitwise_not.default": _unary(mx.bitwise_invert),
    "aten._softmax.default": OpHandler(_literal_ints_check(1), _softmax),
    "aten.softmax.int": OpHandler(_literal_ints_check(1), _softmax),
    "aten.layer_norm.default": OpHandler(_layer_norm_check, _layer_norm),
    "aten.view_copy.default": OpHandler(_ok, _reshape),
    "aten.view.default": OpHandler(_ok, _reshape),
    "aten.reshape.default": OpHandler(_ok, _reshape),
    "aten._unsafe_view.default": OpHandler(_ok, _reshape),
    "aten.permute_copy.default": OpHandler(_ok, _permute),
    "aten.permute.default": OpHandler(_ok, _permute),
    "aten.transpose_copy.int": OpHandler(_literal_ints_check(1, 2), _transpose),
    "aten.transpose.int": OpHandler(_literal_ints_check(1, 2), _transpose),
    "aten.t_copy.default": _unary(lambda x: x.T),
    "aten.expand_copy.default": OpHandler(_ok, _expand),
    "aten.expand.default": OpHandler(_ok, _expand),
    "aten.unsqueeze_copy.default": OpHandler(_ok, _unsqueeze),
    "aten.unsqueeze.default": OpHandler(_ok, _unsqueeze),
    "aten.squeeze_copy.dims": OpHandler(_ok, _squeeze),
    "aten.squeeze_copy.dim": OpHandler(_ok, _squeeze),
    "aten.slice_copy.Tensor": OpHandler(_literal_ints_check(1, 2, 3, 4), _slice),
    "aten.slice.Tensor": OpHandler(_literal_ints_check(1, 2, 3, 4), _slice),
    "aten.select_copy.int": OpHandler(_literal_ints_check(1, 2), _select),
    "aten.cat.default": OpHandler(_literal_ints_check(1), _cat),
    "aten.where.self": OpHandler(_ok, _where),
    "aten.full.default": OpHandler(_ok, _full),
    "aten.full_like.default": OpHandler(_ok, _full_like),
    "aten.scalar_tensor.default": OpHandler(_ok, lambda value, **_: mx.array(value)),
    "aten.arange.start_step": OpHandler(_ok, _arange),
    "aten.arange.default": OpHandler(_ok, _arange),
    "aten.clone.default": OpHandler(_ok, _identity, alias=True),
    "aten.copy.default": OpHandler(_ok, _copy),
    "aten.alias_copy.default": OpHandler(_ok, _identity, alias=True),
    "aten.alias.default": OpHandler(_ok, _identity, alias=True),
    "aten.detach_copy.default": OpHandler(_ok, _identity, alias=True),
    "dim_order_ops._clone_dim_order.default": OpHandler(_ok, _identity, alias=True),
    "aten._to_copy.default": OpHandler(_ok, _cast),
    "dim_order_ops._to_dim_order_copy.default": OpHandler(_ok, _cast),
    "aten.scaled_dot_product_attention.default": OpHandler(_sdpa_check, _sdpa),
    "aten.index_select.default": OpHandler(
        _one_index_check("source"),
        _index_select,
        validate=_index_select_validate,
        index_args=(2,),
        trace=_take_trace,
        bounds=_along_dim_bounds,
    ),
    "aten.index_copy.default": OpHandler(
        _one_index_check("destination"),
        _index_copy_run,
        _index_copy_region,
        _index_copy_validate,
        index_args=(2,),
        trace=_index_copy_trace,
        bounds=_along_dim_bounds,
    ),
    "aten.index.Tensor": OpHandler(
        _index_put_check,
        _index_tensor_run,
        validate=_index_tensor_validate,
        index_args=(1,),
        trace=_index_tensor_trace,
        bounds=_index_put_bounds,
    ),
    "aten.index_put.default": OpHandler(
        _index_put_check,
        _index_put_run,
        _index_put_region,
        _index_put_validate,
        index_args=(1,),
        trace=_index_put_trace,
        bounds=_index_put_bounds,
    ),
    "aten.slice_scatter.default": OpHandler(_literal_ints_check(2, 3, 4, 5), _slice_scatter_run, _slice_scatter_region),
    **{
        f"aten.{name}.{overload}": _binary_handler(fn)
        for name, fn in _COMPARE.items()
        for overload in ("Tensor", "Scalar")
    },
}


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
    x = _val(node.args[0])
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
    reason = _tensor_check(node)
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


# Literal argument types a delegate blob can carry (see ``writeback_mlx_backend.preprocess``).
_LITERALS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _literal_reason(value: Any) -> str | None:
    """Why argument ``value`` cannot be written into a blob, or ``None``."""
    if value is None or isinstance(value, (torch.fx.Node, *_LITERALS)):
        return None
    if isinstance(value, (list, tuple)):
        return next((r for r in map(_literal_reason, value) if r is not None), None)
    return f"argument of type {type(value).__name__}"


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
    reason = _literal_reason([node.args, list(node.kwargs.values())])
    if reason is not None:
        return reason
    try:
        return handler.check(node)
    except (IndexError, KeyError, AttributeError, TypeError) as error:
        return f"unexpected arguments ({type(error).__name__}: {error})"
