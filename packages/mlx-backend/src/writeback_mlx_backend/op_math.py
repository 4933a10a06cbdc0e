"""The ops of the MLX delegate that compute: elementwise arithmetic, comparisons and logic,
reductions, matrix products, softmax, layer norm and attention. Each wraps its dims through
core's ``normalize_dim`` when it runs, as ATen does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.ops import normalize_dim

from writeback_mlx_backend.op_checks import (
    float_check,
    gelu_check,
    layer_norm_check,
    literal_ints_check,
    sdpa_check,
    tensor_check,
)
from writeback_mlx_backend.op_handler import OpHandler

__all__ = ["MATH_OPS", "MATMULS", "SOFTMAXES"]

# Op families, each named once: the attention window and the fusions match them by these.
MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
SOFTMAXES = ("aten._softmax.default", "aten.softmax.int")


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def run(a: Any, b: Any, alpha: Any = 1) -> Any:
        if alpha != 1:
            b = b * alpha
        return fn(a, b)

    return run


def _axes(x: Any, dims: Any, op: str) -> list[int] | None:
    """``dims`` (a list of dims, or ``None`` / ``[]`` for every axis) as MLX axes of ``x``."""
    if dims is None or dims == []:
        return None
    if isinstance(dims, int):
        dims = [dims]
    axes = [normalize_dim(d, x.ndim, what=f"{op} dim") for d in dims]
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: dim {list(dims)} names an axis twice (ATen refuses a repeated dim)")
    return axes


def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    axes = _axes(x, dim, "mean")
    return mx.mean(x, axis=axes, keepdims=keepdim)


def _sum(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    axes = _axes(x, dim, "sum")
    return mx.sum(x, axis=axes, keepdims=keepdim)


def _layer_norm(
    x: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None, eps: float = 1e-5, *_: Any
) -> Any:
    """ATen's layer norm: mean and biased variance over the normalized (last) dimensions.
    One normalized dimension with matching weight and bias runs as ``mx.fast.layer_norm``."""
    count = len(normalized_shape)
    shape = tuple(normalized_shape)
    if not 0 < count <= x.ndim or tuple(x.shape[x.ndim - count :]) != shape:
        raise ValueError(f"layer_norm: normalized_shape {list(shape)} is not the last dimensions of input {x.shape}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"layer_norm: {name} of shape {t.shape}, expected normalized_shape {list(shape)}")
    if count == 1:
        return mx.fast.layer_norm(x, weight, bias, float(eps))
    axes = list(range(x.ndim - count, x.ndim))
    mean = mx.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    out = centered * mx.rsqrt(mx.mean(centered * centered, axis=axes, keepdims=True) + eps)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _softmax(x: Any, dim: int, half_to_float: bool = False) -> Any:
    return mx.softmax(x, axis=normalize_dim(dim, x.ndim, what="softmax dim"), precise=True)


def _addmm(bias: Any, a: Any, b: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    prod = a @ b
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias * beta if beta != 1 else bias)


def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    out = x @ weight.T
    return out if bias is None else out + bias


def _clamp_values(x: Any, lo: Any = None, hi: Any = None) -> Any:
    if lo is not None:
        x = mx.maximum(x, lo)
    return x if hi is None else mx.minimum(x, hi)


def _where(cond: Any, a: Any, b: Any) -> Any:
    return mx.where(cond, a, b)


def _pow(x: Any, exponent: Any) -> Any:
    if exponent == 2:
        return x * x
    return mx.power(x, exponent)


def _div(a: Any, b: Any, rounding_mode: Any = None) -> Any:
    if rounding_mode == "floor":
        return mx.floor_divide(a, b)
    out = mx.divide(a, b)
    return mx.trunc(out) if rounding_mode == "trunc" else out


def _sdpa(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        # Grouped-query attention: each key/value head serves a group of query heads.
        groups = q.shape[-3] // k.shape[-3]
        k, v = mx.repeat(k, groups, axis=-3), mx.repeat(v, groups, axis=-3)
    scores = (q @ mx.swapaxes(k, -1, -2)) * scale
    if is_causal:
        rows, cols = scores.shape[-2], scores.shape[-1]
        scores = mx.where(mx.tril(mx.ones((rows, cols), dtype=mx.bool_)), scores, -math.inf)
    if attn_mask is not None:
        scores = mx.where(attn_mask, scores, -math.inf) if attn_mask.dtype == mx.bool_ else scores + attn_mask
    return mx.softmax(scores, axis=-1, precise=True) @ v


def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _unary(fn: Callable[[Any], Any]) -> OpHandler:
    return OpHandler(tensor_check, fn)


def _binary_handler(fn: Callable[[Any, Any], Any]) -> OpHandler:
    return OpHandler(tensor_check, _binary(fn))


_COMPARE = {
    "lt": mx.less,
    "le": mx.less_equal,
    "gt": mx.greater,
    "ge": mx.greater_equal,
    "eq": mx.equal,
    "ne": mx.not_equal,
}


MATH_OPS: dict[str, OpHandler] = {
    **{op: OpHandler(float_check, _binary(mx.matmul)) for op in MATMULS},
    "aten.addmm.default": OpHandler(float_check, _addmm),
    "aten.linear.default": OpHandler(float_check, _linear),
    "aten.add.Tensor": _binary_handler(mx.add),
    "aten.add.Scalar": _binary_handler(mx.add),
    "aten.sub.Tensor": _binary_handler(mx.subtract),
    "aten.sub.Scalar": _binary_handler(mx.subtract),
    "aten.rsub.Scalar": OpHandler(tensor_check, lambda a, b, alpha=1: b - a * alpha),
    "aten.mul.Tensor": _binary_handler(mx.multiply),
    "aten.mul.Scalar": _binary_handler(mx.multiply),
    "aten.div.Tensor": OpHandler(tensor_check, _div),
    "aten.div.Tensor_mode": OpHandler(tensor_check, _div),
    "aten.div.Scalar": OpHandler(tensor_check, _div),
    "aten.pow.Tensor_Scalar": OpHandler(tensor_check, _pow),
    "aten.pow.Tensor_Tensor": _binary_handler(mx.power),
    "aten.maximum.default": _binary_handler(mx.maximum),
    "aten.minimum.default": _binary_handler(mx.minimum),
    "aten.mean.dim": OpHandler(tensor_check, _mean),
    "aten.sum.dim_IntList": OpHandler(tensor_check, _sum),
    "aten.amax.default": OpHandler(
        tensor_check, lambda x, dim=(), keepdim=False: mx.max(x, axis=_axes(x, list(dim), "amax"), keepdims=keepdim)
    ),
    "aten.any.dim": OpHandler(
        literal_ints_check(1), lambda x, dim, keepdim=False: mx.any(x, axis=_axes(x, [dim], "any"), keepdims=keepdim)
    ),
    "aten.any.dims": OpHandler(
        tensor_check,
        lambda x, dim=None, keepdim=False: mx.any(x, axis=_axes(x, dim, "any"), keepdims=keepdim),
    ),
    "aten.clamp.default": OpHandler(tensor_check, _clamp_values),
    "aten.clamp_min.default": OpHandler(tensor_check, lambda x, lo: mx.maximum(x, lo)),
    "aten.clamp_max.default": OpHandler(tensor_check, lambda x, hi: mx.minimum(x, hi)),
    "aten.rsqrt.default": _unary(mx.rsqrt),
    "aten.sqrt.default": _unary(mx.sqrt),
    "aten.exp.default": _unary(mx.exp),
    "aten.cos.default": _unary(mx.cos),
    "aten.gelu.default": OpHandler(gelu_check, _gelu),
    "aten.sin.default": _unary(mx.sin),
    "aten.log.default": _unary(mx.log),
    "aten.neg.default": _unary(mx.negative),
    "aten.abs.default": _unary(mx.abs),
    "aten.reciprocal.default": _unary(mx.reciprocal),
    "aten.tanh.default": _unary(mx.tanh),
    "aten.sigmoid.default": _unary(mx.sigmoid),
    "aten.silu.default": _unary(lambda x: x * mx.sigmoid(x)),
    "aten.relu.default": _unary(lambda x: mx.maximum(x, 0)),
    "aten.logical_not.default": _unary(mx.logical_not),
    "aten.logical_and.default": _binary_handler(mx.logical_and),
    "aten.logical_or.default": _binary_handler(mx.logical_or),
    "aten.bitwise_and.Tensor": _binary_handler(mx.bitwise_and),
    "aten.bitwise_or.Tensor": _binary_handler(mx.bitwise_or),
    "aten.bitwise_not.default": _unary(mx.bitwise_invert),
    **{op: OpHandler(literal_ints_check(1), _softmax) for op in SOFTMAXES},
    "aten.layer_norm.default": OpHandler(layer_norm_check, _layer_norm),
    "aten.where.self": OpHandler(tensor_check, _where),
    "aten.scaled_dot_product_attention.default": OpHandler(sdpa_check, _sdpa),
    **{
        f"aten.{name}.{overload}": _binary_handler(fn)
        for name, fn in _COMPARE.items()
        for overload in ("Tensor", "Scalar")
    },
}
