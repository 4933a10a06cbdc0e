"""Write state in place with a kernel every stock ExecuTorch runtime links, and drop its copy.

exir writes a mutated buffer or user input back whole: ``new = index_put(P, ...)``
computes a full new copy of ``P`` and ``copy_(P, new)`` copies it back, every call.
ExecuTorch 1.5.1's kernel libraries (portable and optimized) link exactly two
in-place kernels that can write into state: ``aten::copy_`` and ``aten::index_put_``
(the special case: one 1-D ``Long``/``Int`` index tensor, values shaped like the
state except along the indexed dim, every index checked to lie in ``[0, size)``
before anything is written). The runtime has no view of a slice, so a write into
a slice cannot be a ``copy_`` into a view; it becomes ``index_put_`` with an
``arange`` index instead (``arange.start_out`` is linked too). This pass turns
each functional state write into that one kernel:

========================================  =================================================
functional write (edge dialect)           in-place form
========================================  =================================================
``index_put(P, [None, .., i], v)``        ``index_put_(P, [None, .., i], v')``
``index_copy(P, d, i, v)``                ``index_put_(P, [None] * d + [i], v)``
``slice_scatter(P, v, d, a, b, s)``       ``index_put_(P, [None] * d + [arange(a, b, s)], v)``
``select_scatter(P, v, d, k)``            ``index_put_(P, [None] * d + [arange(k, k+1)], v'')``
========================================  =================================================

A negative ``i`` of ``index_put`` is wrapped first (``where(i < 0, i + size, i)``), as
eager wraps it. ``v'`` is ``v`` reshaped (a view once exir replaces view copies) or broadcast
(``expand_copy``, the size of the write) to the shape the kernel requires; ``v''``
is ``v`` with the selected dim put back as size 1. A ``copy_`` into a slice or a
``narrow`` is a ``slice_scatter`` by the time exir sees it. Each ``aten.index_put``
has 1-D index ``i``; ``index_put`` with several index tensors, a boolean mask,
``accumulate``, or a full overwrite has no in-place kernel and keeps its copy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass
from writeback_core.ops import decomposed_from, normalize_dim, normalize_index, packet_name, write_back_copies
from writeback_core.partition import DELEGATION_TAG as _TAG
from writeback_core.registry import InPlaceDecision

from writeback_passes.early_write_back import _Storage
from writeback_passes.graph import arg_value, tensor_value

__all__ = [
    "IN_PLACE_KERNEL",
    "KeptStateWrite",
    "ReinplacedStateWrite",
    "StateWriteReport",
    "in_place_kernel_refusal",
    "reinplace_state_writes",
    "state_writes_pass",
]

# The one in-place kernel the rewritten writes call (portable and optimized libraries).
IN_PLACE_KERNEL = "aten::index_put_"

_INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class _Index:
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
class _Write:
    """One functional write planned as ``index_put_(dest, [None] * dim + [index], values)``.

    ``shape`` is the shape the kernel requires of the values; ``fix`` how ``values``
    gets it: ``None`` (it has it), ``"view"`` (same elements, leading or selected
    size-1 dims added) or ``"expand"`` (broadcast).
    """

    node: torch.fx.Node
    dest: torch.fx.Node
    dim: int
    index: _Index
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


def _plan_index_put(node: torch.fx.Node, dest: torch.fx.Node) -> _Write | str:
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
    wrap = None if _from_index_copy(node) else int(state.shape[dim])
    return _finish(node, dest, dim, _Index(node=index, wrap=wrap), node.args[2], val.shape[0])


def _from_index_copy(node: torch.fx.Node) -> bool:
    """Whether ``index_put`` node ``node`` is a decomposed ``index_copy``: eager's ``index_copy``
    rejects a negative index, as the kernel does, so only an ``index_put`` written as such wraps."""
    return decomposed_from(node, "index_copy")


def _plan_index_copy(node: torch.fx.Node, dest: torch.fx.Node) -> _Write | str:
    dim = _dim(arg_value(node, 1, "dim", 0), dest, "index_copy")
    if isinstance(dim, str):
        return dim
    index = arg_value(node, 2, "index", None)
    val = tensor_value(index)
    if not isinstance(index, torch.fx.Node) or val is None or val.dim() != 1 or val.dtype not in _INDEX_DTYPES:
        return "index_copy's index is not one 1-d int64/int32 tensor"
    return _finish(node, dest, dim, _Index(node=index), arg_value(node, 3, "source", None), val.shape[0])


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


def _plan_slice_scatter(node: torch.fx.Node, dest: torch.fx.Node) -> _Write | str:
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
        index = _Index(start=first, end=last, step=step)
    elif _within(first_bound := _fixed(start, 0, size), last_bound := _fixed(end, size, size), size):
        # Bounds known at run time that the program proves lie in [0, size] (a constant one
        # wrapped and clamped here): nothing is left to clamp, so arange(start, end, step) is
        # the slice eager writes.
        index = _Index(start=first_bound, end=last_bound, step=step)
    else:
        return (
            f"slice_scatter into {dest.name!r} with bounds ({_bound(start)}, {_bound(end)}) known only at run "
            f"time that may fall outside [0, {size}]: eager wraps and clamps them, the in-place kernel "
            "would fail the call"
        )
    return _finish(node, dest, dim, index, node.args[1], src.shape[dim])


def _plan_select_scatter(node: torch.fx.Node, dest: torch.fx.Node) -> _Write | str:
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
    return _finish(node, dest, dim, _Index(start=position, end=position + 1), node.args[1], 1, select=True)


def _finish(
    node: torch.fx.Node,
    dest: torch.fx.Node,
    dim: int,
    index: _Index,
    values: Any,
    length: Any,
    select: bool = False,
) -> _Write | str:
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
        return _Write(node, dest, dim, index, values, shape, "view")
    fix, reason = _fit(values, shape)
    if reason is not None:
        return reason
    dest_val, values_val = tensor_value(dest), tensor_value(values)
    if dest_val is not None and values_val is not None and dest_val.dtype != values_val.dtype:
        return f"values of dtype {values_val.dtype} written into {dest_val.dtype} state"
    return _Write(node, dest, dim, index, values, shape, fix)


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


def _plan_where(node: torch.fx.Node, dest: torch.fx.Node) -> _Write | str:
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
    index = _Index(start=position, end=position + 1)
    return _finish(node, dest, dim, index, unsqueeze.args[0], 1, select=True)


# The functional writes this pass makes in place, keyed by aten packet.
_PLANNERS: dict[str, Callable[[torch.fx.Node, torch.fx.Node], _Write | str]] = {
    "index_put": _plan_index_put,
    "index_copy": _plan_index_copy,
    "slice_scatter": _plan_slice_scatter,
    "select_scatter": _plan_select_scatter,
    "where": _plan_where,
}

# Which argument a write writes into, where it is not the first (keyed by aten packet).
_DEST_ARG = {"where": 2}


def _chain(value: object, placeholder: torch.fx.Node) -> list[_Write] | str:
    """The writes that build ``value`` from ``placeholder``, innermost first, or why not."""
    writes: list[_Write] = []
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


def _hazard(
    writes: Sequence[_Write],
    placeholder: torch.fx.Node,
    storage: _Storage,
    after: Callable[[torch.fx.Node, torch.fx.Node], bool],
    ignored: frozenset[torch.fx.Node],
) -> str | None:
    """Why writing ``writes`` in place would change a result, or ``None``.

    The alias analysis lets a delegate call's results alias its arguments; here they
    do not: a delegate writes its results into outputs the runtime allocated (one
    it writes in place has no reader left: ``reinplace_delegate_input_mutations``).
    """
    state = {n for n in storage.members(placeholder) if not _delegate_result(n)}
    for write in writes:
        state |= {n for n in storage.members(write.node) if not _delegate_result(n)}
    for write in writes:
        inputs = [write.values, *(n for n in write.node.all_input_nodes if n is not write.dest)]
        shared = list(dict.fromkeys(n.name for n in inputs if n in state))
        if shared:
            return (
                f"{write.node.name!r} writes {placeholder.name!r} from {', '.join(shared)}, which may "
                "share its storage: an in-place write would overlap what it reads"
            )
        for old in storage.members(write.dest):
            if _delegate_result(old):
                continue
            for reader in old.users:
                if reader is write.node or reader in ignored or reader.op == "output":
                    continue
                if after(reader, write.node):
                    return (
                        f"{reader.name!r} reads the old value of {placeholder.name!r} (through "
                        f"{old.name!r}) after {write.node.name!r} writes it; writing in place "
                        "would change what it reads"
                    )
    return None


def _delegate_result(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``getitem(executorch_call_delegate(...), j)``."""
    from executorch.exir.delegate import executorch_call_delegate

    source = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(source, torch.fx.Node) and source.target is executorch_call_delegate


def _order(graph: torch.fx.Graph) -> Callable[[torch.fx.Node, torch.fx.Node], bool]:
    """``after(reader, write)``: whether ``reader`` runs after ``write``.

    Graph order, except for a node a delegation partition takes (before
    lowering): the partition runs as one delegate call, which exir places at
    the partition's first node unless one of its nodes depends on ``write``;
    so the node runs after ``write`` when any node of its partition depends on
    ``write``, or when it comes after ``write`` itself.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    members: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        tag = node.meta.get(_TAG)
        if node.op == "call_function" and isinstance(tag, str):
            members.setdefault(tag, []).append(node)
    downstream: dict[torch.fx.Node, set[torch.fx.Node]] = {}

    def depends(write: torch.fx.Node) -> set[torch.fx.Node]:
        found = downstream.get(write)
        if found is None:
            found, frontier = set(), [write]
            while frontier:
                for user in frontier.pop().users:
                    if user not in found:
                        found.add(user)
                        frontier.append(user)
            downstream[write] = found
        return found

    def after(reader: torch.fx.Node, write: torch.fx.Node) -> bool:
        if order[reader] > order[write]:
            return True
        tag = reader.meta.get(_TAG)
        if reader.op != "call_function" or not isinstance(tag, str) or tag not in members:
            return False
        return any(n in depends(write) for n in members[tag])

    return after


def _plan(
    graph: torch.fx.Graph,
    placeholder: torch.fx.Node,
    value: object,
    ignored: Iterable[torch.fx.Node] = (),
    storage: _Storage | None = None,
) -> list[_Write] | str:
    value, peeled = _peel_copy(value, placeholder)
    writes = _chain(value, placeholder)
    if isinstance(writes, str):
        return writes
    if isinstance(placeholder.meta.get(_TAG), str):
        return f"{placeholder.name!r} is consumed into a delegate as constant data"
    storage = storage if storage is not None else _Storage(graph)
    reason = _hazard(writes, placeholder, storage, _order(graph), frozenset([*ignored, *peeled]))
    return reason if reason is not None else writes


def in_place_kernel_refusal(graph: torch.fx.Graph, placeholder: str, value: str) -> str | None:
    """Why the state write that makes node ``value`` from placeholder ``placeholder`` of
    ``graph`` cannot be made in place with the stock runtime's kernels, or ``None`` when it can.

    The one rule of this pass: ``writeback_accepts_in_place`` answers the
    ``portable`` and ``xnnpack`` backends with it at partition time, ``writeback
    explain`` states it, and :func:`reinplace_state_writes` applies it again to the
    final graph. Works on an edge or aten program (after ``run_decompositions()``),
    partitioned or not: a node a delegation partition takes counts as read at the
    partition's last node.
    """
    nodes = {n.name: n for n in graph.nodes}
    if placeholder not in nodes or value not in nodes:
        return f"the graph has no node {placeholder!r} or {value!r}"
    planned = _plan(graph, nodes[placeholder], nodes[value])
    return planned if isinstance(planned, str) else None


@dataclass(frozen=True)
class ReinplacedStateWrite:
    """A state written in place: ``writes`` (functional write nodes) became ``index_put_``."""

    placeholder: str
    writes: tuple[str, ...]


@dataclass(frozen=True)
class KeptStateWrite:
    """The write-back of an accepted state write that had to stay, and why."""

    placeholder: str
    reason: str


@dataclass
class StateWriteReport:
    """What :func:`reinplace_state_writes` did to one graph (usable as an exir ``PassResult``)."""

    graph_module: torch.fx.GraphModule
    reinplaced: list[ReinplacedStateWrite] = field(default_factory=list)
    kept: list[KeptStateWrite] = field(default_factory=list)
    guarded: list[str] = field(default_factory=list)  # decomposed index_copy nodes made to reject negatives

    @property
    def modified(self) -> bool:
        return bool(self.reinplaced or self.guarded)


def _edge(name: str) -> Any:
    from executorch.exir.dialects._ops import ops as exir_ops

    packet, overload = name.split(".")
    return getattr(getattr(exir_ops.edge.aten, packet), overload)


def _fake_mode(graph: torch.fx.Graph) -> Any:
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


def _rewrite(graph: torch.fx.Graph, writes: Sequence[_Write], placeholder: torch.fx.Node, fake: Any) -> torch.fx.Node:
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


def _peel_copy(value: object, placeholder: torch.fx.Node) -> tuple[object, list[torch.fx.Node]]:
    """Follow functional ``aten.copy(placeholder, x)`` nodes down to the value written."""
    chain: list[torch.fx.Node] = []
    while (
        isinstance(value, torch.fx.Node)
        and packet_name(value.target) == "copy"
        and value.args
        and value.args[0] is placeholder
    ):
        chain.append(value)
        value = value.args[1]
    return value, chain


def reinplace_state_writes(program: ExportedProgram | torch.fx.GraphModule) -> StateWriteReport:
    """Make accepted state writes in place with ``index_put_`` and drop their write-backs.

    Runs after exir inserted its write-backs (``to_executorch``'s
    ``before_memory_planning`` stage), before early write-back. Algorithm, per
    write-back ``copy_(P, value)`` where ``P`` is a mutable buffer or a mutated
    user input:

    1. Skip unless core recorded on ``P`` an accepted in-place decision
       (``writeback_accepts_in_place``, answered for the ``portable`` and
       ``xnnpack`` backends with :func:`in_place_kernel_refusal`).
    2. Peel functional ``aten.copy(P, x)`` nodes; follow ``value``'s first
       argument down to ``P`` through writes of the table in the module
       docstring (several writes into one state chain). Anything else keeps
       the copy.
    3. Refuse (keep the copy, report why) when a node after a write reads the
       value that write overwrites (``P`` or an earlier write of the chain)
       through any alias, ``view_copy`` included (exir turns those into views
       later); when the values or index of a write may share ``P``'s storage
       (the write would overlap what it reads); when ``P`` was consumed into a
       delegate as constant data.
    4. Otherwise insert, before each write, its index (an existing tensor, or
       ``arange``) and its values' reshape or broadcast, replace the write by
       ``index_put_`` into the previous one (``P`` for the first), point every
       reader at it and replace the copy by the last in-place node. Indices
       read as eager reads them: ``index_put``'s index gets
       ``where(i < 0, i + size, i)`` first (eager wraps a negative position; a
       decomposed ``index_copy`` does not, as eager's rejects one); constant
       slice bounds are wrapped and clamped here; a slice bound known only at
       run time is written in place only where the program proves it lies in
       ``[0, size]``. Beyond that nothing is assumed: the kernel checks every
       index before it writes (measured on ExecuTorch 1.5.1's portable
       library), and an index eager rejects fails the call with the state
       unchanged.
    5. Every functional ``index_put`` left that is a decomposed ``index_copy``
       (a copy kept, or no state at all) gets ``where(i < 0, i - size, i)``:
       its ``index_put.out`` kernel would wrap a negative index that eager's
       ``index_copy`` rejects; moved below ``-size``, the kernel rejects it too.

    Example it must refuse::

        new = index_put(cache, [None, None, pos], v)   # the write
        y = cache.sum()                                # reads the OLD cache
        cache.copy_(new)                               # the write-back

    :return: the states written in place and the accepted ones kept, with reasons.
    """
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = StateWriteReport(gm)
    copies = [c for c in write_back_copies(graph) if _accepted(c)]
    if copies:
        _reinplace(graph, copies, report)
    report.guarded.extend(_guard_index_copies(graph))
    if report.modified:
        graph.lint()
        gm.recompile()
    return report


def _reinplace(graph: torch.fx.Graph, copies: Sequence[torch.fx.Node], report: StateWriteReport) -> None:
    storage = _Storage(graph)
    plans: list[tuple[torch.fx.Node, torch.fx.Node, list[_Write], list[torch.fx.Node]]] = []
    for copy in copies:
        placeholder = copy.args[0]
        assert isinstance(placeholder, torch.fx.Node)
        value, peeled = _peel_copy(copy.args[1], placeholder)
        planned = _plan(graph, placeholder, value, ignored={copy, *peeled}, storage=storage)
        if isinstance(planned, str):
            report.kept.append(KeptStateWrite(placeholder.name, planned))
            continue
        plans.append((copy, placeholder, planned, peeled))
    fake = _fake_mode(graph)
    for copy, placeholder, writes, peeled in plans:
        last = _rewrite(graph, writes, placeholder, fake)
        copy.replace_all_uses_with(last)
        graph.erase_node(copy)
        for node in reversed(peeled):
            if not node.users:
                graph.erase_node(node)
        report.reinplaced.append(ReinplacedStateWrite(placeholder.name, tuple(w.node.name for w in writes)))


def _guard_index_copies(graph: torch.fx.Graph) -> list[str]:
    """Make each functional ``index_put`` that is a decomposed ``index_copy`` reject a negative
    index, as eager's ``index_copy`` does: the ``index_put.out`` kernel wraps one, so a copy kept
    (or an ``index_copy`` of no state) would write position ``size - 1`` where eager raises.
    ``where(i < 0, i - size, i)`` leaves every index eager accepts as it is and moves a negative
    one below ``-size``, which the kernel rejects before the write-back touches the state.
    Returns the guarded nodes' names."""
    fake = None
    guarded = []
    for node in list(graph.nodes):
        if node.op != "call_function" or packet_name(node.target) != "index_put" or not _from_index_copy(node):
            continue
        indices = list(arg_value(node, 1, "indices", []))
        present = [k for k, i in enumerate(indices) if i is not None]
        state, index = tensor_value(node.args[0]), indices[present[0]] if len(present) == 1 else None
        if not isinstance(index, torch.fx.Node) or state is None or present[0] >= state.dim():
            continue
        size = state.shape[present[0]]
        if not isinstance(size, int):
            continue
        fake = fake if fake is not None else _fake_mode(graph)
        with graph.inserting_before(node):
            negative = _call(graph, "lt.Scalar", (index, 0), {}, fake)
            below = _call(graph, "add.Scalar", (index, -size), {}, fake)
            moved = _call(graph, "where.self", (negative, below, index), {}, fake)
        indices[present[0]] = moved
        node.args = (node.args[0], indices, *node.args[2:])
        guarded.append(node.name)
    return guarded


def _accepted(copy: torch.fx.Node) -> bool:
    placeholder = copy.args[0]
    decision = InPlaceDecision.from_node(placeholder) if isinstance(placeholder, torch.fx.Node) else None
    return decision is not None and decision.accepted


def state_writes_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`, after
    the write-backs a delegate takes are dropped; early write-back, which must see the
    write-backs that remain, runs after it."""
    return ProgramPass(
        name="reinplace_state_writes",
        stage="before_memory_planning",
        run=reinplace_state_writes,
        after=("reinplace_delegate_input_mutations",),
    )
