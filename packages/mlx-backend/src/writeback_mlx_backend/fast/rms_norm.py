"""RMSNorm written out in aten ops, run as one ``mx.fast.rms_norm`` kernel.

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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import Ref, resolve

from writeback_mlx_backend._steps import Step, call, refs
from writeback_mlx_backend.fast._chains import never, ref
from writeback_mlx_backend.op_handler import OpHandler

RMS_NORM = "mlx.fast.rms_norm"

_POW, _MEAN, _ADD, _RSQRT, _MUL = (
    "aten.pow.Tensor_Scalar",
    "aten.mean.dim",
    "aten.add.Tensor",
    "aten.rsqrt.default",
    "aten.mul.Tensor",
)


def _other(step: Step, name: str) -> Any:
    """The other operand of a two-operand step, one of whose operands is ``name``; the
    sentinel ``_other`` when neither or both are."""
    if step.kwargs or len(step.args) != 2:
        return _other
    first, second = (ref(a) for a in step.args)
    if first == name and second != name:
        return step.args[1]
    if second == name and first != name:
        return step.args[0]
    return _other


def _eps(value: Any, constants: Mapping[str, Any]) -> float | None:
    """The epsilon of ``add(mean, eps)``: a Python number or a one-element fp32 constant."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    name = ref(value)
    if name is None or name not in constants:
        return None
    array = constants[name]
    if array.size != 1 or array.dtype != mx.float32:
        return None
    return float(array.item())


def _handler(chain: Sequence[Step], eps: float, eps_arg: Any, weight: Ref | None) -> OpHandler:
    """``run(x, w, eps_value)``: the kernel where it computes exactly the chain, else the chain."""
    x_name = ref(chain[0].args[0])
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

    return OpHandler(never, run)


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
    x_name = ref(pow_step.args[0])
    squares = (pow_step.op == _POW and pow_step.args[1] == 2) or (
        pow_step.op == _MUL and ref(pow_step.args[1]) == x_name
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
    if scaled is None or scaled.op != _MUL or ref(_other(scaled, rsqrt.name)) != x_name:
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
