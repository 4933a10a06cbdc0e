"""Attention windows: the softmax columns a position's mask rules out are not computed.

A static-shape decoder attends over its whole cache at every step: the mask it adds
to the scores sets each position after the current one to ``-inf``, so those columns
weigh exactly zero, yet they are computed. MLX code written by hand (mlx-lm) attends
over the filled positions only. :func:`plan` finds, once at ``init``, where a traced
program can do the same without changing a result:

1. Each softmax is walked back from its input, along its axis, through adds,
   scalings, views and permutes, to the masks added to it: values computed from
   constants and one single-element integer input alone (the position).
2. The masks are computed at ``init`` for every value the position may take (the
   range the runtime checks on the host before each call; without one, the positions
   of the axis, and a call at any other position attends over the whole axis). The *extent* at
   position ``p`` is one past the last column any mask leaves above ``-inf``: every
   column from there on is ``-inf`` in every mask, whatever else the program holds.
3. A pass over the steps follows those columns forward and proves what they hold:
   ``-inf`` through adds and positive scalings, ``0`` after the softmax, ``True``
   after ``eq(x, -inf)``, and so on, up to the steps where they stop mattering: a
   matmul contracting them (``0 * v`` adds nothing) or a reduction whose identity
   they hold. Any other step that reads them, or a program output or state update
   made of them, leaves the program without a window (``plan`` says why).
4. A call at position ``p`` runs the step traced for the smallest length ``L`` in
   :func:`lengths` at or above the extent (the whole axis when none is): each value of
   the proved region is computed over its first ``L`` columns, and so are the scores
   and values feeding it (slices of the cache, pushed back through matmuls and views).

Refused, for example: a mask of ``finfo.min`` rather than ``-inf`` (its columns still
weigh ``exp(min - max)``, which this does not prove zero), a mask that depends on two
inputs, or scores returned as an output.

A write into a caller's tensor (a cache passed as an input, written in place) is
never computed whole in a bounded trace: its value stands in as :class:`Unread`,
the values read from it are its first ``L`` columns, computed as the same write
into the first ``L`` columns of the destination (the call checks on the host that
every written index lies below ``L``), and any read of it over the whole axis
fails the trace with :class:`WholeRead`. The runtime then stores the written
region into the caller's memory itself.

The proof in step 3 holds for finite values: ``-inf + x`` is ``-inf`` and ``0 * x`` is
``0`` only for a finite ``x``. A cache row the mask removes may hold ``inf`` or ``nan``
(eager then answers NaN: the masked score is ``nan``, or its zero weight times the row
is). A bounded trace therefore records, in :attr:`Bounded.sources`, every value it cuts
whole (a state, a caller's tensor, a write into one, a constant): every removed column
the proof reads comes from one of them. The runtime runs a call bounded only when it
knows the removed rows of each source are finite, and over the whole axis otherwise, so
every answer is the unbounded program's (``writeback_mlx_backend.compiled``).

Steps with keyword arguments the rules do not read (``add(x, mask, alpha=-1)`` turns a
``-inf`` mask into ``+inf``) are not followed: such a program has no window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from writeback_core.ops import normalize_dim

from writeback_mlx_backend._steps import Ref, Step, call, refs, resolve
from writeback_mlx_backend.fast.attention import SDPA

__all__ = ["Bounded", "Unread", "WholeRead", "Window", "lengths", "plan"]

NEG_INF = -math.inf

# A fill that is not known: finite values that may differ along the axis.
_ANY: Any = type("AnyFinite", (), {"__repr__": lambda self: "ANY"})()
# What a forward rule returns for a step whose output no longer has the bounded axis.
_EXIT: Any = type("Exit", (), {"__repr__": lambda self: "EXIT"})()
# The dependency of a value on delegate-owned state.
_STATE = "<state>"

# The position may take at most this many values (each mask is computed for each).
_MAX_POSITIONS = 1 << 16
# How many position values one evaluation of the masks covers at ``init``.
_CHUNK = 128


def lengths(size: int) -> list[int]:
    """The traced lengths below ``size``: 32, 48, 64, 96, 128, ... (at most 1.5x the extent)."""
    found: list[int] = []
    base = 32
    while base < size:
        found += [n for n in (base, base * 3 // 2) if n < size]
        base *= 2
    return found


@dataclass(frozen=True)
class _Tag:
    """A value computed over the bounded axis: which axis, and what its removed columns hold."""

    axis: int
    fill: Any


@dataclass
class Window:
    """What :func:`plan` found: the position input, the traced length per position value,
    and the steps a bounded trace computes over ``L`` columns."""

    input_index: int
    input_name: str
    size: int
    lo: int
    # ``table[p - lo]``: the traced length at position ``p``, 0 for the whole axis.
    table: np.ndarray
    # Steps (and masks) computed over the first ``L`` columns of this axis.
    axes: dict[str, int]
    masks: dict[str, int]
    exits: frozenset[str]
    shapes: dict[str, tuple[int, ...]]
    producers: dict[str, Step] = field(repr=False)
    # Per step, the operands whose removed columns the proof takes to be finite.
    assumed: dict[str, frozenset[str]] = field(default_factory=dict)

    def length(self, position: int) -> int:
        """The traced length at a position value, 0 for the whole axis."""
        at = position - self.lo
        return int(self.table[at]) if 0 <= at < len(self.table) else 0

    def describe(self) -> str:
        used = sorted({int(v) for v in self.table if v})
        return (
            f"attention over {len(self.masks)} masked softmax(es) bounded by {self.input_name}: "
            f"{used[0]}..{used[-1]} of {self.size} positions where the mask allows"
        )

    def trace(self, env: dict[str, Any], length: int) -> Bounded:
        """A trace of the step over the first ``length`` columns, reading full values in ``env``
        (where a value is :class:`Unread`, only its first ``length`` columns are computed)."""
        return Bounded(self, env, length)

    def bounds(self, step: Step) -> bool:
        """Whether a bounded trace computes ``step`` through :meth:`Bounded.run`."""
        return step.name in self.exits or (step.name in self.axes and step.name not in self.masks)


# -- finding the window -----------------------------------------------------------------


def _axis(dim: Any, rank: int, step: Step) -> int:
    return normalize_dim(dim, rank, what=f"{step.name} ({step.op}) dim")


def _plain(step: Step) -> bool:
    """Whether ``step``'s keyword arguments change nothing the rules read (``alpha=1`` only)."""
    return all(key == "alpha" and value == 1 for key, value in step.kwargs.items())


def _dim_arg(step: Step) -> Any:
    """A softmax's or reduction's dim, given by position or by name."""
    return step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")


def _view_axis(source: Sequence[int], target: Sequence[int], axis: int) -> int | None:
    """The axis of ``target`` that axis ``axis`` of ``source`` becomes under a reshape, if it
    stays one axis of the same size with the same elements before and after it."""
    size, before = source[axis], math.prod(source[:axis])
    seen = 1
    for position, dim in enumerate(target):
        if seen == before and dim == size:
            return position
        seen *= dim
    return None


class _Analysis:
    def __init__(
        self,
        steps: Sequence[Step],
        shapes: Mapping[str, tuple[int, ...]],
        constants: Mapping[str, Any],
        positions: Sequence[str],
    ) -> None:
        self.steps = steps
        self.shapes = shapes
        self.constants = constants
        self.producers = {s.name: s for s in steps}
        self.tags: dict[str, _Tag] = {}
        # For each step the proof passes, the untagged operands whose removed columns it
        # takes to be finite (see the module docstring).
        self.assumed: dict[str, frozenset[str]] = {}
        self.size = 0
        # The inputs each value is computed from (``_STATE`` for delegate-owned state).
        self.deps: dict[str, frozenset[str]] = {}
        for name in positions:
            self.deps[name] = frozenset({name})
        for step in steps:
            found: set[str] = set()
            for name in refs((step.args, step.kwargs)):
                if name in self.deps:
                    found |= self.deps[name]
                elif name not in constants:
                    found.add(_STATE)
            self.deps[step.name] = frozenset(found)

    def rank(self, value: Any) -> int:
        return len(self.shapes[value.name]) if isinstance(value, Ref) else 0

    def assume(self, step: str, names: Sequence[str]) -> None:
        """Record that the proof at ``step`` takes the removed columns of ``names`` to be finite."""
        self.assumed[step] = self.assumed.get(step, frozenset()) | frozenset(names)

    def fill(self, value: Any) -> Any:
        """What the removed columns of an operand hold, as far as is known."""
        if isinstance(value, Ref):
            if value.name in self.tags:
                return self.tags[value.name].fill
            constant = self.constants.get(value.name)
            if constant is not None and constant.size == 1:
                return constant.item()
            return _ANY
        return value if isinstance(value, (bool, int, float)) else _ANY

    def masks(self, name: str, axis: int) -> dict[str, int] | None:
        """The masks added along ``axis`` into ``name``, or ``None`` where a branch is not one."""
        shape = self.shapes.get(name, ())
        if axis >= len(shape) or shape[axis] != self.size:
            return {}
        if name in self.constants or (self.deps.get(name) and _STATE not in self.deps[name]):
            return {name: axis}
        step = self.producers.get(name)
        back = _BACK.get(step.op) if step is not None else None
        if step is None or back is None:
            return {}
        found: dict[str, int] = {}
        for operand in back(self, step, axis):
            more = self.masks(*operand)
            if more is None:
                return None
            found.update(more)
        return found


def _back_elementwise(first_only: bool) -> Callable[[_Analysis, Step, int], list[tuple[str, int]]]:
    def back(an: _Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
        if not _plain(step):
            return []
        rank = len(an.shapes[step.name])
        operands = step.args[:1] if first_only else step.args[:2]
        return [
            (v.name, axis - (rank - an.rank(v)))
            for v in operands
            if isinstance(v, Ref) and axis - (rank - an.rank(v)) >= 0
        ]

    return back


def _back_view(an: _Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
    source = step.args[0].name
    found = _view_axis(an.shapes[step.name], an.shapes[source], axis)
    return [] if found is None else [(source, found)]


def _back_permute(an: _Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
    dims = [_axis(d, len(an.shapes[step.name]), step) for d in step.args[1]]
    return [(step.args[0].name, dims[axis])]


_VIEWS = ("aten.view_copy.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
_PERMUTES = ("aten.permute_copy.default", "aten.permute.default")
_CASTS = ("aten._to_copy.default", "dim_order_ops._to_dim_order_copy.default")
_MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
_SOFTMAXES = ("aten._softmax.default", "aten.softmax.int")

_BACK: dict[str, Callable[[_Analysis, Step, int], list[tuple[str, int]]]] = {
    "aten.add.Tensor": _back_elementwise(first_only=False),
    "aten.sub.Tensor": _back_elementwise(first_only=True),
    "aten.mul.Tensor": _back_elementwise(first_only=False),
    "aten.div.Tensor": _back_elementwise(first_only=True),
    **{op: _back_view for op in _VIEWS},
    **{op: _back_permute for op in _PERMUTES},
    **{op: _back_elementwise(first_only=True) for op in _CASTS},
}


# Forward rules: a step reading a bounded value gives its own tag, ``_EXIT``, or why not.
_Forward = Callable[[_Analysis, Step], "_Tag | str | Any"]


def _known(*fills: Any) -> bool:
    return all(f is not _ANY for f in fills)


def _arith(fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    with np.errstate(all="ignore"):
        return fn(np.float64(a), np.float64(b)).item()


def _add_fill(a: Any, b: Any) -> Any:
    if _known(a, b):
        return _arith(np.add, a, b)
    # -inf plus anything finite stays -inf.
    return NEG_INF if NEG_INF in (a, b) and math.inf not in (a, b) else _ANY


def _sub_fill(a: Any, b: Any) -> Any:
    if _known(a, b):
        return _arith(np.subtract, a, b)
    return NEG_INF if a == NEG_INF and b is _ANY else _ANY


def _mul_fill(a: Any, b: Any) -> Any:
    if _known(a, b):
        return _arith(np.multiply, a, b)
    return 0.0 if 0 in (a, b) else _ANY  # 0 times anything finite


def _div_fill(a: Any, b: Any) -> Any:
    return _arith(np.divide, a, b) if _known(a, b) else _ANY


def _compare_fill(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda a, b: bool(fn(a, b)) if _known(a, b) else _ANY


def _where_fill(c: Any, a: Any, b: Any) -> Any:
    if c is not _ANY:
        return a if c else b
    return a if _known(a, b) and a == b else _ANY


def _forward_elementwise(combine: Callable[..., Any], arity: int) -> _Forward:
    def forward(an: _Analysis, step: Step) -> _Tag | str:
        if not _plain(step):
            return f"{step.name} has keyword arguments {step.kwargs} the window does not follow"
        rank = len(an.shapes[step.name])
        operands = list(step.args[:arity])
        axes = {an.tags[v.name].axis + rank - an.rank(v) for v in operands if isinstance(v, Ref) and v.name in an.tags}
        if len(axes) != 1:
            return f"{step.name} reads the bounded axis at two positions"
        axis = axes.pop()
        for v in operands:
            if isinstance(v, Ref) and v.name not in an.tags:
                at = axis - (rank - an.rank(v))
                if at >= 0 and an.shapes[v.name][at] not in (1, an.size):
                    return f"{step.name} broadcasts {v.name} against the bounded axis"
        fills = [an.fill(v) for v in operands]
        fill = combine(*fills)
        # An operand whose removed columns the proof takes to be finite: were they NaN,
        # the fill would differ.
        an.assume(
            step.name,
            [
                v.name
                for k, v in enumerate(operands)
                if isinstance(v, Ref) and v.name not in an.tags and fills[k] is _ANY
                if not _same_fill(combine(*fills[:k], math.nan, *fills[k + 1 :]), fill)
            ],
        )
        return _Tag(axis, fill)

    return forward


def _same_fill(a: Any, b: Any) -> bool:
    if a is _ANY or b is _ANY:
        return a is b
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _forward_full_like(an: _Analysis, step: Step) -> _Tag:
    value = step.args[1] if len(step.args) > 1 else step.kwargs.get("fill_value", _ANY)
    return _Tag(an.tags[step.args[0].name].axis, value if isinstance(value, (bool, int, float)) else _ANY)


def _forward_cast(an: _Analysis, step: Step) -> _Tag:
    tag = an.tags[step.args[0].name]
    fill = tag.fill
    if fill is not _ANY and step.dtype is not None:
        fill = bool(fill) if step.dtype == mx.bool_ else float(fill) if mx.issubdtype(step.dtype, mx.floating) else _ANY
    return _Tag(tag.axis, fill)


def _forward_view(an: _Analysis, step: Step) -> _Tag | str:
    tag = an.tags[step.args[0].name]
    found = _view_axis(an.shapes[step.args[0].name], an.shapes[step.name], tag.axis)
    return f"{step.name} reshapes the bounded axis" if found is None else _Tag(found, tag.fill)


def _forward_permute(an: _Analysis, step: Step) -> _Tag:
    tag = an.tags[step.args[0].name]
    dims = [_axis(d, len(an.shapes[step.name]), step) for d in step.args[1]]
    return _Tag(dims.index(tag.axis), tag.fill)


def _forward_softmax(an: _Analysis, step: Step) -> _Tag | str:
    tag = an.tags[step.args[0].name]
    if _axis(_dim_arg(step), len(an.shapes[step.name]), step) != tag.axis or tag.fill != NEG_INF:
        return f"{step.name}: a softmax over columns not proved -inf"
    return _Tag(tag.axis, 0.0)


def _forward_matmul(an: _Analysis, step: Step) -> Any:
    a, b = step.args[:2]
    rank = len(an.shapes[step.name])
    tag_a, tag_b = an.tags.get(a.name), an.tags.get(b.name)
    if step.kwargs:
        return f"{step.name} has keyword arguments {step.kwargs} the window does not follow"
    if tag_a is not None and tag_b is None:
        if tag_a.axis == an.rank(a) - 1:
            an.assume(step.name, [b.name])  # 0 * b adds nothing for a finite b only
            return _EXIT if tag_a.fill == 0 else f"{step.name} contracts columns not proved zero"
        if tag_a.axis == an.rank(a) - 2:
            return _Tag(rank - 2, 0.0 if tag_a.fill == 0 else _ANY)
    if tag_b is not None and tag_a is None:
        if tag_b.axis == an.rank(b) - 2:
            an.assume(step.name, [a.name])
            return _EXIT if tag_b.fill == 0 else f"{step.name} contracts rows not proved zero"
        if tag_b.axis == an.rank(b) - 1:
            return _Tag(rank - 1, 0.0 if tag_b.fill == 0 else _ANY)
    return f"{step.name} multiplies along the bounded axis in a way not handled"


def _forward_sdpa(an: _Analysis, step: Step) -> Any:
    """The fused attention (``writeback_mlx_backend.fast.attention``) reading a mask: its output has
    no bounded axis, and the masked keys weigh zero when the mask holds -inf there."""
    q, k, v, mask = step.args[:4]
    tag = an.tags.get(mask.name) if isinstance(mask, Ref) else None
    if any(isinstance(x, Ref) and x.name in an.tags for x in (q, k, v)) or tag is None:
        return f"{step.name} reads the bounded axis in its queries, keys or values"
    if tag.axis != an.rank(mask) - 1 or tag.fill != NEG_INF:
        return f"{step.name}: a softmax over columns not proved -inf"
    an.assume(step.name, [k.name, v.name])  # a masked score is -inf, its weight 0, for finite keys and values
    return _EXIT


def _forward_reduce(identity: Any) -> _Forward:
    def forward(an: _Analysis, step: Step) -> Any:
        tag = an.tags[step.args[0].name]
        dims = _dim_arg(step)
        dims = [dims] if isinstance(dims, int) else dims
        rank = an.rank(step.args[0])
        if set(step.kwargs) - {"dim"}:
            return f"{step.name} has keyword arguments {step.kwargs} the window does not follow"
        if not dims or [_axis(d, rank, step) for d in dims] != [tag.axis] or tag.fill != identity:
            return f"{step.name} reduces the bounded axis where the removed columns are not its identity"
        return _EXIT

    return forward


_FORWARD: dict[str, _Forward] = {
    "aten.add.Tensor": _forward_elementwise(_add_fill, 2),
    "aten.sub.Tensor": _forward_elementwise(_sub_fill, 2),
    "aten.mul.Tensor": _forward_elementwise(_mul_fill, 2),
    "aten.div.Tensor": _forward_elementwise(_div_fill, 2),
    "aten.eq.Scalar": _forward_elementwise(_compare_fill(lambda a, b: a == b), 2),
    "aten.eq.Tensor": _forward_elementwise(_compare_fill(lambda a, b: a == b), 2),
    "aten.ne.Scalar": _forward_elementwise(_compare_fill(lambda a, b: a != b), 2),
    "aten.ne.Tensor": _forward_elementwise(_compare_fill(lambda a, b: a != b), 2),
    "aten.logical_not.default": _forward_elementwise(lambda a: (not a) if a is not _ANY else _ANY, 1),
    "aten.where.self": _forward_elementwise(_where_fill, 3),
    "aten.full_like.default": _forward_full_like,
    **{op: _forward_cast for op in _CASTS},
    **{op: _forward_view for op in _VIEWS},
    **{op: _forward_permute for op in _PERMUTES},
    **{op: _forward_softmax for op in _SOFTMAXES},
    **{op: _forward_matmul for op in _MATMULS},
    "aten.any.dim": _forward_reduce(False),
    "aten.sum.dim_IntList": _forward_reduce(0),
    "aten.amax.default": _forward_reduce(NEG_INF),
    SDPA: _forward_sdpa,
}


def plan(
    steps: Sequence[Step],
    shapes: Mapping[str, tuple[int, ...]],
    constants: Mapping[str, Any],
    inputs: Sequence[str],
    input_meta: Sequence[Mapping[str, Any]],
    bounds: Mapping[int, tuple[int, int]],
    kept: Sequence[str],
) -> Window | str | None:
    """The program's attention window (see the module docstring), why it has none, or
    ``None`` when it has no softmax over an axis longer than the shortest traced length.

    ``shapes`` holds every value's shape, ``bounds`` each input's checked range
    ``[lo, hi)`` and ``kept`` the values that leave the step (outputs, state updates).
    """
    positions = [
        name
        for name, meta in zip(inputs, input_meta, strict=True)
        if math.prod(meta["shape"]) == 1 and meta["dtype"] in ("int64", "int32")
    ]
    an = _Analysis(steps, shapes, constants, positions)
    softmaxes = [s for s in steps if (s.op in _SOFTMAXES and isinstance(s.args[0], Ref)) or s.op == SDPA]
    if not softmaxes:
        return None
    masks: dict[str, int] = {}
    for step in softmaxes:
        if step.op == SDPA:
            # Its softmax runs over the keys' axis 2; the mask is added along its last axis.
            size, mask = shapes[step.args[1].name][2], step.args[3]
            if not isinstance(mask, Ref):
                return f"{step.name}: attention with no mask"
            where = (mask.name, len(shapes[mask.name]) - 1)
        else:
            shape = shapes[step.args[0].name]
            axis = _axis(_dim_arg(step), len(shape), step)
            size, where = shape[axis], (step.args[0].name, axis)
        if an.size not in (0, size):
            return "softmaxes over axes of different sizes"
        an.size = size
        if not lengths(an.size):
            return None  # too short to bound
        found = an.masks(*where)
        if not found:
            return f"{step.name}: no mask computed from a position input alone is added to its input"
        masks.update(found)
    used = {n for m in masks for n in an.deps.get(m, frozenset())}
    if len(used) != 1:
        return f"the masks depend on {sorted(used) or 'no input'}, not on one position input"
    (position,) = used
    index = list(inputs).index(position)
    # Without a checked range, the masks are computed for the positions of the axis; a call
    # at any other position attends over the whole axis.
    lo, hi = bounds.get(index, (0, an.size))
    if not 0 < hi - lo <= _MAX_POSITIONS:
        return f"{position} ranges over [{lo}, {hi}), too many values to compute the masks for"
    an.tags = {name: _Tag(axis, NEG_INF) for name, axis in masks.items()}
    exits: set[str] = set()
    for step in steps:
        if step.name in masks or not any(n in an.tags for n in refs((step.args, step.kwargs))):
            continue
        rule = _FORWARD.get(step.op)
        result = rule(an, step) if rule is not None else f"{step.name} ({step.op}) reads the bounded axis"
        if isinstance(result, str):
            return result
        if result is _EXIT:
            exits.add(step.name)
        else:
            an.tags[step.name] = result
    leaving = sorted(n for n in kept if n in an.tags)
    if leaving:
        return f"{leaving[0]} leaves the step over the bounded axis"
    extents = _extents(an, masks, position, input_meta[index], lo, hi)
    if isinstance(extents, str):
        return extents
    choices = lengths(an.size)
    table = np.array([next((n for n in choices if n >= max(e, 1)), 0) for e in extents], dtype=np.int64)
    if not table.any():
        return "the masks let every position through at every position value"
    return Window(
        index,
        position,
        an.size,
        lo,
        table,
        {n: t.axis for n, t in an.tags.items()},
        masks,
        frozenset(exits),
        dict(shapes),
        an.producers,
        dict(an.assumed),
    )


def _extents(
    an: _Analysis, masks: Mapping[str, int], position: str, meta: Mapping[str, Any], lo: int, hi: int
) -> list[int] | str:
    """For each position value in ``[lo, hi)``: one past the last column any mask leaves above -inf."""
    needed: set[str] = set()
    pending = list(masks)
    while pending:
        name = pending.pop()
        if name in needed or name not in an.producers:
            continue
        needed.add(name)
        pending += refs((an.producers[name].args, an.producers[name].kwargs))
    cone = [s for s in an.steps if s.name in needed]
    dtype = mx.int64 if meta["dtype"] == "int64" else mx.int32

    def masks_at(value: int) -> list[Any]:
        env: dict[str, Any] = dict(an.constants)
        env[position] = mx.full(meta["shape"], value, dtype=dtype)
        for step in cone:
            env[step.name] = call(
                step, resolve(step.args, env), {k: resolve(v, env) for k, v in step.kwargs.items()}, False
            )
        return [env[name] for name in masks]

    found: list[int] = []
    try:
        for start in range(lo, hi, _CHUNK):
            chunk = [masks_at(value) for value in range(start, min(hi, start + _CHUNK))]
            mx.eval(*[m for row in chunk for m in row])
            for row in chunk:
                found.append(max(_extent(np.asarray(m), masks[name]) for m, name in zip(row, masks, strict=True)))
    except Exception as error:
        return f"computing the masks failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return found


def _extent(mask: np.ndarray, axis: int) -> int:
    columns = np.moveaxis(mask, axis, -1).reshape(-1, mask.shape[axis])
    allowed = np.flatnonzero(np.any(columns != NEG_INF, axis=0))
    return int(allowed[-1]) + 1 if allowed.size else 0


# -- tracing the bounded step ---------------------------------------------------------------


class WholeRead(ValueError):
    """A bounded trace needed a write into a caller's tensor over its whole axis."""


@dataclass(frozen=True)
class Unread:
    """Stands in ``env`` for a write into a caller's tensor (``name``), or a value computed from
    one: a bounded trace computes only its first ``L`` columns (:meth:`Bounded.pull`); reading
    it any other way raises :class:`WholeRead`."""

    name: str

    def whole(self, reader: str) -> WholeRead:
        return WholeRead(f"{reader} reads {self.name}, a write into a caller's tensor, over its whole axis")


class Bounded:
    """One bounded trace: ``env`` holds the full values, ``bounded`` the first ``length``
    columns of each value in the window, ``pulled`` those of values read into it."""

    def __init__(self, window: Window, env: dict[str, Any], length: int) -> None:
        self.window = window
        self.env = env
        self.length = length
        self.bounded: dict[str, Any] = {}
        self.pulled: dict[tuple[str, int], Any] = {}
        self.reader = ""
        # The values cut whole, with the axis cut: their removed rows are the only ones the
        # proof takes to be finite (module docstring).
        self.sources: set[tuple[str, int]] = set()

    def get(self, name: str) -> Any:
        """The bounded value ``name``."""
        return self.bounded[name]

    def full(self, name: str) -> Any:
        """The whole value of ``name``; raises :class:`WholeRead` for a caller write's."""
        value = self.env[name]
        if isinstance(value, Unread):
            raise value.whole(self.reader)
        return value

    def run(self, step: Step) -> None:
        """Compute ``step`` (see :meth:`Window.bounds`): an exit into ``env``, else into ``bounded``."""
        self.reader = step.name
        value = _REWRITE.get(step.op, _rewrite_elementwise)(self, step)
        if step.name in self.window.exits:
            self.env[step.name] = value
        else:
            self.bounded[step.name] = value

    def cut(self, value: Any, axis: int) -> Any:
        return value[(slice(None),) * axis + (slice(0, self.length),)]

    def operand(self, value: Any, rank: int, axis: int) -> Any:
        """An operand of a bounded elementwise step: bounded itself, cut, or broadcast whole."""
        if not isinstance(value, Ref):
            return value
        if value.name in self.bounded:
            return self.get(value.name)
        if value.name in self.window.masks:
            return self.cut(self.full(value.name), self.window.masks[value.name])
        shape = self.window.shapes[value.name]
        at = axis - (rank - len(shape))
        if at >= 0 and shape[at] == self.window.size:
            return self.pull(value.name, at)
        return self.full(value.name)

    def pull(self, name: str, axis: int) -> Any:
        """The first ``length`` entries along ``axis`` of an unbounded value, computed from
        its inputs' first entries where its op allows (so the rest is never computed)."""
        key = (name, axis)
        if key not in self.pulled:
            step = self.window.producers.get(name)
            rule = _PULL.get(step.op) if step is not None and name not in self.window.masks else None
            unread = self.env.get(name)
            if isinstance(unread, Unread) and unread.name == name:
                rule = _pull_write  # the write itself; a value computed from it has its own rule
            value = rule(self, step, axis) if rule is not None and step is not None else None
            if value is None:
                value = self.cut(self.full(name), axis)
                self.sources.add(key)
            self.pulled[key] = value
        return self.pulled[key]

    def shape(self, name: str, axis: int) -> list[int]:
        shape = list(self.window.shapes[name])
        shape[axis] = self.length
        return shape


def _kwargs(step: Step, env: Mapping[str, Any]) -> dict[str, Any]:
    return {k: resolve(v, env) for k, v in step.kwargs.items()}


def _rewrite_elementwise(b: Bounded, step: Step) -> Any:
    rank = len(b.window.shapes[step.name])
    axis = b.window.axes[step.name]
    args = [b.operand(v, rank, axis) for v in step.args]
    return call(step, args, _kwargs(step, b.env), True)


def _rewrite_view(b: Bounded, step: Step) -> Any:
    return mx.reshape(b.get(step.args[0].name), b.shape(step.name, b.window.axes[step.name]))


def _rewrite_matmul(b: Bounded, step: Step) -> Any:
    x, y = step.args[:2]
    if x.name in b.bounded:
        left = b.get(x.name)
        contracted = b.window.axes[x.name] == len(b.window.shapes[x.name]) - 1
        right = b.pull(y.name, len(b.window.shapes[y.name]) - 2) if contracted else b.full(y.name)
    else:
        right = b.get(y.name)
        contracted = b.window.axes[y.name] == len(b.window.shapes[y.name]) - 2
        left = b.pull(x.name, len(b.window.shapes[x.name]) - 1) if contracted else b.full(x.name)
    return call(step, [left, right], _kwargs(step, b.env), True)


def _rewrite_unary(b: Bounded, step: Step) -> Any:
    return call(step, [b.get(step.args[0].name), *step.args[1:]], _kwargs(step, b.env), True)


def _rewrite_sdpa(b: Bounded, step: Step) -> Any:
    """The fused attention over the first ``length`` keys, values and mask columns."""
    q, k, v, mask, *rest = step.args
    args = [b.full(q.name), b.pull(k.name, 2), b.pull(v.name, 2), b.operand(mask, 4, 3), *rest]
    return call(step, args, _kwargs(step, b.env), True)


_REWRITE: dict[str, Callable[[Bounded, Step], Any]] = {
    **{op: _rewrite_view for op in _VIEWS},
    **{op: _rewrite_matmul for op in _MATMULS},
    **{op: _rewrite_unary for op in (*_PERMUTES, *_SOFTMAXES, *_CASTS)},
    "aten.full_like.default": _rewrite_unary,
    "aten.any.dim": _rewrite_unary,
    "aten.sum.dim_IntList": _rewrite_unary,
    "aten.amax.default": _rewrite_unary,
    SDPA: _rewrite_sdpa,
}


def _pull_view(b: Bounded, step: Step, axis: int) -> Any:
    source = step.args[0].name
    found = _view_axis(b.window.shapes[step.name], b.window.shapes[source], axis)
    if found is None:
        return None
    return mx.reshape(b.pull(source, found), b.shape(step.name, axis))


def _pull_permute(b: Bounded, step: Step, axis: int) -> Any:
    dims = [_axis(d, len(b.window.shapes[step.name]), step) for d in step.args[1]]
    return mx.transpose(b.pull(step.args[0].name, dims[axis]), dims)


def _pull_elementwise(b: Bounded, step: Step, axis: int) -> Any:
    rank = len(b.window.shapes[step.name])
    args = [b.operand(v, rank, axis) for v in step.args]
    return call(step, args, _kwargs(step, b.env), True)


def _pull_matmul(b: Bounded, step: Step, axis: int) -> Any:
    x, y = step.args[:2]
    rank = len(b.window.shapes[step.name])
    if axis == rank - 1:
        args = [b.full(x.name), b.pull(y.name, len(b.window.shapes[y.name]) - 1)]
    elif axis == rank - 2 and len(b.window.shapes[x.name]) >= 2:
        args = [b.pull(x.name, len(b.window.shapes[x.name]) - 2), b.full(y.name)]
    else:
        return None
    return call(step, args, _kwargs(step, b.env), True)


def _pull_write(b: Bounded, step: Step, axis: int) -> Any:
    """The first ``length`` entries along ``axis`` of a write into a caller's tensor: the same
    write into the first ``length`` entries of its destination. Only for one index along that
    axis; the call checked that each written index lies in ``[0, length)``."""
    rank = len(b.window.shapes[step.name])
    dest, *rest = step.args
    if step.op == "aten.index_copy.default":
        along = [_axis(rest[0], rank, step)]
    elif step.op == "aten.index_put.default" and not (len(rest) > 2 and rest[2]):
        along = [p for p, index in enumerate(rest[0]) if index is not None]
    else:
        along = []
    if along != [axis] or not isinstance(dest, Ref):
        raise WholeRead(f"{b.reader} reads {step.name}, a write into a caller's tensor, along an axis it does not slot")
    others = resolve(rest, b.env)
    for name in refs(rest):
        if isinstance(b.env[name], Unread):
            raise b.env[name].whole(step.name)
    return call(step, [b.pull(dest.name, axis), *others], _kwargs(step, b.env), True)


_PULL: dict[str, Callable[[Bounded, Step, int], Any]] = {
    **{op: _pull_view for op in _VIEWS},
    **{op: _pull_permute for op in _PERMUTES},
    **{op: _pull_matmul for op in _MATMULS},
    **{op: _pull_elementwise for op in ("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor")},
    **{op: _pull_elementwise for op in _CASTS},
}
