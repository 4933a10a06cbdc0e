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
never computed whole in a bounded trace: its value stands in as ``window_trace.Unread``,
the values read from it are its first ``L`` columns, computed as the same write
into the first ``L`` columns of the destination (the call checks on the host that
every written index lies below ``L``), and any read of it over the whole axis
fails the trace with ``window_trace.WholeRead``. The runtime then stores the written
region into the caller's memory itself.

The proof in step 3 holds for finite values: ``-inf + x`` is ``-inf`` and ``0 * x`` is
``0`` only for a finite ``x``. A cache row the mask removes may hold ``inf`` or ``nan``
(eager then answers NaN: the masked score is ``nan``, or its zero weight times the row
is). A bounded trace therefore records, in ``window_trace.Bounded.sources``, every value it cuts
whole (a state, a caller's tensor, a write into one, a constant): every removed column
the proof reads comes from one of them. The runtime runs a call bounded only when it
knows the removed rows of each source are finite, and over the whole axis otherwise, so
every answer is the unbounded program's (``writeback_mlx_backend.compiled_call``).

Steps with keyword arguments the rules do not read (``add(x, mask, alpha=-1)`` turns a
``-inf`` mask into ``+inf``) are not followed: such a program has no window.

The masks and the proof (steps 1 and 3) are ``writeback_mlx_backend.window_proof``; the
bounded trace (step 4) is ``writeback_mlx_backend.window_trace``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from writeback_core.blob import Ref

from writeback_mlx_backend._steps import Step, call_resolved, refs, step_axis
from writeback_mlx_backend.fast.sdpa import SDPA
from writeback_mlx_backend.op_math import SOFTMAXES
from writeback_mlx_backend.window_proof import EXIT, FORWARD, NEG_INF, Analysis, Tag, dim_arg
from writeback_mlx_backend.window_trace import Bounded

__all__ = ["Window", "lengths", "plan"]

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
        (where a value is ``window_trace.Unread``, only its first ``length`` columns are computed)."""
        return Bounded(self, env, length)

    def bounds(self, step: Step) -> bool:
        """Whether a bounded trace computes ``step`` through ``window_trace.Bounded.run``."""
        return step.name in self.exits or (step.name in self.axes and step.name not in self.masks)


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
    an = Analysis(steps, shapes, constants, positions)
    softmaxes = [s for s in steps if (s.op in SOFTMAXES and isinstance(s.args[0], Ref)) or s.op == SDPA]
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
            axis = step_axis(step, dim_arg(step), len(shape))
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
    an.tags = {name: Tag(axis, NEG_INF) for name, axis in masks.items()}
    exits: set[str] = set()
    for step in steps:
        if step.name in masks or not any(n in an.tags for n in refs((step.args, step.kwargs))):
            continue
        rule = FORWARD.get(step.op)
        result = rule(an, step) if rule is not None else f"{step.name} ({step.op}) reads the bounded axis"
        if isinstance(result, str):
            return result
        if result is EXIT:
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
    an: Analysis, masks: Mapping[str, int], position: str, meta: Mapping[str, Any], lo: int, hi: int
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
            env[step.name] = call_resolved(step, env, False)
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
