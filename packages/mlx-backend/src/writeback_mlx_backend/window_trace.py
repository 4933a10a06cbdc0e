"""A bounded trace of an attention window (``writeback_mlx_backend.window``, step 4): each
value the window proved is computed over its first ``L`` columns only (:meth:`Bounded.run`),
and the values it reads are cut to ``L`` columns, pushed back through their views, permutes,
matmuls and elementwise steps where the op allows (:meth:`Bounded.pull`), so the rest is
never computed.

A write into a caller's tensor stands in the trace as :class:`Unread`: read over its first
``L`` columns it is the same write into the first ``L`` columns of its destination; read any
other way it fails the trace with :class:`WholeRead`. Every value cut whole (a state, a
caller's tensor, a constant) is recorded in :attr:`Bounded.sources`: the rows it removes are
the only ones the proof took to be finite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from writeback_core.blob import Ref, resolve

from writeback_mlx_backend._steps import Step, call, index_write_axes, refs, resolve_kwargs, step_axis
from writeback_mlx_backend.fast.sdpa import SDPA
from writeback_mlx_backend.op_math import MATMULS, SOFTMAXES
from writeback_mlx_backend.op_shapes import CASTS, PERMUTES, VIEWS
from writeback_mlx_backend.window_proof import view_axis

if TYPE_CHECKING:
    from writeback_mlx_backend.window import Window

__all__ = ["Bounded", "Unread", "WholeRead"]


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


def _rewrite_elementwise(b: Bounded, step: Step) -> Any:
    rank = len(b.window.shapes[step.name])
    axis = b.window.axes[step.name]
    args = [b.operand(v, rank, axis) for v in step.args]
    return call(step, args, resolve_kwargs(step.kwargs, b.env), True)


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
    return call(step, [left, right], resolve_kwargs(step.kwargs, b.env), True)


def _rewrite_unary(b: Bounded, step: Step) -> Any:
    return call(step, [b.get(step.args[0].name), *step.args[1:]], resolve_kwargs(step.kwargs, b.env), True)


def _rewrite_sdpa(b: Bounded, step: Step) -> Any:
    """The fused attention over the first ``length`` keys, values and mask columns."""
    q, k, v, mask, *rest = step.args
    args = [b.full(q.name), b.pull(k.name, 2), b.pull(v.name, 2), b.operand(mask, 4, 3), *rest]
    return call(step, args, resolve_kwargs(step.kwargs, b.env), True)


_REWRITE: dict[str, Callable[[Bounded, Step], Any]] = {
    **{op: _rewrite_view for op in VIEWS},
    **{op: _rewrite_matmul for op in MATMULS},
    **{op: _rewrite_unary for op in (*PERMUTES, *SOFTMAXES, *CASTS)},
    "aten.full_like.default": _rewrite_unary,
    "aten.any.dim": _rewrite_unary,
    "aten.sum.dim_IntList": _rewrite_unary,
    "aten.amax.default": _rewrite_unary,
    SDPA: _rewrite_sdpa,
}


def _pull_view(b: Bounded, step: Step, axis: int) -> Any:
    source = step.args[0].name
    found = view_axis(b.window.shapes[step.name], b.window.shapes[source], axis)
    if found is None:
        return None
    return mx.reshape(b.pull(source, found), b.shape(step.name, axis))


def _pull_permute(b: Bounded, step: Step, axis: int) -> Any:
    dims = [step_axis(step, d, len(b.window.shapes[step.name])) for d in step.args[1]]
    return mx.transpose(b.pull(step.args[0].name, dims[axis]), dims)


def _pull_elementwise(b: Bounded, step: Step, axis: int) -> Any:
    rank = len(b.window.shapes[step.name])
    args = [b.operand(v, rank, axis) for v in step.args]
    return call(step, args, resolve_kwargs(step.kwargs, b.env), True)


def _pull_matmul(b: Bounded, step: Step, axis: int) -> Any:
    x, y = step.args[:2]
    rank = len(b.window.shapes[step.name])
    if axis == rank - 1:
        args = [b.full(x.name), b.pull(y.name, len(b.window.shapes[y.name]) - 1)]
    elif axis == rank - 2 and len(b.window.shapes[x.name]) >= 2:
        args = [b.pull(x.name, len(b.window.shapes[x.name]) - 2), b.full(y.name)]
    else:
        return None
    return call(step, args, resolve_kwargs(step.kwargs, b.env), True)


def _pull_write(b: Bounded, step: Step, axis: int) -> Any:
    """The first ``length`` entries along ``axis`` of a write into a caller's tensor: the same
    write into the first ``length`` entries of its destination. Only for one index along that
    axis; the call checked that each written index lies in ``[0, length)``."""
    dest, *rest = step.args
    along = index_write_axes(step, len(b.window.shapes[step.name]))
    if along != [axis] or not isinstance(dest, Ref):
        raise WholeRead(f"{b.reader} reads {step.name}, a write into a caller's tensor, along an axis it does not slot")
    others = resolve(rest, b.env)
    for name in refs(rest):
        if isinstance(b.env[name], Unread):
            raise b.env[name].whole(step.name)
    return call(step, [b.pull(dest.name, axis), *others], resolve_kwargs(step.kwargs, b.env), True)


_PULL: dict[str, Callable[[Bounded, Step, int], Any]] = {
    **{op: _pull_view for op in VIEWS},
    **{op: _pull_permute for op in PERMUTES},
    **{op: _pull_matmul for op in MATMULS},
    **{op: _pull_elementwise for op in ("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor")},
    **{op: _pull_elementwise for op in CASTS},
}
