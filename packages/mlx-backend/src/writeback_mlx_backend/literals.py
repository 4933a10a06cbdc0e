"""A blob's literal dims, indices and sizes, checked at ``init`` against the shapes its steps trace to.

MLX neither checks scatter bounds nor refuses every axis past an array's rank: a dim
written by hand into a blob (``index_copy`` with ``dim=-3`` on a rank-2 cache) would write
along an axis it was never checked against, past the end of the array. So before a
program runs, :func:`check_literals`:

1. gives every input, constant and state a lazy placeholder of its recorded shape (nothing
   is allocated: nothing is evaluated);
2. for each step in blob order, reads the literal arguments its op's rule names (dims,
   indices, sizes) and checks them against its arguments' traced shapes with core's
   :func:`~writeback_core.ops.normalize_dim` and :func:`~writeback_core.ops.normalize_index`
   (eager PyTorch's rules), plus the shape agreements ATen requires where MLX would
   broadcast instead (an ``index_copy`` source, a ``slice_scatter`` source);
3. traces the step lazily to learn its value's shape for the steps after it.

A literal that fails raises :class:`~writeback_core.blob.BlobError` naming the step, its
op, and the dim, index or size with the rank or size it was checked against. A step that
cannot be traced (one reading a scalar input, which has no static value) has no traced
value: it, and every step reading its value, is checked when it runs, by the same helpers
inside each op; the walk goes on with the steps that do not depend on it.

Example it must refuse: ``index_copy(cache, -3, pos, row)`` on a ``[4, 3]`` cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import BlobError, resolve
from writeback_core.ops import normalize_dim, normalize_index

from writeback_mlx_backend._steps import Step, call, refs, resolve_kwargs
from writeback_mlx_backend.delegate_program import DELEGATE
from writeback_mlx_backend.op_handler import MAX_MLX_INT, mlx_dtype

__all__ = ["LITERAL_RULES", "check_literals"]

# ``rule(args, kwargs)`` raises (IndexError, ValueError or TypeError) on a literal the
# op's arguments' traced shapes rule out; ``args`` hold lazy arrays and literals.
Rule = Callable[[Sequence[Any], Mapping[str, Any]], None]


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], position: int, name: str, default: Any = None) -> Any:
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def _array(value: Any, what: str) -> Any:
    if not isinstance(value, mx.array):
        raise TypeError(f"{what} must be a tensor, got {type(value).__name__}")
    return value


def _one_dim(op: str, position: int = 1, name: str = "dim", extra: int = 0, default: Any = None) -> Rule:
    """``op(x, dim, ...)``: ``dim`` one of ``x``'s axes (``extra`` more for ``unsqueeze``)."""

    def rule(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _array(_arg(args, kwargs, 0, "self"), f"{op} input")
        normalize_dim(_arg(args, kwargs, position, name, default), x.ndim + extra, what=f"{op} {name}")

    return rule


def _dim_list(op: str, name: str = "dim", default: Any = None) -> Rule:
    """``op(x, [dims], ...)``: each dim one of ``x``'s axes, none twice (``None`` or ``[]``: all)."""

    def rule(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _array(_arg(args, kwargs, 0, "self"), f"{op} input")
        dims = _arg(args, kwargs, 1, name, default)
        if dims is None:
            return
        if isinstance(dims, int):
            dims = [dims]
        if not isinstance(dims, list):
            raise TypeError(f"{op} {name}: expected a list of ints, got {dims!r}")
        axes = [normalize_dim(d, x.ndim, what=f"{op} {name}") for d in dims]
        if len(set(axes)) != len(axes):
            raise ValueError(f"{op} {name}: {dims} names an axis twice")

    return rule


def _slice_bounds(op: str, x: Any, dim: Any, start: Any, end: Any, step: Any) -> int:
    axis = normalize_dim(dim, x.ndim, what=f"{op} dim")
    step = 1 if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{op}: step {step!r} must be a positive int (as ATen requires)")
    for name, bound in (("start", start), ("end", end)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise TypeError(f"{op}: {name} {bound!r} must be an int or None")
    size = x.shape[axis]
    return len(range(*slice(start, end, step).indices(size)))


def _slice(op: str) -> Rule:
    def rule(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _array(_arg(args, kwargs, 0, "self"), f"{op} input")
        _slice_bounds(op, x, *(_arg(args, kwargs, p, n, d) for p, n, d in _SLICE_ARGS))

    return rule


_SLICE_ARGS = ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1))


def _slice_scatter(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    dest = _array(_arg(args, kwargs, 0, "self"), "slice_scatter destination")
    src = _array(_arg(args, kwargs, 1, "src"), "slice_scatter source")
    bounds = [_arg(args, kwargs, p + 1, n, d) for p, n, d in _SLICE_ARGS]
    count = _slice_bounds("slice_scatter", dest, *bounds)
    axis = normalize_dim(bounds[0], dest.ndim)
    expected = [*dest.shape[:axis], count, *dest.shape[axis + 1 :]]
    if list(src.shape) != expected:
        raise ValueError(f"slice_scatter: source of shape {list(src.shape)}, expected {expected}")


def _select(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "self"), "select input")
    axis = normalize_dim(_arg(args, kwargs, 1, "dim"), x.ndim, what="select dim")
    normalize_index(_arg(args, kwargs, 2, "index"), x.shape[axis], what=f"select index along dim {axis}")


def _index_along(op: str) -> Rule:
    """``op(x, dim, index, ...)``: ``dim`` an axis of ``x``, ``index`` at most 1-D; for
    ``index_copy``, a source of ``x``'s shape with ``len(index)`` along ``dim``."""

    def rule(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _array(_arg(args, kwargs, 0, "self"), f"{op} input")
        axis = normalize_dim(_arg(args, kwargs, 1, "dim"), x.ndim, what=f"{op} dim")
        index = _array(_arg(args, kwargs, 2, "index"), f"{op} index")
        if index.ndim > 1:
            raise ValueError(f"{op}: index of rank {index.ndim}, expected at most 1")
        if op == "index_copy":
            source = _array(_arg(args, kwargs, 3, "source"), "index_copy source")
            expected = [*x.shape[:axis], index.size, *x.shape[axis + 1 :]]
            if list(source.shape) != expected and not (source.ndim == 0 and x.ndim == 0):
                raise ValueError(f"index_copy: source of shape {list(source.shape)}, expected {expected}")

    return rule


def _indices(op: str) -> Rule:
    """``op(x, [indices], ...)``: no more index tensors than ``x`` has axes."""

    def rule(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _array(_arg(args, kwargs, 0, "self"), f"{op} input")
        indices = _arg(args, kwargs, 1, "indices")
        if not isinstance(indices, list) or len(indices) > x.ndim:
            count = len(indices) if isinstance(indices, list) else indices
            raise IndexError(f"{op}: {count} indices for a tensor of rank {x.ndim}")

    return rule


def _cat(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    tensors = _arg(args, kwargs, 0, "tensors")
    if not isinstance(tensors, list) or not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    parts = [_array(t, "cat part") for t in tensors]
    # ATen skips 1-D empty parts (a legacy rule); every other part has the first's rank.
    kept = [t for t in parts if t.size > 0 or t.ndim > 1] or parts[:1]
    axis = normalize_dim(_arg(args, kwargs, 1, "dim", 0), kept[0].ndim, what="cat dim")
    for part in kept[1:]:
        same = part.ndim == kept[0].ndim and all(
            a == b for i, (a, b) in enumerate(zip(part.shape, kept[0].shape, strict=True)) if i != axis
        )
        if not same:
            raise ValueError(
                f"cat: part of shape {list(part.shape)} does not match {list(kept[0].shape)} off dim {axis}"
            )


def _permute(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "self"), "permute input")
    dims = _arg(args, kwargs, 1, "dims")
    if not isinstance(dims, list) or len(dims) != x.ndim:
        raise IndexError(f"permute: dims {dims!r} for a tensor of rank {x.ndim}")
    axes = [normalize_dim(d, x.ndim, what="permute dim") for d in dims]
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"permute: dims {dims} name an axis twice")


def _transpose(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "self"), "transpose input")
    normalize_dim(_arg(args, kwargs, 1, "dim0"), x.ndim, what="transpose dim0")
    normalize_dim(_arg(args, kwargs, 2, "dim1"), x.ndim, what="transpose dim1")


def _sizes(value: Any, op: str, low: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise TypeError(f"{op}: size {value!r} must be a list of ints")
    for position, size in enumerate(value):
        if size < low:
            raise ValueError(f"{op}: size {size} at dimension {position} of {value}")
    return value


def _expand(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "self"), "expand input")
    size = _sizes(_arg(args, kwargs, 1, "size"), "expand", -1)
    lead = len(size) - x.ndim
    if lead < 0:
        raise IndexError(f"expand: size {size} has {len(size)} dimensions, the input has rank {x.ndim}")
    for position, s in enumerate(size):
        have = x.shape[position - lead] if position >= lead else None
        if s == -1 and have is None:
            raise ValueError(f"expand: size -1 at new leading dimension {position} of {size}")
        if have is not None and s != -1 and have not in (1, s):
            raise ValueError(f"expand: size {s} at dimension {position} where the input has {have}")


def _view(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "self"), "view input")
    size = _sizes(_arg(args, kwargs, 1, "size"), "view", -1)
    if size.count(-1) > 1:
        raise ValueError(f"view: size {size} infers more than one dimension")
    known = math.prod(s for s in size if s != -1)
    fits = known > 0 and x.size % known == 0 if -1 in size else x.size == known
    if not fits:
        raise ValueError(f"view: size {size} does not hold the input's {x.size} elements")


def _full(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    size = _sizes(_arg(args, kwargs, 0, "size"), "full", 0)
    if math.prod(size) > MAX_MLX_INT:
        raise ValueError(f"full: size {size} holds more than {MAX_MLX_INT} elements")


def _arange(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    values = [_arg(args, kwargs, p, n, d) for p, n, d in ((0, "start", 0), (1, "end", None), (2, "step", 1))]
    if len(args) < 2 and "end" not in kwargs:
        values = [0, values[0], 1]
    start, end, step = values
    for name, value in (("start", start), ("end", end), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"arange: {name} {value!r} must be a finite number")
    if step == 0:
        raise ValueError("arange: step must be nonzero (as ATen requires)")
    count = math.ceil((end - start) / step)
    if count < 0:
        raise ValueError(f"arange: end {end} is on the wrong side of start {start} for step {step}")
    if count > MAX_MLX_INT:
        raise ValueError(f"arange: {count} elements, more than {MAX_MLX_INT}")


def _embedding(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    weight = _array(_arg(args, kwargs, 0, "weight"), "embedding weight")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight of rank {weight.ndim}, expected 2")


def _layer_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _array(_arg(args, kwargs, 0, "input"), "layer_norm input")
    shape = _sizes(_arg(args, kwargs, 1, "normalized_shape"), "layer_norm", 0)
    if not 0 < len(shape) <= x.ndim or list(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(f"layer_norm: normalized_shape {shape} is not the last dimensions of input {tuple(x.shape)}")
    for position, name in ((2, "weight"), (3, "bias")):
        t = _arg(args, kwargs, position, name)
        if t is not None and list(_array(t, f"layer_norm {name}").shape) != shape:
            raise ValueError(f"layer_norm: {name} of shape {tuple(t.shape)}, expected normalized_shape {shape}")


LITERAL_RULES: dict[str, Rule] = {
    "aten.embedding.default": _embedding,
    "aten.index_copy.default": _index_along("index_copy"),
    "aten.index_select.default": _index_along("index_select"),
    "aten.index.Tensor": _indices("index"),
    "aten.index_put.default": _indices("index_put"),
    "aten.slice_copy.Tensor": _slice("slice"),
    "aten.slice.Tensor": _slice("slice"),
    "aten.slice_scatter.default": _slice_scatter,
    "aten.select_copy.int": _select,
    "aten.cat.default": _cat,
    "aten._softmax.default": _one_dim("softmax"),
    "aten.softmax.int": _one_dim("softmax"),
    "aten.any.dim": _one_dim("any"),
    "aten.any.dims": _dim_list("any"),
    "aten.amax.default": _dim_list("amax", default=[]),
    "aten.sum.dim_IntList": _dim_list("sum"),
    "aten.mean.dim": _dim_list("mean"),
    "aten.squeeze_copy.dims": _dim_list("squeeze"),
    "aten.squeeze_copy.dim": _one_dim("squeeze"),
    "aten.unsqueeze_copy.default": _one_dim("unsqueeze", extra=1),
    "aten.unsqueeze.default": _one_dim("unsqueeze", extra=1),
    "aten.transpose_copy.int": _transpose,
    "aten.transpose.int": _transpose,
    "aten.permute_copy.default": _permute,
    "aten.permute.default": _permute,
    "aten.expand_copy.default": _expand,
    "aten.expand.default": _expand,
    "aten.view_copy.default": _view,
    "aten.view.default": _view,
    "aten.reshape.default": _view,
    "aten._unsafe_view.default": _view,
    "aten.full.default": _full,
    "aten.arange.default": _arange,
    "aten.arange.start_step": _arange,
    "aten.layer_norm.default": _layer_norm,
}


class _Scalar:
    """A scalar input's placeholder: it has no static value, so no literal rule accepts it."""

    def __repr__(self) -> str:
        return "a scalar input"


def _shape(shape: Any, where: str) -> list[int]:
    """``shape`` as MLX can take it: a list of ints in ``[0, 2**31)``, else :class:`BlobError`."""
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_MLX_INT for n in shape
    ):
        raise BlobError(DELEGATE, f"{where}.shape", shape, f"each side must be an int in [0, {MAX_MLX_INT}]")
    return list(shape)


def _placeholder(name: str, meta: Mapping[str, Any]) -> Any:
    if "scalar" in meta:
        return _Scalar()
    return mx.zeros(_shape(meta["shape"], f"input_meta[{name!r}]"), dtype=mlx_dtype(meta["dtype"]))


def check_literals(
    steps: Sequence[Step],
    inputs: Mapping[str, Mapping[str, Any]],
    records: Mapping[str, tuple[Sequence[int], str]],
) -> None:
    """Check each step's literals against its arguments' traced shapes (module docstring).

    ``steps`` are the blob's nodes in order (``steps[i]`` is ``nodes[i]``); ``inputs`` each
    input's ``input_meta``; ``records`` each constant's and state's shape and dtype name.

    :raises BlobError: naming ``nodes[i]``, the step and its op, and the rule that failed.
    """
    env: dict[str, Any] = {name: _placeholder(name, meta) for name, meta in inputs.items()}
    for name, (shape, dtype) in records.items():
        env[name] = mx.zeros(_shape(shape, f"records[{name!r}]"), dtype=mlx_dtype(dtype))
    untraced: set[str] = set()
    for position, step in enumerate(steps):
        if untraced & set(refs((step.args, step.kwargs))):
            untraced.add(step.name)  # its arguments have no traced value: checked when it runs
            continue
        args = resolve(step.args, env)
        kwargs = resolve_kwargs(step.kwargs, env)
        rule = LITERAL_RULES.get(step.op)
        if rule is not None:
            try:
                rule(args, kwargs)
            except (IndexError, ValueError, TypeError) as error:
                raise BlobError(
                    DELEGATE, f"nodes[{position}]", step.name, f"{step.op}: {error}; nothing was run"
                ) from None
        try:
            env[step.name] = call(step, args, kwargs, traced=True)
        except ValueError as error:
            message = str(error)
            if message.startswith("[") and "shape" in message.lower():
                # MLX builds the graph lazily but works out every shape now: arguments whose
                # traced shapes do not fit the op (a reference renamed, a shape changed).
                raise BlobError(
                    DELEGATE,
                    f"nodes[{position}]",
                    step.name,
                    f"{step.op}: its arguments' shapes do not fit the op ({message}); nothing was run",
                ) from None
            untraced.add(step.name)  # the step's own checks raise again when it runs
        except TypeError:
            # An argument with no static value (a scalar input): checked when it runs.
            untraced.add(step.name)
