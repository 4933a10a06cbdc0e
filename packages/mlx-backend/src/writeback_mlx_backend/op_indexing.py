"""The ops of the MLX delegate that take indices: the writes into part of a destination
(``index_copy``, ``index_put``, ``slice_scatter``), the gathers (``index_select``,
``embedding``, ``index.Tensor``) and the slices (``slice``, ``select``).

A write has a ``region``: where in the destination it lands and what is written, as a
numpy index, so the delegate can write only that region into memory it shares with the
caller instead of building a new array. Every index is checked as ATen checks it (MLX
reads and writes out of range silently): ``validate`` and ``bounds`` on the host before a
traced call, the interpreted ``run`` where it reads the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from writeback_core.ops import normalize_dim

from writeback_mlx_backend.op_checks import index_put_check, literal_ints_check, one_index_check
from writeback_mlx_backend.op_handler import MAX_MLX_INT, UNKNOWN, OpHandler, Region

__all__ = ["INDEXING_OPS", "INDEX_COPY", "INDEX_PUT", "INDEX_WRITES"]

INDEX_COPY = "aten.index_copy.default"
INDEX_PUT = "aten.index_put.default"
# The writes at indices along one axis: what a call can bound and store on the host.
INDEX_WRITES = (INDEX_COPY, INDEX_PUT)


def _to_np_index(index: Any) -> np.ndarray:
    return np.asarray(index).astype(np.int64, copy=False)


def _prefix(dim: int) -> tuple[slice, ...]:
    return (slice(None),) * dim


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


def _clamp(bound: Any) -> Any:
    """Bounds such as ``sys.maxsize`` (an open end) clamped to what MLX indexes with."""
    return max(min(bound, MAX_MLX_INT), -MAX_MLX_INT) if isinstance(bound, int) else bound


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


def _embedding_validate(weight: Any, indices: Any, *_: Any) -> None:
    if weight is not UNKNOWN and indices is not UNKNOWN:
        _in_range(indices, "embedding", 0, weight.shape[0], "token ids must be in [0, number of embeddings).")


def _embedding(weight: Any, indices: Any, *_: Any) -> Any:
    # MLX's take reads out of range silently (garbage, or a crash); ATen raises.
    _embedding_validate(weight, indices)
    return mx.take(weight, indices, axis=0)


INDEXING_OPS: dict[str, OpHandler] = {
    "aten.embedding.default": OpHandler(
        literal_ints_check(2),
        _embedding,
        validate=_embedding_validate,
        index_args=(1,),
        trace=_embedding_trace,
        bounds=_embedding_bounds,
    ),
    "aten.slice_copy.Tensor": OpHandler(literal_ints_check(1, 2, 3, 4), _slice),
    "aten.slice.Tensor": OpHandler(literal_ints_check(1, 2, 3, 4), _slice),
    "aten.select_copy.int": OpHandler(literal_ints_check(1, 2), _select),
    "aten.index_select.default": OpHandler(
        one_index_check("source"),
        _index_select,
        validate=_index_select_validate,
        index_args=(2,),
        trace=_take_trace,
        bounds=_along_dim_bounds,
    ),
    INDEX_COPY: OpHandler(
        one_index_check("destination"),
        _index_copy_run,
        _index_copy_region,
        _index_copy_validate,
        index_args=(2,),
        trace=_index_copy_trace,
        bounds=_along_dim_bounds,
    ),
    "aten.index.Tensor": OpHandler(
        index_put_check,
        _index_tensor_run,
        validate=_index_tensor_validate,
        index_args=(1,),
        trace=_index_tensor_trace,
        bounds=_index_put_bounds,
    ),
    INDEX_PUT: OpHandler(
        index_put_check,
        _index_put_run,
        _index_put_region,
        _index_put_validate,
        index_args=(1,),
        trace=_index_put_trace,
        bounds=_index_put_bounds,
    ),
    "aten.slice_scatter.default": OpHandler(literal_ints_check(2, 3, 4, 5), _slice_scatter_run, _slice_scatter_region),
}
