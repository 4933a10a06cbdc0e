"""Rotary position embeddings written out in aten ops, run as one ``mx.fast.rope`` kernel.

:func:`fuse_ropes` runs ``mx.fast.rope`` for Hugging Face's form, see :func:`_match_rope`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import Ref

from writeback_mlx_backend._steps import Step, refs
from writeback_mlx_backend.fast._chains import (
    RESHAPES,
    Info,
    dtype_is,
    fp32,
    last_axis,
    never,
    ref,
    replace_chains,
    shape_of,
)
from writeback_mlx_backend.op_handler import OpHandler
from writeback_mlx_backend.op_shapes import CASTS

ROPE = "mlx.fast.rope"

_INTS = (mx.int32, mx.int64)


def _rope_handler(dims: int) -> OpHandler:
    """``run(x, position, inv_freq)``: ``x * cos + rotate_half(x) * sin`` at ``position`` as one
    kernel (``freqs`` are the wavelengths, ``1 / inv_freq``)."""

    def run(x: Any, position: Any, inv_freq: Any) -> Any:
        offset = position.reshape(()).astype(mx.int32)
        freqs = mx.reciprocal(inv_freq.reshape(-1))
        return mx.fast.rope(x, dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)

    return OpHandler(never, run)


def fuse_ropes(
    steps: Sequence[Step], info: Info, constants: Mapping[str, Any], kept: Sequence[str]
) -> tuple[list[Step], int]:
    """``steps`` with each rotary embedding of one position written as Hugging Face writes it
    (:func:`_match_rope`) replaced by one ``mx.fast.rope`` step, and how many were; the cos
    and sin the ropes shared are dropped when nothing else reads them."""

    def fuse(step: Step, producers: Mapping[str, Step]) -> tuple[set[str], Step] | None:
        found = _match_rope(step, producers, info, constants)
        if found is None:
            return None
        inner, x, position, inv_freq, dims = found
        return inner, Step(step.name, ROPE, _rope_handler(dims), [x, position, inv_freq], {}, step.dtype)

    fused, dropped, producers, readers = replace_chains(steps, kept, fuse)
    # The cos and sin (and the angle) the fused ropes read, once nothing else reads them.
    pending = [n for name in dropped for n in refs((producers[name].args, producers[name].kwargs))]
    still_read = set(kept) | set(fused) | set(refs([s.args for s in fused.values()]))
    while pending:
        name = pending.pop()
        shared = producers.get(name)
        if shared is None or name in dropped or name in still_read or not readers.get(name, set()) <= dropped:
            continue
        if shared.handler.region is None and shared.handler.validate is None:
            dropped.add(name)
            pending += refs((shared.args, shared.kwargs))
    return [fused.get(s.name, s) for s in steps if s.name not in dropped], len(fused)


def _through(name: str | None, ops: Sequence[str], producers: Mapping[str, Step], passed: set[str]) -> str | None:
    """Walk back from ``name`` through steps of ``ops`` (first argument), adding them to ``passed``."""
    while name is not None and name in producers and producers[name].op in ops:
        passed.add(name)
        name = ref(producers[name].args[0])
    return name


def _trig(
    name: str | None, op: str, producers: Mapping[str, Step], constants: Mapping[str, Any], passed: set[str]
) -> str | None:
    """The angle ``e`` behind ``name`` = ``view(op(e) [* 1.0])``, or ``None``."""
    at = _through(name, RESHAPES, producers, passed)
    step = producers.get(at) if at is not None else None
    if step is not None and step.op == "aten.mul.Tensor" and at is not None and not step.kwargs:
        # Hugging Face's attention_scaling, 1.0 for the default rope: only that is matched.
        ones = [ref(a) for a in step.args if ref(a) in constants and constants[str(ref(a))].size == 1]
        if len(ones) != 1 or constants[str(ones[0])].item() != 1.0:
            return None
        passed.add(at)
        at = ref(step.args[1] if ref(step.args[0]) == ones[0] else step.args[0])
        step = producers.get(at) if at is not None else None
    if step is None or step.op != op or at is None:
        return None
    passed.add(at)
    return ref(step.args[0])


def _match_rope(
    out: Step, producers: Mapping[str, Step], info: Info, constants: Mapping[str, Any]
) -> tuple[set[str], Ref, Ref, Ref, int] | None:
    """Hugging Face's ``apply_rotary_pos_emb`` for one position, as exported::

        f = float(position) * inv_freq            # position: one integer; inv_freq a constant
        e = cat([f, f], -1)
        cos, sin = view(cos(e) * 1.0), view(sin(e) * 1.0)
        out = x * cos + cat([-x[..., h:], x[..., :h]], -1) * sin

    ``x`` fp32 ``[..., 1, D]``, ``h = D / 2``. Returns the inner steps (the product and the
    rotation; the shared cos and sin are not), ``x``, the position, ``inv_freq`` and ``D``."""
    if out.op != "aten.add.Tensor" or out.kwargs or len(out.args) != 2:
        return None
    for first, second in ((0, 1), (1, 0)):
        found = _rope_terms(ref(out.args[first]), ref(out.args[second]), producers, info, constants)
        if found is not None:
            return found
    return None


def _rope_terms(
    cos_term: str | None,
    sin_term: str | None,
    producers: Mapping[str, Step],
    info: Info,
    constants: Mapping[str, Any],
) -> tuple[set[str], Ref, Ref, Ref, int] | None:
    a, b = producers.get(cos_term or ""), producers.get(sin_term or "")
    if a is None or b is None or a.op != "aten.mul.Tensor" or b.op != "aten.mul.Tensor" or a.kwargs or b.kwargs:
        return None
    for x, cos_side in ((a.args[0], a.args[1]), (a.args[1], a.args[0])):
        for rotated, sin_side in ((b.args[0], b.args[1]), (b.args[1], b.args[0])):
            x_name = ref(x)
            if x_name is None or not fp32(x_name, info) or len(shape_of(x_name, info)) < 3:
                continue
            dims = shape_of(x_name, info)[-1]
            if shape_of(x_name, info)[-2] != 1 or dims % 2:
                continue
            rotation = _rotation(ref(rotated), x_name, dims, producers, info)
            if rotation is None:
                continue
            shared: set[str] = set()
            angle = _trig(ref(cos_side), "aten.cos.default", producers, constants, shared)
            if angle is None or _trig(ref(sin_side), "aten.sin.default", producers, constants, shared) != angle:
                continue
            found = _angle(angle, dims, producers, info, constants)
            if found is None:
                continue
            position, inv_freq = found
            inner = rotation | {str(cos_term), str(sin_term)}
            return inner, Ref(x_name), Ref(position), Ref(inv_freq), dims
    return None


def _rotation(name: str | None, x: str, dims: int, producers: Mapping[str, Step], info: Info) -> set[str] | None:
    """The steps of ``cat([-x[..., h:], x[..., :h]], -1)`` ending at ``name``, or ``None``."""
    cat = producers.get(name or "")
    if cat is None or cat.op != "aten.cat.default" or len(cat.args) != 2 or cat.kwargs:
        return None
    if not last_axis(cat.args[1], x, info):
        return None
    parts = cat.args[0]
    if not isinstance(parts, list) or len(parts) != 2:
        return None
    neg, low = producers.get(ref(parts[0]) or ""), producers.get(ref(parts[1]) or "")
    if neg is None or low is None or neg.op != "aten.neg.default":
        return None
    high = producers.get(ref(neg.args[0]) or "")
    half = dims // 2
    for part, (lo, hi) in ((high, (half, None)), (low, (0, half))):
        if part is None or part.op != "aten.slice_copy.Tensor" or ref(part.args[0]) != x or part.kwargs:
            return None
        dim, start, end, *step = [*part.args[1:], 1][:4]
        if (
            not last_axis(dim, x, info)
            or start != lo
            or (hi is None and end < dims)
            or (hi is not None and end != hi)
            or step not in ([1], [])
        ):
            return None
    assert high is not None
    return {cat.name, neg.name, high.name, low.name}


def _angle(
    angle: str, dims: int, producers: Mapping[str, Step], info: Info, constants: Mapping[str, Any]
) -> tuple[str, str] | None:
    """The position and ``inv_freq`` of ``cat([f, f], -1)`` with ``f = float(position) * inv_freq``."""
    cat = producers.get(angle)
    if cat is None or cat.op != "aten.cat.default" or cat.kwargs or not last_axis(cat.args[1], angle, info):
        return None
    parts = cat.args[0]
    if not isinstance(parts, list) or len(parts) != 2 or ref(parts[0]) is None or ref(parts[0]) != ref(parts[1]):
        return None
    mul = producers.get(ref(parts[0]) or "")
    if mul is None or mul.op != "aten.mul.Tensor" or mul.kwargs:
        return None
    for pos, freq in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        inv_freq, pos_name = ref(freq), ref(pos)
        if inv_freq is None or inv_freq not in constants or pos_name is None:
            continue
        table = constants[inv_freq]
        if table.size != dims // 2 or table.dtype != mx.float32 or max(table.shape, default=1) != dims // 2:
            continue
        # float(position): views of a one-element integer value, cast to fp32 (every cast
        # passed casts to fp32, so nothing narrows the position on the way).
        passed: set[str] = set()
        source = _through(pos_name, (*CASTS, *RESHAPES), producers, passed)
        casts = [producers[n] for n in passed if producers[n].op in CASTS]
        if source is None or not fp32(pos_name, info) or not casts:
            continue
        if not all(dtype_is(c.dtype, mx.float32) for c in casts):
            continue
        shape, dtype = info.get(source, ((0,), None))
        if math.prod(shape) != 1 or not dtype_is(dtype, *_INTS):
            continue
        return source, inv_freq
    return None
