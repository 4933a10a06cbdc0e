"""Attention written out in aten ops, run as one ``mx.fast.scaled_dot_product_attention`` kernel.

:func:`fuse_attention` runs ``mx.fast.scaled_dot_product_attention`` in place of the steps
PyTorch exports for it (its math SDPA, and a hand-written one), see :func:`_match_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import Ref

from writeback_mlx_backend._steps import Step
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

SDPA = "mlx.fast.scaled_dot_product_attention"

_BMM, _VIEW, _PERMUTE, _SOFTMAX, _WHERE = (
    "aten.bmm.default",
    "aten.view_copy.default",
    "aten.permute_copy.default",
    "aten._softmax.default",
    "aten.where.self",
)
_SCALINGS = ("aten.mul.Scalar", "aten.mul.Tensor", "aten.div.Scalar", "aten.div.Tensor")


def _attention_handler(guard: bool) -> OpHandler:
    """``run(q, k, v, mask, scale)``: ``softmax(scale * q @ k^T + mask) @ v`` as one kernel,
    shaped as the value product's ``bmm`` (``[B * H, T, D]``). With ``guard``, a row whose
    mask is ``-inf`` everywhere gives zeros, as the exported ``_safe_softmax`` does."""

    def run(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
        batch, heads, length, dim = q.shape
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        if guard and mask is not None:
            out = mx.where(mx.all(mask == -mx.inf, axis=-1, keepdims=True), mx.zeros_like(out), out)
        return out.reshape(batch * heads, length, dim)

    return OpHandler(never, run)


def fuse_attention(
    steps: Sequence[Step], info: Info, constants: Mapping[str, Any], kept: Sequence[str]
) -> tuple[list[Step], int]:
    """``steps`` with each attention written out as PyTorch's SDPA decomposition exports it
    (see :func:`_match_attention`) replaced by one ``mx.fast.scaled_dot_product_attention``
    step, and how many were. ``info`` gives each value's shape and dtype; ``kept`` names
    values read after the steps. An attention whose inner values anything else reads, or
    that computes in another dtype than fp32, stays as it is."""

    def fuse(step: Step, producers: Mapping[str, Step]) -> tuple[set[str], Step] | None:
        found = _match_attention(step, producers, info, constants)
        if found is None:
            return None
        inner, (q, k, v, mask, scale, guard) = found
        dtypes = [producers[n].dtype for n in inner | {step.name} if producers[n].dtype is not None]
        if not all(dtype_is(d, mx.float32, mx.bool_) for d in dtypes):  # the safe softmax's guard is bool
            return None
        return inner, Step(step.name, SDPA, _attention_handler(guard), [q, k, v, mask, scale], {}, step.dtype)

    fused, dropped, _, _ = replace_chains(steps, kept, fuse)
    return [fused.get(s.name, s) for s in steps if s.name not in dropped], len(fused)


def _scalar(step: Step, name: str, constants: Mapping[str, Any]) -> float | None:
    """The factor a scaling step multiplies ``name`` by (a number, or a one-element fp32
    constant), or ``None``."""
    if step.op not in _SCALINGS or step.kwargs or len(step.args) != 2 or ref(step.args[0]) != name:
        return None
    by = step.args[1]
    if isinstance(by, Ref):
        array = constants.get(by.name)
        if array is None or array.size != 1 or array.dtype != mx.float32:
            return None
        by = array.item()
    if not isinstance(by, (int, float)) or isinstance(by, bool) or by == 0:
        return None
    return float(by) if step.op.startswith("aten.mul") else 1.0 / float(by)


def _unscale(name: str, producers: Mapping[str, Step], constants: Mapping[str, Any]) -> tuple[str, float, set[str]]:
    """Walk back from ``name`` through scalings: the value scaled, the product of the
    factors, and the scaling steps passed."""
    factor, passed = 1.0, set[str]()
    while name in producers:
        step = producers[name]
        source = ref(step.args[0]) if step.args else None
        by = _scalar(step, source, constants) if source is not None else None
        if by is None or source is None:
            break
        factor, passed, name = factor * by, passed | {name}, source
    return name, factor, passed


def _view_of(name: str, shape: tuple[int, ...], producers: Mapping[str, Step], info: Info) -> str | None:
    """The value ``name`` views, when ``name`` is a ``view_copy`` of it with ``shape``."""
    step = producers.get(name)
    if step is None or step.op != _VIEW or ref(step.args[0]) is None or info.get(name, ((),))[0] != shape:
        return None
    return ref(step.args[0])


def _probabilities(name: str, producers: Mapping[str, Step], info: Info) -> tuple[str, bool, set[str]] | None:
    """The softmax's input behind ``name`` (a softmax over the last axis, or PyTorch's safe
    softmax: ``where(no column above -inf, 0, softmax(x))``), whether it is the safe one,
    and the steps passed."""
    step = producers.get(name)
    if step is None:
        return None
    if step.op == _SOFTMAX:
        if (
            step.kwargs
            or len(step.args) != 3
            or not last_axis(step.args[1], ref(step.args[0]), info)
            or step.args[2]
            or ref(step.args[0]) is None
        ):
            return None
        return str(ref(step.args[0])), False, {name}
    if step.op != _WHERE or len(step.args) != 3 or step.kwargs:
        return None
    cond, zeros, soft = (ref(a) for a in step.args)
    inner = _probabilities(soft, producers, info) if soft is not None else None
    if inner is None or inner[1] or cond is None or zeros is None:
        return None
    scores, _, passed = inner
    fill = producers.get(zeros)
    if fill is None or fill.op != "aten.full_like.default" or ref(fill.args[0]) != soft or fill.args[1] != 0:
        return None
    # cond = not(any(not(eq(scores, -inf)), -1, keepdim))
    chain = [("aten.logical_not.default", None), ("aten.any.dim", [-1, True]), ("aten.logical_not.default", None)]
    at: str | None = cond
    seen = {cond}
    for op, rest in chain:
        link = producers.get(at) if at is not None else None
        if link is None or link.op != op or link.kwargs or (rest is not None and list(link.args[1:]) != rest):
            return None
        at = ref(link.args[0])
        if at is None:
            return None
        seen.add(at)
    test = producers.get(at) if at is not None else None
    if test is None or test.op != "aten.eq.Scalar" or ref(test.args[0]) != scores or test.args[1] != -math.inf:
        return None
    return scores, True, passed | seen | {name, zeros}


def _match_attention(
    out: Step, producers: Mapping[str, Step], info: Info, constants: Mapping[str, Any]
) -> tuple[set[str], tuple[Ref, Ref, Ref, Ref | None, float, bool]] | None:
    """The attention ending at ``out``, as PyTorch's math SDPA (and a hand-written one) exports::

        s = bmm(view(q * a, [B*H, T, D]) * b, view(permute(k, [0, 1, 3, 2]), [B*H, D, S]))
        x = view(s, [B, H, T, S]) * c + mask     # any scalings; the mask optional
        p = softmax(x, -1)                       # or the safe softmax (see _probabilities)
        out = bmm(view(p, [B*H, T, S]), view(v, [B*H, S, D]))

    ``q``, ``k``, ``v`` fp32 ``[B, H, T|S, D]``. Returns the inner steps and the fused step's
    arguments ``(q, k, v, mask, scale, guard)``, or ``None``."""
    if out.op != _BMM or out.kwargs or len(out.args) != 2:
        return None
    p3, v3 = (ref(a) for a in out.args)
    v_view = producers.get(v3) if v3 is not None else None
    v4 = ref(v_view.args[0]) if v_view is not None and v_view.op == _VIEW else None
    if p3 is None or v3 is None or len(shape_of(p3, info)) != 3 or len(shape_of(v4, info)) != 4:
        return None
    bh, t, s = shape_of(p3, info)
    batch, heads, _, d = shape_of(v4, info)
    if shape_of(v4, info)[2] != s or bh != batch * heads or _view_of(v3, (bh, s, d), producers, info) != v4:
        return None
    shape = (batch, heads, t, s)
    p4 = _view_of(p3, (bh, t, s), producers, info)
    found = _probabilities(p4, producers, info) if p4 is not None and shape_of(p4, info) == shape else None
    if found is None:
        return None
    x, guard, inner = found
    inner |= {p3, v3, str(p4)}
    scores, mask = x, None
    add = producers.get(x)
    if add is not None and add.op == "aten.add.Tensor" and len(add.args) == 2 and not add.kwargs:
        for mine, other in ((0, 1), (1, 0)):
            candidate, added = ref(add.args[mine]), ref(add.args[other])
            if candidate and added and _scores(candidate, producers, info, constants, shape) is not None:
                scores, mask = candidate, added
                inner.add(x)
                break
    matched = _scores(scores, producers, info, constants, shape)
    if matched is None or (mask is not None and not fp32(mask, info)):
        return None
    q4, k4, scale, passed = matched
    if not all(fp32(n, info) for n in (q4, k4, v4)) or v4 is None:
        return None
    # Grouped-query heads: the kernel reads the key and value heads once each, unrepeated.
    k_heads, v_heads = _unrepeated(k4, producers, info), _unrepeated(v4, producers, info)
    if k_heads is not None and v_heads is not None and shape_of(k_heads[0], info)[1] == shape_of(v_heads[0], info)[1]:
        (k4, k_steps), (v4, v_steps) = k_heads, v_heads
        passed = passed | k_steps | v_steps
    return inner | passed, (Ref(q4), Ref(k4), Ref(v4), Ref(mask) if mask else None, scale, guard)


def _unrepeated(name: str, producers: Mapping[str, Step], info: Info) -> tuple[str, set[str]] | None:
    """The ``[B, G, S, D]`` heads that ``name`` (``[B, G * n, S, D]``) repeats, each ``n`` times
    in a row, as Hugging Face's ``repeat_kv`` exports it (``view(expand(unsqueeze(x, 2),
    [B, G, n, S, D]), [B, G * n, S, D])``), and the steps passed; else ``None``."""
    view = producers.get(name)
    expand = producers.get(ref(view.args[0]) or "") if view is not None and view.op == _VIEW else None
    if expand is None or expand.op != "aten.expand_copy.default" or expand.kwargs:
        return None
    unsqueeze = producers.get(ref(expand.args[0]) or "")
    if unsqueeze is None or unsqueeze.op not in RESHAPES or unsqueeze.kwargs:
        return None
    source = ref(unsqueeze.args[0])
    batch, heads, length, dim = shape_of(name, info) or (0, 0, 0, 0)
    groups = shape_of(source, info)[1:2] or (0,)
    if source is None or not groups[0] or heads % groups[0]:
        return None
    repeat = heads // groups[0]
    if (
        shape_of(source, info) != (batch, groups[0], length, dim)
        or shape_of(unsqueeze.name, info) != (batch, groups[0], 1, length, dim)
        or shape_of(expand.name, info) != (batch, groups[0], repeat, length, dim)
        or not fp32(source, info)
    ):
        return None
    return source, {name, expand.name, unsqueeze.name}


def _scores(
    name: str, producers: Mapping[str, Step], info: Info, constants: Mapping[str, Any], shape: tuple[int, ...]
) -> tuple[str, str, float, set[str]] | None:
    """``q``, ``k``, the scale and the steps passed, when ``name`` is the scaled scores
    ``view(bmm(q3, k3), [B, H, T, S])`` of :func:`_match_attention` (scalings on either side)."""
    batch, heads, t, s = shape
    view, factor, passed = _unscale(name, producers, constants)
    s3 = _view_of(view, shape, producers, info)
    if s3 is None:
        return None
    at, more, steps = _unscale(s3, producers, constants)
    bmm = producers.get(at)
    if bmm is None or bmm.op != _BMM or bmm.kwargs or len(bmm.args) != 2:
        return None
    q3, k3 = (ref(a) for a in bmm.args)
    if q3 is None or k3 is None:
        return None
    d = shape_of(q3, info)[-1:] or (0,)
    q3, q_factor, q_passed = _unscale(q3, producers, constants)
    q4 = _view_of(q3, (batch * heads, t, d[0]), producers, info)
    if q4 is None:
        return None
    q4, q_more, q_before = _unscale(q4, producers, constants)
    kt = _view_of(k3, (batch * heads, d[0], s), producers, info)
    permute = producers.get(kt) if kt is not None else None
    if permute is None or permute.op != _PERMUTE or list(permute.args[1]) != [0, 1, 3, 2]:
        return None
    k4 = ref(permute.args[0])
    if shape_of(q4, info) != (batch, heads, t, d[0]) or shape_of(k4, info) != (batch, heads, s, d[0]) or k4 is None:
        return None
    inner = passed | steps | q_passed | q_before | {view, at, q3, k3, str(kt)}
    return q4, k4, factor * more * q_factor * q_more, inner
