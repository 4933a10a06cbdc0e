"""How each functional state write becomes one ``index_put_``: the planners of the state-write pass.

This module holds what :mod:`writeback_passes.reinplace_state_writes` knows of each op of the
table in its docstring (``index_put``, ``index_copy``, ``slice_scatter``, ``select_scatter`` and
the ``where`` that ``torch.export`` spells it as), keyed by aten packet, and
:func:`write_chain`, which follows a state's new value down to the state through those writes.
A planner returns the :class:`Write` it would make (dim, index, values and the shape the kernel
requires of them) or why the kernel cannot make it: an index of the wrong kind, a shape known
only at run time, slice bounds eager would wrap or clamp that the kernel would reject.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from writeback_core.ops import decomposed_from, normalize_dim, normalize_index, packet_name
from writeback_core.partition import DELEGATION_TAG as _TAG

from writeback_passes.graph import arg_value, tensor_value

__all__ = ["IN_PLACE_KERNEL", "Index", "Write", "from_index_copy", "write_chain"]

# The one in-place kernel the rewritten writes call (portable and optimized libraries).
IN_PLACE_KERNEL = "aten::index_put_"

_INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Index:
    """The index tensor of the in-place write: an existing node, or ``arange(start, end, step)``.

    ``wrap`` is the size of the indexed dim when a negative entry of ``node`` counts from
    the end, as eager's ``index_put`` reads it (``index_copy`` rejects negatives, as the
    kernel does): the rewrite inserts ``where(node < 0, node + wrap, node)`` before the write.
    """

    node: torch.fx.Node | None = None
    start: Any = None
    end: Any = None
    step: Any = 1
    wrap: int | None = None


@dataclass(frozen=True)
class Write:
    """One functional write planned as ``index_put_(dest, [None] * dim + [index], values)``.

    ``shape`` is the shape the kernel requires of the values; ``fix`` how ``values``
    gets it: ``None`` (it has it), ``"view"`` (same elements, leading or selected
    size-1 dims added) or ``"expand"`` (broadcast).
    """

    node: torch.fx.Node
    dest: torch.fx.Node
    dim: int
    index: Index
    values: torch.fx.Node
    shape: tuple[Any, ...]
    fix: str | None


def _same(a: Any, b: Any) -> bool:
    """Sizes equal for sure (symbolic sizes compare by expression)."""
    return bool(a == b) if isinstance(a, int) and isinstance(b, int) else str(a) == str(b)


def _fit(values: torch.fx.Node, shape: Sequence[Any]) -> tuple[str | None, str | None]:
    """How ``values`` reaches ``shape``: ``(fix, None)`` or ``(None, reason)``."""
    val = tensor_value(values)
    if val is None:
        return None, f"the values {values.name!r} have no known shape"
    have = list(val.shape)
    if len(have) == len(shape) and all(_same(a, b) for a, b in zip(have, shape, strict=True)):
        return None, None
    if len(have) > len(shape):
        return None, f"values of shape {tuple(have)} do not fit the write's shape {tuple(shape)}"
    if not all(isinstance(s, int) for s in shape):
        return None, f"values of shape {tuple(have)} need reshaping to a shape known only at run time"
    padded = [1] * (len(shape) - len(have)) + have
    if all(_same(a, b) for a, b in zip(padded, shape, strict=True)):
        return "view", None
    if all(_same(a, 1) or _same(a, b) for a, b in zip(padded, shape, strict=True)):
        return "expand", None
    return None, f"values of shape {tuple(have)} do not broadcast to the write's shape {tuple(shape)}"


def _kernel_shape(dest: torch.fx.Node, dim: int, length: Any) -> tuple[Any, ...] | None:
    val = tensor_value(dest)
    if val is None:
        return None
    shape = list(val.shape)
    shape[dim] = length
    return tuple(shape)


def _plan_index_put(node: torch.fx.Node, dest: torch.fx.Node) -> Write | str:
    indices = list(arg_value(node, 1, "indices", []))
    if bool(arg_value(node, 3, "accumulate", False)):
        return "index_put with accumulate=True has no in-place kernel (index_put_ refuses accumulate)"
    present = [k for k, i in enumerate(indices) if i is not None]
    if len(present) != 1:
        return f"index_put with {len(present)} index tensors; the in-place kernel takes exactly one"
    dim = present[0]
    index = indices[dim]
    val = tensor_value(index)
    if not isinstance(index, torch.fx.Node) or val is None or val.dim() != 1 or val.dtype not in _INDEX_DTYPES:
        what = "unknown" if val is None else f"{val.dim()}-d {val.dtype}"
        return f"index_put's index is {what}; the in-place kernel takes one 1-d int64/int32 index tensor"
    state = tensor_value(dest)
    if state is None or dim >= state.dim():
        return f"{dest.name!r} has no known shape"
    if not isinstance(state.shape[dim], int):
        # Eager wraps a negative index by the dim's size; the kernel rejects it.
        return "index_put into a dim whose size is known only at run time; a negative index could not be wrapped"
    wrap = None if from_index_copy(node) else int(state.shape[dim])
    return _finish(node, dest, dim, Index(node=index, wrap=wrap), node.args[2], val.shape[0])


def from_index_copy(node: torch.fx.Node) -> bool:
    """Whether ``index_put`` node ``node`` is a decomposed ``index_copy``: eager's ``index_copy``
    rejects a negative index, as the kernel does, so only an ``index_put`` written as such wraps."""
    return decomposed_from(node, "index_copy")


def _plan_index_copy(node: torch.fx.Node, dest: torch.fx.Node) -> Write | str:
    dim = _dim(arg_value(node, 1, "dim", 0), dest, "index_copy")
    if isinstance(dim, str):
        return dim
    index = arg_value(node, 2, "index", None)
    val = tensor_value(index)
    if not isinstance(index, torch.fx.Node) or val is None or val.dim() != 1 or val.dtype not in _INDEX_DTYPES:
        return "index_copy's index is not one 1-d int64/int32 tensor"
    return _finish(node, dest, dim, Index(node=index), arg_value(node, 3, "source", None), val.shape[0])


def _dim(dim: Any, dest: torch.fx.Node, op: str) -> int | str:
    """``dim`` of a write into ``dest`` in ``[0, rank)`` (eager's rule), or why not."""
    val = tensor_value(dest)
    if val is None:
        return f"{op} into {dest.name!r}, whose rank is unknown"
    try:
        return normalize_dim(dim, val.dim(), what=f"{op} into {dest.name!r}")
    except (IndexError, TypeError) as error:
        return str(error)


def _static_range(start: Any, end: Any, step: Any, size: int) -> tuple[int, int, int]:
    """Python slicing's bounds: negatives wrap once, then clamp to ``[0, size]``."""

    def norm(bound: Any, default: int) -> int:
        if bound is None:
            return default
        value = int(bound)
        if value < 0:
            value += size
        return min(max(value, 0), size)

    first, last = norm(start, 0), norm(end, size)
    return first, max(first, last), int(step)


def _bound(bound: Any) -> str:
    return bound.name if isinstance(bound, torch.fx.Node) else repr(bound)


def _fixed(bound: Any, default: int, size: Any) -> Any:
    """A constant slice bound wrapped and clamped as Python slicing does (``None`` is
    ``default``) when the size is known; a run-time bound, or any bound of a run-time
    size, as it is (``None`` stays ``None``: nothing to index with)."""
    if isinstance(size, int) and (bound is None or isinstance(bound, int)):
        return _static_range(bound, None, 1, size)[0] if bound is not None else default
    return bound


def _within(start: Any, end: Any, size: Any) -> bool:
    """Whether ``0 <= start <= end <= size`` holds for every run the program accepts: bounds
    are ints or symbolic ints whose ranges (``torch._check`` and the like) prove it."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    def value(bound: Any) -> Any:
        return bound.meta.get("val") if isinstance(bound, torch.fx.Node) else bound

    first, last = value(start), value(end)
    if first is None or last is None or not all(isinstance(b, int | torch.SymInt) for b in (first, last)):
        return False
    try:
        return all(statically_known_true(c) for c in (first >= 0, first <= last, last <= size))
    except Exception:  # a symbol without a shape environment: nothing is proved
        return False


def _plan_slice_scatter(node: torch.fx.Node, dest: torch.fx.Node) -> Write | str:
    dim = _dim(arg_value(node, 2, "dim", 0), dest, "slice_scatter")
    if isinstance(dim, str):
        return dim
    start, end, step = arg_value(node, 3, "start", None), arg_value(node, 4, "end", None), arg_value(node, 5, "step", 1)
    val, src = tensor_value(dest), tensor_value(node.args[1])
    if val is None or src is None:
        return "slice_scatter with no known shapes"
    if not isinstance(step, int) or step < 1:
        return f"slice_scatter with step {step!r}; only a positive constant step is written in place"
    size = val.shape[dim]
    bounds = (start, end)
    if isinstance(size, int) and all(b is None or isinstance(b, int) for b in bounds):
        first, last, step = _static_range(start, end, step, size)
        index = Index(start=first, end=last, step=step)
    elif _within(first_bound := _fixed(start, 0, size), last_bound := _fixed(end, size, size), size):
        # Bounds known at run time that the program proves lie in [0, size] (a constant one
        # wrapped and clamped here): nothing is left to clamp, so arange(start, end, step) is
        # the slice eager writes.
        index = Index(start=first_bound, end=last_bound, step=step)
    else:
        return (
            f"slice_scatter into {dest.name!r} with bounds ({_bound(start)}, {_bound(end)}) known only at run "
            f"time that may fall outside [0, {size}]: eager wraps and clamps them, the in-place kernel "
            "would fail the call"
        )
    return _finish(node, dest, dim, index, node.args[1], src.shape[dim])


def _plan_select_scatter(node: torch.fx.Node, dest: torch.fx.Node) -> Write | str:
    dim = _dim(arg_value(node, 2, "dim", 0), dest, "select_scatter")
    if isinstance(dim, str):
        return dim
    position = arg_value(node, 3, "index", None)
    val = tensor_value(dest)
    if not isinstance(position, int):
        return "select_scatter at a position known only at run time"
    if val is None or not isinstance(val.shape[dim], int):
        return f"select_scatter along dim {dim} of {dest.name!r}, whose size is known only at run time"
    size = int(val.shape[dim])
    try:
        position = normalize_index(position, size, what=f"select_scatter into {dest.name!r} along dim {dim}")
    except IndexError as error:
        return str(error)
    return _finish(node, dest, dim, Index(start=position, end=position + 1), node.args[1], 1, select=True)


def _finish(
    node: torch.fx.Node,
    dest: torch.fx.Node,
    dim: int,
    index: Index,
    values: Any,
    length: Any,
    select: bool = False,
) -> Write | str:
    if not isinstance(values, torch.fx.Node):
        return "the values written are not a tensor of the graph"
    shape = _kernel_shape(dest, dim, length)
    if shape is None:
        return f"{dest.name!r} has no known shape"
    if select:
        have = tensor_value(values)
        if not all(isinstance(s, int) for s in shape):
            return "select_scatter into state of a shape known only at run time"
        if have is None or list(have.shape) != [s for k, s in enumerate(shape) if k != dim]:
            return "select_scatter's values do not have the selected slice's shape"
        return Write(node, dest, dim, index, values, shape, "view")
    fix, reason = _fit(values, shape)
    if reason is not None:
        return reason
    dest_val, values_val = tensor_value(dest), tensor_value(values)
    if dest_val is not None and values_val is not None and dest_val.dtype != values_val.dtype:
        return f"values of dtype {values_val.dtype} written into {dest_val.dtype} state"
    return Write(node, dest, dim, index, values, shape, fix)


def _constant_arange(node: object, size: Any) -> bool:
    """Whether ``node`` is ``arange(size)`` (or ``arange(0, size[, 1])``) of the default dtype."""
    if not isinstance(node, torch.fx.Node) or packet_name(node.target) != "arange":
        return False
    bounds = list(node.args)
    if len(bounds) == 1:
        bounds = [0, *bounds]
    dtype = node.kwargs.get("dtype")
    return bounds in ([0, size], [0, size, 1]) and dtype in (None, torch.int64)


def _selected_position(mask: object, dim: int, rank: int, size: Any) -> int | None:
    """``k`` when ``mask`` is ``eq(view(arange(size), [1, .., -1, .., 1]), k)`` (true only at
    position ``k`` of dim ``dim``): how ``select_scatter`` decomposes."""
    if not isinstance(mask, torch.fx.Node) or packet_name(mask.target) != "eq" or len(mask.args) != 2:
        return None
    view, position = mask.args
    if not isinstance(position, int) or not isinstance(view, torch.fx.Node) or packet_name(view.target) != "view_copy":
        return None
    given = view.args[1] if len(view.args) > 1 else None
    shape = list(given) if isinstance(given, (list, tuple)) else []
    if len(shape) != rank or any(s != 1 for k, s in enumerate(shape) if k != dim) or shape[dim] not in (-1, size):
        return None
    return position if _constant_arange(view.args[0], size) else None


def _mask_nodes(mask: object) -> list[object]:
    """The ``eq``, ``view_copy`` and ``arange`` nodes of a ``select_scatter`` mask."""
    view = mask.args[0] if isinstance(mask, torch.fx.Node) and mask.args else None
    source = view.args[0] if isinstance(view, torch.fx.Node) and view.args else None
    return [mask, view, source]


def _plan_where(node: torch.fx.Node, dest: torch.fx.Node) -> Write | str:
    """``where(position == k along dim d, expand(unsqueeze(v, d)), P)``: ``select_scatter``
    as ``torch.export``'s decompositions spell it (``P[.., k, ..] = v``)."""
    refusal = "the new value comes from where, not an indexed write"
    expand = node.args[1] if len(node.args) == 3 else None
    unsqueeze = expand.args[0] if isinstance(expand, torch.fx.Node) and expand.args else None
    val = tensor_value(dest)
    if (
        val is None
        or packet_name(getattr(expand, "target", None)) != "expand_copy"
        or not isinstance(unsqueeze, torch.fx.Node)
        or packet_name(unsqueeze.target) != "unsqueeze_copy"
        or not all(isinstance(s, int) for s in val.shape)
    ):
        return refusal
    axis = unsqueeze.args[1] if len(unsqueeze.args) > 1 else None
    # unsqueeze's dim counts in the rank of its result, which is the state's.
    dim = _dim(axis, dest, "where")
    if isinstance(dim, str):
        return refusal
    size = int(val.shape[dim])
    position = _selected_position(node.args[0], dim, val.dim(), size)
    if position is None or not 0 <= position < size:
        return refusal
    pattern = [expand, unsqueeze, *_mask_nodes(node.args[0])]
    if any(isinstance(n, torch.fx.Node) and isinstance(n.meta.get(_TAG), str) for n in pattern):
        # A delegate that takes part of the pattern hides it from the pass after lowering.
        return "select_scatter's mask or values are computed inside a delegate"
    index = Index(start=position, end=position + 1)
    return _finish(node, dest, dim, index, unsqueeze.args[0], 1, select=True)


# The functional writes this pass makes in place, keyed by aten packet.
_PLANNERS: dict[str, Callable[[torch.fx.Node, torch.fx.Node], Write | str]] = {
    "index_put": _plan_index_put,
    "index_copy": _plan_index_copy,
    "slice_scatter": _plan_slice_scatter,
    "select_scatter": _plan_select_scatter,
    "where": _plan_where,
}

# Which argument a write writes into, where it is not the first (keyed by aten packet).
_DEST_ARG = {"where": 2}


def write_chain(value: object, placeholder: torch.fx.Node) -> list[Write] | str:
    """The writes that build ``value`` from ``placeholder``, innermost first, or why not."""
    writes: list[Write] = []
    current = value
    while current is not placeholder:
        if not isinstance(current, torch.fx.Node) or current.op != "call_function" or not current.args:
            return f"the new value of {placeholder.name!r} is not written into it by an indexed write"
        packet = packet_name(current.target) or ""
        plan = _PLANNERS.get(packet)
        dest = current.args[_DEST_ARG.get(packet, 0)] if len(current.args) > _DEST_ARG.get(packet, 0) else None
        if plan is None or not isinstance(dest, torch.fx.Node):
            if writes:
                return f"{current.name!r} ({packet or current.target}) writes before the indexed writes"
            return (
                f"the new value comes from {packet or current.target}, not an indexed write; "
                f"the stock runtime's only in-place state kernel is {IN_PLACE_KERNEL}"
            )
        planned = plan(current, dest)
        if isinstance(planned, str):
            return planned
        writes.append(planned)
        current = dest
        if len(writes) > 64:
            return "more than 64 chained writes"
    writes.reverse()
    return writes
