"""RMSNorm and attention written out in aten ops, run as one ``mx.fast`` kernel each.

(Attention: :func:`fuse_attention`, which runs ``mx.fast.scaled_dot_product_attention``
in place of the steps PyTorch exports for it, see :func:`_match_attention`; rotary
embeddings: :func:`fuse_ropes`, ``mx.fast.rope`` for Hugging Face's form, see
:func:`_match_rope`.)

Llama, Qwen, Gemma and ExecuTorch's Llama example all export their RMSNorm as the
same six steps::

    p = pow(x, 2)            # aten.pow.Tensor_Scalar, or mul(x, x) (aten.mul.Tensor)
    m = mean(p, [-1], True)  # aten.mean.dim
    a = add(m, eps)          # aten.add.Tensor, eps a one-element constant
    r = rsqrt(a)             # aten.rsqrt.default
    n = mul(x, r)            # aten.mul.Tensor, either order
    y = mul(n, w)            # aten.mul.Tensor, either order (optional)

:func:`fuse_rms_norms` finds each such chain whose inner values nothing else reads
and whose steps all compute in fp32, and puts one step in its place. That step runs
``mx.fast.rms_norm(x, w, eps)`` where the kernel computes exactly the chain: fp32
``x`` and ``w``, and ``w`` one value per element of ``x``'s last axis (what a norm's
weight is); on any other shapes or dtypes it runs the chain's own steps, so the
fused program computes what the unfused one does in every case. On Apple GPUs the
kernel is one pass over ``x``; on the CPU MLX computes it with the same ops.

Only steps decoded from the delegate's own blob are matched, and the fused steps are
made here, never named by the blob: nothing read from a file chooses them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.ops import normalize_dim

from writeback_mlx_backend._steps import Ref, Step, call, refs, resolve
from writeback_mlx_backend.ops import OpHandler

RMS_NORM = "mlx.fast.rms_norm"

_POW, _MEAN, _ADD, _RSQRT, _MUL = (
    "aten.pow.Tensor_Scalar",
    "aten.mean.dim",
    "aten.add.Tensor",
    "aten.rsqrt.default",
    "aten.mul.Tensor",
)


def _never(node: Any) -> str:
    return "made by the runtime, never lowered"


def _ref(value: Any) -> str | None:
    return value.name if isinstance(value, Ref) else None


def _other(step: Step, name: str) -> Any:
    """The other operand of a two-operand step, one of whose operands is ``name``; the
    sentinel ``_other`` when neither or both are."""
    if step.kwargs or len(step.args) != 2:
        return _other
    first, second = (_ref(a) for a in step.args)
    if first == name and second != name:
        return step.args[1]
    if second == name and first != name:
        return step.args[0]
    return _other


def _eps(value: Any, constants: Mapping[str, Any]) -> float | None:
    """The epsilon of ``add(mean, eps)``: a Python number or a one-element fp32 constant."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    name = _ref(value)
    if name is None or name not in constants:
        return None
    array = constants[name]
    if array.size != 1 or array.dtype != mx.float32:
        return None
    return float(array.item())


def _handler(chain: Sequence[Step], eps: float, eps_arg: Any, weight: Ref | None) -> OpHandler:
    """``run(x, w, eps_value)``: the kernel where it computes exactly the chain, else the chain."""
    x_name = _ref(chain[0].args[0])
    assert x_name is not None

    def run(x: Any, w: Any, eps_value: Any) -> Any:
        exact = x.dtype == mx.float32 and x.ndim >= 1
        if weight is not None:
            exact = exact and w.dtype == mx.float32 and w.shape == (x.shape[-1],)
        if exact:
            return mx.fast.rms_norm(x, w, eps)
        env: dict[str, Any] = {x_name: x}
        if isinstance(eps_arg, Ref):
            env[eps_arg.name] = eps_value
        if weight is not None:
            env[weight.name] = w
        for step in chain:
            env[step.name] = call(step, resolve(step.args, env), {}, traced=False)
        return env[chain[-1].name]

    return OpHandler(_never, run)


def fuse_rms_norms(steps: Sequence[Step], constants: Mapping[str, Any], kept: Sequence[str]) -> tuple[list[Step], int]:
    """``steps`` with each RMSNorm chain (module docstring) replaced by one step, and how
    many were. ``kept`` names values read after the steps (outputs, state updates): a
    chain whose inner value is one of them, or read by another step, stays as it is."""
    uses = Counter(refs([[s.args, s.kwargs] for s in steps]))
    uses.update(kept)
    users: dict[str, list[int]] = {}
    for position, step in enumerate(steps):
        for name in set(refs((step.args, step.kwargs))):
            users.setdefault(name, []).append(position)
    fused: dict[str, Step] = {}  # the chain's last step -> the step taking its place
    dropped: set[str] = set()  # the chains' other steps
    for step in steps:
        found = _match(step, users, steps, uses, constants)
        if found is not None:
            chain, eps_arg, eps, weight = found
            last = chain[-1]
            handler = _handler(chain, eps, eps_arg, weight)
            fused[last.name] = Step(last.name, RMS_NORM, handler, [chain[0].args[0], weight, eps_arg], {}, last.dtype)
            dropped.update(s.name for s in chain[:-1])
    return [fused.get(s.name, s) for s in steps if s.name not in dropped], len(fused)


def _only_user(name: str, users: Mapping[str, list[int]], steps: Sequence[Step], uses: Counter[str]) -> Step | None:
    positions = users.get(name, [])
    if len(positions) != 1 or uses[name] != 1:
        return None
    return steps[positions[0]]


def _match(
    pow_step: Step,
    users: Mapping[str, list[int]],
    steps: Sequence[Step],
    uses: Counter[str],
    constants: Mapping[str, Any],
) -> tuple[list[Step], Any, float, Any] | None:
    """The chain starting at ``pow_step`` (the square of ``x``), its eps argument and value, and its weight
    argument (``None`` for a norm without one); ``None`` when the steps are not one."""
    if pow_step.kwargs or len(pow_step.args) != 2:
        return None
    x_name = _ref(pow_step.args[0])
    squares = (pow_step.op == _POW and pow_step.args[1] == 2) or (
        pow_step.op == _MUL and _ref(pow_step.args[1]) == x_name
    )
    if x_name is None or not squares:
        return None
    mean = _only_user(pow_step.name, users, steps, uses)
    if mean is None or mean.op != _MEAN or mean.kwargs or list(mean.args[1:]) != [[-1], True]:
        return None
    add = _only_user(mean.name, users, steps, uses)
    if add is None or add.op != _ADD:
        return None
    eps_arg = _other(add, mean.name)
    eps = None if eps_arg is _other else _eps(eps_arg, constants)
    if eps is None:
        return None
    rsqrt = _only_user(add.name, users, steps, uses)
    if rsqrt is None or rsqrt.op != _RSQRT or rsqrt.kwargs or len(rsqrt.args) != 1:
        return None
    scaled = _only_user(rsqrt.name, users, steps, uses)
    if scaled is None or scaled.op != _MUL or _ref(_other(scaled, rsqrt.name)) != x_name:
        return None
    chain = [pow_step, mean, add, rsqrt, scaled]
    weight = None
    final = _only_user(scaled.name, users, steps, uses)
    if final is not None and final.op == _MUL:
        candidate = _other(final, scaled.name)
        if isinstance(candidate, Ref) and candidate.name != x_name:
            weight = candidate
            chain.append(final)
    if any(s.dtype is not None and s.dtype != mx.float32 for s in chain):
        return None  # a value of another dtype inside the chain: the kernel computes in fp32
    return chain, eps_arg, eps, weight


# -- attention -----------------------------------------------------------------------------

SDPA = "mlx.fast.scaled_dot_product_attention"

_BMM, _VIEW, _PERMUTE, _SOFTMAX, _WHERE = (
    "aten.bmm.default",
    "aten.view_copy.default",
    "aten.permute_copy.default",
    "aten._softmax.default",
    "aten.where.self",
)
_SCALINGS = ("aten.mul.Scalar", "aten.mul.Tensor", "aten.div.Scalar", "aten.div.Tensor")

# What a value is before the call: its shape and dtype, from a lazy pass over the steps.
Info = Mapping[str, tuple[tuple[int, ...], Any]]


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

    return OpHandler(_never, run)


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
        if not all(_is(d, mx.float32, mx.bool_) for d in dtypes):  # the safe softmax's guard is bool
            return None
        return inner, Step(step.name, SDPA, _attention_handler(guard), [q, k, v, mask, scale], {}, step.dtype)

    fused, dropped, _, _ = _replace_chains(steps, kept, fuse)
    return [fused.get(s.name, s) for s in steps if s.name not in dropped], len(fused)


def _replace_chains(
    steps: Sequence[Step],
    kept: Sequence[str],
    fuse: Callable[[Step, Mapping[str, Step]], tuple[set[str], Step] | None],
) -> tuple[dict[str, Step], set[str], dict[str, Step], dict[str, set[str]]]:
    """Each step ``fuse`` matches (with the chain's inner steps) and the step taking its place,
    where nothing outside the chain reads an inner value and no chain overlaps another:
    ``(fused by name, inner steps dropped, the steps by name, each value's readers)``."""
    readers: dict[str, set[str]] = {}
    for step in steps:
        for name in refs((step.args, step.kwargs)):
            readers.setdefault(name, set()).add(step.name)
    producers = {s.name: s for s in steps}
    fused: dict[str, Step] = {}
    dropped: set[str] = set()
    for step in steps:
        found = fuse(step, producers)
        if found is None:
            continue
        inner, replacement = found
        chain = inner | {step.name}
        if any(n in kept or not readers.get(n, set()) <= chain for n in inner) or inner & (dropped | set(fused)):
            continue
        fused[step.name] = replacement
        dropped |= inner
    return fused, dropped, producers, readers


def _scalar(step: Step, name: str, constants: Mapping[str, Any]) -> float | None:
    """The factor a scaling step multiplies ``name`` by (a number, or a one-element fp32
    constant), or ``None``."""
    if step.op not in _SCALINGS or step.kwargs or len(step.args) != 2 or _ref(step.args[0]) != name:
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
        source = _ref(step.args[0]) if step.args else None
        by = _scalar(step, source, constants) if source is not None else None
        if by is None or source is None:
            break
        factor, passed, name = factor * by, passed | {name}, source
    return name, factor, passed


def _view_of(name: str, shape: tuple[int, ...], producers: Mapping[str, Step], info: Info) -> str | None:
    """The value ``name`` views, when ``name`` is a ``view_copy`` of it with ``shape``."""
    step = producers.get(name)
    if step is None or step.op != _VIEW or _ref(step.args[0]) is None or info.get(name, ((),))[0] != shape:
        return None
    return _ref(step.args[0])


def _shape(name: str | None, info: Info) -> tuple[int, ...]:
    return info[name][0] if name is not None and name in info else ()


def _last_axis(dim: Any, name: str | None, info: Info) -> bool:
    """Whether literal ``dim`` names the last axis of the value ``name`` at its traced rank
    (``3`` is the last axis at rank 4 only); ``False`` where the rank is not known."""
    rank = len(_shape(name, info))
    if not rank:
        return False
    try:
        return normalize_dim(dim, rank) == rank - 1
    except (IndexError, TypeError):
        return False


def _is(dtype: Any, *choices: Any) -> bool:
    """``dtype`` is one of ``choices`` (an MLX dtype refuses to be compared with ``None``)."""
    return dtype is not None and any(dtype == c for c in choices)


def _fp32(name: str | None, info: Info) -> bool:
    return name is not None and name in info and _is(info[name][1], mx.float32)


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
            or not _last_axis(step.args[1], _ref(step.args[0]), info)
            or step.args[2]
            or _ref(step.args[0]) is None
        ):
            return None
        return str(_ref(step.args[0])), False, {name}
    if step.op != _WHERE or len(step.args) != 3 or step.kwargs:
        return None
    cond, zeros, soft = (_ref(a) for a in step.args)
    inner = _probabilities(soft, producers, info) if soft is not None else None
    if inner is None or inner[1] or cond is None or zeros is None:
        return None
    scores, _, passed = inner
    fill = producers.get(zeros)
    if fill is None or fill.op != "aten.full_like.default" or _ref(fill.args[0]) != soft or fill.args[1] != 0:
        return None
    # cond = not(any(not(eq(scores, -inf)), -1, keepdim))
    chain = [("aten.logical_not.default", None), ("aten.any.dim", [-1, True]), ("aten.logical_not.default", None)]
    at: str | None = cond
    seen = {cond}
    for op, rest in chain:
        link = producers.get(at) if at is not None else None
        if link is None or link.op != op or link.kwargs or (rest is not None and list(link.args[1:]) != rest):
            return None
        at = _ref(link.args[0])
        if at is None:
            return None
        seen.add(at)
    test = producers.get(at) if at is not None else None
    if test is None or test.op != "aten.eq.Scalar" or _ref(test.args[0]) != scores or test.args[1] != -math.inf:
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
    p3, v3 = (_ref(a) for a in out.args)
    v_view = producers.get(v3) if v3 is not None else None
    v4 = _ref(v_view.args[0]) if v_view is not None and v_view.op == _VIEW else None
    if p3 is None or v3 is None or len(_shape(p3, info)) != 3 or len(_shape(v4, info)) != 4:
        return None
    bh, t, s = _shape(p3, info)
    batch, heads, _, d = _shape(v4, info)
    if _shape(v4, info)[2] != s or bh != batch * heads or _view_of(v3, (bh, s, d), producers, info) != v4:
        return None
    shape = (batch, heads, t, s)
    p4 = _view_of(p3, (bh, t, s), producers, info)
    found = _probabilities(p4, producers, info) if p4 is not None and _shape(p4, info) == shape else None
    if found is None:
        return None
    x, guard, inner = found
    inner |= {p3, v3, str(p4)}
    scores, mask = x, None
    add = producers.get(x)
    if add is not None and add.op == "aten.add.Tensor" and len(add.args) == 2 and not add.kwargs:
        for mine, other in ((0, 1), (1, 0)):
            candidate, added = _ref(add.args[mine]), _ref(add.args[other])
            if candidate and added and _scores(candidate, producers, info, constants, shape) is not None:
                scores, mask = candidate, added
                inner.add(x)
                break
    matched = _scores(scores, producers, info, constants, shape)
    if matched is None or (mask is not None and not _fp32(mask, info)):
        return None
    q4, k4, scale, passed = matched
    if not all(_fp32(n, info) for n in (q4, k4, v4)) or v4 is None:
        return None
    # Grouped-query heads: the kernel reads the key and value heads once each, unrepeated.
    k_heads, v_heads = _unrepeated(k4, producers, info), _unrepeated(v4, producers, info)
    if k_heads is not None and v_heads is not None and _shape(k_heads[0], info)[1] == _shape(v_heads[0], info)[1]:
        (k4, k_steps), (v4, v_steps) = k_heads, v_heads
        passed = passed | k_steps | v_steps
    return inner | passed, (Ref(q4), Ref(k4), Ref(v4), Ref(mask) if mask else None, scale, guard)


def _unrepeated(name: str, producers: Mapping[str, Step], info: Info) -> tuple[str, set[str]] | None:
    """The ``[B, G, S, D]`` heads that ``name`` (``[B, G * n, S, D]``) repeats, each ``n`` times
    in a row, as Hugging Face's ``repeat_kv`` exports it (``view(expand(unsqueeze(x, 2),
    [B, G, n, S, D]), [B, G * n, S, D])``), and the steps passed; else ``None``."""
    view = producers.get(name)
    expand = producers.get(_ref(view.args[0]) or "") if view is not None and view.op == _VIEW else None
    if expand is None or expand.op != "aten.expand_copy.default" or expand.kwargs:
        return None
    unsqueeze = producers.get(_ref(expand.args[0]) or "")
    if unsqueeze is None or unsqueeze.op not in _RESHAPES or unsqueeze.kwargs:
        return None
    source = _ref(unsqueeze.args[0])
    batch, heads, length, dim = _shape(name, info) or (0, 0, 0, 0)
    groups = _shape(source, info)[1:2] or (0,)
    if source is None or not groups[0] or heads % groups[0]:
        return None
    repeat = heads // groups[0]
    if (
        _shape(source, info) != (batch, groups[0], length, dim)
        or _shape(unsqueeze.name, info) != (batch, groups[0], 1, length, dim)
        or _shape(expand.name, info) != (batch, groups[0], repeat, length, dim)
        or not _fp32(source, info)
    ):
        return None
    return source, {name, expand.name, unsqueeze.name}


def _scores(
    name: str, producers: Mapping[str, Step], info: Info, constants: Mapping[str, Any], shape: tuple[int, ...]
) -> tuple[str, str, float, set[str]] | None:
    """``q``, ``k``, the scale and the steps passed, when ``name`` is the scaled scores
    ``view(bmm(q3, k3), [B, H, T, S])`` of the module docstring (scalings on either side)."""
    batch, heads, t, s = shape
    view, factor, passed = _unscale(name, producers, constants)
    s3 = _view_of(view, shape, producers, info)
    if s3 is None:
        return None
    at, more, steps = _unscale(s3, producers, constants)
    bmm = producers.get(at)
    if bmm is None or bmm.op != _BMM or bmm.kwargs or len(bmm.args) != 2:
        return None
    q3, k3 = (_ref(a) for a in bmm.args)
    if q3 is None or k3 is None:
        return None
    d = _shape(q3, info)[-1:] or (0,)
    q3, q_factor, q_passed = _unscale(q3, producers, constants)
    q4 = _view_of(q3, (batch * heads, t, d[0]), producers, info)
    if q4 is None:
        return None
    q4, q_more, q_before = _unscale(q4, producers, constants)
    kt = _view_of(k3, (batch * heads, d[0], s), producers, info)
    permute = producers.get(kt) if kt is not None else None
    if permute is None or permute.op != _PERMUTE or list(permute.args[1]) != [0, 1, 3, 2]:
        return None
    k4 = _ref(permute.args[0])
    if _shape(q4, info) != (batch, heads, t, d[0]) or _shape(k4, info) != (batch, heads, s, d[0]) or k4 is None:
        return None
    inner = passed | steps | q_passed | q_before | {view, at, q3, k3, str(kt)}
    return q4, k4, factor * more * q_factor * q_more, inner


# -- rotary position embedding -------------------------------------------------------------

ROPE = "mlx.fast.rope"

_RESHAPES = ("aten.view_copy.default", "aten.unsqueeze_copy.default", "aten.squeeze_copy.dims")
_CASTS = ("aten._to_copy.default", "dim_order_ops._to_dim_order_copy.default")
_INTS = (mx.int32, mx.int64)


def _rope_handler(dims: int) -> OpHandler:
    """``run(x, position, inv_freq)``: ``x * cos + rotate_half(x) * sin`` at ``position`` as one
    kernel (``freqs`` are the wavelengths, ``1 / inv_freq``)."""

    def run(x: Any, position: Any, inv_freq: Any) -> Any:
        offset = position.reshape(()).astype(mx.int32)
        freqs = mx.reciprocal(inv_freq.reshape(-1))
        return mx.fast.rope(x, dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)

    return OpHandler(_never, run)


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

    fused, dropped, producers, readers = _replace_chains(steps, kept, fuse)
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
        name = _ref(producers[name].args[0])
    return name


def _trig(
    name: str | None, op: str, producers: Mapping[str, Step], constants: Mapping[str, Any], passed: set[str]
) -> str | None:
    """The angle ``e`` behind ``name`` = ``view(op(e) [* 1.0])``, or ``None``."""
    at = _through(name, _RESHAPES, producers, passed)
    step = producers.get(at) if at is not None else None
    if step is not None and step.op == "aten.mul.Tensor" and at is not None and not step.kwargs:
        # Hugging Face's attention_scaling, 1.0 for the default rope: only that is matched.
        ones = [_ref(a) for a in step.args if _ref(a) in constants and constants[str(_ref(a))].size == 1]
        if len(ones) != 1 or constants[str(ones[0])].item() != 1.0:
            return None
        passed.add(at)
        at = _ref(step.args[1] if _ref(step.args[0]) == ones[0] else step.args[0])
        step = producers.get(at) if at is not None else None
    if step is None or step.op != op or at is None:
        return None
    passed.add(at)
    return _ref(step.args[0])


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
        found = _rope_terms(_ref(out.args[first]), _ref(out.args[second]), producers, info, constants)
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
            x_name = _ref(x)
            if x_name is None or not _fp32(x_name, info) or len(_shape(x_name, info)) < 3:
                continue
            dims = _shape(x_name, info)[-1]
            if _shape(x_name, info)[-2] != 1 or dims % 2:
                continue
            rotation = _rotation(_ref(rotated), x_name, dims, producers, info)
            if rotation is None:
                continue
            shared: set[str] = set()
            angle = _trig(_ref(cos_side), "aten.cos.default", producers, constants, shared)
            if angle is None or _trig(_ref(sin_side), "aten.sin.default", producers, constants, shared) != angle:
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
    if not _last_axis(cat.args[1], x, info):
        return None
    parts = cat.args[0]
    if not isinstance(parts, list) or len(parts) != 2:
        return None
    neg, low = producers.get(_ref(parts[0]) or ""), producers.get(_ref(parts[1]) or "")
    if neg is None or low is None or neg.op != "aten.neg.default":
        return None
    high = producers.get(_ref(neg.args[0]) or "")
    half = dims // 2
    for part, (lo, hi) in ((high, (half, None)), (low, (0, half))):
        if part is None or part.op != "aten.slice_copy.Tensor" or _ref(part.args[0]) != x or part.kwargs:
            return None
        dim, start, end, *step = [*part.args[1:], 1][:4]
        if (
            not _last_axis(dim, x, info)
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
    if cat is None or cat.op != "aten.cat.default" or cat.kwargs or not _last_axis(cat.args[1], angle, info):
        return None
    parts = cat.args[0]
    if not isinstance(parts, list) or len(parts) != 2 or _ref(parts[0]) is None or _ref(parts[0]) != _ref(parts[1]):
        return None
    mul = producers.get(_ref(parts[0]) or "")
    if mul is None or mul.op != "aten.mul.Tensor" or mul.kwargs:
        return None
    for pos, freq in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        inv_freq, pos_name = _ref(freq), _ref(pos)
        if inv_freq is None or inv_freq not in constants or pos_name is None:
            continue
        table = constants[inv_freq]
        if table.size != dims // 2 or table.dtype != mx.float32 or max(table.shape, default=1) != dims // 2:
            continue
        # float(position): views of a one-element integer value, cast to fp32 (every cast
        # passed casts to fp32, so nothing narrows the position on the way).
        passed: set[str] = set()
        source = _through(pos_name, (*_CASTS, *_RESHAPES), producers, passed)
        casts = [producers[n] for n in passed if producers[n].op in _CASTS]
        if source is None or not _fp32(pos_name, info) or not casts:
            continue
        if not all(_is(c.dtype, mx.float32) for c in casts):
            continue
        shape, dtype = info.get(source, ((0,), None))
        if math.prod(shape) != 1 or not _is(dtype, *_INTS):
            continue
        return source, inv_freq
    return None
