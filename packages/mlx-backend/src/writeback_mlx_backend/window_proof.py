"""The proof behind an attention window (``writeback_mlx_backend.window``, steps 1 and 3):
which masks are added to a softmax's input, and what the columns they rule out hold
through every step that reads them.

:class:`Analysis` walks back from a softmax's input, along its axis, through adds,
scalings, views, permutes and casts, to the masks added to it (the backward rules). The
forward rules then follow those columns from the masks on: each step reading them gives a
:class:`Tag` (the axis they are on now and the value they hold: ``-inf`` through adds and
positive scalings, ``0`` after the softmax, ``True`` after ``eq(x, -inf)``), :data:`EXIT`
where they stop mattering (a matmul contracting them with weight ``0``, a reduction whose
identity they hold), or why the window is refused. The proof holds for finite values only:
each rule records, in :attr:`Analysis.assumed`, the operands whose removed columns it takes
to be finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from writeback_core.blob import Ref

from writeback_mlx_backend._steps import Step, refs, step_axis
from writeback_mlx_backend.fast.sdpa import SDPA
from writeback_mlx_backend.op_math import MATMULS, SOFTMAXES
from writeback_mlx_backend.op_shapes import CASTS, PERMUTES, VIEWS

__all__ = ["EXIT", "FORWARD", "NEG_INF", "Analysis", "Tag", "dim_arg", "view_axis"]

NEG_INF = -math.inf

# A fill that is not known: finite values that may differ along the axis.
_ANY: Any = type("AnyFinite", (), {"__repr__": lambda self: "ANY"})()
# What a forward rule returns for a step whose output no longer has the bounded axis.
EXIT: Any = type("Exit", (), {"__repr__": lambda self: "EXIT"})()
# The dependency of a value on delegate-owned state.
_STATE = "<state>"


@dataclass(frozen=True)
class Tag:
    """A value computed over the bounded axis: which axis, and what its removed columns hold."""

    axis: int
    fill: Any


def _plain(step: Step) -> bool:
    """Whether ``step``'s keyword arguments change nothing the rules read (``alpha=1`` only)."""
    return all(key == "alpha" and value == 1 for key, value in step.kwargs.items())


def dim_arg(step: Step) -> Any:
    """A softmax's or reduction's dim, given by position or by name."""
    return step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")


def view_axis(source: Sequence[int], target: Sequence[int], axis: int) -> int | None:
    """The axis of ``target`` that axis ``axis`` of ``source`` becomes under a reshape, if it
    stays one axis of the same size with the same elements before and after it."""
    size, before = source[axis], math.prod(source[:axis])
    seen = 1
    for position, dim in enumerate(target):
        if seen == before and dim == size:
            return position
        seen *= dim
    return None


class Analysis:
    """What :func:`~writeback_mlx_backend.window.plan` knows of a program: each value's shape,
    producer and the inputs it is computed from, the axis size being bounded, and (once the
    masks are found) the :class:`Tag` of every value the proof has passed."""

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
        self.tags: dict[str, Tag] = {}
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


# Backward rules: from a step's value along an axis, the operands (and their axes) a mask
# added into that value may come through.


def _back_elementwise(first_only: bool) -> Callable[[Analysis, Step, int], list[tuple[str, int]]]:
    def back(an: Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
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


def _back_view(an: Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
    source = step.args[0].name
    found = view_axis(an.shapes[step.name], an.shapes[source], axis)
    return [] if found is None else [(source, found)]


def _back_permute(an: Analysis, step: Step, axis: int) -> list[tuple[str, int]]:
    dims = [step_axis(step, d, len(an.shapes[step.name])) for d in step.args[1]]
    return [(step.args[0].name, dims[axis])]


_BACK: dict[str, Callable[[Analysis, Step, int], list[tuple[str, int]]]] = {
    "aten.add.Tensor": _back_elementwise(first_only=False),
    "aten.sub.Tensor": _back_elementwise(first_only=True),
    "aten.mul.Tensor": _back_elementwise(first_only=False),
    "aten.div.Tensor": _back_elementwise(first_only=True),
    **{op: _back_view for op in VIEWS},
    **{op: _back_permute for op in PERMUTES},
    **{op: _back_elementwise(first_only=True) for op in CASTS},
}


# Forward rules: a step reading a bounded value gives its own tag, ``EXIT``, or why not.
_Forward = Callable[[Analysis, Step], "Tag | str | Any"]


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
    def forward(an: Analysis, step: Step) -> Tag | str:
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
        return Tag(axis, fill)

    return forward


def _same_fill(a: Any, b: Any) -> bool:
    if a is _ANY or b is _ANY:
        return a is b
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _forward_full_like(an: Analysis, step: Step) -> Tag:
    value = step.args[1] if len(step.args) > 1 else step.kwargs.get("fill_value", _ANY)
    return Tag(an.tags[step.args[0].name].axis, value if isinstance(value, (bool, int, float)) else _ANY)


def _forward_cast(an: Analysis, step: Step) -> Tag:
    tag = an.tags[step.args[0].name]
    fill = tag.fill
    if fill is not _ANY and step.dtype is not None:
        fill = bool(fill) if step.dtype == mx.bool_ else float(fill) if mx.issubdtype(step.dtype, mx.floating) else _ANY
    return Tag(tag.axis, fill)


def _forward_view(an: Analysis, step: Step) -> Tag | str:
    tag = an.tags[step.args[0].name]
    found = view_axis(an.shapes[step.args[0].name], an.shapes[step.name], tag.axis)
    return f"{step.name} reshapes the bounded axis" if found is None else Tag(found, tag.fill)


def _forward_permute(an: Analysis, step: Step) -> Tag:
    tag = an.tags[step.args[0].name]
    dims = [step_axis(step, d, len(an.shapes[step.name])) for d in step.args[1]]
    return Tag(dims.index(tag.axis), tag.fill)


def _forward_softmax(an: Analysis, step: Step) -> Tag | str:
    tag = an.tags[step.args[0].name]
    if step_axis(step, dim_arg(step), len(an.shapes[step.name])) != tag.axis or tag.fill != NEG_INF:
        return f"{step.name}: a softmax over columns not proved -inf"
    return Tag(tag.axis, 0.0)


def _forward_matmul(an: Analysis, step: Step) -> Any:
    a, b = step.args[:2]
    rank = len(an.shapes[step.name])
    tag_a, tag_b = an.tags.get(a.name), an.tags.get(b.name)
    if step.kwargs:
        return f"{step.name} has keyword arguments {step.kwargs} the window does not follow"
    if tag_a is not None and tag_b is None:
        if tag_a.axis == an.rank(a) - 1:
            an.assume(step.name, [b.name])  # 0 * b adds nothing for a finite b only
            return EXIT if tag_a.fill == 0 else f"{step.name} contracts columns not proved zero"
        if tag_a.axis == an.rank(a) - 2:
            return Tag(rank - 2, 0.0 if tag_a.fill == 0 else _ANY)
    if tag_b is not None and tag_a is None:
        if tag_b.axis == an.rank(b) - 2:
            an.assume(step.name, [a.name])
            return EXIT if tag_b.fill == 0 else f"{step.name} contracts rows not proved zero"
        if tag_b.axis == an.rank(b) - 1:
            return Tag(rank - 1, 0.0 if tag_b.fill == 0 else _ANY)
    return f"{step.name} multiplies along the bounded axis in a way not handled"


def _forward_sdpa(an: Analysis, step: Step) -> Any:
    """The fused attention (``writeback_mlx_backend.fast.sdpa``) reading a mask: its output has
    no bounded axis, and the masked keys weigh zero when the mask holds -inf there."""
    q, k, v, mask = step.args[:4]
    tag = an.tags.get(mask.name) if isinstance(mask, Ref) else None
    if any(isinstance(x, Ref) and x.name in an.tags for x in (q, k, v)) or tag is None:
        return f"{step.name} reads the bounded axis in its queries, keys or values"
    if tag.axis != an.rank(mask) - 1 or tag.fill != NEG_INF:
        return f"{step.name}: a softmax over columns not proved -inf"
    an.assume(step.name, [k.name, v.name])  # a masked score is -inf, its weight 0, for finite keys and values
    return EXIT


def _forward_reduce(identity: Any) -> _Forward:
    def forward(an: Analysis, step: Step) -> Any:
        tag = an.tags[step.args[0].name]
        dims = dim_arg(step)
        dims = [dims] if isinstance(dims, int) else dims
        rank = an.rank(step.args[0])
        if set(step.kwargs) - {"dim"}:
            return f"{step.name} has keyword arguments {step.kwargs} the window does not follow"
        if not dims or [step_axis(step, d, rank) for d in dims] != [tag.axis] or tag.fill != identity:
            return f"{step.name} reduces the bounded axis where the removed columns are not its identity"
        return EXIT

    return forward


FORWARD: dict[str, _Forward] = {
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
    **{op: _forward_cast for op in CASTS},
    **{op: _forward_view for op in VIEWS},
    **{op: _forward_permute for op in PERMUTES},
    **{op: _forward_softmax for op in SOFTMAXES},
    **{op: _forward_matmul for op in MATMULS},
    "aten.any.dim": _forward_reduce(False),
    "aten.sum.dim_IntList": _forward_reduce(0),
    "aten.amax.default": _forward_reduce(NEG_INF),
    SDPA: _forward_sdpa,
}
